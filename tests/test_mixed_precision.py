"""Mixed precision (autoshard/ir/mixed_precision.py): bf16 compute from float32 master weights whose gradients
are reduced in float32, against the single device under the same policy.

Tolerance: the parallel program rounds in a different order than the single device, and in bfloat16 one
rounding is 2**-8 relative. verify measures the model's own noise under the policy (the single device
trained again from weights and inputs nudged by one bfloat16 ulp) and allows 10 x max(noise, bf16 eps)
per tensor; the loss curves must in addition stay within two bfloat16 roundings of each other at every
one of 20 steps.
"""
import os

import pytest
import torch

import autoshard
from autoshard.ir.errors import UserInputError
from autoshard.runtime.loss_scale import LossScaler
from autoshard.runtime.simulator import run_ranks
from autoshard.runtime.zero import ZeroOptimizer
from autoshard.verify.verify import verify_factory
from autoshard.zoo import llama, mlp
from autoshard.zoo.hints import plan_hints

LLAMA_DP_TP = plan_hints("llama", ("dp", "tp"), ("dp",), "tp")
BF16_ULP = 2.0 ** -7  # bfloat16 keeps 8 significant bits: neighbours differ by up to 2**-7 relative

FULL = os.environ.get("AUTOSHARD_FULL_MATRIX") == "1"  # fp16 through a pipeline: bf16 covers that path by default


def test_twenty_bf16_steps_follow_the_single_device_loss_curve():
    """Twenty steps with AUTOSHARD_FULL_MATRIX=1, five by default (the suite's time: 13 s -> 4 s)."""
    report, program = verify_factory("autoshard.zoo:llama", (2, 2), ("dp", "tp"), hints=LLAMA_DP_TP, simulate=True,
                                     dtype="float32", mixed_precision="bf16", steps=20 if FULL else 5)
    assert report.ok, str(report)
    assert report.max_diff["loss"] <= 2 * BF16_ULP, str(report)
    assert "bf16 mixed precision" in str(report)
    assert program.state.options.mixed_precision.compute_dtype == torch.bfloat16


@pytest.mark.parametrize("mesh,names,options", [
    ((4,), ("dp",), {"zero": 2}),
    ((4,), ("dp",), {"zero": 3}),  # float32 masters sharded; their gradients reduce-scattered in float32
    ((2, 2, 2), ("pp", "dp", "tp"), {"pipeline": {"microbatches": 2}}),
], ids=["zero2-dp4", "zero3-dp4", "pp2xdp2xtp2"])
def test_bf16_with_zero_and_pipelines(mesh, names, options):
    inner = tuple(n for n in names if n != "pp")
    hints = plan_hints("llama", inner, ("dp",), "tp" if "tp" in names else None)
    report, _ = verify_factory("autoshard.zoo:llama", mesh, names, hints=hints, simulate=True, dtype="float32",
                               mixed_precision="bf16", steps=3, **options)
    assert report.ok, str(report)


def test_masters_are_float32_and_gradients_are_reduced_in_float32():
    model, inputs, loss_fn = llama()
    prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"), hints=LLAMA_DP_TP,
                                 mixed_precision="bf16")

    def step(module):
        loss, _ = module(*module.local_inputs(*inputs))
        loss.backward()
        module.sync_grads()
        return (loss.dtype, {p.dtype for _, p in module.named_local_parameters()},
                {p.grad.dtype for _, p in module.named_local_parameters()}, dict(module.comm.log.dtypes))
    for loss_dtype, params, grads, reductions in run_ranks(prog, step).values():
        assert loss_dtype == torch.bfloat16 and params == {torch.float32} and grads == {torch.float32}
        assert reductions and set(reductions) == {("sync", "float32")}, reductions
    # The cost model reads the dtypes: tp's activation all-reduces move bf16, dp's gradient sync float32.
    plain = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"), hints=LLAMA_DP_TP)
    mixed, full = prog.plan.predicted["comm_bytes_per_step"], plain.plan.predicted["comm_bytes_per_step"]
    assert mixed["tp"]["fwd"] * 2 == full["tp"]["fwd"] and mixed["dp"]["sync"] == full["dp"]["sync"] > 0


def test_unsupported_policies_are_named():
    model, inputs, loss_fn = llama()
    with pytest.raises(UserInputError, match="mixed_precision='int8' is not a policy autoshard knows"):
        autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",), mixed_precision="int8")


