"""Plan files: save / load (JSON only, schema-checked) and parallelize(plan=...) reproducing the program."""
import copy
import json
import os
import pickle

import pytest
import torch

import autoshard
from autoshard import Plan, PlanError, UserInputError
from autoshard.plan import io as plan_io
from autoshard.plan.io import PlanFileError, PlanMismatchError
from autoshard.zoo import gpt2, mlp
from autoshard.zoo.hints import plan_hints

MESH = (2, 2)
NAMES = ("dp", "tp")
GPT2_HINTS = plan_hints("gpt2", NAMES, batch_axes=("dp",), tp_axis="tp")


@pytest.fixture(scope="module")
def gpt2_case():
    return gpt2()


@pytest.fixture(scope="module", params=["hints", "auto"])
def solved(request, gpt2_case):
    """(mode, keyword arguments, solved Program) for gpt2 on (2, 2) with Megatron+DP hints and in auto mode."""
    model, inputs, loss_fn = gpt2_case
    kwargs = {"axis_names": NAMES, "hints": GPT2_HINTS} if request.param == "hints" else {"pipeline": False}
    prog = autoshard.parallelize(model, MESH, inputs, loss_fn=loss_fn, **kwargs)
    return request.param, kwargs, prog


@pytest.fixture(scope="module")
def small():
    model, inputs, loss_fn = mlp(batch=8, in_dim=8, hidden=16, out_dim=8)
    prog = autoshard.parallelize(model, MESH, inputs, loss_fn=loss_fn, axis_names=NAMES,
                                 hints={"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"}})
    return (model, inputs, loss_fn), prog


def _same_rank_programs(a, b, mesh_size):
    for rank in range(mesh_size):
        ga, gb = a.graph(rank), b.graph(rank)
        assert ga.code == gb.code, f"rank {rank}: generated code differs"
        sa, sb = ga.state_dict(), gb.state_dict()
        assert list(sa) == list(sb)
        for key in sa:
            assert sa[key].shape == sb[key].shape and torch.equal(sa[key], sb[key]), f"rank {rank}: {key} differs"


# --- round trip --------------------------------------------------------------------------------------------


def test_saved_plan_carries_structured_choices_mesh_hints_and_fingerprint(solved, tmp_path):
    mode, _, prog = solved
    path = tmp_path / "plan.json"
    prog.plan.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == autoshard.plan.plan.PLAN_VERSION
    assert data["fingerprint"] == prog.plan.fingerprint
    assert data["mesh"] == prog.mesh.to_json()
    assert data["hints"] == (GPT2_HINTS if mode == "hints" else {})
    ops = [n for n in data["nodes"] if n["kind"] == "op"]
    assert ops and all(len(n["choice"]) == 2 and set(n["choice"][0]) == {"inputs", "output"} for n in ops)
    assert all(n["choice"] == [] for n in data["nodes"] if n["kind"] == "comm")


def test_load_reproduces_byte_identical_json(solved, tmp_path):
    _, _, prog = solved
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    prog.plan.save(first)
    loaded = Plan.load(first)
    assert loaded.dumps() == prog.plan.dumps()
    assert loaded.fingerprint == prog.plan.fingerprint
    loaded.save(second)
    assert first.read_bytes() == second.read_bytes()
    assert loaded.summary() == prog.plan.summary()
    assert _decisions(loaded.table_cells()) == _decisions(prog.plan.table_cells())
    assert all(line[-2:] == ["", ""] for line in loaded.table_cells()[1])  # per-row costs are not in the file
    assert [line[:5] for line in loaded.totals_cells()[1]] == [line[:5] for line in prog.plan.totals_cells()[1]]


def _decisions(cells):
    """The table's cells without the predicted time and memory columns."""
    head, body = cells
    keep = [i for i, h in enumerate(head) if not h.startswith("predicted")]
    return [[line[i] for i in keep] for line in [head, *body]]


