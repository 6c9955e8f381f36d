"""The bad-input catalogue: every mistake a user can make gets an AutoshardError that says what is wrong,
where, and what to do — never a bare traceback from inside torch."""
import json

import pytest
import torch
from torch import nn

import autoshard
from autoshard import ExportError, HintError, Mesh, UserInputError
from autoshard.frontend.hints import Hints
from autoshard.zoo import gpt2, mlp


@pytest.fixture(scope="module")
def small():
    return mlp(batch=8, in_dim=8, hidden=16, out_dim=8)


def plan(small, hints=None, mesh=(2, 2), axis_names=("dp", "tp"), **kwargs):
    model, inputs, loss_fn = small
    kwargs.setdefault("example_inputs", inputs)
    return autoshard.parallelize(model, mesh=mesh, axis_names=axis_names, hints=hints, loss_fn=loss_fn, **kwargs)


def test_every_error_class_is_an_autoshard_error():
    for cls in (UserInputError, HintError, ExportError, autoshard.PlanError):
        assert issubclass(cls, autoshard.AutoshardError)
    assert issubclass(UserInputError, ValueError)  # callers catching ValueError keep working


# --- mesh ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh, message", [
    ((2, 0), (r"mesh=\(2, 0\): axis 1 has size 0, but every axis needs a positive integer size .*pass e\.g\. "
             r"mesh=\(2, 4\)")),
    ((-2,), r"mesh=\(-2,\): axis 0 has size -2, but every axis needs a positive integer size"),
    ((2, 2.0), r"mesh=\(2, 2\.0\): axis 1 has size 2\.0, but every axis needs a positive integer size"),
    ((2, "2"), r"axis 1 has size '2'"),
    ((True, 2), r"axis 0 has size True"),
    ((), r"mesh=\(\) is not a non-empty tuple of axis sizes; pass e\.g\. mesh=\(2, 4\)"),
    ("2x2", r"mesh='2x2' is not a non-empty tuple of axis sizes"),
])
def test_bad_mesh_sizes(small, mesh, message):
    with pytest.raises(UserInputError, match=message):
        plan(small, mesh=mesh, axis_names=None)


def test_numpy_integer_sizes_are_fine():
    np = pytest.importorskip("numpy")
    assert Mesh((np.int64(2), 2)).shape == (2, 2)


@pytest.mark.parametrize("names, message", [
    (("dp", "dp"), r"axis_names=\('dp', 'dp'\) repeats 'dp': each mesh axis needs its own name"),
    (("dp",), r"mesh=\(2, 2\) has 2 axes but axis_names=\('dp',\) has 1; give one name per axis"),
    (("dp", "tp", "pp"), r"has 2 axes but axis_names=\('dp', 'tp', 'pp'\) has 3"),
    (("dp", "t p"), r"'t p' is not an identifier; use names like 'dp', 'tp', 'pp'"),
    (("dp", 1), r"1 is not an identifier"),
    ("dp", r"axis_names='dp' is not a tuple of names; pass e\.g\. axis_names=\('dp', 'tp'\)"),
])
def test_bad_axis_names(small, names, message):
    with pytest.raises(UserInputError, match=message):
        plan(small, axis_names=names)


def test_axis_names_disagreeing_with_a_mesh_object(small):
    with pytest.raises(UserInputError, match=r"axis_names=\('dp', 'tp'\) disagree with the names of "
                                             r"Mesh\(x=2, y=2\); leave axis_names out"):
        plan(small, mesh=Mesh((2, 2), ("x", "y")))


def test_unknown_axis_lookup():
    with pytest.raises(UserInputError, match=r"unknown mesh axis 'pp': Mesh\(dp=2, tp=2\) has axes \['dp', 'tp'\]"):
        Mesh((2, 2), ("dp", "tp")).axis("pp")


# --- hints naming nothing ----------------------------------------------------------------------------------


