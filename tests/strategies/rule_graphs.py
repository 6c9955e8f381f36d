"""Helpers for the strategy-rule tests: export a tiny function, find one op node, list its candidates, and
run every candidate on real values.

Candidates are compared as sets of their printed form, e.g. `"(S(0), R) -> S(0)"`, so a failing
assertion shows exactly which placements differ. `check_candidates` proves them numerically: each
candidate's inputs are split over the ranks of one axis (S: blocks, P: random shares that sum to the
value, R: copies), the op runs on every rank's block (shape arguments made local, as codegen does), and
the blocks joined by the output placement must equal the op on the whole tensors.
"""
from __future__ import annotations

import operator

import torch
import torch.utils._pytree as pytree
from torch import fx

from autoshard.ir.placement import Partial, Shard
from autoshard.strategies import REGISTRY, candidates_for, tensor_inputs
from autoshard.strategies.base import output_shapes

aten = torch.ops.aten


class _Fn(torch.nn.Module):
    def __init__(self, fn, modules=None):
        super().__init__()
        self.fn = fn
        self.mods = torch.nn.ModuleDict(modules or {})

    def forward(self, *args):
        return self.fn(self.mods, *args) if len(self.mods) else self.fn(*args)


def export_graph(fn, *args, modules=None) -> fx.Graph:
    """The ATen-level graph torch.export makes of `fn(*args)` (or `fn(modules, *args)`)."""
    return torch.export.export(_Fn(fn, modules), tuple(args), strict=False).graph_module.graph


def find_node(graph: fx.Graph, target, index: int = 0) -> fx.Node:
    """The `index`-th call of `target` (an OpOverload, or operator.getitem) in graph order."""
    found = [n for n in graph.nodes if n.op == "call_function" and n.target is target]
    if len(found) <= index:
        ops = sorted({str(n.target) for n in graph.nodes if n.op == "call_function"})
        raise AssertionError(f"no call #{index} of {target} in the graph; it calls {ops}")
    return found[index]


def shapes_of(node: fx.Node):
    """(input shapes, output shapes) as the strategies pass computes them."""
    ins = [output_shapes(n)[0] if output_shapes(n) else () for n in tensor_inputs(node)]
    return ins, output_shapes(node)


def candidate_set(node: fx.Node, axis_size: int = 2) -> set[str]:
    ins, outs = shapes_of(node)
    return {repr(s) for s in candidates_for(node, ins, outs, axis_size, warn=False)}


def candidates_of(fn, *args, target, index=0, axis_size=2, modules=None) -> set[str]:
    """Export `fn`, find the `index`-th `target` node and return its printed candidate set."""
    return candidate_set(find_node(export_graph(fn, *args, modules=modules), target, index), axis_size)


def hand_node(target, arg_shapes, out_shapes, build=None):
    """One call of `target` on placeholders of `arg_shapes` (for ops export never emits).

    `build(placeholders) -> (args, kwargs)` places them among the other arguments (default: in order).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    graph = fx.Graph()
    inputs = []
    for i, shape in enumerate(arg_shapes):
        ph = graph.placeholder(f"x{i}")
        ph.meta["val"] = mode.from_tensor(torch.empty(shape))
        inputs.append(ph)
    args, kwargs = build(inputs) if build is not None else (tuple(inputs), {})
    node = graph.call_function(target, tuple(args), kwargs)
    vals = [mode.from_tensor(torch.empty(s)) for s in out_shapes]
    node.meta["val"] = vals[0] if len(vals) == 1 else tuple(vals)
    return node


GETITEM = operator.getitem


def export_module(fn, *args, modules=None):
    """(ExportedProgram, its GraphModule) of `fn(*args)`: placeholders are the lifted tensors, then `args`."""
    exported = torch.export.export(_Fn(fn, modules), tuple(args), strict=False)
    return exported, exported.graph_module


def node_values(fn, *args, modules=None) -> tuple[fx.Graph, dict]:
    """(graph, {node: its value}) of `fn(*args)` run node by node on the real tensors."""
    exported, gm = export_module(fn, *args, modules=modules)
    sig = exported.graph_signature
    state = {**exported.state_dict, **exported.constants}
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    values: dict = {}
    user = iter(args)

    class Recorder(fx.Interpreter):
        def run_node(self, n):  # a copy: a later in-place op must not change what an input was
            result = super().run_node(n)
            values[n] = pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, result)
            return result

    flat = [state[lifted[n.name]] if n.name in lifted else next(user) for n in gm.graph.nodes if n.op == "placeholder"]
    Recorder(gm).run(*flat)
    return gm.graph, values


def _split(value, placement, k, generator):
    """The k ranks' blocks of `value` under one axis placement (copies: in-place ops write into them)."""
    if isinstance(placement, Shard):
        return [block.clone() for block in value.chunk(k, placement.dim)]
    if isinstance(placement, Partial):
        if value.is_floating_point():
            shares = [torch.randn(value.shape, generator=generator, dtype=value.dtype) for _ in range(k - 1)]
            return [value - sum(shares)] + shares
        return [value.clone()] + [torch.zeros_like(value) for _ in range(k - 1)]
    return [value.clone() for _ in range(k)]


