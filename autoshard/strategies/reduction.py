"""Reductions: a reduced sharded dim makes a partial sum (sums) or must stay whole (max, var, ...).

>>> REGISTRY.lookup(torch.ops.aten.sum.dim_IntList).note, REGISTRY.lookup(torch.ops.aten.amax.default).note
('sharded reduced dim -> partial', 'reduced dims stay whole')
"""
from __future__ import annotations

import torch

from autoshard.ir.placement import P, R, Shard
from autoshard.strategies.base import REGISTRY, AxisStrategy, RuleContext, keeps_sums

aten = torch.ops.aten


def _reduced_dims(ctx: RuleContext):
    """(sorted reduced dims, keepdim) of a reduction node; no dims or an empty list = all dims."""
    ndim = len(ctx.in_shapes[0])
    dims = ctx.arg("dim")
    if dims is None or dims == []:
        dims = list(range(ndim))
    elif isinstance(dims, int):
        dims = [dims]
    keepdim = bool(ctx.arg("keepdim"))
    return sorted(d % max(ndim, 1) for d in dims), keepdim


def _out_dim(d, reduced, keepdim):
    return d if keepdim else d - sum(1 for r in reduced if r < d)


def _reduction_rule(partial: bool):
    def rule(ctx):
        reduced, keepdim = _reduced_dims(ctx)
        n = len(ctx.in_shapes)
        found = [ctx.replicated()]
        for d in range(len(ctx.in_shapes[0])):
            if d in reduced:
                if partial:
                    found.append(AxisStrategy((Shard(d),) + (R,) * (n - 1), P))
            else:
                found.append(AxisStrategy((Shard(d),) + (R,) * (n - 1), Shard(_out_dim(d, reduced, keepdim))))
        if partial and keeps_sums(ctx.node):
            found.append(AxisStrategy((P,) + (R,) * (n - 1), P))
        return found
    return rule


def _whole_sum(ctx):
    """sum.default reduces every dim: any shard gives a partial sum."""
    found = [AxisStrategy((Shard(d),), P) for d in range(len(ctx.in_shapes[0]))]
    return found + ([AxisStrategy((P,), P)] if keeps_sums(ctx.node) else [])


REGISTRY.register([aten.sum.dim_IntList], _reduction_rule(True), note="sharded reduced dim -> partial")
REGISTRY.register([aten.sum.default], _whole_sum, note="sum of everything: any shard -> partial")
REGISTRY.register([aten.amax.default, aten.amin.default, aten.max.dim, aten.min.dim, aten.argmax.default,
                   aten.argmin.default, aten.logsumexp.default, aten.prod.dim_int, aten.any.dim, aten.all.dim],
                  _reduction_rule(False), note="reduced dims stay whole")
REGISTRY.register([aten.norm.ScalarOpt_dim, aten.linalg_vector_norm.default], _reduction_rule(False),
                  note="reduced dims stay whole")
REGISTRY.register([aten.var.dim, aten.std.dim, aten.var_mean.dim], _reduction_rule(False), note="reduced dims whole")
REGISTRY.register([aten.var.correction, aten.std.correction, aten.var_mean.correction], _reduction_rule(False),
                  note="reduced dims stay whole")


def _along_dim(linear: bool):
    """Ops working along one dim (softmax, cumsum, topk): that dim stays whole; every tensor input (diff's
    prepend/append) is sharded alike on the others."""
    def rule(ctx):
        dim = ctx.arg("dim") % max(len(ctx.in_shapes[0]), 1)
        n = len(ctx.in_shapes)
        found = [AxisStrategy((Shard(d),) * n, Shard(d)) for d in range(len(ctx.in_shapes[0]))
                 if d != dim and all(s[d] == ctx.in_shapes[0][d] for s in ctx.in_shapes)]
        if linear and keeps_sums(ctx.node):
            found.append(AxisStrategy((P,) * n, P))
        return found
    return rule


REGISTRY.register([aten.softmax.int, aten.log_softmax.int, aten._softmax.default, aten._log_softmax.default,
                   aten.cummax.default, aten.cummin.default, aten.sort.default],
                  _along_dim(False), note="the softmax/sort dim stays whole")
REGISTRY.register([aten.cumsum.default], _along_dim(True), note="the cumsum dim stays whole; linear")
# diff(x, n, dim, prepend, append): differences along dim, linear in x, prepend and append together.
REGISTRY.register([aten.diff.default], _along_dim(True), note="the diff dim stays whole; linear")
REGISTRY.register([aten.topk.default, aten.kthvalue.default], _along_dim(False), note="the topk dim stays whole")


def _histc(ctx):
    """Counts over a fixed range add up across shards; min == max takes the range from the data (whole)."""
    low, high = ctx.arg("min"), ctx.arg("max")
    return [AxisStrategy((Shard(d),), P) for d in range(len(ctx.in_shapes[0]))] if low < high else []


REGISTRY.register([aten.histc.default], _histc, note="bin counts: any shard -> partial")