def test_unknown_parameter_suggests_close_matches(small):
    with pytest.raises(HintError, match=r"hint 'layers\.0\.wieght' matches no parameter of the model\. Did you mean "
                                        r"'layers\.0\.weight'.*Check the path against model\.named_parameters\(\)"):
        plan(small, {"layers.0.wieght": {"tp": "S(0)"}})


def test_unknown_parameter_glob(small):
    with pytest.raises(HintError, match=r"hint 'blocks\.\*\.weight' matches no parameter"):
        plan(small, {"blocks.*.weight": {"tp": "S(0)"}})


def test_unknown_module_for_output(small):
    with pytest.raises(HintError, match=r"hint 'layer\.1:output' matches no module of the model\. Did you mean "
                                        r"'layers\.1'.*model\.named_modules\(\)"):
        plan(small, {"layer.1:output": {"tp": "S(0)"}})


def test_unknown_module_for_split_counts(small):
    with pytest.raises(HintError, match=r"hint 'fc1:shard' matches no module"):
        plan(small, {"fc1:shard": {"in_strategy": [[2, 1], [1, 1]]}})


def test_unknown_axis(small):
    with pytest.raises(HintError, match=r"hint 'layers\.0\.weight' names mesh axis 'pp', but the mesh has axes "
                                        r"\['dp', 'tp'\]; use one of those names"):
        plan(small, {"layers.0.weight": {"pp": "S(0)"}})


def test_unknown_axis_on_an_unnamed_mesh(small):
    with pytest.raises(HintError, match=r"names mesh axis 'dp', but the mesh has axes \['a0', 'a1'\].*axis_names="):
        plan(small, {"input:0": {"dp": "S(0)"}}, axis_names=None)


def test_input_index_out_of_range(small):
    with pytest.raises(HintError, match=r"hint 'input:1': the model takes 1 example input, so input indices run "
                                        r"from 0 to 0; number inputs by their position in example_inputs"):
        plan(small, {"input:1": {"dp": "S(0)"}})


@pytest.mark.parametrize("key, message", [
    ("input:first", r"key 'input:first': write input:<index>, e\.g\. 'input:0'"),
    ("layers.0 weight", r"key 'layers\.0 weight' is not a parameter glob, '<module glob>:output'.*write e\.g\."),
    ("layers.0:outputs", r"key 'layers\.0:outputs' is not a parameter glob"),
])
def test_malformed_keys(small, key, message):
    with pytest.raises(HintError, match=message):
        plan(small, {key: {"tp": "R"}})


# --- malformed values -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["S(x)", "Shard(0)", 3, "s(0)", "S0", None, ["S(0)"]])
def test_malformed_placement(small, text):
    with pytest.raises(HintError, match=r"malformed placement .* in hints key 'layers\.0\.weight' axis 'tp': "
                                        r"write 'S\(<dim>\)', 'R' or 'P', e\.g\. 'S\(0\)'"):
        plan(small, {"layers.0.weight": {"tp": text}})


def test_huge_placement_is_shortened_in_the_message(small):
    with pytest.raises(HintError, match=r"malformed placement 'S\(9+\.\.\. \(5004 characters\) in hints key "
                                        r"'layers\.0\.weight' axis 'tp'") as info:
        plan(small, {"layers.0.weight": {"tp": "S(" + "9" * 5000}})
    assert len(str(info.value)) < 200


@pytest.mark.parametrize("value", ["S(0)", ["tp", "S(0)"], 3, {}])
def test_hint_value_not_a_dict(small, value):
    with pytest.raises(HintError, match=r"hints: 'layers\.0\.weight' must map axis names to placements, e\.g\. "
                                        r"\{\"tp\": \"S\(0\)\"\}; got"):
        plan(small, {"layers.0.weight": value})


def test_hint_axis_not_a_string(small):
    with pytest.raises(HintError, match=r"'layers\.0\.weight' maps 1 to a placement, but keys there are mesh axis "
                                        r"names"):
        plan(small, {"layers.0.weight": {1: "S(0)"}})


@pytest.mark.parametrize("hints", [["layers.0.weight"], 42])
def test_hints_not_a_dict_or_path(small, hints):
    with pytest.raises(HintError, match=r"hints must be a dict \{key: \{axis: placement\}\} or the path of a JSON "
                                        r"hint file; got"):
        plan(small, hints)


