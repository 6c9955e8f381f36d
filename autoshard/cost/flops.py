"""Forward FLOPs of one ATen node (matmul-like ops exactly, everything else one per output element).

The examples use the traced graph of a one-layer MLP (batch 8, 32 -> 32 features):

>>> from autoshard.frontend.trace import trace
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=1)
>>> graph = trace(model, inputs, loss_fn).gm.graph
>>> linear = next(n for n in graph.nodes if n.target is aten.linear.default)
"""
from __future__ import annotations

import functools
import math

import torch

from autoshard.ir.op_schema import argument, op_signature
from autoshard.ir.placement import Shard

aten = torch.ops.aten


def _numel(val) -> int:
    vals = val if isinstance(val, (tuple, list)) else [val]
    return sum(math.prod(v.shape) for v in vals if isinstance(v, torch.Tensor))


def node_flops(node) -> float:
    """Forward FLOPs of `node`: 2 m n k for matmuls (convolutions, attention alike), else its output elements.

    >>> node_flops(linear)  # 2 * (8 * 32 outputs) * 32
    16384.0
    """
    val = node.meta.get("val")
    out = _numel(val)
    args = [a.meta.get("val") if hasattr(a, "meta") else a for a in node.args]
    target = node.target
    if target in (aten.linear.default, aten.mm.default, aten.matmul.default, aten.bmm.default):
        k = args[0].shape[-1] if args[0].dim() > 0 else 1
        return 2.0 * out * k
    if target in (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default):
        weight = args[1]
        return 2.0 * out * math.prod(weight.shape[1:])
    if target is aten.scaled_dot_product_attention.default:
        q, k = args[0], args[1]
        return 4.0 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
    return float(out)


def is_matmul_like(node) -> bool:
    """Whether `node`'s time is bound by FLOPs (matmul, convolution, attention) rather than memory traffic.

    >>> is_matmul_like(linear), is_matmul_like(next(iter(linear.users)))
    (True, False)
    """
    return node.target in (aten.linear.default, aten.mm.default, aten.matmul.default, aten.bmm.default,
                           aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
                           aten.convolution.default, aten.scaled_dot_product_attention.default)


def is_view(node) -> bool:
    """Whether the node's op returns a view of its first argument (its schema's alias annotation): no data moves,
    only the op's dispatch is paid.

    >>> graph = torch.fx.Graph()
    >>> x = graph.placeholder("x")
    >>> is_view(graph.call_function(torch.ops.aten.slice.Tensor, (x, 1, 1))), is_view(x)
    (True, False)
    """
    return node.op == "call_function" and _returns_view(node.target)


@functools.cache  # per op, not per node: the cost model asks for every candidate of every node
def _returns_view(target) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    # aten.to's schema says "may alias": a cast that changes the dtype copies, yet counts as a view here (priced as a
    # copy, bf16 plans' norms cost 13% more and the Mixtral-like benchmark lost its 32-stage cut, through a fault of
    # the cut's memory model mended since: to be tried again)
    out, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return out is not None and not out.is_write and first is not None and first.before_set == out.before_set


def returns_input(node) -> bool:
    """Whether the node is an `aten.to` that changes neither dtype nor device (nor asks for a copy): torch returns its
    input itself, with no autograd node of its own (transformers' norms cast to float32 what already is).

    >>> graph = torch.fx.Graph()
    >>> x = graph.placeholder("x")
    >>> x.meta["val"] = torch.empty(2)
    >>> same, other = (graph.call_function(aten.to.dtype, (x, dtype)) for dtype in (torch.float32, torch.float64))
    >>> same.meta["val"], other.meta["val"] = torch.empty(2), torch.empty(2, dtype=torch.float64)
    >>> copied = graph.call_function(aten.to.dtype, (x, torch.float32, False, True))  # copy=True, positionally
    >>> copied.meta["val"] = torch.empty(2)
    >>> returns_input(same), returns_input(other), returns_input(copied)
    (True, False, False)
    """
    if node.op != "call_function" or getattr(node.target, "overloadpacket", None) is not aten.to:
        return False
    source, val = node.args[0], node.meta.get("val")
    before = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(before, torch.Tensor):
        return False
    if "copy" in op_signature(node.target).slots and argument(node, "copy"):
        return False
    return (val.dtype, val.device) == (before.dtype, before.device)


def node_bytes(node) -> int:
    """Bytes of `node`'s output tensor(s), unsharded.

    >>> node_bytes(linear)  # 8 x 32 float32
    1024
    """
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):  # the common case, without building a list (the cost model asks often)
        return val.numel() * val.element_size()
    vals = val if isinstance(val, (tuple, list)) else [val]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def local_bytes(node, spec, mesh) -> int:
    """Bytes of one rank's block of `node`'s value under `spec` (one placement per mesh axis).

    >>> from autoshard.ir.mesh import Mesh
    >>> from autoshard.ir.placement import R, S
    >>> local_bytes(linear, [S(0)], Mesh((2,), ("dp",))), local_bytes(linear, [R], Mesh((2,), ("dp",)))
    (512, 1024)
    """
    split = math.prod(mesh.shape[a] for a, p in enumerate(spec) if isinstance(p, Shard))
    return node_bytes(node) // split
