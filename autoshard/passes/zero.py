"""zero: ZeRO stage 1/2/3 on the data-parallel axis (the mesh axis the batch is split on).

Reads the request (`parallelize(zero=...)` in `state.options.zero`, `{"zero": {"dp": 3}}` in the hint
file) or the ZeRO solve chose because only it fits the memory budget (`state.memory_savers`:
passes/memory_fit.py), the input specs
(which axis carries the batch) and the parameters' specs. Writes `state.zero` (ZeroConfig or None) and
`state.hints.zero` (so the plan's hints record the stage and a saved plan reproduces it). Stage 3 also
shards every parameter that is replicated on the ZeRO axis along a dim no other axis shards (spec and
choice become S(d) there): insert_comm then gathers it right before each use with `param_all_gather`
(all-gather forward, reduce-scatter of the partial gradient backward, re-gathered in backward instead of
kept). Stages 1 and 2 change no placement: the runtime shards optimizer state and gradients
(autoshard/runtime/zero.py). A parameter with no evenly divisible free dim stays replicated and is
treated as in stage 2.

The examples ask for ZeRO-3 on the data-parallel axis of a two-layer MLP:

>>> import autoshard
>>> from autoshard.passes.pass_lists import state_before
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> hints = {"input:0": {"dp": "S(0)"}}
>>> state = state_before("zero", model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",), hints=hints, zero=3)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from autoshard.cost.axis_cost import needs_grad
from autoshard.frontend.hints import Hints, parse_zero
from autoshard.ir import meta
from autoshard.ir.errors import HintError
from autoshard.ir.placement import Replicate, Shard
from autoshard.passes.choice import record_choice
from autoshard.passes.contract import Contract, compiler_pass
from autoshard.strategies import AxisStrategy


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO `stage` on mesh axis `axis`; `reason` says who chose it ("requested" or "memory budget").

    >>> ZeroConfig("dp", 2, "memory budget")
    ZeRO-2 on 'dp', chosen by the memory budget
    """

    axis: str
    stage: int
    reason: str = "requested"

    def __repr__(self) -> str:
        why = "" if self.reason == "requested" else f", chosen by the {self.reason}"
        return f"ZeRO-{self.stage} on {self.axis!r}{why}"


def requested_zero(state) -> dict:
    """{axis or None: stage} asked for by `zero=` and/or the hint file ({} when neither); they must agree.

    >>> requested_zero(state)  # zero=3 names no axis: the batch axis, whichever it is
    {None: 3}
    """
    option = state.options.zero
    if option is None:
        from_option = {}
    elif isinstance(option, bool) or not isinstance(option, (int, dict)):
        raise HintError(f"zero={option!r:.60} must be a ZeRO stage (1, 2 or 3) or {{axis name: stage}}, "
                        "e.g. zero=3 or zero={'dp': 3}")
    elif isinstance(option, int):
        from_option = {None: parse_zero({"dp": option}, f"zero={option!r}")["dp"]}
    else:
        from_option = parse_zero(option, f"zero={option!r}")
    hints = state.hints if isinstance(state.hints, Hints) else Hints.parse(state.hints)
    from_hints = dict(hints.zero)
    if from_option and from_hints:
        (axis, stage), = from_option.items()
        (hint_axis, hint_stage), = from_hints.items()
        if stage != hint_stage or axis not in (None, hint_axis):
            raise HintError(f"zero={option!r} disagrees with the hints' \"zero\": {from_hints}; give ZeRO once")
    return from_hints or from_option


def batch_axes(state) -> list[str]:
    """Mesh axes on which some input is split along its first (batch) dim, after solve.

    >>> batch_axes(state)
    ['dp']
    """
    names = state.mesh.names
    found = set()
    for node in state.gm.graph.nodes:
        if node.op == "placeholder" and node.meta.get(meta.KIND) == "input" and meta.SPEC in node.meta:
            found |= {a for a, p in enumerate(node.meta[meta.SPEC]) if p == Shard(0)}
    return [names[a] for a in sorted(found)]


def resolve_zero(state) -> ZeroConfig | None:
    """The ZeRO to apply after solve: the memory budget's choice, else the request on its (batch) axis;
    None when neither asks for it. A request off the batch axis is an error.

    >>> resolve_zero(state)
    ZeRO-3 on 'dp'
    """
    auto = state.memory_savers.chosen_zero if state.memory_savers is not None else None
    if auto is not None:
        return auto
    request = requested_zero(state)
    if not request:
        return None
    (axis, stage), = request.items()
    axes = batch_axes(state)
    if axis is None:
        if len(axes) != 1:
            why = (f"the batch is split on axes {axes}" if axes else "no input is split on any mesh axis")
            raise HintError(f"zero={stage}: ZeRO runs on the data-parallel axis, but {why}; name the axis, "
                            f"e.g. zero={{'dp': {stage}}}, and shard the batch there (hint \"input:0\": "
                            "{\"dp\": \"S(0)\"})")
        axis = axes[0]
    if axis not in state.mesh.names:
        raise HintError(f"ZeRO names mesh axis {axis!r}, but the mesh has axes {list(state.mesh.names)}")
    if axis not in axes:
        raise HintError(f"ZeRO-{stage} on axis {axis!r}: the batch is not split on {axis!r} (it is on {axes}); ZeRO "
                        f"shards what data parallelism replicates, so shard the batch there (hint \"input:0\": "
                        f"{{\"{axis}\": \"S(0)\"}}) or name a batch axis")
    return ZeroConfig(axis, stage)


