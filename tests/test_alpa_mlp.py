"""Alpa's published MLP objectives (Zheng et al., OSDI'22, auto-sharding tests), on the abstract mesh.

Communication-only cost model: collectives cost bytes * beta (alpha = 0); compute is made so slow
that replicating work never pays, and is identical for every split plan, so the plan's predicted
communication time is Alpa's objective.
"""
import math

import pytest
import torch
from torch import nn

import autoshard
from autoshard.cost.collective_time import all_reduce_time
from autoshard.cost.profiles import HardwareProfile, Link


class MLP(nn.Module):
    def __init__(self, hidden, layers):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(layers))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def _profile(betas):
    links = tuple(Link(0.0, 1.0 / beta) for beta in betas)
    return HardwareProfile(name="alpa-test", peak_flops=1.0, memory_bandwidth=math.inf, axis_links=links)


def _plan(batch, hidden, layers, mesh, betas):
    model = MLP(hidden, layers)
    x = torch.randn(batch, hidden, device="meta")
    model = model.to("meta")
    return autoshard.parallelize(model, mesh, (x,), loss_fn=lambda out, x: out.pow(2).mean(),
                                 profile=_profile(betas), pipeline=False)


def AR(nbytes, k, beta=1.0):
    return all_reduce_time(nbytes, k, Link(0.0, 1.0 / beta))


def _param_specs(prog):
    return {r.path: r.spec for r in prog.plan.rows if r.kind == "param"}


@pytest.mark.parametrize("layers", [2, 12])
def test_data_parallel_for_small_hidden(layers):
    b, h = 1024, 128
    prog = _plan(b, h, layers, (4,), [1.0])
    assert set(_param_specs(prog).values()) == {"[R]"}
    assert prog.plan.predicted["comm_s"] == pytest.approx(layers * AR(h * h * 4, 4), rel=1e-9)


@pytest.mark.parametrize("layers", [2, 12])
def test_megatron_for_large_hidden(layers):
    b, h = 128, 1024
    prog = _plan(b, h, layers, (4,), [1.0])
    specs = _param_specs(prog)
    assert all(s in ("[S(0)]", "[S(1)]") for s in specs.values()), specs
    assert prog.plan.predicted["comm_s"] == pytest.approx((layers - 1) * AR(b * h * 4, 4), rel=1e-9)


@pytest.mark.parametrize("mesh", [(4, 8), (8, 4), (3, 4)])
def test_2d_mesh_data_parallel_outer_model_parallel_inner(mesh):
    m0, m1 = mesh
    b, h = 1536, 384
    betas = (1.0, 0.01)
    prog = _plan(b, h, 2, mesh, betas)
    specs = _param_specs(prog)
    assert all(s.startswith("[R, S(") for s in specs.values()), specs
    expected = 2 * AR(h * h * 4 / m1, m0, betas[0]) + AR(b * h * 4 / m0, m1, betas[1])
    assert prog.plan.predicted["comm_s"] == pytest.approx(expected, rel=1e-9)
