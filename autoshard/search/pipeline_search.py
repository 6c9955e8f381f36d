"""Whether to pipeline, over which axis, with how many micro-batches: decided by predicted step time.

A named axis "pp" (or `pipeline={"axis": ...}`) fixes the axis; the micro-batch count, when not given,
is the candidate (p, 2p, 4p that divide the batch) with the least predicted step time, estimated from
one plan (see `estimate_step`) and re-planned once if another count wins. On an unnamed mesh without
hints every axis of size >= 2 is a candidate pp axis besides not pipelining at all (one per class of equal size and
links); each is planned (intra-op plan on the other axes + cut) and the fastest predicted step wins. The predicted
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

import logging
import os

import torch

from autoshard.frontend.request import CompileRequest
from autoshard.ir.errors import AutoshardError, UserInputError
from autoshard.plan.io import PlanMismatchError
from autoshard.plan.plan import Plan
from autoshard.program.pipeline import batch_size, check_options, parallelize_pipeline
from autoshard.search.hand_plan_search import plan_with_hand_plans
from autoshard.solver.errors import MemoryBudgetError

log = logging.getLogger(__name__)


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
    if axis is None and (not unnamed or request.hints or not isinstance(request.model, torch.nn.Module)):
        return None  # hints name axis roles (the user has decided them); a non-module fails in the front end
    if axis is not None:
        if axis not in mesh.names:
            raise UserInputError(f"pipeline axis {axis!r} is not a mesh axis; mesh axes: {list(mesh.names)}")
        return best_schedule(request, _best_microbatches(request, axis, opts), opts)
    return _search_axes(request, opts)


# Besides 1F1B, the schedules the search weighs (with two stages per rank): interleaving shrinks the bubble by the
# number of stages per rank (Narayanan et al. 2021; torchtitan measured interleaved 1F1B 28% faster than 1F1B on
# Llama 3 405B), zero bubble fills it with weight gradients (Qi et al. 2023).
SEARCHED_SCHEDULES = (("Interleaved1F1B", 2), ("ZBVZeroBubble", 2))
# What a pipelined plan's record keeps of its searches (part of its fingerprint; a saved plan carries them).
SEARCH_RECORDS = ("microbatch_search", "not_replanned", "schedule_search")


def best_schedule(request: CompileRequest, prog, opts: dict, to_beat: float = float("inf")):
    """`prog`'s pipeline (one stage per rank, 1F1B) or, when its predicted step is shorter, the same axis and
    micro-batch count under each of SEARCHED_SCHEDULES: each is planned (the model cut into twice the stages) and
    its step is the simulated timeline of the schedule's own action order. A schedule or virtual stages the user
    gave are kept; `plan.pipeline["schedule_search"]` lists what was compared. When even a schedule without any
    bubble could not beat `to_beat` (the best step found so far), none is planned.

    >>> from autoshard.frontend.request import CompileRequest
    >>> deep, deep_inputs, deep_loss = mlp(n_layers=8)
    >>> request = CompileRequest(deep, autoshard.Mesh((2,), ("pp",)), deep_inputs, loss_fn=deep_loss)
    >>> piped = best_schedule(request, _best_microbatches(request, "pp", {}), {})
    >>> [row["schedule"] for row in piped.plan.pipeline["schedule_search"]]
    ['1F1B', 'Interleaved1F1B', 'ZBVZeroBubble']
    """
    if "schedule" in opts or "virtual_stages" in opts:
        return prog
    pipeline = prog.plan.pipeline
    if pipeline["predicted_step_s"] * (1 - pipeline["predicted_bubble"]) >= to_beat:
        return prog
    config = prog.config
    rows = [{"schedule": config.schedule, "virtual_stages": config.virtual,
             "predicted_step_s": prog.plan.pipeline["predicted_step_s"]}]
    best = prog
    for schedule, virtual in SEARCHED_SCHEDULES:
        try:
            other = parallelize_pipeline(request, config.axis, dict(opts, microbatches=config.microbatches,
                                                                    schedule=schedule, virtual_stages=virtual))
        except AutoshardError as exc:  # e.g. fewer layers than stages
            rows.append({"schedule": schedule, "virtual_stages": virtual, "error": str(exc).splitlines()[0]})
            continue
        step = other.plan.pipeline["predicted_step_s"]
        rows.append({"schedule": schedule, "virtual_stages": virtual, "predicted_step_s": step})
        if step < best.plan.pipeline["predicted_step_s"]:
            best = other
    for key in SEARCH_RECORDS[:2]:  # the micro-batch count was searched under 1F1B
        if key in prog.plan.pipeline:
            best.plan.pipeline[key] = prog.plan.pipeline[key]
    best.plan.pipeline["schedule_search"] = rows
    return best


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
            prog.plan.pipeline[key] = record[key]
    if request.plan_other_shapes:  # other shapes: another fingerprint, but every node in its stage
        moved = [r.name for r, s in zip(prog.plan.rows, saved.rows) if r.kind != "comm" and r.stage != s.stage]
        if moved or len(prog.plan.rows) != len(saved.rows):
            raise PlanMismatchError(f"at these input shapes the pipeline cuts the model elsewhere ({moved[:3]} "
                                    "change stage): plan again")
    elif prog.plan.fingerprint != saved.fingerprint:
        raise PlanMismatchError(f"the pipelined plan cuts the model differently here (fingerprint "
                                f"{prog.plan.fingerprint} vs the plan's {saved.fingerprint}): give the same stage "
                                f"annotations as when it was made (its cut: {record['cut']})")
    return prog


def _microbatch_candidates(p: int, batch: int) -> list[int]:
    return [m for m in (p, 2 * p, 4 * p) if m <= batch and batch % m == 0] or [1]


def estimate_step(stages: list[dict], m0: int, m: int, virtual: int, link) -> float:
    """The predicted step with `m` micro-batches from stage times measured at `m0`: the bandwidth and
    compute parts scale with the micro-batch size, the latencies (collectives, stage sends) do not.

    >>> from autoshard.cost.profiles import Link
    >>> stages = [{"seconds": 1.0, "sync_s": 0.0}, {"seconds": 1.0, "sync_s": 0.0}]
    >>> estimate_step(stages, m0=2, m=4, virtual=1, link=Link(0.0, 1e9))  # half the time per micro-batch, 4 + 1
    2.5
    """
    scaled = []
    for row in stages:
        fixed = row.get("latency_s", 0.0) + 4 * link.alpha
        scaled.append(dict(row, seconds=max(row["seconds"] - fixed, 0.0) * m0 / m + fixed))
    return predicted_step(scaled, m, virtual)


def _best_microbatches(request: CompileRequest, axis: str, opts: dict, to_beat: float = float("inf")):
    """Plan at one micro-batch count, estimate the others, re-plan once if another count is better. The
    re-plan is skipped when even without its gradient sync (the only cost a plan for another count weighs
    differently: its share per micro-batch) the estimate cannot beat `to_beat`, the best step found so far."""
    if "microbatches" in opts:
        return parallelize_pipeline(request, axis, opts)
    inputs = request.example_inputs
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    mesh = request.mesh
    p = mesh.shape[mesh.axis(axis)]
    candidates = _microbatch_candidates(p, batch_size(inputs))
    m0 = max([m for m in candidates if m <= 2 * p] or candidates[:1])
    request = request.replace(example_inputs=inputs)
    prog = parallelize_pipeline(request, axis, dict(opts, microbatches=m0))
    config = prog.config
    estimates = {m: estimate_step(prog.state.pipeline_stages, m0, m, config.virtual, config.link) for m in candidates}
    best = min(candidates, key=lambda m: (estimates[m], m))
    sync = max(row.get("sync_s", 0.0) for row in prog.state.pipeline_stages)
    # The estimates rank the counts; scaled to the plan's own predicted step at m0 they say what best would take.
    expected = estimates[best] * prog.plan.pipeline["predicted_step_s"] / estimates[m0]
    pruned = best != m0 and expected - sync >= to_beat
    if best != m0 and not pruned:
        try:
            prog = parallelize_pipeline(request, axis, dict(opts, microbatches=best))
        except AutoshardError as exc:  # e.g. a micro-batch too small to shard on dp: keep m0
            log.info("pipelining with %d micro-batches is not possible (%s); keeping %d", best, exc, m0)
    prog.plan.pipeline["microbatch_search"] = {str(m): estimates[m] for m in candidates}
    if pruned:
        prog.plan.pipeline["not_replanned"] = {"microbatches": best, "expected_step_s": expected}
    return prog


def _search_axes(request: CompileRequest, opts: dict):
    """No pipeline, or one axis of each (size, link) class as pp (equal classes plan alike)."""
    mesh = request.mesh
    try:
        flat = plan_with_hand_plans(request)
        candidates = [{"axis": None, "predicted_step_s": flat.plan.predicted.step_time_s}]
        best_step = flat.plan.predicted.step_time_s
    except AutoshardError as exc:  # e.g. no intra-op plan fits the memory budget: a pipeline may
        flat, flat_error, best_step = None, exc, float("inf")
        candidates = [{"axis": None, "error": str(exc).splitlines()[0]}]
    best, seen, errors = None, {}, [] if flat is not None else [flat_error]
    profile = request.options.profile
    for i, name in enumerate(mesh.names):
        key = (mesh.shape[i], profile.link(mesh.shape, i))
        if mesh.shape[i] < 2:
            continue
        if key in seen:
            candidates.append({"axis": name, "same_as": seen[key]})
            continue
        seen[key] = name
        try:
            prog = best_schedule(request, _best_microbatches(request, name, opts, to_beat=best_step), opts,
                                 to_beat=best_step)
        except AutoshardError as exc:
            candidates.append({"axis": name, "error": str(exc).splitlines()[0]})
            errors.append(exc)
            continue
        step = prog.plan.pipeline["predicted_step_s"]
        skipped = prog.plan.pipeline.get("not_replanned")
        if skipped:  # its best count was not planned: it cannot win
            candidates.append({"axis": name, "microbatches": skipped["microbatches"],
                               "predicted_step_s": skipped["expected_step_s"], "estimated": True})
        else:
            candidates.append({"axis": name, "microbatches": prog.config.microbatches, "predicted_step_s": step})
        if step < best_step:
            best, best_step = prog, step
    chosen = best.config.axis if best is not None else None
    why = _why(candidates, chosen)
    log.info(why)
    if best is None and flat is None:
        raise _smallest_footprint(errors)
    target = best if best is not None else flat
    # The flat plan's record (the hand plans it was compared with) is kept beside the pipeline candidates; for a
    # pipelined plan only the rows, as the no-pipeline candidate's alternatives.
    kept = {} if flat is None else flat.plan.search if target is flat else \
        {k: v for k, v in flat.plan.search.items() if k == "hand_plans"}
    target.plan.search = {**kept, "candidates": candidates, "chosen_pipeline_axis": chosen, "why": why}
    return target


def _smallest_footprint(errors: list) -> AutoshardError:
    """The refusal when no candidate plans: the memory refusal with the smallest footprint over every
    candidate (flat and each pipeline), else the flat plan's error."""
    memory = [e for e in errors if isinstance(e, MemoryBudgetError)]
    if len(memory) < len(errors) or not memory:
        return errors[0]
    return min(memory, key=lambda e: e.minimum)


def _why(candidates, chosen) -> str:
    parts = []
    for c in candidates:
        label = "no pipeline" if c["axis"] is None else f"pipeline over {c['axis']}"
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
