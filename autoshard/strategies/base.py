"""What a strategy rule sees and returns, and the registry that maps ATen ops to rules.

A rule is written for ONE mesh axis of size `k`: it lists `AxisStrategy` candidates (one placement
per tensor input position, one for the output). The solver expands it to N axes by choosing one
candidate per axis; candidates whose shards do not divide evenly are dropped centrally
(`feasible`), so rules need not check sizes.

The examples look at the linear of a traced `nn.Linear(4, 2)` on a batch of 8, on an axis of size 2:

>>> import torch
>>> from autoshard.frontend.trace import trace
>>> gm = trace(torch.nn.Linear(4, 2), (torch.randn(8, 4),)).gm
>>> linear = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default)
>>> ctx = RuleContext(linear, [(8, 4), (2, 4), (2,)], [(8, 2)], axis_size=2)
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

from autoshard.ir.op_schema import argument
from autoshard.ir.placement import Partial, Placement, R, Replicate, Shard


@dataclass(frozen=True)
class AxisStrategy:
    """Input placements (per tensor input position) and output placement on one mesh axis.

    >>> AxisStrategy((Shard(1), Shard(1)), Partial())  # contract the sharded features: a partial sum
    (S(1), S(1)) -> P
    """

    inputs: tuple[Placement, ...]
    output: Placement
    method: str = ""  # how the op runs when its placements alone do not say (attention's "ring")

    def __repr__(self) -> str:
        text = f"({', '.join(map(repr, self.inputs))}) -> {self.output!r}"
        return f"{text} {self.method}" if self.method else text

    @functools.cached_property  # asked for hundreds of thousands of times while an ILP is built
    def splits_work(self) -> bool:
        """True when ranks on the axis compute different things (some placement is not R): the
        gradient of a replicated input then comes back partial (the duality rule).

        >>> AxisStrategy((R, R), R).splits_work, AxisStrategy((R, Shard(0)), Shard(1)).splits_work
        (False, True)
        """
        return not all(isinstance(p, Replicate) for p in (*self.inputs, self.output))

    def partial_grad(self, pos: int) -> bool:
        """The placement duality, in its one home: the gradient of input `pos` comes back partial on this
        axis when the input is replicated and the ranks split the work (each holds part of the sum).

        >>> AxisStrategy((R, Shard(0)), Shard(1)).partial_grad(0), AxisStrategy((R, R), R).partial_grad(0)
        (True, False)
        """
        return self.splits_work and isinstance(self.inputs[pos], Replicate)

    @functools.cached_property  # asked for hundreds of thousands of times while an ILP is built
    def divides_compute(self) -> bool:
        """True when each rank does 1/k of the work (something is sharded; partial sums do not shrink it).

        >>> AxisStrategy((Partial(), R), Partial()).divides_compute, AxisStrategy((Shard(0),), Shard(0)).divides_compute
        (False, True)
        """
        return any(isinstance(p, Shard) for p in (*self.inputs, self.output))

    def to_json(self):
        """The plan file's form of the strategy (a row's `choice` per axis).

        >>> AxisStrategy((Shard(0), R), Shard(0)).to_json()
        {'inputs': ['S(0)', 'R'], 'output': 'S(0)'}
        >>> AxisStrategy((Shard(2), Shard(2), Shard(2)), Shard(2), "ring").to_json()["method"]
        'ring'
        """
        out = {"inputs": [repr(p) for p in self.inputs], "output": repr(self.output)}
        if self.method:
            out["method"] = self.method
        return out


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor-valued inputs in argument order (repeats kept: `mul(x, x)` has two).

    >>> [n.name for n in tensor_inputs(linear)]
    ['inputs_0', 'p_model_weight', 'p_model_bias']
    """
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) or n)
    return [n for n in found if is_tensor_value(n)]


