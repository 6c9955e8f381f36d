"""`autoshard.constrain(x, {"dp": "S(0)", "tp": "R"})`: fix an activation's placement from inside forward.

Like jax's `with_sharding_constraint`: eagerly it returns a copy of `x` (gradient: identity), and
torch.export keeps it in the graph as the custom op `autoshard::constrain(Tensor x, str spec)`,
where `annotate` turns its spec string ("dp=S(0);tp=R") into a hint on the node and codegen drops it.
Axes the spec does not mention stay free for the planner.

>>> import torch
>>> y = constrain(torch.ones(4, 2), {"dp": "S(0)"})
>>> y.shape
torch.Size([4, 2])
>>> spec_text({"dp": "S(0)", "tp": "R"})
'dp=S(0);tp=R'
"""
from __future__ import annotations

import torch

from autoshard.ir.errors import HintError
from autoshard.ir.placement import Placement, parse_placement
from autoshard.strategies.base import REGISTRY
from autoshard.strategies.pointwise import scaling_rule


@torch.library.custom_op("autoshard::constrain", mutates_args=())
def _constrain_op(x: torch.Tensor, spec: str) -> torch.Tensor:
    return x.clone()


@_constrain_op.register_fake
def _(x, spec):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return grad, None


_constrain_op.register_autograd(_backward)

# Identity on its operand: the input placement equals the output placement (partial passes through).
REGISTRY.register([torch.ops.autoshard.constrain.default], scaling_rule(),
                  note="autoshard.constrain: identity; the hint on its output fixes its input's placement")


def parse_spec(text: str, where: str = "autoshard.constrain") -> dict[str, Placement]:
    """'dp=S(0);tp=R' -> {'dp': S(0), 'tp': R}; errors say what is malformed and show the format.

    >>> parse_spec("dp=S(0);tp=R")
    {'dp': S(0), 'tp': R}
    >>> parse_spec("dp:S(0)")
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.HintError: autoshard.constrain: 'dp:S(0)' in spec 'dp:S(0)' is not '<axis>=<placement>'; ...
    """
    out: dict[str, Placement] = {}
    for item in filter(None, (p.strip() for p in text.split(";"))):
        axis, eq, placement = item.partition("=")
        axis = axis.strip()
        if not eq or not axis.isidentifier():
            raise HintError(f"{where}: {item!r} in spec {text!r} is not '<axis>=<placement>'; write e.g. "
                            "{'dp': 'S(0)', 'tp': 'R'} (or 'dp=S(0);tp=R')")
        if axis in out:
            raise HintError(f"{where}: spec {text!r} names axis {axis!r} twice; give each axis one placement")
        try:
            out[axis] = parse_placement(placement, f"{where} axis {axis!r}")
        except ValueError as exc:
            raise HintError(str(exc)) from None
    if not out:
        raise HintError(f"{where}: spec {text!r} names no axis; write e.g. {{'dp': 'S(0)'}}")
    return out


def spec_text(spec) -> str:
    """Canonical string form of a constrain spec (a dict {axis: placement} or the string itself).

    >>> from autoshard.ir.placement import S, R
    >>> spec_text({"dp": S(0), "tp": "R"}), spec_text(" dp = S(0) ; tp=R ")
    ('dp=S(0);tp=R', 'dp=S(0);tp=R')
    """
    if isinstance(spec, str):
        parsed = parse_spec(spec)
    elif isinstance(spec, dict):
        if not spec:
            raise HintError("autoshard.constrain: the spec is empty; map axis names to placements, "
                            "e.g. {'dp': 'S(0)'}")
        parsed = {}
        for axis, placement in spec.items():
            if not isinstance(axis, str) or not axis.isidentifier():
                raise HintError(f"autoshard.constrain: axis {axis!r} is not a mesh axis name; use names like 'dp'")
            text = repr(placement) if isinstance(placement, Placement) else placement
            try:
                parsed[axis] = parse_placement(text, f"autoshard.constrain axis {axis!r}")
            except ValueError as exc:
                raise HintError(str(exc)) from None
    else:
        raise HintError(f"autoshard.constrain: spec must be a dict {{axis: placement}}, e.g. {{'dp': 'S(0)'}}; "
                        f"got {type(spec).__name__}")
    return ";".join(f"{axis}={placement!r}" for axis, placement in parsed.items())


def constrain(tensor: torch.Tensor, spec) -> torch.Tensor:
    """Ask that `tensor` have placement `spec` ({axis name: "S(d)" | "R" | "P"}) at this point of forward.

    >>> import autoshard
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
    ...     def forward(self, x):
    ...         return self.down(constrain(self.up(x), {"tp": "S(1)"}))  # column-parallel up
    >>> prog = autoshard.parallelize(Net(), (2,), (torch.randn(4, 8),), axis_names=("tp",))
    >>> [row.type for row in prog.plan.rows if row.op == "autoshard.constrain.default"]
    ['f32[4, 16@tp]']
    """
    if not isinstance(tensor, torch.Tensor):
        raise HintError(f"autoshard.constrain: the first argument must be a tensor, got {type(tensor).__name__}")
    return torch.ops.autoshard.constrain(tensor, spec_text(spec))