def _join(blocks, placement, compare_values):
    if isinstance(placement, Shard):
        return torch.cat(blocks, placement.dim)
    if isinstance(placement, Partial):
        return sum(blocks[1:], blocks[0])
    for block in blocks[1:] if compare_values else []:  # replicated: every rank computed the same
        torch.testing.assert_close(block, blocks[0], rtol=0, atol=0, equal_nan=True)
    return blocks[0]


def _local_args(node, inputs, rank_values, out_placement, out_value, k):
    """The node's args and kwargs on one rank: its tensor inputs' blocks, shape arguments made local."""
    position = iter(range(len(inputs)))
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: rank_values[next(position)]
                                   if n in inputs else n)
    rule = REGISTRY.lookup(node.target)
    if rule is not None and rule.shape_arg is not None:
        shape = list(out_value.shape)
        if isinstance(out_placement, Shard):
            shape[out_placement.dim] //= k
        args = tuple(shape if i == rule.shape_arg else a for i, a in enumerate(args))
    return args, kwargs


def check_candidates(fn, *args, target, index=0, axis_size=2, modules=None, compare_values=True) -> set[str]:
    """Run every candidate of the `index`-th `target` node of `fn(*args)` on `axis_size` ranks (see the
    module docstring) and assert each equals the single device; returns the printed candidate set.
    `compare_values=False` checks only shapes and dtypes (ops that make uninitialized memory)."""
    graph, values = node_values(fn, *args, modules=modules)
    node = find_node(graph, target, index)
    inputs = tensor_inputs(node)
    ins, outs = shapes_of(node)
    generator = torch.Generator().manual_seed(0)
    candidates = candidates_for(node, ins, outs, axis_size, warn=False)
    for strategy in candidates:
        if strategy.method:  # not the op on local blocks (a ring, shifted causal rows): tests/test_context_parallel.py
            continue
        blocks = [_split(values[n], p, axis_size, generator) for n, p in zip(inputs, strategy.inputs)]
        expected = values[node]
        per_rank = []
        for rank in range(axis_size):
            local_args, local_kwargs = _local_args(node, inputs, [b[rank] for b in blocks], strategy.output,
                                                   expected if isinstance(expected, torch.Tensor) else expected[0],
                                                   axis_size)
            per_rank.append(node.target(*local_args, **local_kwargs))
        got = ([_join([r[i] for r in per_rank], strategy.output, compare_values) for i in range(len(expected))]
               if isinstance(expected, (tuple, list)) else [_join(per_rank, strategy.output, compare_values)])
        for g, e in zip(got, expected if isinstance(expected, (tuple, list)) else [expected]):
            where = f"{node.target} candidate {strategy!r}"
            assert g.shape == e.shape and g.dtype == e.dtype, f"{where}: {g.shape}/{g.dtype} != {e.shape}/{e.dtype}"
            if compare_values:  # float64 to round-off; a cast to a narrower type to that type's precision
                tolerance = {"rtol": 1e-10, "atol": 1e-10} if e.dtype == torch.float64 else {}
                torch.testing.assert_close(g, e, equal_nan=True, msg=lambda m, where=where: f"{where}: {m}", **tolerance)
    return {repr(s) for s in candidates}
