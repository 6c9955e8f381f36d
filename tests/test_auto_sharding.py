"""Tier 1 for the automatic planner: memory budget, determinism, explanations, mesh roles."""
import json

import pytest
import torch
from torch import nn

import autoshard
from autoshard.cost.profiles import CPU_PROFILE, HardwareProfile, load_profile
from autoshard.solver.errors import MemoryBudgetError
from autoshard.zoo import gpt2, llama


def _gpt2_plan(mesh=(4,), **kw):
    model, inputs, loss_fn = gpt2()
    return autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, profile=CPU_PROFILE, pipeline=False, **kw)


def test_budget_below_replicated_parameters_shards_them_instead_of_failing():
    replicated = _gpt2_plan(memory_budget=float("inf"))
    footprint = replicated.plan.predicted["memory_bytes_per_rank"]
    assert all(r.spec == "[R]" for r in replicated.plan.rows if r.kind == "param")
    tight = _gpt2_plan(memory_budget=0.5 * footprint)
    assert tight.plan.predicted["memory_bytes_per_rank"] <= 0.5 * footprint
    assert any(r.spec != "[R]" for r in tight.plan.rows if r.kind == "param")


def test_impossible_budget_names_the_budget_and_the_minimum():
    with pytest.raises(MemoryBudgetError, match=r"memory budget of .*1000 bytes.* smallest footprint .* is "
                                                 r".*\d+ bytes"):
        _gpt2_plan(memory_budget=1000)


def test_explain_lists_alternatives_with_costs_and_stars_the_choice():
    prog = _gpt2_plan(mesh=(2,))
    text = prog.plan.explain("layers.0.mlp.fc1")
    assert "axis a0 (size 2)" in text
    assert text.count("*") >= 1 and "compute" in text and "reshard" in text and "memory" in text
    assert "no op under module path" in prog.plan.explain("no.such.module")


def test_plan_json_carries_predictions():
    data = _gpt2_plan(mesh=(2, 2)).plan.to_json()
    predicted = data["predicted"]
    assert set(predicted) >= {"step_time_s", "comm_bytes_per_step", "memory_bytes_per_rank"}
    assert set(predicted["comm_bytes_per_step"]) == {"a0", "a1"}


def test_unnamed_mesh_roles_are_reported():
    model, inputs, loss_fn = llama(batch=2, seq=16, dim=512, ffn_dim=1024)
    prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, profile=CPU_PROFILE, pipeline=False)
    roles = prog.plan.axis_roles()
    assert roles["a0"].startswith("model parallel"), roles
    assert "a0 (model parallel" in prog.plan.summary()


def test_repeated_layers_share_decisions_so_the_ilp_does_not_grow_with_depth():
    sizes = []
    for layers in (2, 6):  # traced whole: the decision classes, not the folded trace, keep the ILP's size
        model, inputs, loss_fn = llama(n_layers=layers, device="meta")
        prog = autoshard.parallelize(model, (2, 2, 2), inputs, loss_fn=loss_fn, pipeline=False, fold_layers=False)
        sizes.append([s["classes"] for s in prog.state.ilp_stats])
    assert sizes[0] == sizes[1]


def test_profile_json_round_trip_and_named_profiles(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(CPU_PROFILE.to_json()))
    assert load_profile(str(path)) == CPU_PROFILE
    assert load_profile("gpu") == HardwareProfile()
    with pytest.raises(autoshard.UserInputError, match="neither one of"):
        load_profile("tpu")


def test_plan_html_has_a_row_per_tensor_and_a_column_per_axis():
    prog = _gpt2_plan(mesh=(2, 2))
    html = prog.plan._repr_html_()
    rows, totals = html.split("</table>")[:2]
    assert rows.count("<tr>") == len(prog.plan.rows) + 1
    assert totals.count("<tr>") == len(prog.mesh.names) + 2  # header, one per axis, all axes
    assert "<th>a0 (2)</th>" in html and "<th>collective</th>" in html


def test_plan_filter_by_module_glob():
    prog = _gpt2_plan(mesh=(2,))
    rows = prog.plan.filter("layers.0.mlp")
    assert rows and all(r.path.startswith("layers.0.mlp") for r in rows)
    assert {r.path for r in prog.plan.filter("layers.*.attn.q")} >= {"layers.0.attn.q", "layers.1.attn.q"}
    assert prog.plan.filter("no.such") == []


def test_pipeline_microbatch_plan_pays_gradient_sync_once_per_step():
    """Each micro-batch program recurs m times per step but syncs gradients once: priced per micro-batch
    at full cost, data parallelism on x (sync 128 MiB once, splits the work 8 ways) lost to replication."""
    h = 2048
    model = nn.Sequential(*[nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h)) for _ in range(4)]).to("meta")
    x = torch.randn(8192, h, device="meta")
    prog = autoshard.parallelize(model, (2, 8), (x,), axis_names=("pp", "x"),
                                 pipeline={"microbatches": 16, "schedule": "1F1B"})
    assert [r.spec for r in prog.plan.rows if r.kind == "input"] == ["[S(0)]"]
    assert prog.plan.predicted["comm_bytes_per_step"]["x"]["sync"] > 0