@pytest.mark.parametrize("value, message", [
    ([[2, 1], [1, 1]], r"'layers\.0:shard' needs \{\"in_strategy\": \[\[split counts per dim\] per input\]\}"),
    ({"in_strategy": [[2, 0], [1, 1]]}, r"in_strategy must be a list of lists of positive split counts"),
    ({"in_strategy": [2, 1]}, r"in_strategy must be a list of lists"),
    ({"in_strategy": [[2, 1]]}, (r"module 'layers\.0' has an op with 2 tensor inputs but in_strategy gives 1; "
                                r"give one list per input")),
    ({"in_strategy": [[2], [1, 1]]}, (r"input 0 of 'layers\.0' has 2 dims \(shape \(8, 8\)\) but in_strategy gives "
                                     r"1 counts; give one count per dim")),
    ({"in_strategy": [[3, 1], [1, 1]]}, (r"split count 3 does not divide dim 0 \(size 8\) of input 0 of 'layers\.0' "
                                        r"\(input:0 .*\); use a count that divides it")),
    ({"in_strategy": [[8, 1], [1, 1]]}, (r"split count 8 on dim 0 of input 0 of 'layers\.0'.* matches no product of "
                                        r"distinct mesh axes \[\('dp', 2\), \('tp', 2\)\]; use a count that is")),
    ({"in_strategy": [[1, 2], [1, 1]]}, (r"no mapping of the split counts \[\[1, 2\], \[1, 1\]\] onto the axes of "
                                        r"Mesh\(dp=2, tp=2\).*aten\.linear\.default.*contracted dim")),
])
def test_bad_split_counts(small, value, message):
    with pytest.raises(HintError, match=message):
        plan(small, {"layers.0:shard": value})


# --- hints that cannot hold for the tensor ---------------------------------------------------------------


def test_placement_dim_out_of_range(small):
    with pytest.raises(HintError, match=r"hint 'layers\.\*\.bias' for layers\.0\.bias \(node '\w+'\), on axis 'tp': "
                                        r"S\(1\) names dim 1, but the parameter has 1 dims \(shape \(16,\)\); use "
                                        r"'S\(0\)' \.\. 'S\(0\)' or 'R'"):
        plan(small, {"layers.*.bias": {"tp": "S(1)"}})


def test_output_placement_dim_out_of_range(small):
    with pytest.raises(HintError, match=r"hint 'layers\.1:output' for layers\.1 .*S\(2\) names dim 2, but the "
                                        r"module output has 2 dims"):
        plan(small, {"layers.1:output": {"tp": "S(2)"}})


@pytest.mark.parametrize("key, what", [("layers.0.weight", "a parameter"), ("input:0", "an input")])
def test_partial_on_parameter_or_input(small, key, what):
    with pytest.raises(HintError, match=rf"hint '{key}' for .* on axis 'tp': {what} cannot be partial \('P'\).*"
                                        r"use 'R' or 'S\(d\)'"):
        plan(small, {key: {"tp": "P"}})


def test_contradicting_hints_name_both_keys(small):
    with pytest.raises(HintError, match=r"hints 'layers\.\*\.weight' and 'layers\.1\.weight' contradict on "
                                        r"layers\.1\.weight \(node '\w+'\) axis 'tp': S\(0\) vs S\(1\); keep one"):
        plan(small, {"layers.*.weight": {"tp": "S(0)"}, "layers.1.weight": {"tp": "S(1)"}})


def test_agreeing_overlapping_hints_are_fine(small):
    plan(small, {"layers.*.weight": {"tp": "S(0)"}, "layers.1.weight": {"tp": "S(0)", "dp": "R"}})