def test_parallelize_with_a_plan_reproduces_every_rank_program(solved, gpt2_case, tmp_path):
    _, kwargs, prog = solved
    model, inputs, loss_fn = gpt2_case
    path = tmp_path / "plan.json"
    prog.plan.save(path)
    names = {"axis_names": kwargs["axis_names"]} if "axis_names" in kwargs else {}
    again = autoshard.parallelize(model, MESH, inputs, loss_fn=loss_fn, plan=str(path), **names)
    assert "apply_plan" in [e.name for e in again.history] and "solve" not in [e.name for e in again.history]
    assert again.plan.dumps() == prog.plan.dumps()
    _same_rank_programs(prog, again, 4)
    # A Plan object works as well as a path, and hints equal to the plan's are accepted.
    third = autoshard.parallelize(model, MESH, inputs, loss_fn=loss_fn, plan=Plan.load(path), **kwargs)
    assert third.plan.dumps() == prog.plan.dumps()


def test_a_plan_applied_to_the_same_model_simulates_like_the_model(small):
    (model, inputs, loss_fn), prog = small
    again = autoshard.parallelize(model, MESH, inputs, loss_fn=loss_fn, axis_names=NAMES, plan=prog.plan)
    loss, _ = again.simulate(*inputs)
    assert torch.allclose(loss, loss_fn(model(*inputs), *inputs), rtol=1e-5)


def test_a_hand_edited_plan_without_fingerprint_is_accepted(small, tmp_path):
    _, prog = small
    data = json.loads(json.dumps(prog.plan.to_json()))
    data["fingerprint"] = None
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    assert Plan.load(path).dumps() == prog.plan.dumps()


# --- a plan for something else -----------------------------------------------------------------------------


def test_plan_for_another_model_names_the_first_mismatching_node(solved, tmp_path):
    _, kwargs, prog = solved
    path = tmp_path / "plan.json"
    prog.plan.save(path)
    model, inputs, loss_fn = mlp(batch=8, in_dim=8, hidden=16, out_dim=8)
    names = {"axis_names": kwargs["axis_names"]} if "axis_names" in kwargs else {}
    with pytest.raises(PlanMismatchError, match=r"the plan was made for another model or other example inputs: the "
                                                r"plan has node 'p_model_wte_weight' \(param at wte\.weight, param, "
                                                r"f32\[64, 32\]\) where the traced graph has node "
                                                r"'p_model_layers_0_weight' \(param at layers\.0\.weight.*; pass the "
                                                r"plan saved for this model and these example inputs"):
        autoshard.parallelize(model, MESH, inputs, loss_fn=loss_fn, plan=path, **names)


def test_plan_for_a_deeper_model_says_where_the_graphs_part(small):
    (_, _, _), prog = small
    model, inputs, loss_fn = mlp(batch=8, in_dim=8, hidden=16, out_dim=8, n_layers=4)
    with pytest.raises(PlanMismatchError, match=r"another model or other example inputs: the plan has node '\w+' "
                                                r"\(.*\) where the traced graph has node '\w+'"):
        autoshard.parallelize(model, MESH, inputs, loss_fn=loss_fn, axis_names=NAMES, plan=prog.plan)


def test_plan_for_other_input_shapes(small):
    (model, _, loss_fn), prog = small
    with pytest.raises(PlanMismatchError, match=r"the plan has node 'inputs_0' \(input at input:0, input, "
                                                r"f32\[8, 8\]\) where the traced graph has node 'inputs_0' \(input at input:0, input, "
                                                r"f32\[16, 8\]\)"):
        autoshard.parallelize(model, MESH, (torch.randn(16, 8),), loss_fn=loss_fn, axis_names=NAMES, plan=prog.plan)


@pytest.mark.parametrize("mesh, names, message", [
    ((4,), ("dp",), (r"the plan was made for mesh Mesh\(dp=2, tp=2\) but parallelize got Mesh\(dp=4\); pass "
                    r"mesh=\(2, 2\) with axis_names=\('dp', 'tp'\)")),
    ((2, 2), ("x", "y"), r"made for mesh Mesh\(dp=2, tp=2\) but parallelize got Mesh\(x=2, y=2\)"),
    ((2, 2), None, r"made for mesh Mesh\(dp=2, tp=2\) but parallelize got Mesh\(a0=2, a1=2\)"),
])
def test_plan_for_another_mesh(small, mesh, names, message):
    (model, inputs, loss_fn), prog = small
    with pytest.raises(PlanMismatchError, match=message):
        autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=names, plan=prog.plan)


