"""Small graph-editing helpers shared by passes."""
from __future__ import annotations

import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .. import meta


def new_node(graph: fx.Graph, target, args, kwargs=None, like: fx.Node | None = None) -> fx.Node:
    """A call_function node that inherits `like`'s module path and stack (so plans stay readable)."""
    node = graph.call_function(target, tuple(args), kwargs or {})
    if like is not None:
        for key in ("nn_module_stack", "stack_trace", meta.PATH):
            if key in like.meta:
                node.meta[key] = like.meta[key]
        node.meta[meta.KIND] = "op"
    return node


def refresh_vals(gm: fx.GraphModule) -> None:
    """Recompute every node's FakeTensor `val` after a rewrite (placeholders keep theirs)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta["val"] for n in placeholders]
    mode = detect_fake_mode(vals)
    gm.recompile()
    with mode:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*vals)


def val_of(node: fx.Node):
    return node.meta.get("val")
