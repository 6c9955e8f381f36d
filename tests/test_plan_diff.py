"""plan.diff: placement changes, collectives added/removed, gradient reductions and predicted deltas."""
from collections import Counter

import pytest

import autoshard
from autoshard.plan.plan import Plan
from autoshard.zoo import mlp


def _plan(mesh, names, hints):
    model, inputs, loss_fn = mlp(n_layers=2)
    return autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=names, hints=hints).plan


@pytest.fixture(scope="module")
def plans():
    return {
        "dp": _plan((2,), ("x",), {"input:0": {"x": "S(0)"}}),
        "tp": _plan((2,), ("x",), {"layers.0.weight": {"x": "S(0)"}, "layers.1.weight": {"x": "S(1)"}}),
        "dp4": _plan((4,), ("dp",), {"input:0": {"dp": "S(0)"}}),
    }


def test_same_plan_has_no_differences(plans):
    d = plans["dp"].diff(plans["dp"])
    assert not d
    assert "the same decisions" in repr(d) and "the same decisions" in d._repr_html_()


def test_data_parallel_to_megatron(plans):
    dp, tp = plans["dp"], plans["tp"]
    d = dp.diff(tp)
    assert d
    changed = {c.path: c.axes(dp.mesh.names) for c in d.placements if c.op == "param"}
    # The first bias follows its weight's sharding (propagation); the second layer's partial sum is reduce-scattered
    # and its bias added to the shards: a replicated bias's gradient would be synced, a whole all-reduce latency on
    # this tiny MLP (the ILP prices a sync as its share of the bucket a data-parallel plan syncs: here all of it).
    assert changed == {"layers.0.weight": "x: R -> S(0)", "layers.1.weight": "x: R -> S(1)",
                       "layers.0.bias": "x: R -> S(0)", "layers.1.bias": "x: R -> S(0)"}
    # Every collective of either plan is accounted for: kept ones cancel, the rest are listed.
    def key(x):
        return x.collective, x.axis, x.path, x.bytes_fwd, x.bytes_bwd
    assert d.collectives and any(c.added for c in d.collectives)
    got = Counter(key(r) for r in dp.collectives())
    got.subtract(key(c) for c in d.collectives if not c.added)
    got.update(key(c) for c in d.collectives if c.added)
    assert +got == Counter(key(r) for r in tp.collectives())
    assert d.totals["step_time_s"] == (dp.predicted["step_time_s"], tp.predicted["step_time_s"])
    assert d.totals["memory_bytes_per_rank"] == (dp.predicted["memory_bytes_per_rank"],
                                                 tp.predicted["memory_bytes_per_rank"])
    # Data parallel reduces every gradient on x; Megatron reduces none of the sharded weights' there.
    assert d.grad_reduce["layers.0.weight"] == (("x",), ())
    text = repr(d)
    assert "layers.0.weight" in text and "x: R -> S(0)" in text and "predicted step" in text
    html = d._repr_html_()
    assert "<table>" in html and "layers.1.weight" in html and "x: R -&gt; S(1)" in html


def test_reverse_diff_swaps_added_and_removed(plans):
    forward, backward = plans["dp"].diff(plans["tp"]), plans["tp"].diff(plans["dp"])
    flip = sorted((not c.added, c.collective, c.axis, c.path) for c in forward.collectives)
    assert flip == sorted((c.added, c.collective, c.axis, c.path) for c in backward.collectives)
    assert len(forward.placements) == len(backward.placements)


def test_other_mesh_compares_named_types(plans):
    d = plans["dp"].diff(plans["dp4"])
    assert "Mesh(x=2) -> Mesh(dp=4)" in repr(d)
    assert set(d.axis_bytes) == {"x", "dp"}
    # [S(0)] on x and [S(0)] on dp name different axes, so the input's type changed.
    assert any(c.path == "input:0" and c.type_after == "f32[8@dp, 32]" for c in d.placements)


def test_loaded_plan_diffs_like_the_compiled_one(plans, tmp_path):
    plans["tp"].save(tmp_path / "tp.json")
    loaded = Plan.load(tmp_path / "tp.json")
    assert not loaded.diff(plans["tp"])
    assert repr(plans["dp"].diff(loaded)) == repr(plans["dp"].diff(plans["tp"]))