def test_hints_that_differ_from_the_plans(small):
    (model, inputs, loss_fn), prog = small
    with pytest.raises(PlanMismatchError, match=r"hints= differ from the hints the plan was made with: .*; leave "
                                                r"hints out when passing plan="):
        autoshard.parallelize(model, MESH, inputs, loss_fn=loss_fn, axis_names=NAMES, plan=prog.plan,
                              hints={"input:0": {"tp": "S(0)"}})


@pytest.mark.parametrize("value", [42, {"nodes": []}, b"{}"])
def test_plan_argument_of_the_wrong_type(small, value):
    (model, inputs, loss_fn), _ = small
    with pytest.raises(UserInputError, match=r"plan= takes a Plan or the path of a plan file written by Plan\.save"):
        autoshard.parallelize(model, MESH, inputs, loss_fn=loss_fn, axis_names=NAMES, plan=value)


def test_an_edited_choice_the_op_cannot_take(small, tmp_path):
    (model, inputs, loss_fn), prog = small
    data = copy.deepcopy(prog.plan.to_json())
    row = data["nodes"][_first_op(data)]
    row["choice"][1]["output"] = "S(7)"
    row["spec"] = "[" + ", ".join(c["output"] for c in row["choice"]) + "]"
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data | {"fingerprint": None}))
    with pytest.raises(PlanMismatchError, match=rf"the plan chooses \(.*\) -> S\(7\) for node '{row['name']}' .* on "
                                                r"mesh axis 'tp', which is not a strategy autoshard can use there "
                                                r"\(it can use .*\): the plan was made for other shapes or hints"):
        autoshard.parallelize(model, MESH, inputs, loss_fn=loss_fn, axis_names=NAMES, plan=path)


def test_a_loaded_plan_cannot_explain(small, tmp_path):
    _, prog = small
    prog.plan.save(tmp_path / "p.json")
    with pytest.raises(PlanError, match=r"explain needs the compiled program"):
        Plan.load(tmp_path / "p.json").explain("layers.0")


# --- files that are not plans ------------------------------------------------------------------------------


def _edit(data, path, value):
    """Set (or delete, when value is `...`) the item at `path` (a tuple of keys/indices)."""
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is ...:
        del target[path[-1]]
    else:
        target[path[-1]] = value


def _first_op(data):
    return next(i for i, r in enumerate(data["nodes"]) if r["kind"] == "op")