def test_tied_parameter_contradiction_names_both_keys():
    model, inputs, loss_fn = gpt2(batch=2, seq=4, dim=8, n_heads=2, n_layers=1, vocab_size=16)
    with pytest.raises(HintError, match=r"hints 'wte\.weight' and 'lm_head\.weight' contradict on wte\.weight"):
        autoshard.parallelize(model, mesh=(2,), axis_names=("tp",), example_inputs=inputs, loss_fn=loss_fn,
                              hints={"wte.weight": {"tp": "S(0)"}, "lm_head.weight": {"tp": "S(1)"}})


def test_sharded_dim_not_divisible(small):
    with pytest.raises(HintError, match=r"hint 'input:0' shards dim 0 \(size 8\) of input:0 \(node '\w+'\) over axis "
                                        r"'dp' of size 3, which does not divide it; pick a divisible dim"):
        plan(small, {"input:0": {"dp": "S(0)"}}, mesh=(3,), axis_names=("dp",))


def test_nested_sharding_not_divisible():
    model, inputs, loss_fn = mlp(batch=6, in_dim=8, hidden=16, out_dim=8)
    with pytest.raises(HintError, match=r"hints \['input:0'\] shard dim 0 \(size 6\) of input:0 \(node '\w+'\) over "
                                        r"axes \['dp', 'tp'\] \(4 blocks\), which does not divide it; shard it over "
                                        r"fewer axes or make the size a multiple of 4"):
        autoshard.parallelize(model, mesh=(2, 2), axis_names=("dp", "tp"), example_inputs=inputs, loss_fn=loss_fn,
                              hints={"input:0": {"dp": "S(0)", "tp": "S(0)"}})


def test_nested_sharding_from_two_keys_names_both():
    model, inputs, loss_fn = mlp(batch=8, in_dim=8, hidden=6, out_dim=8)
    with pytest.raises(HintError, match=r"hints \['layers\.\*\.bias', 'layers\.0\.bias'\] shard dim 0 \(size 6\)"):
        autoshard.parallelize(model, mesh=(2, 2), axis_names=("dp", "tp"), example_inputs=inputs, loss_fn=loss_fn,
                              hints={"layers.*.bias": {"dp": "S(0)"}, "layers.0.bias": {"tp": "S(0)"}})


def test_stage_hints_need_a_pipeline_axis(small):
    with pytest.raises(HintError, match=r"hint 'layers\.0:stage' puts modules into a pipeline stage but the mesh has "
                                        r"no pipeline axis; name a mesh axis 'pp'"):
        plan(small, {"layers.0:stage": 0})


def test_stage_hint_value_must_be_a_stage_number(small):
    with pytest.raises(HintError, match=r"'layers\.0:stage' maps to a pipeline stage number \(int >= 0\), got 'a'"):
        plan(small, {"layers.0:stage": "a"})


# --- hint files --------------------------------------------------------------------------------------


def test_hint_file_not_json(small, tmp_path):
    path = tmp_path / "hints.json"
    path.write_text("{'layers.0.weight': {'tp': 'S(0)'}}")
    with pytest.raises(HintError, match=r"hint file '.*hints\.json' is not valid JSON: .*line 1, column 2.*write it "
                                        r"again"):
        plan(small, str(path))


def test_hint_file_not_utf8(tmp_path):
    path = tmp_path / "hints.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(HintError, match=r"is not UTF-8 text.*check the path"):
        Hints.load(path)


def test_hint_file_too_large(tmp_path):
    path = tmp_path / "huge.json"
    path.write_text(json.dumps({"layers.0.weight": {"tp": "S(0)"}, "padding": " " * (4 << 20)}))
    with pytest.raises(HintError, match=r"hint file '.*huge\.json' is \d+ bytes; the limit is 4194304 \(4 MiB\)\. "
                                        r"Use globs"):
        Hints.load(path)


def test_hint_file_missing(small, tmp_path):
    with pytest.raises(HintError, match=r"cannot read hint file '.*nope\.json': No such file or directory; check the "
                                        r"path"):
        plan(small, str(tmp_path / "nope.json"))


def test_hint_file_is_a_directory(tmp_path):
    with pytest.raises(HintError, match=r"cannot read hint file"):
        Hints.load(tmp_path)


