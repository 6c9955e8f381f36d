"""The ILP's memory row is predict's memory (issue 28 item 4): a plan the solver accepts under a budget is
predicted within it. The row charges, on the solver's edges, the converted copy a consumer keeps for backward
(an all-gathered weight or activation) instead of the producer's storage (autoshard/cost/conversion_memory.py);
before, a plan that gathered its weights per use was accepted at 31.3 MiB under benchmark 1's 26.8 MiB budget.

The row of the chosen plan (`state.memory_row_bytes`) equals predict's memory to the byte where no ZeRO or
recomputation is planned (their rows are approximations the ladder and the recompute pass check), except
where a value is converted after a view of it (the row then still counts the producer's storage too): within
1%, and never below.
"""
import os

import pytest

import autoshard
from autoshard import zoo
from autoshard.zoo.hints import plan_hints

FULL = os.environ.get("AUTOSHARD_FULL_MATRIX") == "1"
# benchmark 1's (plan_quality) weight-heavy shapes: the automatic plan gets the Megatron plan's memory
WIDE = {"gpt2": {"batch": 8, "seq": 16, "dim": 512, "n_heads": 8},
        "llama": {"batch": 8, "seq": 16, "dim": 512, "n_heads": 8, "n_kv_heads": 8, "ffn_dim": 1024}}
# zoo models under a budget a share of their unbounded plan's memory
SHARED = [("mlp", (2, 2), 0.35), ("mlp", (2, 4), 0.35), ("vit", (2, 4), 0.35), ("gpt2", (2, 2), 0.6)]
SHARED += [("bert", (2, 2), 0.6), ("vit", (2, 2), 0.6), ("resnet", (2, 2), 0.6), ("llama", (2, 4), 0.6)] if FULL else []


def _check(prog, budget):
    predicted = prog.plan.predicted["memory_bytes_per_rank"]
    assert predicted <= budget, (predicted, budget)
    if prog.zero is None and not prog.state.recompute_regions:
        row = prog.state.memory_row_bytes
        assert predicted - 8 <= row <= 1.01 * predicted, (row, predicted)


@pytest.mark.skipif(not FULL, reason="AUTOSHARD_FULL_MATRIX=1 runs it (28 s; gpt2 under a binding budget on (2, 2) "
                                     "runs by default)")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_automatic_plan_fits_benchmark_1s_budget(name):
    axes = ("dp", "tp")
    model, inputs, loss_fn = getattr(zoo, name)(**WIDE[name])
    megatron = autoshard.parallelize(model, (2, 4), inputs, loss_fn=loss_fn, axis_names=axes,
                                     hints=plan_hints(name, axes, batch_axes=axes[:-1], tp_axis=axes[-1]))
    budget = megatron.plan.predicted["memory_bytes_per_rank"]
    assert megatron.state.memory_row_bytes == budget  # Megatron's own plan: the row is predict's, exactly
    model, inputs, loss_fn = getattr(zoo, name)(**WIDE[name])
    auto = autoshard.parallelize(model, (2, 4), inputs, loss_fn=loss_fn, axis_names=axes, memory_budget=budget)
    _check(auto, budget)


@pytest.mark.parametrize(("name", "mesh", "share"), SHARED, ids=[f"{n}-{m}-{s}" for n, m, s in SHARED])
def test_a_binding_budget_is_met_and_the_row_is_predicts_memory(name, mesh, share):
    model, inputs, loss_fn = getattr(zoo, name)()
    free = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=("dp", "tp"), pipeline=False)
    budget = share * free.plan.predicted["memory_bytes_per_rank"]
    model, inputs, loss_fn = getattr(zoo, name)()
    prog = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=("dp", "tp"), pipeline=False,
                                 memory_budget=budget)
    _check(prog, budget)