SCHEMA_CASES = [
    (("version",), 1, (r"at version: the file has plan format version 1 but this autoshard reads version 2; re-plan "
                      r"with this version of autoshard \(parallelize without plan=\) and save again")),
    (("version",), "2", r"at version: the file has plan format version '2'"),
    (("version",), ..., r"at the top level: no 'version' key, so this is not an autoshard plan file"),
    (("nodes",), ..., (r"at the top level: a plan lacks the key 'nodes'; save the plan again with "
                      r"prog\.plan\.save\(path\)")),
    (("extra",), 1, r"at the top level: unexpected key 'extra' in a plan \(it has exactly the keys 'version'"),
    (("nodes",), {}, r"at nodes: expected the list of nodes \(a JSON array\), got dict"),
    (("mesh", "shape"), [2, 0], r"at mesh\.shape\[1\]: expected an axis size \(integer >= 1\), got int 0"),
    (("mesh", "names"), ["dp", "dp"], r"at mesh: axis_names=\('dp', 'dp'\) repeats 'dp'"),
    (("mesh", "named"), "yes", r"at mesh\.named: expected true or false, got str 'yes'"),
    (("hints",), {"input:0": {"dp": "S(x)"}}, r"at hints: malformed placement 'S\(x\)'"),
    (("nodes", 0, "choice"), ..., r"at nodes\[0\] \(node '\w+'\): a node lacks the key 'choice'"),
    (("nodes", 0, "bytes_fwd"), "12", r"at nodes\[0\]\.bytes_fwd \(node '\w+'\): expected an integer >= 0, got str"),
    (("nodes", 0, "bytes_bwd"), -1, r"at nodes\[0\]\.bytes_bwd \(node '\w+'\): expected an integer >= 0, got int -1"),
    (("nodes", 0, "name"), 7, r"at nodes\[0\]\.name: expected a string, got int 7"),
    (("nodes", 0, "spec"), "[S(0)]", (r"at nodes\[0\]\.spec \(node '\w+'\): '\[S\(0\)\]' has 1 placements but the "
                                     r"mesh Mesh\(dp=2, tp=2\) has 2 axes")),
    (("nodes", 0, "spec"), "S(0), R", r"at nodes\[0\]\.spec \(node '\w+'\): malformed spec 'S\(0\), R'"),
    (("nodes", 0, "choice", 1, "output"), "Shard(0)", (r"at nodes\[0\]\.choice\[1\]\.output \(node '\w+'\): malformed "
                                                      r"placement 'Shard\(0\)': a placement is 'S\(<dim>\)', 'R' or 'P'")),
    (("nodes", 0, "choice", 1, "output"), "S(5)", (r"at nodes\[0\]\.choice \(node '\w+'\): the chosen outputs "
                                                  r"\[\w+(\(\d\))?, S\(5\)\] disagree with the node's spec")),
    (("nodes", 0, "choice"), [], (r"at nodes\[0\]\.choice \(node '\w+'\): expected one chosen strategy per mesh axis "
                                 r"of Mesh\(dp=2, tp=2\) \(2\), got 0")),
    (("nodes", 0, "choice", 0, "cost"), 1, (r"at nodes\[0\]\.choice\[0\] \(node '\w+'\): unexpected key 'cost' in a "
                                           r"strategy")),
    (("nodes", 0, "axis"), "pp", r"at nodes\[0\]\.axis \(node '\w+'\): 'pp' is not an axis of Mesh\(dp=2, tp=2\)"),
    (("nodes", 1), "node", r"at nodes\[1\]: expected a node \(a JSON object\), got str 'node'"),
    (("grad_reduce", "layers.0.bias"), ["pp"], r"at grad_reduce\['layers\.0\.bias'\]\[0\]: 'pp' is not an axis"),
    (("predicted", "comm_s"), -1.0, r"at predicted\.comm_s: expected a finite number >= 0, got float -1\.0"),
    (("predicted", "comm_bytes_per_step", "dp"), ..., (r"at predicted\.comm_bytes_per_step: bytes per mesh axis lacks "
                                                      r"the key 'dp'")),
    (("fingerprint",), "0123456789abcdef", (r"at fingerprint: the file says '0123456789abcdef' but its content hashes "
                                           r"to '[0-9a-f]{16}': it was changed after it was saved, or is corrupt; save "
                                           r"it again; if you edited it on purpose, set \"fingerprint\" to null")),
    (("fingerprint",), 5, r"at fingerprint: expected a string, got int 5"),
]


@pytest.mark.parametrize("path, value, message", SCHEMA_CASES)
def test_schema_violations_say_what_and_where(small, tmp_path, path, value, message):
    _, prog = small
    data = copy.deepcopy(prog.plan.to_json()) | {"fingerprint": None}  # else every edit fails the fingerprint
    if path[:2] == ("nodes", 0) and len(path) > 3 and path[2] == "choice":  # edit an op (with inputs)
        path = ("nodes", _first_op(data), *path[2:])
        message = message.replace(r"nodes\[0\]", rf"nodes\[{path[1]}\]")
    _edit(data, path, value)
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=message) as info:
        Plan.load(file)
    assert str(info.value).startswith(f"plan file '{file}': at ")


def test_repeated_node_names(small, tmp_path):
    _, prog = small
    data = prog.plan.to_json() | {"fingerprint": None}
    data["nodes"][1] = dict(data["nodes"][1], name=data["nodes"][0]["name"])
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"at nodes\[1\]\.name \(node '\w+'\): the name repeats nodes\[0\]"):
        Plan.load(tmp_path / "p.json")


def _saved_text(prog):
    return json.dumps(prog.plan.to_json() | {"fingerprint": prog.plan.fingerprint})


