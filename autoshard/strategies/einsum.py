"""Strategies of einsum-like ops, generated from their equation.

For each index letter: if it survives into the output, every operand holding it is sharded on it and
the rest replicated (`S`); if it is contracted, the operands holding it are sharded and the output is
a partial sum (`P`). The ops are multilinear, so a partial operand with the others replicated gives a
partial output. A `1` in a subscript marks a broadcast dim of size 1 (never sharded).
"""
from __future__ import annotations

import torch

from autoshard.ir.placement import P, R, Shard
from autoshard.strategies.base import AxisStrategy, RuleContext, register, unique

aten = torch.ops.aten
_BATCH = "ABCDEFGHIJ"


def einsum_strategies(operands: list[str], output: str, partial_ok: bool = True) -> list[AxisStrategy]:
    """The candidates of an einsum-like op from its subscripts (see the module docstring); with
    `partial_ok`, a contracted letter makes a partial output and a partial operand passes through.

    >>> einsum_strategies(["mk", "kn"], "mn")  # matrix multiplication
    [(R, R) -> R, (S(1), S(0)) -> P, (S(0), R) -> S(0), (R, S(1)) -> S(1), (P, R) -> P, (R, P) -> P]
    """
    n = len(operands)
    found = [AxisStrategy((R,) * n, R)]
    for letter in sorted(set("".join(operands)) - {"1"}):
        if any(s.count(letter) > 1 for s in operands):  # a diagonal ("ii->i") needs both dims whole
            continue
        inputs = tuple(Shard(s.index(letter)) if letter in s else R for s in operands)
        out = Shard(output.index(letter)) if letter in output else P
        if out is P and not partial_ok:
            continue
        found.append(AxisStrategy(inputs, out))
    if partial_ok:
        for i in range(n):
            found.append(AxisStrategy(tuple(P if j == i else R for j in range(n)), P))
    return unique(found)


def matmul_subscripts(a_shape, b_shape) -> tuple[list[str], str]:
    """Subscripts of torch.matmul with right-aligned broadcasting batch dims (1-D operands included).

    >>> matmul_subscripts((4, 8, 16), (16, 2)), matmul_subscripts((16,), (3, 16, 2))
    ((['Amk', 'kn'], 'Amn'), (['k', 'Akn'], 'An'))
    """
    cores = ["k" if len(a_shape) == 1 else "mk", "k" if len(b_shape) == 1 else "kn"]
    batch_shapes = [tuple(a_shape[: len(a_shape) - len(cores[0])]), tuple(b_shape[: len(b_shape) - len(cores[1])])]
    nbatch = max(len(b) for b in batch_shapes)
    out_batch = [max((b[j - nbatch + len(b)] for b in batch_shapes if j - nbatch + len(b) >= 0), default=1)
                 for j in range(nbatch)]
    operands = []
    for batch, core in zip(batch_shapes, cores):
        offset = nbatch - len(batch)
        letters = "".join("1" if size == 1 and out_batch[offset + i] != 1 else _BATCH[offset + i]
                          for i, size in enumerate(batch))
        operands.append(letters + core)
    out = _BATCH[:nbatch] + ("m" if len(a_shape) > 1 else "") + ("n" if len(b_shape) > 1 else "")
    return operands, out


@register([aten.linear.default])
def _linear_rule(ctx: RuleContext):
    x_shape = ctx.in_shapes[0]
    batch = _BATCH[: len(x_shape) - 1]
    operands = [batch + "k", "nk"]
    if len(ctx.in_shapes) == 3:  # the bias, when normalize could not split it off
        operands.append("n")
    return einsum_strategies(operands, batch + "n", partial_ok=len(ctx.in_shapes) == 2)


@register([aten.mm.default])
def _mm_rule(ctx):
    return einsum_strategies(["mk", "kn"], "mn")


@register([aten.bmm.default])
def _bmm_rule(ctx):
    return einsum_strategies(["bmk", "bkn"], "bmn")


@register([aten.matmul.default])
def _matmul_rule(ctx):
    operands, out = matmul_subscripts(ctx.in_shapes[0], ctx.in_shapes[1])
    return einsum_strategies(operands, out)


@register([aten.einsum.default])
def _einsum_rule(ctx):
    equation = ctx.arg("equation").replace(" ", "")
    if "..." in equation or "->" not in equation:
        return []
    lhs, out = equation.split("->")
    return einsum_strategies(lhs.split(","), out)


@register([aten.embedding.default])
def _embedding_rule(ctx):
    """weight [V, D], ids [...] -> [..., D]; linear in the weight."""
    ids_dims = len(ctx.in_shapes[1])
    found = [AxisStrategy((R, Shard(d)), Shard(d)) for d in range(ids_dims)]
    found.append(AxisStrategy((Shard(1), R), Shard(ids_dims)))
    found.append(AxisStrategy((P, R), P))
    return found


@register([aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default])
def _conv_rule(ctx):
    """Batch (N), output channels (O) and, without groups, input channels (C, partial output)."""
    generic = ctx.node.target is aten.convolution.default
    groups = ctx.arg("groups")
    # A transposed convolution's weight is [C_in, C_out, ...]: the channel dims swap roles.
    w_out, w_in = (1, 0) if generic and ctx.arg("transposed") else (0, 1)
    found = [AxisStrategy((Shard(0), R), Shard(0))]
    if groups == 1:
        found.append(AxisStrategy((R, Shard(w_out)), Shard(1)))
        found.append(AxisStrategy((Shard(1), Shard(w_in)), P))
        found += [AxisStrategy((P, R), P), AxisStrategy((R, P), P)]
    if len(ctx.in_shapes) == 3:  # bias left in place: no partial outputs, bias follows O
        found = [AxisStrategy((*s.inputs, Shard(0) if s.output == Shard(1) else R), s.output)
                 for s in found if s.output is not P]
    return found


def _grouped_mm_rule(ctx):
    """grouped_mm(x [S, K], w [E, K, N], offs [E]): row block i of x times w[i]; offs counts rows per expert.
    The rows stay whole (offs are global); N shards with w, K gives partial sums."""
    if len(ctx.in_shapes) != 3 or len(ctx.in_shapes[0]) != 2 or len(ctx.in_shapes[1]) != 3:
        return []
    return [AxisStrategy((R, Shard(2), R), Shard(1)), AxisStrategy((Shard(1), Shard(1), R), P),
            AxisStrategy((P, R, R), P), AxisStrategy((R, P, R), P)]


# transformers' MoE experts (integrations/moe.py) call its own op where torch's grouped_mm cannot run.
register([aten._grouped_mm.default, "transformers.grouped_mm_fallback.default"], note="per-expert matmul")(
    _grouped_mm_rule)
