"""Whether to pipeline, over which axis, with how many micro-batches: decided by predicted step time.

A named axis "pp" (or `pipeline={"axis": ...}`) fixes the axis; the micro-batch count, when not given,
is the multiple of p dividing the batch with the least predicted step time: planned at p or 2p (and at Megatron's
count, one sample per data-parallel device, when that first plan does not split its micro-batch over them all),
every other count estimated from those plans (see `estimate_step`), and re-planned once if another count wins. On an unnamed mesh without
hints every axis of size >= 2 is a candidate pp axis besides not pipelining at all (one per class of equal size and
links); each is planned (intra-op plan on the other axes + cut) and, where that plan splits parameters on an
inner axis that does not carry the batch, planned again with the batch and ZeRO-2 there (`_zero_data_request`); the
fastest predicted step wins. The predicted
step of a pipeline is the 1F1B-family formula: sum of stage times + (m - 1) x the slowest stage + the
slowest stage's gradient sync; `plan.pipeline["search"]` keeps every candidate's figures (the why).

On an unnamed mesh the planner compares pipelining over each axis with not pipelining:

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=3)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn)
>>> [c["axis"] for c in prog.plan.search["candidates"]], prog.plan.search["chosen_pipeline_axis"] in (None, "a0")
([None, 'a0'], True)
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
import os

import torch

from autoshard.frontend.request import CompileRequest
from autoshard.ir.errors import AutoshardError, UserInputError
from autoshard.ir.placement import Shard
from autoshard.plan.io import PlanMismatchError
from autoshard.plan.plan import Plan
from autoshard.program.pipeline import (
    batch_size,
    check_options,
    inner_mesh,
    parallelize_pipeline,
    recut_pipeline,
)
from autoshard.search.hand_plan_search import plan_with_hand_plans
from autoshard.solver.errors import MemoryBudgetError

log = logging.getLogger(__name__)


# A step some other plan of the same request is known to reach (the mesh search's first shapes): a pipeline
# candidate whose bound cannot beat it is not planned further (`step_to_beat`).
_STEP_TO_BEAT: contextvars.ContextVar = contextvars.ContextVar("autoshard_step_to_beat", default=math.inf)


@contextlib.contextmanager
def step_to_beat(seconds: float):
    """Within the block the pipeline search prunes as if a plan with a `seconds` step had been found already (the
    mesh search passes the best step of the shapes it planned first): a re-plan at another micro-batch count or
    another schedule that cannot beat it is not planned. Each shape still records its own best plan.

    >>> with step_to_beat(0.5):
    ...     _STEP_TO_BEAT.get()
    0.5
    """
    token = _STEP_TO_BEAT.set(seconds)
    try:
        yield
    finally:
        _STEP_TO_BEAT.reset(token)


def predicted_step(stages: list[dict], m: int, virtual: int = 1) -> float:
    """Step time of a pipeline whose stages take `stages[s]["seconds"]` per micro-batch.

    >>> predicted_step([{"seconds": 1.0, "sync_s": 0.5}, {"seconds": 2.0, "sync_s": 0.0}], m=4)  # 3 + 3 x 2 + 0.5
    9.5
    """
    per_rank = max(s["seconds"] for s in stages) * virtual
    sync = max(s["sync_s"] for s in stages)
    return sum(s["seconds"] for s in stages) + (m - 1) * per_rank + sync


def choose_pipeline(request: CompileRequest, pipeline, unnamed: bool):
    """The pipelined Program when the user asked for one or the search prefers one; else None.
    `parallelize` calls it first.

    >>> from autoshard.frontend.request import CompileRequest
    >>> choose_pipeline(CompileRequest(model, autoshard.Mesh((2,), ("dp",)), inputs, loss_fn=loss_fn), None, False)
    >>> choose_pipeline(CompileRequest(model, autoshard.Mesh((2,), ("pp",)), inputs, loss_fn=loss_fn), None, False)
    ... # doctest: +ELLIPSIS
    PipelineProgram(Mesh(pp=2), 2 stages over 'pp', 1F1B, ... micro-batches, fingerprint=...)
    ...
    """
    mesh, plan = request.mesh, request.plan
    if pipeline is False:
        if "pp" in mesh.names:
            raise UserInputError("pipeline=False but the mesh has an axis named 'pp'; rename the axis to shard "
                                 "on it instead")
        return None
    if plan is not None:  # a saved plan decides; a flat one is applied by the normal path
        saved = plan if isinstance(plan, Plan) else Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else None
        if saved is None or not saved.pipeline:  # resolve_plan reports a plan= of the wrong type
            return None
        return _from_saved(request.replace(plan=saved), pipeline)
    opts = check_options(pipeline)
    axis = opts.get("axis") or ("pp" if "pp" in mesh.names else None)
    if axis is None and pipeline is not None and not unnamed:
        raise UserInputError(f"pipeline options given but no pipeline axis: name a mesh axis 'pp' or pass "
                             f"pipeline={{'axis': ...}} (mesh axes: {list(mesh.names)})")
    if axis is None and not (unnamed and searches_axes(request, pipeline)):
        return None  # hints name axis roles (the user has decided them); a non-module fails in the front end
    if axis is not None:
        if axis not in mesh.names:
            raise UserInputError(f"pipeline axis {axis!r} is not a mesh axis; mesh axes: {list(mesh.names)}")
        return best_schedule(request, _best_microbatches(request, axis, opts), opts)
    return _search_axes(request, opts)


def searches_axes(request: CompileRequest, pipeline) -> bool:
    """Whether `choose_pipeline` weighs every axis of `request`'s mesh as the pipeline's (`_search_axes`): an unnamed
    mesh without hints (they name the axes' roles) or a saved plan, and no pipeline axis given.

    >>> from autoshard.frontend.request import CompileRequest
    >>> [searches_axes(CompileRequest(model, mesh, inputs, loss_fn=loss_fn), None)
    ...  for mesh in (autoshard.Mesh((2,)), autoshard.Mesh((2,), ("pp",)))]
    [True, False]
    """
    if pipeline is False or request.plan is not None or request.hints or request.mesh.named:
        return False
    if not isinstance(request.model, torch.nn.Module):
        return False
    return check_options(pipeline).get("axis") is None and "pp" not in request.mesh.names


# Besides 1F1B, the schedules the search weighs (with two stages per rank): zero bubble fills the bubble with
# weight gradients (Qi et al. 2023), interleaving shrinks it by the number of stages per rank (Narayanan et al.
# 2021; torchtitan measured interleaved 1F1B 28% faster than 1F1B on Llama 3 405B). Zero bubble first: it keeps
# 1F1B's activations in flight, so it is a recut of the same plan (cheap), and its step may rule out interleaving,
# which keeps more in flight and is planned afresh (on Llama 3 70B over (2, 32, 8): 14 s of a 51 s plan).
SEARCHED_SCHEDULES = (("ZBVZeroBubble", 2), ("Interleaved1F1B", 2))
# What a pipelined plan's record keeps of its searches (part of its fingerprint; a saved plan carries them).
SEARCH_RECORDS = ("microbatch_search", "not_replanned", "schedule_search")


def best_schedule(request: CompileRequest, prog, opts: dict, to_beat: float = float("inf")):
    """`prog`'s pipeline (one stage per rank, 1F1B) or, when its predicted step is shorter, the same axis and
    micro-batch count under each of SEARCHED_SCHEDULES: each is the same micro-batch program cut into twice the
    stages (`recut_pipeline`), and its step is the simulated timeline of the schedule's own action order. A schedule
    or virtual stages the user gave are kept; `plan.pipeline["schedule_search"]` lists what was compared. A schedule
    whose least step (`least_step`) cannot beat `to_beat` (the best step found so far) or the best schedule so far
    is not planned.

    >>> from autoshard.frontend.request import CompileRequest
    >>> deep, deep_inputs, deep_loss = mlp(n_layers=8)
    >>> request = CompileRequest(deep, autoshard.Mesh((2,), ("pp",)), deep_inputs, loss_fn=deep_loss)
    >>> piped = best_schedule(request, _best_microbatches(request, "pp", {}), {})
    >>> [row["schedule"] for row in piped.plan.pipeline["schedule_search"]]
    ['1F1B', 'ZBVZeroBubble', 'Interleaved1F1B']
    """
    if "schedule" in opts or "virtual_stages" in opts:
        return prog
    work = prog.predicted_step_s * (1 - prog.predicted_bubble)  # its step without the bubble
    if work >= to_beat:
        return prog
    config = prog.config
    rows = [{"schedule": config.schedule, "virtual_stages": config.virtual,
             "predicted_step_s": prog.predicted_step_s}]
    best = prog
    for schedule, virtual in SEARCHED_SCHEDULES:
        least = least_step(work, config.pp_size, config.microbatches, schedule, virtual)
        beat = min(to_beat, best.predicted_step_s)
        if least >= beat:
            rows.append({"schedule": schedule, "virtual_stages": virtual,
                         "not_planned": f"its least step {least:.4g} s cannot beat {beat:.4g} s"})
            continue
        try:  # the same micro-batch program, cut into `virtual` stages per rank
            other = recut_pipeline(request, prog, dict(opts, microbatches=config.microbatches, schedule=schedule,
                                                       virtual_stages=virtual), _replan_bound(beat, schedule, virtual))
        except AutoshardError as exc:  # e.g. fewer layers than stages
            rows.append({"schedule": schedule, "virtual_stages": virtual, "error": str(exc).splitlines()[0]})
            continue
        step = other.predicted_step_s
        rows.append({"schedule": schedule, "virtual_stages": virtual, "predicted_step_s": step})
        if step < best.predicted_step_s:
            best = other
    for key in SEARCH_RECORDS[:2]:  # the micro-batch count was searched under 1F1B
        if key in prog.search_records:
            best.record(key, prog.search_records[key])
    best.record("schedule_search", rows)
    return best


def _replan_bound(to_beat: float, schedule: str, virtual: int):
    """parallelize_pipeline's `worth_replanning` for a search whose best step so far is `to_beat`: a plan whose
    fullest pp rank overflows the budget is planned again against a tighter one (one to three more plans of the
    micro-batch program) only if its least step (`least_step` of its work) can beat `to_beat`: the tighter budget
    only constrains it more. None (always re-plan) while nothing is known to beat.

    >>> _replan_bound(float("inf"), "1F1B", 1) is None
    True
    """
    if math.isinf(to_beat):
        return None

    def reason(prog) -> str | None:
        config = prog.config
        least = least_step(prog.predicted_step_s * (1 - prog.predicted_bubble), config.pp_size, config.microbatches,
                           schedule, virtual)
        return None if least < to_beat else f"not planned again: its least step {least:.4g} s cannot beat {to_beat:.4g} s"
    return reason


def least_step(work: float, p: int, m: int, schedule: str, virtual: int) -> float:
    """The least step a schedule can take for a pipeline whose 1F1B plan does `work` seconds besides its bubble:
    interleaving leaves a bubble of (p - 1) / (virtual x m) of the work (Narayanan et al. 2021), zero bubble none. A
    bound as the search's other prunes are: a plan of this schedule keeps at least as many activations in flight,
    so its ILP is at least as constrained and its work per micro-batch no smaller.

    >>> least_step(64.0, p=32, m=64, schedule="Interleaved1F1B", virtual=2), least_step(64.0, 32, 64, "ZBVZeroBubble", 2)
    (79.5, 64.0)
    """
    if schedule == "Interleaved1F1B":
        return work * (1 + (p - 1) / (virtual * m))
    return work


def _from_saved(request: CompileRequest, pipeline):
    """A saved pipelined plan: its axis, schedule and micro-batches, its intra-op decisions applied (no
    solving); the cut is computed again from the same annotations (it is deterministic) and the plan's
    fingerprint, which covers every row's stage, must come out the same."""
    saved, mesh = request.plan, request.mesh
    record = saved.pipeline
    if record["axis"] not in mesh.names:
        raise PlanMismatchError(f"the plan pipelines over axis {record['axis']!r}, which mesh {mesh!r} does not have; "
                                "pass the mesh and axis_names the plan was made for")
    opts = dict(check_options(pipeline), axis=record["axis"], schedule=record["schedule"],
                microbatches=record["microbatches"], virtual_stages=record["virtual_stages"])
    prog = parallelize_pipeline(request, record["axis"], opts)
    prog.plan.search = dict(saved.search)  # the records of why this axis, micro-batch count and schedule (made
    for key in SEARCH_RECORDS:             # where the plan was made)
        if key in record:
            prog.record(key, record[key])
    if request.plan_other_shapes:  # other shapes: another fingerprint, but every node in its stage
        moved = [r.name for r, s in zip(prog.plan.rows, saved.rows) if r.kind != "comm" and r.stage != s.stage]
        if moved or len(prog.plan.rows) != len(saved.rows):
            raise PlanMismatchError(f"at these input shapes the pipeline cuts the model elsewhere ({moved[:3]} "
                                    "change stage): plan again")
    elif prog.plan.fingerprint != saved.fingerprint:
        raise PlanMismatchError(f"the pipelined plan cuts the model differently here (fingerprint "
                                f"{prog.plan.fingerprint} vs the plan's {saved.fingerprint}): give the same stage "
                                f"annotations and profile= as when it was made (the cut weighs each stage's "
                                f"predicted time; its cut: {record['cut']})")
    return prog


def _microbatch_candidates(p: int, batch: int) -> list[int]:
    """The counts the first plan is made at (the smallest bubble per planning second)."""
    return [m for m in (p, 2 * p, 4 * p) if m <= batch and batch % m == 0] or [1]


def _data_devices(inner: tuple) -> int:
    """The devices Megatron's rule gives data parallelism in an inner mesh: all but its innermost axis (tensor
    parallelism inside a node); none of a one-axis mesh."""
    return math.prod(inner[:-1]) if len(inner) > 1 else 1


def _batch_ways(prog) -> int:
    """Over how many devices of the inner mesh the first plan splits a micro-batch (its data parallelism)."""
    shape = prog.inner_mesh.shape
    specs = [spec for spec in prog.input_specs if spec]
    return max((math.prod(shape[a] for a, p in enumerate(spec) if p == Shard(0)) for spec in specs), default=1)


def _finer_counts(p: int, batch: int, ways: int) -> list[int]:
    """The micro-batch counts estimated from the first plan: every multiple of the pp size dividing the batch
    whose micro-batch still splits over the `ways` devices the first plan gives the batch (Megatron runs 8 to 24
    micro-batches per stage: the bubble (p - 1) / (m + p - 1) shrinks with m while each micro-batch's latencies
    stay).

    >>> _finer_counts(2, 48, 4)  # micro-batches of 24, 12, 8, 4 sequences over 4 data-parallel devices
    [2, 4, 6, 12]
    """
    return [m for m in range(p, batch + 1, p) if batch % m == 0 and (batch // m) % ways == 0]


def estimate_step(stages: list[dict], m0: int, m: int, virtual: int, link, action_s: float = 0.0) -> float:
    """The predicted step with `m` micro-batches from stage times measured at `m0`: the bandwidth and
    compute parts scale with the micro-batch size, the latencies (collectives, stage sends, the runtime's
    `action_s` per forward and backward) do not.

    >>> from autoshard.cost.profiles import Link
    >>> stages = [{"seconds": 1.0, "sync_s": 0.0}, {"seconds": 1.0, "sync_s": 0.0}]
    >>> estimate_step(stages, m0=2, m=4, virtual=1, link=Link(0.0, 1e9))  # half the time per micro-batch, 4 + 1
    2.5
    """
    scaled = []
    for row in stages:
        fixed = row.get("latency_s", 0.0) + 4 * link.alpha
        scaled.append(dict(row, seconds=max(row["seconds"] - fixed, 0.0) * m0 / m + fixed + 2 * action_s))
    return predicted_step(scaled, m, virtual)


def _best_microbatches(request: CompileRequest, axis: str, opts: dict, to_beat: float = float("inf")):
    """Plan at one or two micro-batch counts (`_first_counts`), estimate the others from each plan, re-plan once if
    another count is expected to be faster; the fastest planned count wins. The re-plan is skipped when even without
    its gradient sync (the only cost a plan for another count weighs differently: its share per micro-batch) the
    estimate cannot beat `to_beat`, the best step found so far."""
    if "microbatches" in opts:
        return parallelize_pipeline(request, axis, opts)
    inputs = request.example_inputs
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    mesh = request.mesh
    p, batch = mesh.shape[mesh.axis(axis)], batch_size(inputs)
    request = request.replace(example_inputs=inputs)
    planned, errors = {}, []
    replan = _replan_bound(to_beat, "1F1B", 1)
    inner = inner_mesh(mesh, axis).shape
    for m in _first_counts(p, batch, inner):
        if planned and all(_batch_ways(prog) >= _data_devices(inner) for prog in planned.values()):
            break  # the first plan splits its micro-batch over every data device: it estimates the finer count
        try:
            planned[m] = parallelize_pipeline(request, axis, dict(opts, microbatches=m), replan)
        except AutoshardError as exc:  # e.g. micro-batches too large to fit: the finer count may
            errors.append(exc)
    if not planned:
        raise errors[0]
    expected = {}  # count -> (expected step, the planned count it is estimated from)
    for m0, prog in planned.items():
        config, stages = prog.config, prog.state.pipeline_stages
        own = estimate_step(stages, m0, m0, config.virtual, config.link, config.action_s)
        for m in sorted({m0, *_finer_counts(p, batch, _batch_ways(prog))}):
            # the estimates rank the counts; scaled to the plan's own predicted step they say what m would take
            step = estimate_step(stages, m0, m, config.virtual, config.link, config.action_s) \
                * prog.predicted_step_s \
                / own if m != m0 else prog.predicted_step_s
            if m not in expected or step < expected[m][0]:
                expected[m] = (step, m0)
    best = min(expected, key=lambda m: (expected[m][0], m))
    base = planned[expected[best][1]]
    sync = max(row.get("sync_s", 0.0) for row in base.state.pipeline_stages)
    pruned = best not in planned and expected[best][0] - sync >= to_beat
    if best not in planned and not pruned:
        try:
            planned[best] = parallelize_pipeline(request, axis, dict(opts, microbatches=best), replan)
        except AutoshardError as exc:  # e.g. a micro-batch too small to shard on dp: keep the planned counts
            log.info("pipelining with %d micro-batches is not possible (%s)", best, exc)
    prog = min(planned.values(), key=lambda prog: (prog.predicted_step_s, prog.config.microbatches))
    prog.record("microbatch_search", {str(m): expected[m][0] for m in sorted(expected)})
    if pruned:
        prog.record("not_replanned", {"microbatches": best, "expected_step_s": expected[best][0]})
    return prog


def first_microbatch_counts(shape: tuple, batch: int) -> list[int]:
    """The micro-batch counts the pipeline search plans first on a mesh of `shape`, over every axis it may pipeline
    (`_first_counts` of each): the mesh search traces these micro-batches before it forks its workers, which would
    otherwise each trace them again.

    >>> first_microbatch_counts((8, 8), 16), first_microbatch_counts((2, 4, 8), 16)
    ([16], [4, 8, 16])
    """
    counts = set()
    for i, p in enumerate(shape):
        if p >= 2:
            counts.update(_first_counts(p, batch, shape[:i] + shape[i + 1:]))
    return sorted(counts)


def _first_counts(p: int, batch: int, inner: tuple) -> list[int]:
    """The micro-batch counts planned before the others are estimated: the largest of p, 2p that divides the
    batch (a small bubble for few micro-batches), and, when it is at least four times as many, Megatron's count:
    one sample per data-parallel device and micro-batch, the data-parallel devices taken as the inner mesh less
    its innermost axis (tensor parallelism inside a node). A plan at a large micro-batch may shard very
    differently (its activations crowd out the parameters): estimates from it alone would miss the fine counts.

    >>> _first_counts(2, 1536, (32, 8)), _first_counts(2, 8, (2,))
    ([4, 48], [4])
    """
    coarse = _microbatch_candidates(p, batch)
    first = max([m for m in coarse if m <= 2 * p] or coarse[:1])
    data = _data_devices(inner)
    fine = [m for m in _finer_counts(p, batch, data) if batch // m == data] if data > 1 else []
    return [first] + [m for m in fine if m >= 4 * first]


def _search_axes(request: CompileRequest, opts: dict):
    """No pipeline, or one axis of each (size, link) class as pp (equal classes plan alike)."""
    try:
        flat = plan_with_hand_plans(request)
        candidates = [{"axis": None, "predicted_step_s": flat.plan.predicted.step_time_s}]
        best_step = flat.plan.predicted.step_time_s
    except AutoshardError as exc:  # e.g. no intra-op plan fits the memory budget: a pipeline may
        flat, flat_error, best_step = None, exc, float("inf")
        candidates = [{"axis": None, "error": str(exc).splitlines()[0]}]
    best, errors = None, [] if flat is not None else [flat_error]
    for name, same_as in pipeline_axes(request):
        if same_as is not None:
            candidates.append({"axis": name, "same_as": same_as})
            continue
        part = search_axis(request, name, opts, best_step)
        candidates += part.rows
        errors += part.errors
        best, best_step = _faster(part.best, best, best_step)
    if best is None and flat is None:
        log.info(_why(candidates, None))
        raise smallest_footprint(errors)
    target = best if best is not None else flat
    target.plan.search = pipeline_record(flat.plan.search if flat is not None else None, target is flat, candidates,
                                         best.config.axis if best is not None else None)
    return target


def pipeline_axes(request: CompileRequest) -> list[tuple[str, str | None]]:
    """The axes an unnamed mesh may pipeline over, in the order the search plans them, each with the axis of its
    (size, link) class planned before it (None for the first of its class: those plan alike, so only the first is
    planned). The slowest links first, the longest axis first among them (Megatron's place for a pipeline): the
    likeliest winner planned early gives the others' re-plans a tight bound to prune against (`_replan_bound`, and
    the micro-batch counts' estimates), which skip only what they say cannot win: the order moves the time, not the
    plan (the same plans for Llama 3 8B / 70B / 405B and every pinned case). Llama-3-405B on (2, 32, 8): a1 (32
    stages) before a0 (2), whose ZeRO-data variant was planned four times against the flat plan's 108 s.

    >>> from autoshard.frontend.request import CompileRequest
    >>> pipeline_axes(CompileRequest(model, autoshard.Mesh((4, 4, 4)), inputs, loss_fn=loss_fn))  # a0, a1 across nodes
    [('a0', None), ('a1', 'a0'), ('a2', None)]
    """
    mesh, profile = request.mesh, request.options.profile
    order = sorted(range(mesh.ndim), key=lambda i: (profile.link(mesh.shape, i).bandwidth, -mesh.shape[i], i))
    axes, seen = [], {}
    for i in order:
        if mesh.shape[i] < 2:
            continue
        key = (mesh.shape[i], profile.link(mesh.shape, i))
        axes.append((mesh.names[i], seen.get(key)))
        seen.setdefault(key, mesh.names[i])
    return axes


@dataclasses.dataclass
class AxisSearch:
    """One axis's part of the pipeline search (`search_axis`): the fastest pipeline over it that beats the step it
    was given (None when none does), its rows of `plan.search["candidates"]` and the refusals among them.

    >>> AxisSearch(None, [{"axis": "a0", "error": "no plan fits"}], []).best is None
    True
    """
    best: object
    rows: list
    errors: list


def search_axis(request: CompileRequest, axis: str, opts: dict, best_step: float = math.inf) -> AxisSearch:
    """The pipeline over `axis` (micro-batch count and schedule searched), then the same pipeline with the batch and
    ZeRO-2 on an axis where that plan split parameters instead (`_zero_data_request`); each pruned by `best_step`
    (the step to beat: the flat plan's or another axis's) and by `step_to_beat`. The mesh search plans the axes of
    a shape as separate tasks this way (`best_step` unknown there: each is compared afterwards).

    >>> from autoshard.frontend.request import CompileRequest
    >>> part = search_axis(CompileRequest(model, autoshard.Mesh((2,)), inputs, loss_fn=loss_fn), "a0", {})
    >>> part.best.config.axis, [row["axis"] for row in part.rows]
    ('a0', ['a0'])
    """
    rows, errors, best = [], [], None
    planned = _plan_axis(request, axis, opts, min(best_step, _STEP_TO_BEAT.get()), rows, errors)
    best, best_step = _faster(planned, best, best_step)
    variant = _zero_data_request(request, planned) if planned is not None else None
    if variant is not None:
        best, best_step = _faster(_plan_axis(variant, axis, opts, min(best_step, _STEP_TO_BEAT.get()), rows, errors),
                                  best, best_step)
    return AxisSearch(best, rows, errors)


def pipeline_record(flat_search: dict | None, flat_kept: bool, candidates: list, chosen: str | None) -> dict:
    """The search record (`plan.search`) of the plan the pipeline search keeps: the flat plan's own record
    (`flat_search`: the hand plans it was compared with) when it is kept (`flat_kept`), else only its hand-plan rows,
    as the no-pipeline candidate's alternatives; then every candidate's row and why the `chosen` axis (None: none).

    >>> pipeline_record({"hand_plans_deferred": True, "other": 1}, False, [{"axis": "a0", "predicted_step_s": 1.0}],
    ...                 "a0")["why"]
    "pipelined over axis 'a0' (fastest predicted step): pipeline over a0: predicted step 1 s"
    """
    why = _why(candidates, chosen)
    log.info(why)
    kept = {} if flat_search is None else flat_search if flat_kept else \
        {k: v for k, v in flat_search.items() if k in ("hand_plans", "hand_plans_deferred")}
    return {**kept, "candidates": candidates, "chosen_pipeline_axis": chosen, "why": why}


def _faster(prog, best, best_step: float) -> tuple:
    """(the pipelined Program, its step) of `prog` and `best` (whose step is `best_step`) that is faster."""
    if prog is None or prog.predicted_step_s >= best_step:
        return best, best_step
    return prog, prog.predicted_step_s


def _plan_axis(request: CompileRequest, axis: str, opts: dict, to_beat: float, candidates: list, errors: list):
    """The pipeline over `axis` (micro-batch count and schedule searched), or None when none is possible; its row
    is appended to `candidates` (a refusal's to `errors` too)."""
    row = {"axis": axis} if request.options.zero is None else {"axis": axis, "zero": request.options.zero}
    try:
        prog = best_schedule(request, _best_microbatches(request, axis, opts, to_beat=to_beat), opts, to_beat=to_beat)
    except AutoshardError as exc:
        candidates.append({**row, "error": str(exc).splitlines()[0]})
        errors.append(exc)
        return None
    skipped = prog.search_records.get("not_replanned")
    if skipped:  # its best count was not planned: it cannot win
        candidates.append({**row, "microbatches": skipped["microbatches"],
                           "predicted_step_s": skipped["expected_step_s"], "estimated": True})
    else:
        candidates.append({**row, "microbatches": prog.config.microbatches,
                           "predicted_step_s": prog.predicted_step_s})
    return prog


def _zero_data_request(request: CompileRequest, prog):
    """`request` with the batch split on the inner axis where `prog`'s plan splits parameters but not the batch,
    and ZeRO-2 there (Megatron's and torchtitan's layout: data parallelism with sharded optimizer state and
    gradients, synchronised once a step, instead of parameters split on a slow axis and gathered or reduced every
    micro-batch); None when the plan has no such axis or the batch does not split over it.

    >>> from autoshard.frontend.request import CompileRequest
    >>> request = CompileRequest(model, autoshard.Mesh((2, 2), ("pp", "a")), inputs, loss_fn=loss_fn)
    >>> _zero_data_request(request, _best_microbatches(request, "pp", {})) is None  # it splits the batch on a
    True
    """
    inner = prog.inner_mesh
    batch_on = {a for spec in prog.input_specs for a, p in enumerate(spec) if p == Shard(0)}
    specs = prog.param_specs
    params_on = {a for spec in specs.values() for a, p in enumerate(spec) if isinstance(p, Shard)}
    inputs = request.example_inputs
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    micro = batch_size(inputs) // prog.config.microbatches
    axes = [a for a in sorted(params_on - batch_on) if inner.shape[a] >= 2 and micro % inner.shape[a] == 0]
    if not axes or request.hints or request.options.zero is not None:
        return None
    name = inner.names[axes[0]]  # the outermost: data parallelism syncs once a step, on the slowest links
    hints = {f"input:{i}": {name: "S(0)"} for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)}
    return request.replace(hints=hints, options=request.options.replace(zero={name: 2}))


def smallest_footprint(errors: list) -> AutoshardError:
    """The refusal when no candidate plans: the memory refusal with the smallest footprint over every
    candidate (flat and each pipeline), else the flat plan's error.

    >>> str(smallest_footprint([UserInputError("no batch")]))
    'no batch'
    """
    memory = [e for e in errors if isinstance(e, MemoryBudgetError)]
    if len(memory) < len(errors) or not memory:
        return errors[0]
    return min(memory, key=lambda e: e.minimum)


def _why(candidates, chosen) -> str:
    parts = []
    for c in candidates:
        label = "no pipeline" if c["axis"] is None else f"pipeline over {c['axis']}"
        if c.get("zero"):
            (axis, stage), = c["zero"].items()
            label += f" with the batch and ZeRO-{stage} on {axis}"
        if "error" in c:
            parts.append(f"{label}: not possible ({c['error']})")
        elif "same_as" in c:
            parts.append(f"{label}: same size and links as {c['same_as']}, same prediction")
        else:
            extra = f", {c['microbatches']} micro-batches" if c.get("microbatches") else ""
            how = "expected (scaled from its plan at another count; not planned: it cannot win)" \
                if c.get("estimated") else "predicted"
            parts.append(f"{label}{extra}: {how} step {c['predicted_step_s']:.3g} s")
    head = f"pipelined over axis {chosen!r}" if chosen else "no axis pipelined"
    return f"{head} (fastest predicted step): " + "; ".join(parts)