def test_hint_file_top_level_not_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(HintError, match=r"list\.json must be a JSON object mapping keys to \{axis: placement\}, "
                                        r"got list"):
        Hints.load(path)


# --- model and inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("inputs, shown", [(([1.0, 2.0],), r"list \(\[1\.0, 2\.0\]\)"), ((3,), r"int \(3\)"),
                                           ((None,), r"NoneType \(None\)")], ids=["list", "int", "None"])
def test_example_inputs_not_tensors(small, inputs, shown):
    with pytest.raises(UserInputError, match=rf"example_inputs\[0\] is of type {shown}, not a torch\.Tensor; "
                                             r"autoshard shards tensor inputs only\. Bind other arguments"):
        plan(small, example_inputs=inputs)


def test_second_example_input_not_a_tensor(small):
    with pytest.raises(UserInputError, match=r"example_inputs\[1\] is of type str \('mask'\), not a torch\.Tensor"):
        plan(small, example_inputs=(small[1][0], "mask"))


def test_example_input_that_is_a_list_of_tensors(small):
    with pytest.raises(UserInputError, match=r"example_inputs\[0\] is of type list of 2 items, not a torch\.Tensor; "
                                             r"pass its 2 tensors as separate example inputs"):
        plan(small, example_inputs=([small[1][0], small[1][0]],))


def test_example_inputs_as_a_dict(small):
    with pytest.raises(UserInputError, match=r"example_inputs must be a tuple \(or list\) of tensors, one per "
                                             r"positional argument of forward\(\), got a dict .*\(keyword inputs are "
                                             r"not supported\); pass e\.g\. \(ids, mask\)"):
        plan(small, example_inputs={"x": small[1][0]})


def test_model_not_a_module():
    with pytest.raises(UserInputError, match=r"model must be a torch\.nn\.Module \(or an fx\.GraphModule\), got "
                                             r"function; wrap a plain function in an nn\.Module"):
        autoshard.parallelize(lambda x: x * 2, mesh=(2,), example_inputs=(torch.randn(4),))


def test_loss_fn_not_callable(small):
    with pytest.raises(UserInputError, match=r"loss_fn must be a function loss_fn\(outputs, \*inputs\) -> scalar "
                                             r"tensor, got str"):
        autoshard.parallelize(small[0], mesh=(2,), example_inputs=small[1], loss_fn="mse")


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


def test_model_that_cannot_be_exported():
    with pytest.raises(ExportError) as info:
        autoshard.parallelize(DataDependent(), mesh=(2,), example_inputs=(torch.randn(2, 4),))
    text = str(info.value)
    assert "torch.export could not trace the model" in text and "data-dependent" in text  # what
    assert f'File "{__file__}"' in text and "in forward: if x.sum() > 0:" in text  # where
    assert "use torch.where / torch.cond instead of Python `if` on tensors" in text  # what to do
    assert info.value.__cause__ is not None  # the original error stays chained


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 2


def _project(x):
    return x @ torch.ones(5, 3)


class Projects(nn.Module):
    def forward(self, x):
        return _project(x)


@pytest.mark.parametrize("inner, line", [(DataDependent(), "if x.sum() > 0:"),
                                         (Projects(), "return x @ torch.ones(5, 3)")], ids=["guard", "shape"])
def test_export_error_names_the_innermost_model_line(inner, line):
    """Not the wrapper's `self.inner(x)`: the line inside the wrapped model (or its helper) that failed."""
    with pytest.raises(ExportError) as info:
        autoshard.parallelize(Wrapper(inner), mesh=(2,), axis_names=("dp",), example_inputs=(torch.randn(2, 4),))
    where = next(row for row in str(info.value).splitlines() if row.startswith("Where:"))
    assert where.endswith(line) and "self.inner(x)" not in where


HUB_MODEL = """
import torch


class Embeds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)

    def forward(self, ids):
        return self.embed(ids)
"""