@pytest.mark.parametrize("make, message", [
    (lambda text: text[:len(text) // 2].encode(), (r"is not valid JSON: .* \(line 1, column \d+\); it ends too early "
                                                  r"\(truncated\?\) — write it again")),
    (lambda text: text.replace('"nodes"', "'nodes'").encode(), (r"is not valid JSON: Expecting property name enclosed "
                                                               r"in double quotes .*; it is corrupt or was edited")),
    (lambda text: b"\xff\xfe" + text.encode("utf-16-le"), r"is not UTF-8 text \(byte 0: invalid start byte\)"),
    (lambda text: text.replace('"comm_s":', '"comm_s":NaN,"x":').encode(), (r"is not valid JSON for autoshard: NaN is "
                                                                           r"not a JSON number")),
    (lambda text: b"[" * 100_000 + b"]" * 100_000, r"nests JSON arrays/objects too deeply to parse"),
    (lambda text: b"[" + b"7" * 5000 + b"]", r"is not valid JSON for autoshard: Exceeds the limit \(4300 digits\)"),
    (lambda text: b"", r"is not valid JSON: Expecting value \(line 1, column 1\); it ends too early"),
    (lambda text: b"[1, 2]", r"at the top level: expected a plan \(a JSON object\), got list \[1, 2\]"),
])
def test_corrupt_files(small, tmp_path, make, message):
    _, prog = small
    path = tmp_path / "plan.json"
    path.write_bytes(make(_saved_text(prog)))
    with pytest.raises(PlanFileError, match=message):
        Plan.load(path)


def test_a_byte_order_mark_is_fine(small, tmp_path):
    _, prog = small
    path = tmp_path / "plan.json"
    path.write_bytes(b"\xef\xbb\xbf" + _saved_text(prog).encode())
    assert Plan.load(path).dumps() == prog.plan.dumps()


def test_size_limit(small, tmp_path, monkeypatch):
    _, prog = small
    path = tmp_path / "plan.json"
    prog.plan.save(path)
    monkeypatch.setattr(plan_io, "MAX_PLAN_FILE_BYTES", 1000)
    with pytest.raises(PlanFileError, match=r"plan file '.*plan\.json' is larger than the limit of 1000 bytes"):
        Plan.load(path)
    assert plan_io.MAX_PLAN_FILE_BYTES == 1000 and os.path.getsize(path) > 1000


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "plan.pkl"
    path.write_bytes(pickle.dumps(_Exploit(str(marker))))
    with pytest.raises(PlanFileError, match=r"is not (UTF-8 text|valid JSON)"):
        Plan.load(path)
    assert not marker.exists()


def test_missing_file_directory_and_bad_path(tmp_path):
    with pytest.raises(PlanFileError, match=r"cannot read plan file '.*nope\.json': No such file or directory; check "
                                             r"the path"):
        Plan.load(tmp_path / "nope.json")
    with pytest.raises(PlanFileError, match=r"cannot read plan file '.*': Is a directory"):
        Plan.load(tmp_path)
    with pytest.raises(PlanFileError, match=r"plan file must be the path of a JSON file \(str or os\.PathLike\), got "
                                             r"int 3"):
        Plan.load(3)


def test_saving_into_a_missing_directory(small, tmp_path):
    _, prog = small
    with pytest.raises(PlanFileError, match=r"cannot write plan file '.*no/such/plan\.json': No such file or "
                                             r"directory; check that the directory exists"):
        prog.plan.save(tmp_path / "no" / "such" / "plan.json")
    assert not list(tmp_path.iterdir())


def test_pipelined_plan_saves_and_loads_with_its_stage_table(gpt2_case, tmp_path):
    model, inputs, loss_fn = gpt2_case
    prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("pp", "dp"),
                                 hints={"input:0": {"dp": "S(0)"}}, pipeline={"microbatches": 2})
    path = tmp_path / "pipeline.json"
    prog.plan.save(path)
    loaded = Plan.load(path)
    assert loaded.fingerprint == prog.plan.fingerprint
    assert loaded.pipeline["stages"] == 2 and {r.stage for r in loaded.rows} == {0, 1}
    head, body = loaded.table_cells()
    assert {line[head.index("stage")] for line in body} == {"0", "1"}
    assert _decisions(loaded.table_cells()) == _decisions(prog.plan.table_cells())
    again = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("pp", "dp"), plan=str(path))
    assert again.plan.fingerprint == prog.plan.fingerprint
    assert "apply_plan" in [e.name for e in again.history] and "solve" not in [e.name for e in again.history]
    for rank in range(4):
        for a, b in zip(again.graph(rank), prog.graph(rank)):
            assert a.gm.code == b.gm.code


