"""Small graph-editing helpers shared by passes.

The examples edit the traced graph of a one-layer MLP:

>>> import torch
>>> from autoshard.frontend.trace import trace
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=1)
>>> gm = trace(model, inputs, loss_fn).gm
>>> linear = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default)
"""
from __future__ import annotations

import copy

from torch import fx
from torch._guards import detect_fake_mode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autoshard.ir import meta
from autoshard.ir.placement import Shard


def new_node(graph: fx.Graph, target, args, kwargs=None, like: fx.Node | None = None) -> fx.Node:
    """A call_function node that inherits `like`'s module path and stack (so plans stay readable).

    >>> with gm.graph.inserting_after(linear):
    ...     double = new_node(gm.graph, torch.ops.aten.mul.Tensor, [linear, 2.0], like=linear)
    >>> double.meta["autoshard.path"], "val" in double.meta
    ('layers.0', False)
    """
    node = graph.call_function(target)  # arguments given after: see copy_node
    node.args, node.kwargs = tuple(args), dict(kwargs or {})
    if like is not None:
        for key in ("nn_module_stack", "stack_trace", meta.PATH):
            if key in like.meta:
                node.meta[key] = like.meta[key]
        node.meta[meta.KIND] = "op"
    return node


def lazy_graph_module(root, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule that writes its Python code when first run or read, not when made or recompiled (torch's
    lazy GraphModule, which inductor uses): a plan that is only priced never runs, and writing out a 32-layer
    model's code after each pass that rewrites the graph took a sixth of its planning time.

    >>> lazy = lazy_graph_module(gm, gm.graph)
    >>> lazy.recompile()  # cheap: marks the code stale
    >>> "linear" in lazy.code  # written here
    True
    """
    return _LazyGraphModule(root, graph)


def copy_node(graph: fx.Graph, node: fx.Node, arg_transform) -> fx.Node:
    """`graph.node_copy(node, arg_transform)`, made without arguments and given them after: torch 2.13's
    `create_node` walks every argument tree looking for raw SymInts (a warning for hand-built graphs, which
    an exported graph's copies never are), and that walk was most of unfolding an 80-layer model.

    >>> fresh = torch.fx.Graph()
    >>> x = fresh.placeholder("x")
    >>> copy_node(fresh, linear, lambda a: x).args[0] is x
    True
    """
    new = graph.create_node(node.op, node.target, (), {}, node.name, node.type)
    new.args = fx.map_arg(node.args, arg_transform)
    new.kwargs = fx.map_arg(node.kwargs, arg_transform)
    new.meta = copy.copy(node.meta)
    return new


def refresh_vals(gm: fx.GraphModule) -> None:
    """Recompute every node's FakeTensor `val` after a rewrite (placeholders keep theirs).

    >>> with gm.graph.inserting_after(linear):
    ...     double = new_node(gm.graph, torch.ops.aten.mul.Tensor, [linear, 2.0], like=linear)
    >>> refresh_vals(gm)
    >>> double.meta["val"].shape
    torch.Size([8, 32])
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta["val"] for n in placeholders]
    mode = detect_fake_mode(vals)
    gm.recompile()
    with mode:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*vals)


def val_of(node: fx.Node):
    """The node's FakeTensor value (None where it has none yet, e.g. a node just made by `new_node`).

    >>> val_of(linear).shape
    torch.Size([8, 32])
    """
    return node.meta.get("val")


def data_parallel_axes(nodes) -> set:
    """Mesh axes on which the user sharded an input (their data-parallel axes), from annotate's hints.

    >>> data_parallel_axes(gm.graph.nodes)  # no hints in this graph
    set()
    """
    return {axis for n in nodes if n.op == "placeholder" and n.meta.get(meta.KIND) == "input"
            for axis, p in n.meta.get(meta.HINT, {}).items() if isinstance(p, Shard)}
