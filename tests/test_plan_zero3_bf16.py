"""A saved ZeRO-3 plan in bf16 mixed precision applies again (plan=, and so ParallelModule's ranks): fuse_comm folds
each parameter's cast into its all-gather, so the plan has no row for the cast; applying it gives the cast what solve
gave it and comes out with the same fingerprint (it was refused: 'the plan has node embedding where the traced
graph has node to')."""
import warnings

import pytest

import autoshard
from autoshard.zoo import gpt2, llama
from autoshard.zoo.hints import plan_hints


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_zero3_bf16_plan_applies_with_the_same_fingerprint(name, tmp_path):
    factory = {"gpt2": gpt2, "llama": llama}[name]
    mesh, names = ((2,), ("dp",)) if name == "gpt2" else ((2, 2), ("dp", "tp"))
    hints = {"input:0": {"dp": "S(0)"}} if name == "gpt2" else plan_hints(name, names, ("dp",), "tp")
    model, inputs, loss_fn = factory(n_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=names, hints=hints, zero=3,
                                     mixed_precision="bf16")
        assert made.zero.stage == 3
        made.plan.save(tmp_path / "plan.json")
        again = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=names,
                                      plan=str(tmp_path / "plan.json"), mixed_precision="bf16")
    assert again.plan.fingerprint == made.plan.fingerprint
    assert [n.name for n in again.state.gm.graph.nodes] == [n.name for n in made.state.gm.graph.nodes]
