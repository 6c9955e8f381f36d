"""Edge cases found by the random-model property tests (size-1 mesh axes, models without parameters)."""
import torch
from torch import nn

from autoshard.verify import verify_simulated


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
