"""parallelize(plan=..., plan_other_shapes=True): a plan made at one width and batch (e.g. a model at its real size
on the meta device) applied to the same model at other sizes, which then trains like the single device."""
import pytest

import autoshard
from autoshard.plan.io import PlanMismatchError
from autoshard.verify.verify import verify_simulated
from autoshard.zoo import gpt2

HINTS = {"input:0": {"dp": "S(0)"}, "layers.*.attn.q.*": {"tp": "S(0)"}, "layers.*.mlp.fc1.*": {"tp": "S(0)"}}


def _wide_plan():
    model, inputs, loss_fn = gpt2(batch=8, seq=32, dim=128, n_heads=8, n_layers=2, vocab_size=128, device="meta")
    return autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"), hints=HINTS,
                                 mixed_precision="bf16").plan


def test_a_plan_made_at_another_width_and_batch_trains_the_narrow_model_like_the_single_device(tmp_path):
    plan = _wide_plan()
    plan.save(tmp_path / "plan.json")  # what a plan file holds: the decisions
    model, inputs, loss_fn = gpt2(batch=4, seq=8, dim=32, n_heads=4, n_layers=2, vocab_size=64)
    report, prog = verify_simulated(model, inputs, loss_fn, mesh=(2, 2), axis_names=("dp", "tp"),
                                    plan=str(tmp_path / "plan.json"), plan_other_shapes=True, dtype="float32",
                                    mixed_precision="bf16")
    assert report.ok, report
    assert [r.choice for r in prog.plan.rows if r.kind != "comm"] == [r.choice for r in plan.rows if r.kind != "comm"]


def test_without_the_keyword_other_shapes_are_refused_and_another_depth_always_is():
    plan = _wide_plan()
    model, inputs, loss_fn = gpt2(batch=4, seq=8, dim=32, n_heads=4, n_layers=2, vocab_size=64)
    with pytest.raises(PlanMismatchError, match="another model or other example inputs"):
        autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"), plan=plan,
                              mixed_precision="bf16")
    deeper, deeper_inputs, _ = gpt2(batch=4, seq=8, dim=32, n_heads=4, n_layers=3, vocab_size=64)
    with pytest.raises(PlanMismatchError):
        autoshard.parallelize(deeper, (2, 2), deeper_inputs, loss_fn=loss_fn, axis_names=("dp", "tp"), plan=plan,
                              mixed_precision="bf16", plan_other_shapes=True)


def test_plan_other_shapes_needs_a_plan():
    model, inputs, loss_fn = gpt2(n_layers=2)
    with pytest.raises(autoshard.UserInputError, match="plan_other_shapes=True applies a plan="):
        autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, plan_other_shapes=True)
