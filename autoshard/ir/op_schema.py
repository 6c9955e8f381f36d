"""Op arguments by name, from the op's schema (torch's `FunctionSchema`, as DTensor's `OpSchema` reads it): a node
or a call may pass an argument positionally or by keyword, so the sharding rules, the cost model, the lowering and
the runtime's random ops ask for it by name (`argument`, `call_argument`), never by a position written by hand.

>>> import torch
>>> from torch import fx
>>> graph = fx.Graph()
>>> x, w, b = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("b")
>>> linear = graph.call_function(torch.ops.aten.linear.default, (x, w), {"bias": b})
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import fx

_REQUIRED = object()  # the default of an argument the schema gives none


@dataclass(frozen=True)
class OpSignature:
    """An op's arguments as its schema declares them (torch's `FunctionSchema`, as DTensor's `OpSchema` reads it):
    per name, its position among the positional arguments (None: keyword-only) and its default. Nodes pass an
    argument positionally or by keyword (a pass that builds a node may use either), so rules ask by name.

    >>> sdpa = op_signature(torch.ops.aten.scaled_dot_product_attention.default)
    >>> sdpa.names[:4], sdpa.slots["dropout_p"], sdpa.slots["scale"]
    (('query', 'key', 'value', 'attn_mask'), (4, 0.0), (None, None))
    """

    op: str
    names: tuple[str, ...]
    slots: dict  # name -> (position or None, default or _REQUIRED)

    def slot(self, name: str) -> tuple:
        """(position, default) of argument `name`; an error naming the op's arguments when it has none so named.

        >>> op_signature(torch.ops.aten.linear.default).slot("bias")
        (2, None)
        >>> op_signature(torch.ops.aten.linear.default).slot("dim")
        Traceback (most recent call last):
        ...
        TypeError: aten.linear.default has no argument 'dim' (its arguments: input, weight, bias)
        """
        found = self.slots.get(name)
        if found is None:
            raise TypeError(f"{self.op} has no argument {name!r} (its arguments: {', '.join(self.names)})")
        return found


@functools.cache  # one schema read per op: rules ask for arguments on every node of every plan
def op_signature(target) -> OpSignature:
    """The OpSignature of an ATen op (an OpOverload, or a custom op's); a target without a schema is an error.

    >>> op_signature(torch.ops.aten.sum.dim_IntList).slots["keepdim"]
    (2, False)
    """
    schema = getattr(target, "_schema", None)
    if schema is None:
        raise TypeError(f"{target} has no schema: its arguments have no names to ask for")
    slots = {a.name: (None if a.kwarg_only else i, a.default_value if a.has_default_value() else _REQUIRED)
             for i, a in enumerate(schema.arguments)}
    return OpSignature(str(target), tuple(slots), slots)


def argument(node: fx.Node, name: str):
    """The argument `name` of the node's op, passed positionally or by keyword, else the schema's default.

    >>> argument(linear, "bias").name, argument(linear, "weight").name
    ('b', 'w')
    """
    return call_argument(node.target, node.args, node.kwargs, name, f"node {node.name!r}")


def call_argument(target, args, kwargs, name: str, where: str = "a call"):
    """The argument `name` of a call of op `target` with `args` and `kwargs` (what a rank's interpreter sees).

    >>> call_argument(torch.ops.aten.dropout.default, (None, 0.1), {}, "train")
    Traceback (most recent call last):
    ...
    TypeError: a call calls aten.dropout.default without its required argument 'train'
    >>> call_argument(torch.ops.aten.dropout.default, (None,), {"p": 0.1, "train": True}, "p")
    0.1
    """
    op = op_signature(target)
    position, default = op.slot(name)
    if position is not None and position < len(args):
        return args[position]
    value = (kwargs or {}).get(name, default)
    if value is _REQUIRED:
        raise TypeError(f"{where} calls {op.op} without its required argument {name!r}")
    return value


def arguments(node: fx.Node) -> dict:
    """Every argument of the node's op by name, in the schema's order, defaults filled in.

    >>> {name: getattr(value, "name", value) for name, value in arguments(linear).items()}
    {'input': 'x', 'weight': 'w', 'bias': 'b'}
    """
    return {name: argument(node, name) for name in op_signature(node.target).names}