def hinted_batch_axes(state) -> list[str]:
    """Axes the hints split an input's batch dim on (known before solving).

    >>> hinted_batch_axes(state)
    ['dp']
    """
    return [state.mesh.names[a] for a in sorted({a for n in state.gm.graph.nodes if n.meta.get(meta.KIND) == "input"
                                                 for a, p in n.meta.get(meta.HINT, {}).items() if p == Shard(0)})]


def planned_zero(state) -> ZeroConfig | None:
    """The requested ZeRO when its axis is known before solving (named, or the one hinted batch axis).

    >>> planned_zero(state)
    ZeRO-3 on 'dp'
    """
    request = requested_zero(state)
    if not request:
        return None
    (axis, stage), = request.items()
    axes = hinted_batch_axes(state)
    if axis is None and len(axes) == 1:
        axis = axes[0]
    return ZeroConfig(axis, stage) if axis in state.mesh.names else None


@compiler_pass("zero", reads=(meta.SPEC, meta.IN_SPECS, meta.CHOICE, "state.hints", "state.memory_savers"),
               writes=("state.zero", "state.hints", meta.SPEC, meta.CHOICE, meta.CANDIDATES))
def zero(state) -> None:
    """The pass: write `state.zero`; ZeRO-3 shards each replicated parameter on the ZeRO axis (its sharded placement
    joins the parameter's candidates, so that the choice stays one of them).

    >>> zero(state)
    >>> state.zero, [n.meta["autoshard.spec"] for n in state.gm.graph.nodes if n.op == "placeholder"][:2]
    (ZeRO-3 on 'dp', [[S(0)], [S(0)]])
    """
    config = state.zero = resolve_zero(state)
    if config is None:
        return
    hints = state.hints = state.hints if isinstance(state.hints, Hints) else Hints.parse(state.hints)
    hints.zero = {config.axis: config.stage}
    if config.stage == 3:
        _shard_parameters(state, state.mesh.axis(config.axis))



def shard_dim(shape, spec, axis: int, k: int) -> int | None:
    """The dim ZeRO-3 shards a parameter along on `axis`: the first one no other axis shards and `k`
    divides (so one all-gather on `axis` restores it); None when there is none.

    >>> from autoshard.ir.placement import Spec, R, S
    >>> shard_dim((128, 32), Spec([R, S(0)]), axis=0, k=2), shard_dim((3,), Spec([R]), axis=0, k=2)
    (1, None)
    """
    taken = {p.dim for a, p in enumerate(spec) if a != axis and isinstance(p, Shard)}
    for d, size in enumerate(shape):
        if d not in taken and size >= k and size % k == 0:
            return d
    return None


def _shard_parameters(state, axis: int) -> None:
    k = state.mesh.shape[axis]
    grad = needs_grad(state.gm.graph)
    for node in state.gm.graph.nodes:
        if node.op != "placeholder" or node.meta.get(meta.KIND) != "param" or not grad.get(node):
            continue
        spec = node.meta[meta.SPEC]
        if not isinstance(spec[axis], Replicate) or axis in node.meta.get(meta.HINT, {}):
            continue  # already sharded there, or the user pinned it
        dim = shard_dim(tuple(node.meta["val"].shape), spec, axis, k)
        if dim is None:
            continue
        strategy = AxisStrategy((), Shard(dim))
        candidates = node.meta[meta.CANDIDATES][axis]
        if strategy not in candidates:
            candidates.append(strategy)  # keeps "the choice is one of the candidates" true for explain/apply_plan
        chosen = list(node.meta[meta.CHOICE])
        chosen[axis] = strategy
        record_choice(node, chosen, grad)


@dataclass(frozen=True, eq=False)
class AllowPlannedZeroShards:
    """Runs before apply_plan: a saved ZeRO-3 plan stores parameters S(d) on the ZeRO axis, which semi-auto
    planning offers no candidate for; add exactly those candidates so the plan applies as saved.

    >>> zero3 = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",), hints=hints, zero=3)
    >>> again = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",), plan=zero3.plan)
    >>> "allow_planned_zero_shards" in [entry.name for entry in again.history], again.zero
    (True, ZeRO-3 on 'dp')
    """

    plan: object
    name: str = "allow_planned_zero_shards"
    contract: ClassVar[Contract] = Contract(reads=(meta.CANDIDATES,), writes=(meta.CANDIDATES,))

    def __call__(self, state) -> None:
        zero_axes = [a for a, s in (self.plan.hints or {}).get("zero", {}).items() if s == 3]
        if not zero_axes:
            return
        axis = state.mesh.axis(zero_axes[0])
        rows = {r.name: r for r in self.plan.rows if r.kind == "param"}
        for node in state.gm.graph.nodes:
            row = rows.get(node.name)
            if row is None or node.op != "placeholder" or meta.CANDIDATES not in node.meta:
                continue
            wanted = row.choice[axis]["output"] if row.choice else "R"
            if wanted.startswith("S("):
                strategy = AxisStrategy((), Shard(int(wanted[2:-1])))
                if strategy not in node.meta[meta.CANDIDATES][axis]:
                    node.meta[meta.CANDIDATES][axis].append(strategy)
