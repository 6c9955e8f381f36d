"""The pipeline benchmark's model: equal blocks whose compute is a timed wait (a custom op).

Four or more gloo ranks on a 2-core machine would fight over the cores, and the fight, not the
schedule, would decide the measured idle time. So each block's work is `busy(x, s)`: it waits `s`
seconds in forward and `2 s` in backward without using a core, like a device kernel the host waits
on. The schedule, the stage-to-stage transfers and autoshard's runtime are the real ones.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn


@torch.library.custom_op("autoshard_bench::busy", mutates_args=())
def busy(x: torch.Tensor, seconds: float) -> torch.Tensor:
    time.sleep(seconds)
    return x.clone()


@busy.register_fake
def _(x, seconds):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.seconds = inputs[1]


def _backward(ctx, grad):
    time.sleep(2 * ctx.seconds)  # backward ~ 2x forward
    return grad.clone(), None


busy.register_autograd(_backward, setup_context=_setup)


class Block(nn.Module):
    def __init__(self, dim: int, seconds: float):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.seconds = seconds

    def forward(self, x):
        return busy(torch.tanh(self.linear(x)), self.seconds)


class BusyStack(nn.Sequential):
    """`blocks` equal blocks of `seconds` forward work each (per micro-batch)."""

    def __init__(self, blocks: int, dim: int = 64, seconds: float = 0.01):
        super().__init__(*(Block(dim, seconds) for _ in range(blocks)))


def busy_stack(blocks: int = 8, batch: int = 32, dim: int = 64, seconds: float = 0.01):
    """(model, inputs, loss_fn) factory."""
    model = BusyStack(blocks, dim, seconds)
    x = torch.randn(batch, dim)
    return model, (x,), lambda out, x: out.pow(2).mean()
