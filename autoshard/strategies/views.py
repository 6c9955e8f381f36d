"""The view/reshape family through a dimension-mapping algebra.

`reshape_groups(in_shape, out_shape)` pairs runs of input dims with runs of output dims of equal
product (size-1 dims between runs are groups of their own). A shard of input dim i maps to output
dim o exactly when i and o lead their group and both sizes divide by the axis size: then the rank's
contiguous block of the flattened group is the same on both sides. Every view is linear, so partials pass.
"""
from __future__ import annotations

import math

import torch

from autoshard.ir.placement import P, R, Shard
from autoshard.strategies.base import REGISTRY, AxisStrategy, RuleContext, output_shapes

aten = torch.ops.aten


def reshape_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]]:
    """[(input dims, output dims)] with equal products, in order; size-1 dims between groups alone.

    Needs equal non-zero products. A size-1 dim inside a run stays in its group (`[2, 1, 3] -> [6]`).

    >>> reshape_groups((8, 16, 4), (8, 4, 4, 4))  # [8 | 16 -> 4 x 4 | 4]
    [([0], [0]), ([1], [1, 2]), ([2], [3])]
    """
    groups, i, o = [], 0, 0
    while i < len(in_shape) or o < len(out_shape):
        if i < len(in_shape) and in_shape[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if o < len(out_shape) and out_shape[o] == 1:
            groups.append(([], [o]))
            o += 1
            continue
        ins, outs = [i], [o]
        pin, pout = in_shape[i], out_shape[o]
        i, o = i + 1, o + 1
        while pin != pout:
            if pin < pout:
                ins.append(i)
                pin *= in_shape[i]
                i += 1
            else:
                outs.append(o)
                pout *= out_shape[o]
                o += 1
        groups.append((ins, outs))
    return groups


def reshape_dim_map(in_shape, out_shape) -> dict[int, int]:
    """Input dim -> output dim whose shards coincide (leading dims of each group).

    >>> reshape_dim_map((8, 16, 4), (8, 4, 4, 4))
    {0: 0, 1: 1, 2: 3}
    """
    return {ins[0]: outs[0] for ins, outs in reshape_groups(in_shape, out_shape) if ins and outs}


def _reshape_rule(ctx: RuleContext):
    in_shape, out_shape = ctx.in_shapes[0], ctx.out_shape
    if math.prod(in_shape) != math.prod(out_shape) or math.prod(in_shape) == 0:  # empty: nothing to pair
        return []
    rest = (R,) * (len(ctx.in_shapes) - 1)
    found = [AxisStrategy((Shard(i),) + rest, Shard(o)) for i, o in reshape_dim_map(in_shape, out_shape).items()]
    return found + [AxisStrategy((P,) + rest, P)]


def _permute_rule(ctx):
    node = ctx.node
    ndim = len(ctx.in_shapes[0])
    if node.target is aten.permute.default:
        order = [d % ndim for d in ctx.arg("dims")]
    elif node.target in (aten.t.default, aten.numpy_T.default):
        order = list(reversed(range(ndim)))
    else:  # transpose(x, a, b)
        a, b = ctx.arg("dim0") % ndim, ctx.arg("dim1") % ndim
        order = list(range(ndim))
        order[a], order[b] = order[b], order[a]
    return [AxisStrategy((Shard(src),), Shard(dst)) for dst, src in enumerate(order)] + [AxisStrategy((P,), P)]


def _expand_rule(ctx):
    """Expanded (size-1) dims may be sharded for free: each rank expands to its block only."""
    in_shape, out_shape = ctx.in_shapes[0], ctx.out_shape
    offset = len(out_shape) - len(in_shape)
    found = []
    for d in range(len(out_shape)):
        i = d - offset
        if i >= 0 and in_shape[i] == out_shape[d]:
            found.append(AxisStrategy((Shard(i),), Shard(d)))
        elif out_shape[d] > 1:
            found.append(AxisStrategy((R,), Shard(d)))
    return found + [AxisStrategy((P,), P)]


def _keep_dim_whole(removes_dim: bool = False):
    """slice/select/split/narrow/index_select along one dim: every other dim may be sharded."""
    def rule(ctx):
        ndim = len(ctx.in_shapes[0])
        dim = ctx.arg("dim") % ndim
        rest = (R,) * (len(ctx.in_shapes) - 1)
        found = []
        for d in range(ndim):
            if d != dim:
                found.append(AxisStrategy((Shard(d),) + rest, Shard(d - 1 if removes_dim and d > dim else d)))
        return found + [AxisStrategy((P,) + rest, P)]
    return rule


def _cat_rule(ctx):
    """Inputs shard alike off the cat dim; a 1-D empty input (torch.cat skips it: transformers' first KV-cache
    update concatenates onto one) stays replicated."""
    ndim = len(ctx.out_shape)
    dim = ctx.arg("dim") % ndim
    skipped = [shape == (0,) and ndim > 1 for shape in ctx.in_shapes]

    def each(placement):
        return tuple(R if skip else placement for skip in skipped)
    found = [AxisStrategy(each(Shard(d)), Shard(d)) for d in range(ndim) if d != dim]
    return found + [AxisStrategy(each(P), P)]


def _stack_rule(ctx):
    ndim = len(ctx.out_shape)
    dim = ctx.arg("dim") % ndim
    n = len(ctx.in_shapes)
    found = [AxisStrategy((Shard(d),) * n, Shard(d if d < dim else d + 1)) for d in range(ndim - 1)]
    return found + [AxisStrategy((P,) * n, P)]


def _pad_rule(ctx):
    """constant_pad_nd(x, pad, value) / pad(x, pad, mode, value): padded dims stay whole; the others shard.
    Padding with zeros (or copying edges) is linear, so partial sums pass."""
    ndim = len(ctx.in_shapes[0])
    pads = ctx.arg("pad")
    padded = {ndim - 1 - i // 2 for i, amount in enumerate(pads) if amount}
    if ctx.node.target is aten.pad.default:
        linear = ctx.arg("mode") != "constant" or not ctx.arg("value")
    else:
        linear = not ctx.arg("value")
    found = [AxisStrategy((Shard(d),), Shard(d)) for d in range(ndim) if d not in padded]
    return found + ([AxisStrategy((P,), P)] if linear else [])


def _getitem_rule(ctx):
    """Picking one output of a multi-output op keeps that op's placement."""
    producer_shapes = output_shapes(ctx.node.args[0])
    ndim = max((len(s) for s in producer_shapes), default=0)
    return [AxisStrategy((Shard(d),), Shard(d)) for d in range(ndim)] + [AxisStrategy((P,), P)]


REGISTRY.register([aten.view.default, aten.reshape.default, aten._unsafe_view.default], _reshape_rule, shape_arg=1,
                  note="dimension-mapping algebra")
REGISTRY.register([aten.flatten.using_ints, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                   aten.unsqueeze.default, aten.unflatten.int], _reshape_rule, note="dimension-mapping algebra")
REGISTRY.register([aten.permute.default, aten.transpose.int, aten.t.default, aten.numpy_T.default], _permute_rule,
                  note="dims permuted")
REGISTRY.register([aten.expand.default, aten.broadcast_to.default], _expand_rule, shape_arg=1,
                  note="broadcast dims shard for free")
REGISTRY.register([aten.slice.Tensor, aten.narrow.default], _keep_dim_whole(), note="the sliced dim stays whole")
REGISTRY.register([aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default], _keep_dim_whole(),
                  note="the split dim stays whole")
REGISTRY.register([aten.select.int, aten.unbind.int], _keep_dim_whole(removes_dim=True),
                  note="the selected dim stays whole")
REGISTRY.register([aten.index_select.default], _keep_dim_whole(), note="the indexed dim stays whole")
REGISTRY.register([aten.cat.default], _cat_rule, note="the concatenated dim stays whole")
REGISTRY.register([aten.stack.default], _stack_rule, note="shards move past the new dim")
REGISTRY.register([aten.constant_pad_nd.default, aten.pad.default], _pad_rule, note="padded dims stay whole")
REGISTRY.register([__import__("operator").getitem], _getitem_rule, note="follows the multi-output producer")
