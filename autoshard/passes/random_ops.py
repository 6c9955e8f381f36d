"""The program's random ops: numbered in the single device's order, described for the rank streams.

normalize numbers every op that draws random numbers (`number_random_ops`: dropout, attention with a
dropout probability, rand_like, ...) in graph order, which is the order the single device draws in;
with `rng="exact"` an op whose draw a rank cannot reproduce is refused there, naming it. After solve,
`describe_random_ops(state)` gives each op's global shape, dtype and the placement of its draw
(autoshard/runtime/rng.py draws them on ranks; codegen puts `random_op(index, op, ...)` in their place).

>>> import torch
>>> import autoshard
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1)).double()
>>> prog = autoshard.parallelize(model, (2,), (torch.randn(4, 8, dtype=torch.float64),), axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}})
>>> [(op.index, str(op.target), op.shape, op.spec) for op in prog.random_ops]
[(0, 'aten.dropout.default', (4, 8), [S(0)])]
"""
from __future__ import annotations

import torch
from torch import fx

from autoshard.ir import meta
from autoshard.ir.errors import UserInputError
from autoshard.ir.placement import R, Shard, Spec
from autoshard.runtime.rng import MODES, RandomOp, exact_limit, is_random

aten = torch.ops.aten


def number_random_ops(graph: fx.Graph, mode: str = "placement") -> int:
    """Number the random ops of `graph` in order (`meta.RNG_INDEX`); returns how many. With `mode`
    "exact", an op whose single-device draw a rank cannot reproduce is an error naming it.

    >>> number_random_ops(prog.state.gm.graph)
    1
    """
    assert mode in MODES, mode  # checked where the options enter (CompileOptions.parse)
    count = 0
    for node in graph.nodes:
        if node.op != "call_function" or not is_random(node.target, node.args, node.kwargs):
            continue
        if mode == "exact" and exact_limit(node.target):
            raise UserInputError(f"rng='exact' cannot honour {node.target} at {node.meta.get(meta.PATH) or node.name} "
                                 f"(node {node.name}): {exact_limit(node.target)}")
        node.meta[meta.RNG_INDEX] = count
        count += 1
    return count


def describe_random_ops(state) -> list[RandomOp]:
    """Each numbered op's RandomOp: what it draws (global shape of one micro-batch, dtype) and how the
    draw is placed on the mesh (the output's spec; attention: its weights', sharded like the output on
    batch, heads and queries).

    >>> describe_random_ops(prog.state)[0].path
    '1'
    """
    ops = []
    batched = _downstream_of_inputs(state.gm.graph)
    for node in state.gm.graph.nodes:
        if meta.RNG_INDEX not in node.meta:
            continue
        spec = node.meta.get(meta.SPEC)
        if spec is not None and len(spec) and isinstance(spec[0], Spec):  # multi-output ops: the first
            spec = spec[0]
        spec = Spec(spec) if spec is not None else Spec.replicated(0)
        val = node.meta["val"]
        val = val[0] if isinstance(val, (tuple, list)) else val
        shape, dtype = tuple(val.shape), val.dtype
        if node.target is aten.scaled_dot_product_attention.default:
            query, key = node.args[0].meta["val"], node.args[1].meta["val"]
            shape = (*query.shape[:-1], key.shape[-2])
            spec = Spec([p if isinstance(p, Shard) and p.dim < len(shape) - 1 else R for p in spec])
        args = tuple(None if isinstance(a, fx.Node) else a for a in node.args)
        kwargs = {k: v for k, v in node.kwargs.items() if not isinstance(v, fx.Node)}
        ops.append(RandomOp(node.meta[meta.RNG_INDEX], node.target, shape, dtype, spec,
                            node.meta.get(meta.PATH) or node.name, args, kwargs, node in batched))
    return ops


def _downstream_of_inputs(graph: fx.Graph) -> set:
    """The nodes whose value depends on a model input (their dim 0 is taken to be the batch)."""
    found = set()
    for node in graph.nodes:
        if node.meta.get(meta.KIND) == "input" or any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found
