"""Tier 3: every zoo model trains on real gloo ranks exactly like the single device (float64).

DP-only, Megatron-TP and mixed hints on meshes (4,), (2,2) and (2,2,2) (three sharding axes: two nested
batch axes and tp). The (4,) cases, the (2,2) ones except gpt2's and the (2,2,2) ones except gpt2's and llama's run
in the simulator (bitwise equal
to gloo: test_sim_equals_real.py); `AUTOSHARD_FULL_MATRIX=1` runs them on gloo and adds (2,). Also checks Megatron's collective count per transformer layer (gpt2 and
llama with tp on (4,) and (2, 2)).
"""
import os

import pytest

from autoshard.verify.verify import verify_factory
from autoshard.zoo import FACTORIES
from autoshard.zoo.hints import plan_hints

FULL = os.environ.get("AUTOSHARD_FULL_MATRIX") == "1"
CASES = []
for model in FACTORIES:
    CASES += [
        (model, (4,), ("dp",), ("dp",), None),
        (model, (4,), ("tp",), (), "tp"),
        (model, (2, 2), ("dp", "tp"), ("dp",), "tp"),
        (model, (2, 2, 2), ("dp", "sp", "tp"), ("dp", "sp"), "tp"),
    ]
    if FULL:  # the same rules on groups of 2 (the (4,) cases cover them by default)
        CASES += [(model, (2,), ("dp",), ("dp",), None), (model, (2,), ("tp",), (), "tp")]


@pytest.mark.parametrize("model,mesh,names,batch_axes,tp_axis", CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{'+'.join(c[3] + ((c[4],) if c[4] else ()))}"
                              for c in CASES])
def test_zoo_model_matches_single_device(pool_runner, model, mesh, names, batch_axes, tp_axis):
    hints = plan_hints(model, names, batch_axes, tp_axis)
    # the (2,2,2) cases and gpt2's (2,2) carry the gloo tier
    # gloo: gpt2's (2, 2) and the transformers' (2, 2, 2); the rest simulated (bitwise the same: test_sim_equals_real)
    simulate = not FULL and (len(mesh) == 1 or (len(mesh) == 2 and model != "gpt2")
                             or (len(mesh) == 3 and model not in ("gpt2", "llama")))
    report, program = verify_factory(f"autoshard.zoo:{model}", mesh, names, hints=hints, steps=2,
                                     runner=pool_runner, simulate=simulate)
    assert report.ok, f"{model} on {mesh}:\n{report}"
    # Predicted bytes per axis equal the counted ones.
    for axis, kinds in report.collectives.items():
        counted = sum(k["bytes"] for k in kinds.values())
        predicted = sum(program.plan.predicted["comm_bytes_per_step"][axis].values())
        assert counted == predicted, (axis, counted, predicted)
    if model in ("gpt2", "llama") and tp_axis and len(mesh) <= 2:  # (4,) tp, (2, 2) dp x tp (and (2,) tp)
        _assert_megatron_counts(report, model, names)


def _assert_megatron_counts(report, model, names):
    """Megatron's pattern: two all-reduces per transformer layer on tp each way, nothing else there."""
    layers = FACTORIES[model]()[0].cfg.n_layers
    assert report.collectives["tp"] == {
        "all_reduce": {"fwd": 2 * layers, "bwd": 2 * layers, "sync": 0, "bytes": report.collectives["tp"]
                       ["all_reduce"]["bytes"]}}
    if "dp" in names:
        # dp carries the gradient reduction (bucketed sync, plus in-graph reductions of gradients of
        # parameter-derived activations such as GPT-2's position embeddings) and the loss's target count.
        dp = report.collectives["dp"]
        assert set(dp) == {"all_reduce"}
        assert dp["all_reduce"]["sync"] == 1
        assert dp["all_reduce"]["fwd"] == 1  # the scalar count of targets in the mean cross-entropy
