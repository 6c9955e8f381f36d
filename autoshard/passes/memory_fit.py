"""What solve does when its plan does not fit the memory budget per device: a ladder of memory savers.

Each rung re-solves with the ILP's memory row changed; the first rung that fits wins. Cheapest in step
time first (in a pipeline ZeRO-3 comes after recomputation: it gathers the parameters for every micro-batch):
  1. ZeRO-1, ZeRO-2, ZeRO-3 on the batch axis (optimizer state, then gradients, then parameters sharded
     over it; the memory rules of autoshard/cost/zero_cost.py). Stages 1 and 2 move no more bytes than
     the all-reduce they replace; stage 3 adds the parameter gathers.
  2. Recomputation of repeated layers, alone, then with ZeRO-1, 2, 3: the memory row keeps of a layer's
     activations only the values that leave it (the next layer's saved input) and one layer's in full
     (live again while it is recomputed); the recompute pass then checkpoints only as many layers as the
     budget needs, most bytes saved per second of recompute first (autoshard/passes/recompute.py).
Sequence parallelism needs no rung: activations sharded over the tensor-parallel axis are placements the
ILP already weighs in the memory row. A requested ZeRO stage fixes the stage; `checkpoint=` given by the
user fixes recomputation.

The most memory-saving rung is tried first: when even it does not fit, nothing does, and the refusal names
its smallest footprint, what dominates it and how long it searched, without trying the others. When every
axis is decided in one ILP, a rung that does not fit proves that no rung saving less fits either: those are
not solved, and after a rung fails, the most memory-saving untried rung of its kind (with or without
recomputation) is tried next, so that a kind of which none fits costs two solves. A rung whose ILP stops at
its time limit without a plan counts as not fitting (not as proof); when that happens to the most
memory-saving rung, the IlpTimeLimitError names the rung.

A budget below the plain plan's footprint makes the ladder reach for ZeRO:

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> hints = {"input:0": {"dp": "S(0)"}}
>>> plain = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",), hints=hints)
>>> budget = 0.8 * plain.plan.predicted["memory_bytes_per_rank"]
>>> autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",), hints=hints,
...                       memory_budget=budget).zero
ZeRO-2 on 'dp', chosen by the memory budget
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from autoshard.cost.recompute_cost import dropped_activations
from autoshard.frontend.hints import ZERO_STAGES
from autoshard.ir import meta
from autoshard.passes.recompute import checkpoint_regions, region_of
from autoshard.passes.zero import (
    ZeroConfig,
    batch_axes,
    hinted_batch_axes,
    requested_zero,
)
from autoshard.solver.errors import IlpTimeLimitError, MemoryBudgetError
from autoshard.solver.layers import layer_key


@dataclass(frozen=True)
class MemorySavers:
    """What the ILP's memory row assumed when solve planned: a ZeRO (requested, or chosen because only it fits the
    budget) and whether repeated layers are recomputed as far as the budget needs. Solve writes it
    (`state.memory_savers`); the zero pass applies its ZeRO, the recompute pass its recomputation; nothing
    rewrites the user's options.

    >>> MemorySavers(ZeroConfig("dp", 2, "memory budget"), recompute=True)
    ZeRO-2 on 'dp', chosen by the memory budget + recomputation
    """

    zero: ZeroConfig | None = None
    recompute: bool = False
    bounded: bool = True  # False: the ILP has no memory row (the ladder's probe for where the batch goes)

    def __repr__(self) -> str:
        parts = ([repr(self.zero)] if self.zero else []) + (["recomputation"] if self.recompute else [])
        return " + ".join(parts) or "no memory saver"

    @property
    def chosen_zero(self) -> ZeroConfig | None:
        """The ZeRO the memory budget chose (None when none, or when it is the one requested).

        >>> MemorySavers(ZeroConfig("dp", 3)).chosen_zero is None  # requested: the zero pass resolves the request
        True
        """
        return self.zero if self.zero is not None and self.zero.reason != "requested" else None


@dataclass(frozen=True)
class Rung:
    """One memory saver of the ladder: a ZeRO stage (None: none) and whether repeated layers are recomputed.

    >>> Rung(3, True)
    ZeRO-3 + recomputation
    """

    zero: int | None
    recompute: bool

    def __repr__(self) -> str:
        parts = ([f"ZeRO-{self.zero}"] if self.zero else []) + (["recomputation"] if self.recompute else [])
        return " + ".join(parts) or "no memory saver"


def ladder(state) -> list[Rung]:
    """The rungs solve may try for this compile, in order (the plain plan, which did not fit, excluded).

    >>> [repr(r) for r in ladder(plain.state)][:4]
    ['ZeRO-1', 'ZeRO-2', 'ZeRO-3', 'recomputation']
    """
    requested = requested_zero(state)
    stages = [next(iter(requested.values()))] if requested else list(ZERO_STAGES)
    recompute = [False] + ([True] if state.options.checkpoint is None else [])
    rungs = [Rung(None, r) for r in recompute if not requested] + [Rung(s, r) for r in recompute for s in stages]
    # In a pipeline ZeRO-3 gathers the parameters again for every micro-batch (torchtitan keeps them gathered under
    # pipelining for that reason): recomputation first, ZeRO-3 last.
    pipelined = state.options.pipeline is not None
    rungs.sort(key=lambda r: (pipelined and r.zero == 3, r.recompute, r.zero or 0))
    tried = Rung(stages[0] if requested else None, False)  # what solve planned first
    return [r for r in rungs if r != tried]


def fit_memory(state, solve_once, error: MemoryBudgetError) -> Rung:
    """Climb the ladder after `solve_once(state)` raised `error`; leaves `state` solved with the first rung that
    fits (`state.memory_savers`) and returns it, or raises the refusal: the smallest
    footprint of the most memory-saving rung and what dominates it.

    When nothing fits, the refusal says what was tried and what dominates the smallest footprint:

    >>> autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",), hints=hints,
    ...                       memory_budget=1000)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autoshard.solver.errors.MemoryBudgetError: no plan fits ... (with ZeRO-3 + recomputation, searched ... s; tried ZeRO-1, ...
    """
    rungs = ladder(state)
    axis = _zero_axis(state, solve_once) if any(r.zero for r in rungs) else None
    rungs = [r for r in rungs if not r.zero or axis is not None]
    if not rungs:
        raise error
    top, started = rungs[-1], time.perf_counter()
    try:
        _solve_with(state, solve_once, top, axis)
    except MemoryBudgetError as last:
        _reset(state)
        tried = ", ".join(map(repr, rungs))
        raise MemoryBudgetError(last.problem, searched=f"with {top!r}, searched {time.perf_counter() - started:.1f} "
                                                       f"s; tried {tried}",
                                advice="Use a larger mesh or a smaller batch per device, or raise the budget "
                                       "(memory_budget=, memory_headroom=).") from None
    except IlpTimeLimitError as stopped:
        _reset(state)
        raise stopped.at(f"with {top!r}, the most memory-saving rung of the memory ladder") from None
    return _climb(state, solve_once, rungs, axis) if len(rungs) > 1 else top


def _climb(state, solve_once, rungs: list, axis) -> Rung:
    """Leave `state` solved with the first of `rungs` that fits and return it; the last one is known to fit (see
    the module docstring for the rungs not solved)."""
    joint = state.mesh.ndim == 1 or any(len(stats["axes"]) == state.mesh.ndim for stats in state.ilp_stats)
    refused: list = []  # rungs that do not fit, proven by a joint ILP

    def fits(rung) -> bool:
        if any(_saves_at_least(other, rung) for other in refused):
            return False
        try:
            _solve_with(state, solve_once, rung, axis)
            return True
        except (MemoryBudgetError, IlpTimeLimitError) as failed:
            _reset(state)
            if joint and isinstance(failed, MemoryBudgetError):
                refused.append(rung)
            return False

    for i, rung in enumerate(rungs[:-1]):
        if fits(rung):
            return rung
        kind = [r for r in rungs[i + 1:-1] if r.recompute == rung.recompute]
        if refused and refused[-1] is rung and len(kind) > 1:
            fits(kind[-1])  # when the most saving of its kind does not fit either, none of them is solved
    _solve_with(state, solve_once, rungs[-1], axis)  # the session remembers its solve
    return rungs[-1]


def _saves_at_least(rung: Rung, other: Rung) -> bool:
    """Whether `rung` saves at least the memory `other` does: ZeRO stage no lower, recomputation if `other` has it."""
    return (rung.zero or 0) >= (other.zero or 0) and rung.recompute >= other.recompute


def recompute_dropped(nodes, regions=None) -> set:
    """Ops whose saved activations the memory row leaves out when planning for recomputation: in every
    repeated-layer instance (or each of the `regions` the user's `checkpoint=` names) but the first, those only
    the instance itself uses (`dropped_activations`).

    >>> from autoshard.zoo import gpt2
    >>> three, three_inputs, _ = gpt2(n_layers=3)
    >>> state = autoshard.parallelize(three, (2,), three_inputs, axis_names=("dp",)).state
    >>> ops = [n for n in state.gm.graph.nodes if n.op == "call_function"]
    >>> sorted({layer_key(n.meta.get("autoshard.path", ""))[1] for n in recompute_dropped(ops)})
    ['layers.1', 'layers.2']
    >>> sorted({layer_key(n.meta.get("autoshard.path", ""))[1] for n in recompute_dropped(ops, ["layers.0", "layers.2"])})
    ['layers.2']
    """
    by_instance: dict = {}
    regions = None if regions is None else set(regions)  # outermost (checkpoint_regions): at most one holds a node
    for node in nodes:
        if node.op != "call_function":
            continue
        path = node.meta.get(meta.PATH, "")
        instance = layer_key(path)[1] if regions is None else region_of(node, regions)
        if instance:
            by_instance.setdefault(instance, []).append(node)
    dropped = set()
    for members in list(by_instance.values())[1:]:  # the first counts in full: live while a layer is recomputed
        dropped.update(dropped_activations(members))
    return dropped


def planned_dropped(state, nodes) -> set:
    """The activations the ILP's memory row leaves out: the ladder's recomputation rung drops repeated layers'
    (`recompute_dropped`); a user's `checkpoint=` globs drop their regions' (else the ILP would bend the placements
    to fit activations that are recomputed anyway); nothing otherwise.

    >>> len(planned_dropped(plain.state, list(plain.state.gm.graph.nodes)))  # neither: every activation counts
    0
    """
    if state.memory_savers is not None and state.memory_savers.recompute:
        return recompute_dropped(nodes)
    option = state.options.checkpoint
    if not option or option == "auto":
        return set()
    return recompute_dropped(nodes, checkpoint_regions(option, [n for n in nodes if n.op == "call_function"]))


def _zero_axis(state, solve_once) -> str | None:
    """The axis ZeRO shards over: the requested one, the hinted batch axis, else where the unbounded plan puts
    the batch."""
    named = [axis for axis in requested_zero(state) if axis is not None]
    axes = named or hinted_batch_axes(state)
    if not axes:
        savers = state.memory_savers
        state.memory_savers = MemorySavers(savers.zero, savers.recompute, bounded=False)
        try:
            solve_once(state)
        finally:
            state.memory_savers = savers
        axes = batch_axes(state)
    return axes[0] if axes else None


def _solve_with(state, solve_once, rung: Rung, axis) -> None:
    reason = "requested" if requested_zero(state) else "memory budget"
    # Only the memory row changes between rungs; the recompute pass reads `recompute` and checkpoints layers until
    # the predicted memory fits the budget.
    state.memory_savers = MemorySavers(ZeroConfig(axis, rung.zero, reason) if rung.zero else None, rung.recompute)
    solve_once(state)


def _reset(state) -> None:
    state.memory_savers = MemorySavers()