def test_export_error_names_the_installed_model_line_not_the_wrapper(tmp_path, monkeypatch):
    """A model from an installed package (transformers, ...) wrapped by the user: its own line is the
    culprit (only torch, what torch calls into and the standard library are skipped)."""
    package = tmp_path / "site-packages" / "autoshard_hub_models"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(HUB_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    from autoshard_hub_models.model import Embeds
    with pytest.raises(ExportError) as info:  # float token ids
        autoshard.parallelize(Wrapper(Embeds()), mesh=(2,), axis_names=("dp",), example_inputs=(torch.randn(2, 3),))
    where = next(row for row in str(info.value).splitlines() if row.startswith("Where:"))
    assert "site-packages/autoshard_hub_models/model.py" in where and where.endswith("return self.embed(ids)")


def test_example_input_with_the_wrong_shape(small):
    with pytest.raises(ExportError, match=r"(?s)could not trace the model: RuntimeError: .*Where: File .*mlp\.py.*"
                                          r"What to do: check that example_inputs match what forward\(\) expects"):
        plan(small, example_inputs=(torch.randn(8, 5),))


def test_real_model_with_meta_inputs():
    """A model on the CPU with example inputs on the meta device (a meta model's real inputs are traced as
    meta tensors instead: tests/test_weights.py)."""
    model, _, loss_fn = mlp(batch=4, in_dim=8, hidden=16, out_dim=8)
    with pytest.raises(ExportError, match=r"(?s)same device.*What to do: put the example inputs on the model's "
                                          r"device \(for a model built on the meta device, pass meta inputs"):
        autoshard.parallelize(model, mesh=(2,), example_inputs=(torch.empty(4, 8, device="meta"),), loss_fn=loss_fn)


def test_rank_outside_the_mesh(small):
    prog = plan(small, mesh=(2,), axis_names=("dp",))
    with pytest.raises(UserInputError, match=r"rank 2 is outside the mesh Mesh\(dp=2\) \(ranks 0\.\.1\)"):
        prog.graph(2)


# --- autoshard.constrain ----------------------------------------------------------------------------------


class BadConstrain(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.spec = spec

    def forward(self, x):
        return autoshard.constrain(self.fc(x), self.spec)


def test_constrain_malformed_spec_fails_eagerly():
    with pytest.raises(HintError, match=r"malformed placement 'Q' in autoshard\.constrain axis 'dp'"):
        autoshard.constrain(torch.ones(2), {"dp": "Q"})
    with pytest.raises(HintError, match=r"the first argument must be a tensor, got list"):
        autoshard.constrain([1.0], {"dp": "R"})


def test_constrain_unknown_axis_names_the_module():
    with pytest.raises(HintError, match=r"autoshard\.constrain\('tp=S\(0\)'\) in the top-level forward names mesh "
                                        r"axis 'tp', but the mesh has axes \['dp'\]; use one of those names"):
        autoshard.parallelize(BadConstrain({"tp": "S(0)"}), mesh=(2,), axis_names=("dp",),
                              example_inputs=(torch.randn(4, 8),))


def test_constrain_dim_out_of_range():
    with pytest.raises(HintError, match=r"autoshard\.constrain\('dp=S\(3\)'\).* S\(3\) names dim 3, but the module "
                                        r"output has 2 dims"):
        autoshard.parallelize(BadConstrain({"dp": "S(3)"}), mesh=(2,), axis_names=("dp",),
                              example_inputs=(torch.randn(4, 8),))


def test_partial_on_a_buffer():
    from autoshard.zoo import resnet
    model, inputs, loss_fn = resnet(batch=2, image_size=8, width=4)
    with pytest.raises(HintError, match=r"hint 'stem\.1\.running_mean' for stem\.1\.running_mean .*a buffer cannot "
                                        r"be partial"):
        autoshard.parallelize(model, mesh=(2,), example_inputs=inputs, loss_fn=loss_fn,
                              hints={"stem.1.running_mean": {"a0": "P"}})


def test_parsed_hints_object_is_accepted(small):
    prog = plan(small, Hints.parse({"input:0": {"dp": "S(0)"}}))
    assert prog.input_specs[0][0] == autoshard.S(0)
