"""One generic rule for elementwise ops with broadcasting.

Each output dim may be sharded: operands that carry it (same size, right-aligned) are sharded on it,
operands that broadcast it are replicated. Partial sums pass through ops that are linear in them:
`ADDITIVE` ops when every tensor operand is partial, `SCALING` ops when exactly one (allowed) operand
is partial and the others replicated.

>>> from autoshard.strategies.base import RuleContext
>>> ctx = RuleContext(None, [(8, 4), (4,)], [(8, 4)], axis_size=2)  # x [8, 4] and w [4] broadcast over rows
"""
from __future__ import annotations

import numbers

import torch

from autoshard.ir.placement import P, R, Shard
from autoshard.strategies.base import REGISTRY, AxisStrategy, RuleContext, keeps_sums

aten = torch.ops.aten


def broadcast_strategies(ctx: RuleContext) -> list[AxisStrategy]:
    """Shard any output dim; operands holding it are sharded alike, operands broadcasting it replicated.

    >>> broadcast_strategies(ctx)
    [(R, R) -> R, (S(0), R) -> S(0), (S(1), S(0)) -> S(1)]
    """
    out = ctx.out_shape
    found = [ctx.replicated()]
    for d in range(len(out)):
        placements = []
        for shape in ctx.in_shapes:
            i = d - (len(out) - len(shape))
            placements.append(R if i < 0 or shape[i] != out[d] else Shard(i))
        found.append(AxisStrategy(tuple(placements), Shard(d)))
    return found


def _nonzero_scalars(ctx: RuleContext) -> bool:
    scalars = [a for a in ctx.node.args if isinstance(a, numbers.Number) and not isinstance(a, bool)]
    return any(a != 0 for a in scalars[: 1])  # `alpha` (a later scalar) only scales a partial operand


def _additive_rule(ctx):
    found = broadcast_strategies(ctx)
    if not _nonzero_scalars(ctx) and all(s == ctx.out_shape for s in ctx.in_shapes):
        found.append(AxisStrategy((P,) * len(ctx.in_shapes), P))
    return found


def scaling_rule(partial_positions=None):
    """A rule for ops linear in each of `partial_positions` (default: every operand): besides the
    broadcast candidates, a partial operand there (the others replicated) gives a partial output.

    >>> scaling_rule((0,))(ctx)[-1]  # x * w: a partial x times a replicated w is a partial product
    (P, R) -> P
    """
    def rule(ctx):
        found = broadcast_strategies(ctx)
        n = len(ctx.in_shapes)
        for i in range(n) if partial_positions is None else partial_positions:
            if i < n and ctx.in_shapes[i] == ctx.out_shape:
                found.append(AxisStrategy(tuple(P if j == i else R for j in range(n)), P))
        return found
    return rule


ADDITIVE = [aten.add.Tensor, aten.sub.Tensor]
SCALING_ANY = [aten.mul.Tensor, aten.neg.default, aten.clone.default, aten.contiguous.default,
               aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default, aten.zeros_like.default,
               aten.real.default, aten.view_as_real.default]
SCALING_FIRST = [aten.div.Tensor, aten.div.Scalar, aten.mul.Scalar]
NONLINEAR = [
    aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar, aten.rsub.Tensor, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
    aten.pow.Scalar, aten.exp.default, aten.log.default, aten.log1p.default, aten.expm1.default, aten.sqrt.default,
    aten.rsqrt.default, aten.abs.default, aten.sin.default, aten.cos.default, aten.tanh.default,
    aten.sigmoid.default, aten.relu.default, aten.gelu.default, aten.silu.default, aten.erf.default,
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.minimum.default, aten.maximum.default,
    aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.eq.Tensor, aten.eq.Scalar,
    aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar, aten.le.Scalar, aten.le.Tensor,
    aten.gt.Tensor, aten.gt.Scalar, aten.ge.Scalar, aten.ge.Tensor, aten.logical_not.default, aten.logical_and.default,
    aten.logical_or.default, aten.bitwise_not.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.reciprocal.default, aten.square.default, aten.sign.default, aten.floor.default, aten.ceil.default,
    aten.round.default, aten.trunc.default, aten.ones_like.default, aten.full_like.default,
    aten.empty_like.default, aten.hardtanh.default, aten.leaky_relu.default, aten.elu.default, aten.mish.default,
    aten.softplus.default, aten.hardswish.default, aten.hardsigmoid.default, aten.relu6.default,
    aten.dropout.default, aten.native_dropout.default, aten.lerp.Scalar, aten.addcmul.default,
    aten.addcdiv.default, aten.isnan.default, aten.isinf.default, aten.nan_to_num.default, aten.tril.default,
    aten.triu.default, aten.__and__.Tensor, aten.__and__.Scalar, aten.__or__.Tensor, aten.__or__.Scalar,
    aten.__xor__.Tensor, aten.bitwise_xor.Tensor, aten.logical_xor.default, aten.floor_divide.default,
    aten.floor_divide.Scalar, aten.remainder.Tensor, aten.remainder.Scalar, aten.fmod.Tensor, aten.fmod.Scalar,
    aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar, aten.min.other, aten.max.other,
    aten.fmin.default, aten.fmax.default,
]

REGISTRY.register(ADDITIVE, _additive_rule, note="elementwise; partial when every operand is partial")
REGISTRY.register(SCALING_ANY, scaling_rule(), note="elementwise, linear in each operand")
REGISTRY.register(SCALING_FIRST, scaling_rule((0,)), note="elementwise, linear in the first operand")
REGISTRY.register(NONLINEAR, broadcast_strategies, note="elementwise")


def _cast_rule(ctx):
    """Casts pass partial sums only where the sum survives the cast: into a floating type, or between equal
    integer types (float -> int truncates each rank's share; bool saturates). Further tensors (`to.other`,
    `type_as`) only lend their dtype."""
    found = broadcast_strategies(ctx)
    if keeps_sums(ctx.node):
        found.append(AxisStrategy((P,) + (R,) * (len(ctx.in_shapes) - 1), P))
    return found


CASTS = [aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other,
         aten.type_as.default]
REGISTRY.register(CASTS, _cast_rule, note="elementwise; partial when the cast keeps sums")


def _tri_rule(ctx):
    """tril/triu mask the last two dims: those stay whole."""
    return [s for s in broadcast_strategies(ctx)
            if not (isinstance(s.output, Shard) and s.output.dim >= len(ctx.out_shape) - 2)]


REGISTRY.register([aten.tril.default, aten.triu.default], _tri_rule, note="shards leading dims only")