def mutated_positions(node) -> tuple[int, ...]:
    """Positions (among the node's tensor inputs) of the operands its op writes in place, from the op's
    schema: they cannot be resharded (the write would land on a copy).

    >>> graph = torch.fx.Graph()
    >>> x, y = graph.placeholder("x"), graph.placeholder("y")
    >>> x.meta["val"] = y.meta["val"] = torch.zeros(2)
    >>> add_ = graph.call_function(torch.ops.aten.add_.Tensor, (x, y))
    >>> mutated_positions(add_), mutated_positions(graph.call_function(torch.ops.aten.add.Tensor, (x, y)))
    ((0,), ())
    """
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return ()
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                written.append(value)
    inputs = tensor_inputs(node)
    return tuple(pos for pos, value in enumerate(inputs) if value in written)


def is_tensor_value(node: fx.Node) -> bool:
    """Whether the node's value is a tensor or a tuple holding one (the nodes strategies are made for).

    >>> is_tensor_value(linear), is_tensor_value(list(gm.graph.nodes)[-1])  # the output node has no value
    (True, False)
    """
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in val)
    return isinstance(val, torch.Tensor)


def output_shapes(node: fx.Node) -> list[tuple[int, ...]]:
    """The shapes of the node's tensor outputs (several for a multi-output op).

    >>> output_shapes(linear)
    [(8, 2)]
    """
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return [tuple(v.shape) for v in vals if isinstance(v, torch.Tensor)]