def test_checkpointed_plan_round_trips(gpt2_case, tmp_path):
    """A plan with activation checkpointing predicts recompute time; its file loads and applies."""
    model, inputs, loss_fn = gpt2_case
    prog = autoshard.parallelize(model, MESH, inputs, loss_fn=loss_fn, axis_names=NAMES, hints=GPT2_HINTS,
                                 checkpoint=["layers.*"])
    assert prog.plan.predicted["recompute_s"] > 0
    prog.plan.save(tmp_path / "ckpt.json")
    again = autoshard.parallelize(model, MESH, inputs, loss_fn=loss_fn, axis_names=NAMES,
                                  checkpoint=["layers.*"], plan=str(tmp_path / "ckpt.json"))
    assert again.plan.fingerprint == prog.plan.fingerprint


def test_pipelined_plan_with_another_cut_is_a_mismatch(gpt2_case, tmp_path):
    model, inputs, loss_fn = gpt2_case
    names, dp = ("pp", "dp"), {"input:0": {"dp": "S(0)"}}
    prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=names, hints=dp,
                                 pipeline={"microbatches": 2, "balance": [4, 3]})
    with pytest.raises(PlanMismatchError, match=r"cuts the model differently here .*its cut: balance=\[4, 3\]"):
        autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=names, plan=prog.plan,
                              pipeline={"balance": [5, 2]})
    with pytest.raises(PlanMismatchError, match=r"pipelines over axis 'pp', which mesh Mesh\(dp=2, tp=2\)"):
        autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"), plan=prog.plan)


def test_pipelined_plan_applies_its_cut_under_another_profile(tmp_path):
    """A saved pipelined plan's cut is one of its decisions: under another profile (a user's new calibration), where
    a fresh plan cuts the model elsewhere, the saved one applies with its stages and placements and is priced anew
    (it was refused: the cut was made again and compared by fingerprint)."""
    import dataclasses

    from autoshard.cost.profiles import CPU_PROFILE
    model, inputs, loss_fn = gpt2(batch=4, seq=16, dim=32, n_heads=2, n_layers=3, vocab_size=512)
    slower_ops = dataclasses.replace(CPU_PROFILE, op_overhead_s=1e-3, grad_op_overhead_s=1e-3)
    kwargs = {"loss_fn": loss_fn, "axis_names": ("pp",)}
    prog = autoshard.parallelize(model, (2,), inputs, pipeline={"microbatches": 2}, **kwargs)
    fresh = autoshard.parallelize(model, (2,), inputs, profile=slower_ops, pipeline={"microbatches": 2}, **kwargs)
    stages = [(r.name, r.stage) for r in prog.plan.rows if r.kind != "comm"]
    assert stages != [(r.name, r.stage) for r in fresh.plan.rows if r.kind != "comm"]  # the case: another cut
    prog.plan.save(tmp_path / "piped.json")
    again = autoshard.parallelize(model, (2,), inputs, profile=slower_ops, plan=str(tmp_path / "piped.json"), **kwargs)
    assert [(r.name, r.stage) for r in again.plan.rows if r.kind != "comm"] == stages
    assert [r.choice for r in again.plan.rows] == [r.choice for r in prog.plan.rows]
    assert again.plan.pipeline["cut"] == "automatic"
    assert again.plan.pipeline["predicted_step_s"] > 2 * prog.plan.pipeline["predicted_step_s"]  # priced anew


def test_pipelined_plan_with_a_stage_of_unlisted_ops_applies(tmp_path):
    """A 2-layer model cut into 4 stages: one stage holds only a check of a tensor's metadata, which has no row in the
    plan (no placement); applying the saved cut puts it back in that stage (it left the stage empty: an error)."""
    from autoshard.zoo.transformers_families import llama
    model, inputs, loss_fn = llama()
    kwargs = {"loss_fn": loss_fn, "axis_names": ("pp",)}
    prog = autoshard.parallelize(model, (4,), inputs, pipeline={"schedule": "1f1b", "microbatches": 4}, **kwargs)
    assert {r.stage for r in prog.plan.rows if r.kind != "comm"} != set(range(4))  # the case: a stage without rows
    prog.plan.save(tmp_path / "piped.json")
    again = autoshard.parallelize(model, (4,), inputs, plan=str(tmp_path / "piped.json"), **kwargs)
    assert again.plan.fingerprint == prog.plan.fingerprint
    assert [n.meta.get("autoshard.stage") for n in again.state.gm.graph.nodes] == \
        [n.meta.get("autoshard.stage") for n in prog.state.gm.graph.nodes]
