"""Edge cases of verify: found by the random-model property tests (size-1 mesh axes, models without
parameters), and verify below float64 (tolerances derived from the model's own noise)."""
import pytest
import torch
from torch import nn

from autoshard import UserInputError, parallelize
from autoshard.verify.tolerance import to_dtype
from autoshard.verify.training import VerifyOptions
from autoshard.verify.verify import (
    compare,
    rank_run,
    reference_runs,
    simulate_ranks,
    verify_simulated,
)
from autoshard.zoo import FACTORIES, mlp
from autoshard.zoo.hints import plan_hints


def bias_free_linears(n, d=4):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(n)])


def test_linears_on_a_mesh_without_size_one_axes():
    report, _ = verify_simulated(bias_free_linears(2), (torch.randn(2, 2, 4),), mesh=(2,))
    assert report.ok


# A full tensor must never be fed into a partial-input strategy, even on a size-1 axis.
SIZE_ONE_CASES = [(1, (1, 1, 2), (1,)), (1, (2, 2, 4), (2, 1)), (2, (2, 2, 4), (1, 2)), (1, (2, 2, 4), (1,)),
                  (2, (2, 2, 4), (1,))]


def test_size_one_mesh_axes():
    for layers, shape, mesh in SIZE_ONE_CASES:
        x = torch.randn(shape)
        report, _ = verify_simulated(bias_free_linears(layers, shape[-1]), (x,), mesh=mesh)
        assert report.ok, (layers, shape, mesh)


def test_model_without_parameters():
    class Tanh(nn.Module):
        def forward(self, x):
            return torch.tanh(x)
    report, _ = verify_simulated(Tanh(), (torch.randn(4, 4),), mesh=(2,), hints={"input:0": {"a0": "S(0)"}})
    assert report.ok


# --- verify below float64 (--dtype): tolerances from the model's own rounding noise -----------------------

DP_TP = {"mesh": (2, 2), "axis_names": ("dp", "tp")}


@pytest.mark.parametrize("name, dtype", [("gpt2", "float32"), ("mlp", "bfloat16")])
def test_zoo_model_verifies_below_float64(name, dtype):
    model, inputs, loss_fn = FACTORIES[name]()
    hints = plan_hints(name, ("dp", "tp"), batch_axes=("dp",), tp_axis="tp")
    report, _ = verify_simulated(model, inputs, loss_fn, hints=hints, dtype=dtype, **DP_TP)
    assert report.ok, report
    eps = torch.finfo(getattr(torch, dtype)).eps
    assert report.dtype == dtype and all(report.tolerances[k] >= 10 * eps for k in report.max_diff)
    assert f"{dtype}, tolerance 10 x max(own noise, eps)" in repr(report)


@pytest.mark.parametrize("dtype, wrong", [("float32", lambda w: w.mul_(1 + 1e-4)), ("bfloat16", lambda w: w.zero_())],
                         ids=["float32: one shard off by 1e-4", "bfloat16: one shard lost"])
def test_noise_tolerance_catches_a_real_mismatch(dtype, wrong):
    """One tensor-parallel shard on one rank is wrong: the derived tolerance must not absorb it."""
    dtype = getattr(torch, dtype)
    model, inputs, loss_fn = mlp(batch=8, in_dim=16, hidden=32, out_dim=16, n_layers=2)
    model, inputs = to_dtype(model, inputs, dtype)
    options = VerifyOptions(steps=2, lr=0.1, dtype=dtype)
    ref, noise = reference_runs(model, inputs, loss_fn, options)
    hints = plan_hints("mlp", ("dp", "tp"), batch_axes=("dp",), tp_axis="tp")
    program = parallelize(model, example_inputs=inputs, loss_fn=loss_fn, hints=hints, **DP_TP)

    def run(module):
        if module.rank == 3:
            with torch.no_grad():
                wrong(dict(module.named_local_parameters())["layers.0.weight"])
        return rank_run(module, inputs, options)

    report = compare(program, ref, simulate_ranks(program, run), options, noise)
    assert not report.ok
    assert report.max_diff["outputs"] > report.tolerances["outputs"]


class Experts(nn.Module):
    """Grouped matmul (mixture-of-experts layers): no float64 kernel on CPU."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(2, 8, 8) / 3)
        self.register_buffer("offs", torch.tensor([4, 8], dtype=torch.int32))

    def forward(self, x):
        return torch._grouped_mm(x, self.w, offs=self.offs)


def test_model_without_float64_kernel_verifies_in_bfloat16():
    x, loss_fn = torch.randn(8, 8), (lambda out, x: out.pow(2).mean())
    with pytest.raises(UserInputError, match=r"the model Experts cannot run in float64, verify's default: "
                                             r"RuntimeError: .*Double.*; .*verify --dtype float32 \(or bfloat16"):
        verify_simulated(Experts(), (x,), loss_fn, mesh=(2,), axis_names=("dp",))
    report, _ = verify_simulated(Experts(), (x,), loss_fn, mesh=(2,), axis_names=("dp",), dtype="bfloat16")
    assert report.ok, report
