"""Whether to pipeline, and over which axis: decided by predicted step time.

A named axis "pp" (or `pipeline={"axis": ...}`) fixes the axis; its micro-batch count and schedule, when not given,
are searched (autoshard/search/microbatch_search.py). On an unnamed mesh without hints every axis of size >= 2 is a
candidate pp axis besides not pipelining at all (one per class of equal size and links); each is planned (intra-op
plan on the other axes + cut) and, where that plan splits parameters on an inner axis that does not carry the
batch, planned again with the batch and ZeRO-2 there (`_zero_data_request`); the fastest predicted step wins;
`plan.search["candidates"]` keeps every candidate's figures (the why).

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
    parallelize_pipeline,
)
from autoshard.search.hand_plan_search import plan_with_hand_plans
from autoshard.search.microbatch_search import (
    SEARCH_RECORDS,
    best_pipeline,
)
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
        return best_pipeline(request, axis, opts)
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


def _from_saved(request: CompileRequest, pipeline):
    """A saved pipelined plan: its axis, schedule, micro-batches, intra-op decisions and cut applied (no solving, no
    cut made again: under another profile its costs are priced anew, its decisions kept); stage annotations the
    user gives must cut where it does."""
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
    # Every op in the stage the plan gives it (its predicted costs may differ: another profile prices it anew).
    moved = [r.name for r, s in zip(prog.plan.rows, saved.rows) if r.kind != "comm" and r.stage != s.stage]
    if moved or len(prog.plan.rows) != len(saved.rows):
        if request.plan_other_shapes:
            raise PlanMismatchError(f"at these input shapes the pipeline cuts the model elsewhere ({moved[:3]} "
                                    "change stage): plan again")
        raise PlanMismatchError(f"the pipelined plan cuts the model differently here ({moved[:3]} change stage): give "
                                f"the same stage annotations as when it was made, or none (its cut: {record['cut']})")
    return prog


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
    likeliest winner planned early gives the others' re-plans a tight bound to prune against (`replan_bound`, and
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
        prog = best_pipeline(request, axis, opts, to_beat=to_beat)
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
    micro-batch); None when the plan has no such axis or the batch of one of p micro-batches does not split over it.

    >>> from autoshard.frontend.request import CompileRequest
    >>> request = CompileRequest(model, autoshard.Mesh((2, 2), ("pp", "a")), inputs, loss_fn=loss_fn)
    >>> from autoshard.search.microbatch_search import best_microbatches
    >>> _zero_data_request(request, best_microbatches(request, "pp", {})) is None  # it splits the batch on a
    True
    """
    inner = prog.inner_mesh
    batch_on = {a for spec in prog.input_specs for a, p in enumerate(spec) if p == Shard(0)}
    specs = prog.param_specs
    params_on = {a for spec in specs.values() for a, p in enumerate(spec) if isinstance(p, Shard)}
    inputs = request.example_inputs
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    # the largest micro-batch a pipeline over this axis runs (p of them): the request searches its own counts (Llama 3
    # 70B over (2, 16, 8): a 2-sample micro-batch of the 256 first kept does not split over 8, 32 micro-batches do,
    # and with ZeRO-2 there take 18.3 s against 19.6)
    micro = batch_size(inputs) // prog.config.pp_size
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
