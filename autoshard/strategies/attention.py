"""scaled_dot_product_attention: batch and head sharding, and context parallelism (the query's sequence dim split
over a mesh axis) by three strategies (autoshard/runtime/context_parallel.py runs them):

- "allgather": queries S(L), keys and values whole (the solver all-gathers them; their gradients come back
  partial and are reduce-scattered): each rank attends with its query rows to every key.
- "ring": queries, keys and values S(L); the keys and values travel around the axis inside the attention.
  Not with attention dropout (no rank holds a row's whole mask at once); causal rings need L == S and L a
  multiple of 2k (the zigzag chunks).
- "alltoall" (DeepSpeed-Ulysses): the head-sharded strategy, reached from sequence-sharded q, k, v by the
  solver's all-to-all conversions. It has no candidate of its own; `method_of` names it.
A mask [..., L, S] shards its rows with the queries (a mask broadcast over rows stays whole). At most one mesh
axis may split an attention's sequence (`one_sequence_axis`).

The examples use a causal attention on q, k, v of shape [2, 4, 8, 16], on an axis of size 2:

>>> import torch
>>> from torch import fx
>>> from autoshard.strategies.base import RuleContext
>>> graph = fx.Graph()
>>> q, k, v = (graph.placeholder(name) for name in "qkv")
>>> for p in (q, k, v):
...     p.meta["val"] = torch.empty(2, 4, 8, 16)
>>> node = graph.call_function(aten.scaled_dot_product_attention.default, (q, k, v), {"is_causal": True})
>>> ctx = RuleContext(node, [(2, 4, 8, 16)] * 3, [(2, 4, 8, 16)], axis_size=2)
"""
from __future__ import annotations

import torch
from torch import fx

from autoshard.ir.op_schema import argument, arguments
from autoshard.ir.placement import R, Shard
from autoshard.strategies.base import REGISTRY, AxisStrategy

aten = torch.ops.aten
SEQUENCE_METHODS = ("allgather", "ring", "alltoall")


def _attention(ctx):
    """q, k, v [..., L, E] (usually [B, H, L, E]): batch dims (heads included) shard; and the sequence L (see the
    module docstring). The mask broadcasts against [..., L, S], right-aligned."""
    q, key = ctx.in_shapes[0], ctx.in_shapes[1]
    ndim = len(ctx.out_shape)
    found = []
    # Batch and heads: only the dims before the last two (a 3-D q [B, L, E] must not shard its L with k and v).
    for d in range(ndim - 2):
        placements = []
        for shape in ctx.in_shapes:
            j = d - (ndim - len(shape))
            placements.append(Shard(j) if j >= 0 and shape[j] != 1 else R)
        found.append(AxisStrategy(tuple(placements), Shard(d)))
    if len(q) < 2:
        return found
    args = arguments(ctx.node)
    mask = tuple(_mask_rows(shape) for shape in ctx.in_shapes[3:])
    rows = Shard(len(q) - 2)
    found.append(AxisStrategy((rows, R, R, *mask), rows, "allgather"))
    k = ctx.axis_size
    causal_ok = not args["is_causal"] or (q[-2] == key[-2] and q[-2] % (2 * k) == 0)
    if not args["dropout_p"] and causal_ok and not learned(args["attn_mask"]):
        found.append(AxisStrategy((rows, Shard(len(key) - 2), Shard(len(ctx.in_shapes[2]) - 2), *mask), rows, "ring"))
    return found


def learned(mask, limit: int = 256) -> bool:
    """Whether an attention mask is computed from a trained parameter (a learned bias: the ring refuses it, its
    gradient would be lost); masks made from more than `limit` nodes count as learned (not searched further).

    >>> learned(None), learned(argument(node, "query"))  # q is a placeholder without the "param" kind
    (False, False)
    """
    if not isinstance(mask, fx.Node):
        return False
    seen, todo = set(), [mask]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.meta.get("autoshard.kind") == "param" and n.meta["val"].is_floating_point():
            return True
        if len(seen) > limit:
            return True
        todo.extend(n.all_input_nodes)
    return False


def _mask_rows(shape):
    return Shard(len(shape) - 2) if len(shape) >= 2 and shape[-2] != 1 else R


def why_not(node, method: str, axis_size: int) -> str:
    """Why an attention offers no `method` candidate on an axis of `axis_size` ('' when it does, as far as the
    op itself goes: the other axes' choices may still rule it out).

    >>> why_not(node, "ring", 2), why_not(node, "ring", 8)[:48]
    ('', 'a causal ring cuts the sequence (8) into 2 x 8 =')
    """
    args = arguments(node)
    q, key = args["query"].meta["val"].shape, args["key"].meta["val"].shape
    if method == "ring":
        if args["dropout_p"]:
            return (f"the ring has no attention dropout (this attention drops {args['dropout_p']}); use 'allgather' or "
                    "'alltoall'")
        if learned(args["attn_mask"]):
            return "the ring takes a constant mask, and this one is computed from a trained parameter; use 'allgather' or 'alltoall'"
        if args["is_causal"] and q[-2] != key[-2]:
            return f"a causal ring needs as many queries as keys ({q[-2]} vs {key[-2]})"
        if args["is_causal"] and q[-2] % (2 * axis_size):
            return (f"a causal ring cuts the sequence ({q[-2]}) into 2 x {axis_size} = {2 * axis_size} zigzag chunks, "
                    "which do not divide it")
    if method == "alltoall" and len(q) < 3:
        return "the attention has no head dim to split ('alltoall' swaps the sequence for the heads)"
    if method in ("ring", "allgather") and q[-2] % axis_size:
        return f"the sequence ({q[-2]}) does not split evenly over {axis_size} ranks"
    return ""


def one_sequence_axis(node, strategies) -> bool:
    """At most one mesh axis splits the query's sequence (a ring or a row offset spans one axis).

    >>> ring = next(c for c in _attention(ctx) if c.method == "ring")
    >>> one_sequence_axis(node, [ring]), one_sequence_axis(node, [ring, ring])
    (True, False)
    """
    rows = Shard(len(argument(node, "query").meta["val"].shape) - 2)
    return sum(1 for s in strategies if s.inputs and s.inputs[0] == rows) <= 1


def method_of(node, strategy) -> str:
    """The context-parallel strategy a candidate is ("allgather", "ring", "alltoall": heads split), or "".

    >>> [method_of(node, c) for c in _attention(ctx)]
    ['', 'alltoall', 'allgather', 'ring']
    """
    if strategy.method:
        return strategy.method
    q = argument(node, "query").meta["val"]
    heads = Shard(q.dim() - 3) if q.dim() >= 3 else None
    return "alltoall" if heads is not None and strategy.inputs and strategy.inputs[0] == heads else ""


REGISTRY.register([aten.scaled_dot_product_attention.default], _attention, combine=one_sequence_axis,
                  note="batch, heads, and the sequence: allgather / ring (alltoall: the head split)")
