"""The automatic plan is never worse than a hand plan: the search plans the model by the ILP and, where a hand
plan could do better, also plans every catalogue plan that applies (autoshard/catalogue/), each priced by the
same cost model (predict), and keeps the fastest predicted step among those that fit.

When a hand plan cannot win, it is not planned. The ILP over every mesh axis at once is exact over the
placements a hand plan pins (its prices are predict's: a data-parallel plan's gradient sync included, priced on
the bucket that plan syncs, `collective_time.grad_sync_time`; a full bucket's share at the fitted line once made
the zoo GPT-2's automatic plan 10% slower than data parallelism on a calibrated profile), so a hand plan wins only
through what that ILP does not weigh: ZeRO-3 (chosen by the memory budget, not by the objective), the greedy
order of a solve axis by axis, or a budget-bound joint ILP its time limit stopped (the zoo Llama on (2, 4) under
the Megatron plan's memory: 80k columns, the search at 0.356 ms after 17 s and 0.308 ms after 150 s, where DDP x
Megatron TP predicts 0.302 ms). So the hand plans are
planned when the ILP solved the axes one after another, when the plan needed a memory saver, or when its
memory is more than half the budget (the budget may have kept the ILP from its unbounded optimum); a hand plan
whose parameters alone cannot fit the budget is refused without planning. Every candidate, planned or not, is
recorded in `plan.search["hand_plans"]` with its predicted step and memory or why it was not planned.

>>> import autoshard
>>> from autoshard.zoo import llama
>>> model, inputs, loss_fn = llama(n_layers=2)
>>> prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"),
...                              memory_budget=1.2e6)  # the plan takes 0.71 MB: the budget may bind
>>> [(c["name"], c["predicted_step_s"] >= prog.plan.predicted.step_time_s) for c in prog.plan.search["hand_plans"]]
[('automatic', True), ('ddp', True), ('fsdp', True), ('dp_tp', True), ('fsdp_tp', True), ('tp_sp', True)]
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import warnings

from autoshard.catalogue import hand_plans as catalogue
from autoshard.catalogue.roles import model_roles
from autoshard.cost.axis_cost import held_bytes_factor, needs_grad
from autoshard.frontend.request import CompileOptions, CompileRequest
from autoshard.ir import meta
from autoshard.ir.errors import AutoshardError
from autoshard.ir.warn_once import caught_warnings
from autoshard.passes.pass_lists import compile_state, trace_for_plan
from autoshard.program.program import Program

log = logging.getLogger(__name__)

# Inside `hand_plans_deferred()` (the mesh search over candidate shapes): the ILP's flat plan alone; the hand plans
# are compared on the mesh the search keeps (`plan_with_hand_plans` there), not on every candidate shape.
_DEFERRED: contextvars.ContextVar = contextvars.ContextVar("autoshard_hand_plans_deferred", default=False)
BINDING_SHARE = 0.5  # memory above this share of the budget: the budget may have bound the ILP
NEAR_BUDGET = 0.9  # memory above this share: the placements may have been bent to fit (try recomputing instead)


def plan_with_hand_plans(request: CompileRequest) -> Program:
    """The automatic Program, or the hand plan's when one predicts a faster step (see the module docstring).

    >>> prog.plan.search["chosen_plan"]
    'automatic'
    """
    return compare_hand_plans(request, Program(*compile_state(request)))


def compare_hand_plans(request: CompileRequest, auto: Program) -> Program:
    """`auto` (the ILP's flat plan of `request`), or the hand plan's when one predicts a faster step; inside
    `hand_plans_deferred()` `auto` alone, marked where a hand plan could have won.

    Without a binding budget the joint ILP is exact over what a hand plan pins: none is planned (the module's
    example shows a comparison that plans them).

    >>> request = CompileRequest(model, autoshard.Mesh((2, 2), ("dp", "tp")), inputs, loss_fn=loss_fn)
    >>> auto = Program(*compile_state(request))
    >>> compare_hand_plans(request, auto) is auto, "hand_plans" in auto.plan.search
    (True, False)
    """
    if not _hand_plans_may_win(request, auto):
        return auto
    automatic = _row("automatic", "the ILP's plan", auto)
    recompute = _recompute_variant_applies(request, auto)
    if _DEFERRED.get():
        auto.plan.search = dict(auto.plan.search,
                                hand_plans_deferred={"automatic": automatic, "recompute_variant": recompute})
        return auto
    record = [automatic]
    planned = [(auto, [], "automatic")]
    for name, plan, why in hand_candidates(request, recompute):
        rows, progs = plan_hand_candidate(request, name, plan, why)
        record += rows
        planned += progs
    best, caught, chosen = min(planned, key=lambda entry: entry[0].state.predicted.step_time_s)  # first on a tie
    for warning in caught:  # a hand plan's warnings are told only when it is the plan returned
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    best.plan.search = dict(best.plan.search, hand_plans=record, chosen_plan=chosen,
                            why_plan=why_plan(record, chosen))
    log.info(best.plan.search["why_plan"])
    return best


# The automatic plan again with repeated layers recomputed: a candidate of its own (`_recompute_variant_applies`).
AUTO_RECOMPUTE = "automatic + recomputation"


def hand_candidates(request: CompileRequest, recompute_automatic: bool) -> list:
    """The candidates the automatic plan of `request` is compared with, in the record's order, as
    (name, HandPlan or None, why not planned): the automatic plan with recomputation when `recompute_automatic`
    (`_recompute_variant_applies`), then each catalogue plan (`applicable_hand_plans`). The mesh search plans each
    as a task of its own (autoshard/search/hand_parts.py).

    >>> request = CompileRequest(model, autoshard.Mesh((2, 2), ("dp", "tp")), inputs, loss_fn=loss_fn)
    >>> [name for name, _, _ in hand_candidates(request, recompute_automatic=True)]
    ['automatic + recomputation', 'ddp', 'fsdp', 'dp_tp', 'fsdp_tp', 'tp_sp']
    """
    first = [(AUTO_RECOMPUTE, None, "")] if recompute_automatic else []
    return first + applicable_hand_plans(request)


def plan_hand_candidate(request: CompileRequest, name: str, plan, why: str) -> tuple[list, list]:
    """One candidate of `hand_candidates` planned: (its rows of the record, [(Program, its warnings, name), ...]),
    a catalogue plan followed by its own recomputation variant when that applies; a candidate not planned is its
    row alone, a refusal its error row.

    >>> request = CompileRequest(model, autoshard.Mesh((2, 2)), inputs, loss_fn=loss_fn)
    >>> rows, planned = plan_hand_candidate(request, "ddp", None, "not this time")
    >>> rows, planned
    ([{'name': 'ddp', 'not_planned': 'not this time'}], [])
    """
    record: list = []
    planned: list = []
    if name == AUTO_RECOMPUTE:
        _plan_quietly(request.replace(options=request.options.recomputing_as_needed()), AUTO_RECOMPUTE,
                      "the ILP's plan, repeated layers recomputed as the budget needs", record, planned,
                      hand_plan=False)
    elif plan is None:
        record.append({"name": name, "not_planned": why})
    else:
        hand = request.replace(hints=plan.hints, options=request.options.replace(zero=plan.zero))
        prog = _plan_quietly(hand, name, plan.description, record, planned)
        if prog is not None and _recompute_variant_applies(hand, prog):
            _plan_quietly(hand.replace(options=hand.options.recomputing_as_needed()), f"{name} + recomputation",
                          f"{plan.description}, repeated layers recomputed as the budget needs", record, planned)
    return record, planned


@contextlib.contextmanager
def hand_plans_deferred():
    """Within the block `plan_with_hand_plans` plans the ILP's plan only and marks it where the hand plans could have
    won: `plan.search["hand_plans_deferred"]` holds its row of the record and whether its recomputation variant is a
    candidate (`_recompute_variant_applies`). The mesh search plans every candidate shape this way and compares the
    hand plans on the shape it keeps and those within reach (planning them on each shape cost a third of its time,
    and the ILP's plan won on every shape of the benchmarks), each hand plan a task of its own
    (autoshard/search/hand_parts.py).

    >>> request = CompileRequest(model, autoshard.Mesh((2, 2), ("dp", "tp")), inputs, loss_fn=loss_fn,
    ...                          options=CompileOptions(memory_budget=1.2e6))
    >>> with hand_plans_deferred():
    ...     deferred = plan_with_hand_plans(request)
    >>> marker = deferred.plan.search["hand_plans_deferred"]
    >>> "hand_plans" in deferred.plan.search, marker["automatic"]["name"], marker["recompute_variant"]
    (False, 'automatic', False)
    """
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def _plan_quietly(request: CompileRequest, name: str, description: str, record: list, planned: list,
                  hand_plan: bool = True):
    """Plan one candidate, recording its row (or its error); its warnings are kept, not shown."""
    try:
        with caught_warnings() as caught:  # all its own warnings
            prog = Program(*compile_state(request, hand_plan=hand_plan))
    except AutoshardError as exc:
        record.append({"name": name, "description": description, "error": str(exc).splitlines()[0]})
        return None
    record.append(_row(name, description, prog))
    planned.append((prog, caught, name))
    return prog


def _recompute_variant_applies(request: CompileRequest, prog: Program) -> bool:
    """Recomputation weighed, not only climbed to: whether a candidate that fits near the budget without recomputing
    (its placements bent to fit: activations resharded, weights moved) is planned again with repeated layers
    recomputed as far as the budget needs (the faster of the two counts)."""
    if request.options.checkpoint is not None or prog.state.recompute_regions:
        return False
    return prog.state.predicted.memory_bytes_per_rank >= NEAR_BUDGET * _budget(request)


def _row(name: str, description: str, prog: Program) -> dict:
    predicted = prog.state.predicted  # not prog.plan: building a losing candidate's Plan costs seconds at scale
    overlapped = predicted.overlapped_step_s
    return {"name": name, "description": description, "predicted_step_s": predicted.step_time_s,
            "overlapped_step_s": predicted.step_time_s if overlapped is None else overlapped,
            "memory_bytes_per_rank": predicted.memory_bytes_per_rank,
            "savers": repr(prog.zero) if prog.zero is not None else ""}


def why_plan(record: list, chosen: str) -> str:
    """Why the plan `chosen` among the candidates of `record` (the rows of `plan.search["hand_plans"]`).

    >>> why_plan([{"name": "automatic", "predicted_step_s": 1.0}, {"name": "ddp", "not_planned": "too big"}],
    ...          "automatic")
    "plan 'automatic' (fastest predicted step among the automatic and the hand plans): automatic 1 s; ddp: too big"
    """
    parts = []
    for row in record:
        if "predicted_step_s" in row:
            parts.append(f"{row['name']} {row['predicted_step_s']:.4g} s")
        else:
            parts.append(f"{row['name']}: {row.get('not_planned') or row.get('error')}")
    return f"plan {chosen!r} (fastest predicted step among the automatic and the hand plans): " + "; ".join(parts)


def _hand_plans_may_win(request: CompileRequest, auto: Program) -> bool:
    """Whether some hand plan could predict a faster step than `auto` (see the module docstring)."""
    if request.hints or request.plan is not None or request.options.zero is not None:
        return False  # the user decided the layout (or ZeRO) themselves
    mesh = request.mesh
    if sum(n > 1 for n in mesh.shape) < 2 or not hasattr(request.model, "named_parameters"):
        return False
    state = auto.state
    joint = any(len(stats["axes"]) == mesh.ndim for stats in state.ilp_stats)
    budget = _budget(request)
    binding = state.zero is not None or bool(state.recompute_regions) or \
        auto.state.predicted.memory_bytes_per_rank > BINDING_SHARE * budget
    return not joint or binding


def _budget(request: CompileRequest) -> float:
    return CompileOptions.of(request.options).budget_bytes


def applicable_hand_plans(request: CompileRequest) -> list:
    """(name, HandPlan or None, why not) for each flat catalogue plan on the request's mesh: tensor parallel on
    the axis named "tp" (else the innermost), the batch on the others; planned only where its parameters'
    share of the budget can fit (with ZeRO-3, which the memory ladder adds when a plan does not fit).

    >>> from autoshard.frontend.request import CompileRequest
    >>> request = CompileRequest(model, autoshard.Mesh((2, 2), ("dp", "tp")), inputs, loss_fn=loss_fn)
    >>> [(name, plan is not None) for name, plan, _ in applicable_hand_plans(request)]
    [('ddp', True), ('fsdp', True), ('dp_tp', True), ('fsdp_tp', True), ('tp_sp', True)]
    """
    mesh = request.mesh
    traced, fold = trace_for_plan(request, None, request.options)
    roles = model_roles(traced.gm)
    inputs = [n for n in traced.gm.graph.nodes if n.op == "placeholder" and n.meta.get(meta.KIND) == "input"]
    batch = inputs[0].meta["val"].shape[0] if inputs and inputs[0].meta["val"].dim() else 1
    tp = "tp" if "tp" in mesh.names else next(a for a, n in reversed(list(zip(mesh.names, mesh.shape))) if n > 1)
    builders = {"ddp": lambda: catalogue.ddp(roles, mesh, batch, len(inputs)),
                "fsdp": lambda: catalogue.fsdp(roles, mesh, batch, len(inputs)),
                "dp_tp": lambda: catalogue.dp_tp(roles, mesh, batch, len(inputs), tp=tp),
                "fsdp_tp": lambda: catalogue.fsdp_tp(roles, mesh, batch, len(inputs), tp=tp),
                "tp_sp": lambda: catalogue.tp_sp(roles, mesh, batch, len(inputs), tp=tp)}
    if roles.experts:
        builders["ep_dp"] = lambda: catalogue.ep_dp(roles, mesh, batch, len(inputs))
    state_bytes = _trained_state_bytes(traced, fold, request.options.optimizer_state_factor)
    out = []
    for name, build in builders.items():
        try:
            plan = build()
        except catalogue.NotApplicable as exc:
            out.append((name, None, str(exc)))
            continue
        need = state_bytes / _parameter_split(plan, mesh)
        if need > _budget(request):
            out.append((name, None, (f"its parameters, gradients and optimizer state alone take {need / 2**30:.1f} "
                                    f"GiB per device, over the budget of {_budget(request) / 2**30:.1f} GiB")))
            continue
        out.append((name, plan, ""))
    return out


def _trained_state_bytes(traced, fold, factor: float) -> float:
    """Bytes of the parameters and buffers with their gradients and optimizer state, unsharded (a folded trace's
    middle layer counted for every layer it stands for)."""
    grad = needs_grad(traced.gm.graph)
    copies = fold.copies if fold is not None else lambda node: 1
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() * held_bytes_factor(n, grad, factor) * copies(n)
               for n in traced.gm.graph.nodes
               if n.op == "placeholder" and n.meta.get(meta.KIND) in ("param", "buffer"))


def _parameter_split(plan, mesh) -> int:
    """The most ways the hand plan can split its parameters: its tensor-parallel axes, and ZeRO-3 on its ZeRO axis
    or, where it has none, on a batch axis (the memory ladder adds it when the plan does not fit)."""
    sharded = {a for glob, value in plan.hints.items() if not glob.startswith("input:") and ":" not in glob
               for a, p in value.items() if p.startswith("S(")}
    batch = {a for glob, value in plan.hints.items() if glob.startswith("input:") for a, p in value.items()
             if p == "S(0)"} - sharded
    zero = set(plan.zero or ()) or ({max(batch, key=lambda a: mesh.shape[mesh.axis(a)])} if batch else set())
    return math.prod(mesh.shape[mesh.axis(a)] for a in sharded | zero)
