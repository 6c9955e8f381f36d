"""The runtime benchmark's model: a residual MLP stack, and its hand-written Megatron version on
local tensors (the limit a compiler's generated code is measured against).

`MLPStack`: x -> x + fc2(gelu(fc1(x))) per layer, loss mean(out^2). `LocalMegatronMLP` holds this
rank's shards (fc1 by output rows, fc2 by input columns, fc2's bias whole) and calls Megatron's two
operators, written as autograd functions around one dist.all_reduce each:
  f: identity forward, all-reduce of the gradient in backward (before the column-parallel fc1);
  g: all-reduce forward, identity backward (after the row-parallel fc2).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class MLPStack(nn.Module):
    def __init__(self, hidden: int, n_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(_Block(hidden) for _ in range(n_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def mlp_stack_loss(out, x):
    return out.pow(2).mean()


def mlp_stack(hidden: int = 64, n_layers: int = 4, batch: int = 8, seq: int = 16):
    """(model, (x,), loss_fn), seeded: every rank builds the same weights and batch."""
    torch.manual_seed(0)
    return MLPStack(hidden, n_layers), (torch.randn(batch, seq, hidden),), mlp_stack_loss


def megatron_hints(axis: str = "tp") -> dict:
    """The same Megatron plan as autoshard hints."""
    return {"layers.*.fc1.weight": {axis: "S(0)"}, "layers.*.fc1.bias": {axis: "S(0)"},
            "layers.*.fc2.weight": {axis: "S(1)"}}


class _CopyToTP(torch.autograd.Function):  # Megatron's f
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):  # Megatron's g
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class LocalMegatronMLP(nn.Module):
    """This rank's shard of an MLPStack, with explicit all-reduces (plain tensors, no DTensor)."""

    def __init__(self, full: MLPStack, rank: int, tp: int, group):
        super().__init__()
        self.group = group
        self.w1, self.b1, self.w2, self.b2 = (nn.ParameterList() for _ in range(4))
        for layer in full.layers:
            self.w1.append(nn.Parameter(layer.fc1.weight.detach().chunk(tp, 0)[rank].clone()))
            self.b1.append(nn.Parameter(layer.fc1.bias.detach().chunk(tp, 0)[rank].clone()))
            self.w2.append(nn.Parameter(layer.fc2.weight.detach().chunk(tp, 1)[rank].clone()))
            self.b2.append(nn.Parameter(layer.fc2.bias.detach().clone()))

    def forward(self, x):
        for w1, b1, w2, b2 in zip(self.w1, self.b1, self.w2, self.b2):
            h = F.gelu(F.linear(_CopyToTP.apply(x, self.group), w1, b1))
            x = x + _ReduceFromTP.apply(F.linear(h, w2), self.group) + b2
        return x