@dataclass
class RuleContext:
    """Everything a rule may look at for one node on one mesh axis.

    >>> ctx.axis_size, ctx.in_shapes
    (2, [(8, 4), (2, 4), (2,)])
    """

    node: fx.Node
    in_shapes: list[tuple[int, ...]]
    out_shapes: list[tuple[int, ...]]
    axis_size: int

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The (first) output's shape.

        >>> ctx.out_shape
        (8, 2)
        """
        return self.out_shapes[0]

    def arg(self, name: str):
        """The node's argument `name`, wherever the node passes it, else its default (`argument`).

        >>> ctx.arg("bias").name
        'p_model_bias'
        """
        return argument(self.node, name)

    def replicated(self) -> AxisStrategy:
        """The always-correct candidate: everything replicated.

        >>> ctx.replicated()
        (R, R, R) -> R
        """
        return AxisStrategy((R,) * len(self.in_shapes), R)


RuleFn = Callable[[RuleContext], list[AxisStrategy]]


@dataclass(frozen=True)
class Rule:
    """A strategy rule; `shape_arg` names the argument holding the output shape (rewritten locally).

    >>> REGISTRY.lookup(torch.ops.aten.view.default).shape_arg
    1
    """

    fn: RuleFn
    shape_arg: int | None = None
    note: str = ""
    combine: Callable | None = None  # combine(node, [AxisStrategy per axis so far]) -> whether they go together


@dataclass
class Registry:
    """ATen op (overload or packet) -> Rule. Overload entries win over packet entries. An op of a library
    that may not be loaded (a custom op such as transformers' grouped matmul) is registered by its name,
    `str(op)`, e.g. "transformers.grouped_mm_fallback.default".

    >>> registry = Registry()
    >>> registry.register(torch.ops.aten.relu, lambda ctx: [], note="a packet: every overload")
    >>> registry.lookup(torch.ops.aten.relu.default).note
    'a packet: every overload'
    """

    rules: dict = field(default_factory=dict)

    def register(self, ops, fn: RuleFn, shape_arg: int | None = None, note: str = "", combine=None):
        """Map `ops` (one op or a list: overloads or packets) to the rule `fn`; `combine(node, strategies)`, where
        given, says whether per-axis candidates may be chosen together (a sequence split by one axis only).

        >>> registry = Registry()
        >>> registry.register([torch.ops.aten.relu.default], lambda ctx: [ctx.replicated()])
        >>> sorted(map(str, registry.rules))
        ['aten.relu.default']
        """
        for op in ops if isinstance(ops, (list, tuple)) else [ops]:
            self.rules[op] = Rule(fn, shape_arg, note, combine)

    def lookup(self, target) -> Rule | None:
        """The rule of an op: its overload's entry, else its packet's, else None.

        >>> REGISTRY.lookup(torch.ops.aten.linear.default) is not None, REGISTRY.lookup(torch.ops.aten.lgamma.default)
        (True, None)
        """
        if target in self.rules:
            return self.rules[target]
        packet = getattr(target, "overloadpacket", None)
        rule = self.rules.get(packet)
        if rule is None and isinstance(target, torch._ops.OpOverload):
            rule = self.rules.get(str(target))
        return rule


REGISTRY = Registry()


def register(ops, shape_arg: int | None = None, note: str = ""):
    """Decorator form of `REGISTRY.register`.

    >>> @register([torch.ops.aten.lgamma.default], note="elementwise")
    ... def _lgamma_rule(ctx):
    ...     return [AxisStrategy((Shard(d),), Shard(d)) for d in range(len(ctx.out_shape))]
    >>> REGISTRY.lookup(torch.ops.aten.lgamma.default).note
    'elementwise'
    >>> del REGISTRY.rules[torch.ops.aten.lgamma.default]  # the example leaves the registry as it was
    """
    def wrap(fn):
        REGISTRY.register(ops, fn, shape_arg, note)
        return fn
    return wrap


def keeps_sums(node: fx.Node) -> bool:
    """Whether a linear op that may also cast (`to`, `sum(dtype=)`, `cumsum(dtype=)`) still passes partial
    sums: it does into a floating type, or between equal non-bool types; a float cast to int truncates
    each rank's share, a cast to bool saturates it.

    >>> keeps_sums(linear)
    True
    """
    src, out = node.args[0].meta["val"].dtype, node.meta["val"].dtype
    return out.is_floating_point or out.is_complex or (src == out and src != torch.bool)


def feasible(strategy: AxisStrategy, ctx: RuleContext) -> bool:
    """Shards must name existing dims and split them evenly over the axis.

    >>> feasible(AxisStrategy((Shard(0), R, R), Shard(0)), ctx), feasible(AxisStrategy((Shard(2), R, R), R), ctx)
    (True, False)
    """
    k = ctx.axis_size
    for placement, shape in zip(strategy.inputs, ctx.in_shapes):
        if isinstance(placement, Shard) and not _divides(shape, placement.dim, k):
            return False
    if isinstance(strategy.output, Shard):
        return all(_divides(shape, strategy.output.dim, k) for shape in ctx.out_shapes)
    return True


def _divides(shape, dim, k) -> bool:
    return 0 <= dim < len(shape) and shape[dim] % k == 0 and shape[dim] >= k


def unique(strategies) -> list[AxisStrategy]:
    """Drop repeats, keeping first-seen order (deterministic).

    >>> unique([AxisStrategy((R,), R), AxisStrategy((Shard(0),), Shard(0)), AxisStrategy((R,), R)])
    [(R) -> R, (S(0)) -> S(0)]
    """
    seen, out = set(), []
    for s in strategies:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def candidates_for(node: fx.Node, in_shapes, out_shapes, axis_size: int, warn=True) -> list[AxisStrategy]:
    """Feasible candidates of `node` on an axis of `axis_size`; unknown ops are replicated with a warning.
    The all-replicated candidate comes first.

    >>> candidates_for(linear, [(8, 4), (2, 4), (2,)], [(8, 2)], axis_size=2)
    [(R, R, R) -> R, (S(0), R, R) -> S(0), (R, S(0), S(0)) -> S(1)]
    """
    ctx = RuleContext(node, list(in_shapes), list(out_shapes), axis_size)
    rule = REGISTRY.lookup(node.target)
    if rule is None:
        if warn:
            warnings.warn(f"autoshard: no sharding rule for {node.target} (node {node.name!r}); it runs "
                          "replicated on every rank. Register one in autoshard/strategies to shard it.",
                          stacklevel=2)
        return [ctx.replicated()]
    found = [s for s in unique(rule.fn(ctx)) if len(s.inputs) == len(in_shapes) and feasible(s, ctx)]
    replicated = ctx.replicated()
    if replicated not in found:
        found.insert(0, replicated)
    return found


__all__ = [
    "REGISTRY",
    "AxisStrategy",
    "Partial",
    "Replicate",
    "Rule",
    "RuleContext",
    "Shard",
    "candidates_for",
    "is_tensor_value",
    "output_shapes",
    "register",
    "tensor_inputs",
    "unique",
]
