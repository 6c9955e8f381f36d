"""Helpers for the strategy-rule tests: export a tiny function, find one op node, list its candidates.

Candidates are compared as sets of their printed form, e.g. `"(S(0), R) -> S(0)"`, so a failing
assertion shows exactly which placements differ.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from autoshard.strategies import candidates_for, tensor_inputs
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