@pytest.mark.parametrize("mesh,names,options", [
    ((2, 2), ("dp", "tp"), {}),
    ((4,), ("dp",), {"zero": 3}),
    *([((2, 2, 2), ("pp", "dp", "tp"), {"pipeline": {"microbatches": 2}})] if FULL else []),
], ids=["dp2xtp2", "zero3-dp4", "pp2xdp2xtp2"][:None if FULL else 2])
def test_fp16_with_loss_scaling_skips_and_trains_like_grad_scaler(mesh, names, options):
    """fp16 against the single device under torch.amp.GradScaler: GradScaler's first scale, 2**16, is inf in
    float16, so the first step overflows on both sides and is skipped; the scale after every step must be
    equal, and the gradients compared are those of the first step that ran."""
    inner = tuple(n for n in names if n != "pp")
    hints = plan_hints("llama", inner, ("dp",), "tp" if "tp" in names else None)
    report, _ = verify_factory("autoshard.zoo:llama", mesh, names, hints=hints, simulate=True, dtype="float32",
                               mixed_precision="fp16", steps=3, **options)
    assert report.ok, str(report)
    assert report.max_diff["loss_scale"] == 0 and "grads" in report.max_diff, str(report)


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    """GradScaler alone would skip only on the rank that overflowed, and the replicas' weights would part."""
    model, inputs, loss_fn = mlp(n_layers=2)
    megatron = {"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"}, "layers.1.weight": {"tp": "S(1)"}}
    prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"), hints=megatron,
                                 mixed_precision="fp16")

    def step(module):
        scaler = LossScaler(module, init_scale=8.0)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        before = [p.detach().clone() for p in module.parameters()]
        scaler.scale(module(*module.local_inputs(*inputs))[0]).backward()
        module.sync_grads()
        if module.rank == 3:
            next(module.parameters()).grad.view(-1)[0] = float("inf")
        ran = scaler.step(opt)
        scaler.update()
        return ran, scaler.get_scale(), all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    assert set(run_ranks(prog, step).values()) == {(False, 4.0, True)}


def test_loss_scaler_misuse_is_named():
    model, inputs, loss_fn = mlp(n_layers=2)
    prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",), mixed_precision="fp16",
                                 hints={"input:0": {"dp": "S(0)"}})

    def misuse(module):
        with pytest.raises(UserInputError, match="growth_factor > 1"):
            LossScaler(module, growth_factor=0.5)
        scaler = LossScaler(module)
        scaler.scale(module(*module.local_inputs(*inputs))[0]).backward()
        with pytest.raises(UserInputError, match=r"before module.sync_grads\(\)"):
            scaler.unscale_()
        module.sync_grads()
        with pytest.raises(UserInputError, match=r"needs unscale_\(\) or step\(\) first"):
            scaler.update()
        scaler.unscale_()
        with pytest.raises(UserInputError, match="called twice in one step"):
            scaler.unscale_()
        return True
    assert all(run_ranks(prog, misuse).values())



class AutocastInForward(torch.nn.Module):
    """`torch.autocast` inside forward: the first layer computes in bfloat16, the second in float32."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.relu(self.a(x))
        return self.b(y.float())


@pytest.mark.parametrize("mesh,names,hints,options", [
    ((2, 2), ("dp", "tp"), {"input:0": {"dp": "S(0)"}, "a.weight": {"tp": "S(0)"}, "a.bias": {"tp": "S(0)"},
                            "b.weight": {"tp": "S(1)"}}, {}),
    ((2,), ("pp",), None, {"pipeline": {"split_points": ["b"], "microbatches": 2}}),
], ids=["dp2xtp2", "pp2"])
def test_autocast_regions_in_forward_train_like_the_single_device(mesh, names, hints, options):
    """The region is traced again under autocast, so its casts are ops of the graph like any other (bf16
    inside the region); verify nudges by bf16's eps, the coarsest dtype the program computes in."""
    from autoshard.verify.verify import verify_simulated
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    report, program = verify_simulated(AutocastInForward(), (x,), mesh=mesh, axis_names=names, hints=hints,
                                       dtype="float32", steps=5, **options)
    assert report.ok, str(report)
    dtypes = {n.meta["val"].dtype for n in program.state.gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    assert torch.bfloat16 in dtypes and torch.float32 in dtypes


def test_zero3_gathers_bf16_and_reduce_scatters_float32():
    """FSDP2's param_dtype / reduce_dtype: each float32 master shard is cast before its all-gather (half the
    bytes of gathering the master) and its gradient cast back before the reduce-scatter; the cost model
    prices the same."""
    model, inputs, loss_fn = mlp(n_layers=2)
    plans = {mp: autoshard.parallelize(model, (4,), inputs, loss_fn=loss_fn, axis_names=("dp",), zero=3,
                                       hints={"input:0": {"dp": "S(0)"}}, mixed_precision=mp) for mp in (None, "bf16")}

    def step(module):
        ZeroOptimizer(module, torch.optim.SGD(module.parameters(), lr=0.1))
        module(*module.local_inputs(*inputs))[0].backward()
        module.sync_grads()
        return dict(module.comm.log.dtypes), {p.grad.dtype for _, p in module.named_local_parameters()}
    for dtypes, grads in run_ranks(plans["bf16"], step).values():
        assert grads == {torch.float32}
        assert dtypes[("fwd", "bfloat16")] > 0 and dtypes[("bwd", "float32")] > 0, dtypes
        assert ("fwd", "float32") not in dtypes and ("bwd", "bfloat16") not in dtypes, dtypes
    mixed, full = (plans[mp].plan.predicted["comm_bytes_per_step"]["dp"] for mp in ("bf16", None))
    assert 2 * mixed["fwd"] == full["fwd"]
