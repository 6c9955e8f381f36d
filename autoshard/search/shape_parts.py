"""A shape the mesh search plans after its first ones, as separate tasks: its flat plan, and the pipeline over each
axis its search weighs (`search_axis`). Each task is pruned by the step the first shapes reached (`step_to_beat`), a
bound fixed before any of them starts, so they may run in any order, in this process or in workers, and give the
same plan; `assembled` puts their rows together as the shape's one search would have (pipeline_search's
`_search_axes`), and keeps the fastest. Planned one task per shape, the MoE over 256 devices left a worker idle for 9
of its 70 s while the other planned the last shape (its four later shapes took 18 to 29 s each).

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> from autoshard.frontend.request import CompileRequest
>>> model, inputs, loss_fn = mlp(n_layers=3)
>>> request = CompileRequest(model, autoshard.Mesh((4,)), inputs, loss_fn=loss_fn)
>>> tasks = shape_tasks(request, None, (2, 2))
>>> tasks
[((2, 2), None), ((2, 2), 'a0')]
>>> parts = [plan_part(request, None, float("inf"), task) for task in tasks]
>>> result = assembled(request, parts, float("inf"))
>>> [row["axis"] for row in result.plan["search"]["candidates"]]
[None, 'a0', 'a1']
"""
from __future__ import annotations

import dataclasses
import math
import time

from autoshard.frontend.request import CompileRequest
from autoshard.ir.errors import AutoshardError
from autoshard.ir.mesh import Mesh
from autoshard.program.pipeline import check_options
from autoshard.search.hand_plan_search import hand_plans_deferred, plan_with_hand_plans
from autoshard.search.pipeline_search import (
    pipeline_axes,
    pipeline_record,
    search_axis,
    searches_axes,
    smallest_footprint,
    step_to_beat,
)
from autoshard.search.planning_workers import picklable
from autoshard.search.shape_result import ShapeResult, deferred_flat_step, figures_of


@dataclasses.dataclass
class PartResult:
    """One task of a shape's search (`plan_part`), as a worker returns it: the shape, the axis it pipelines over
    (None: the flat plan), its rows of `plan.search["candidates"]` and refusals, and of its fastest plan (none when
    `step` is inf) the plan file's content, the row figures, the search record (the flat plan's only: the shape's
    record keeps its hand-plan rows) and the ILP solves that made it.

    >>> PartResult((2, 2), "a0", [{"axis": "a0", "error": "no plan fits"}], []).step
    inf
    """
    shape: tuple
    axis: str | None
    rows: list
    errors: list
    step: float = math.inf
    plan: dict | None = None
    figures: dict | None = None
    search: dict | None = None
    ilp_stats: list = dataclasses.field(default_factory=list)
    ilp_stopped: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def shape_tasks(request: CompileRequest, pipeline, shape: tuple) -> list[tuple] | None:
    """The tasks of `shape`'s search: (shape, None) for its flat plan, then (shape, axis) for each axis it plans a
    pipeline over (one per class of equal size and links: `pipeline_axes`); None when the search on that shape does
    not weigh the axes one by one (`searches_axes`: then it is one task).

    >>> shape_tasks(request.replace(hints={"input:0": {"a0": "S(0)"}}), None, (2, 2)) is None
    True
    """
    on_shape = request.replace(mesh=Mesh(shape))
    if not searches_axes(on_shape, pipeline):
        return None
    return [(shape, None)] + [(shape, axis) for axis, same_as in pipeline_axes(on_shape) if same_as is None]


# A shape's first tasks: its flat plan and the pipeline over the axis its search plans first (`pipeline_axes`: the
# likeliest winner). Its other axes are planned once those are done, each pruned by the better of their steps as
# well (`step_found`), as the shape's one search prunes each axis by the best found before it: pruned by the first
# shapes' step alone, Llama 3 405B's (4, 16, 8) took 38.5 s of planning where its one search took 25.2.
FIRST_TASKS = 2


def step_found(first: list[PartResult]) -> float:
    """The step a shape's other axes must beat: the best of its first tasks' (`FIRST_TASKS`).

    >>> step_found([PartResult((2, 2), None, [], [], step=2.0), PartResult((2, 2), "a0", [], [], step=1.5)])
    1.5
    """
    return min(part.step for part in first)


def plan_part(request: CompileRequest, pipeline, to_beat: float, task: tuple,
              best_step: float = math.inf) -> PartResult:
    """One task of `shape_tasks` planned: the shape's flat plan (its hand plans deferred, as the mesh search defers
    them on every shape) or the pipeline over one axis, pruned by `to_beat` (another shape's step) and `best_step`
    (the shape's own, `step_found`: a pipeline that does not beat it is planned no further, and not kept).

    >>> plan_part(request, None, float("inf"), ((2, 2), "a0")).rows[0]["axis"]
    'a0'
    """
    shape, axis = task
    started = time.perf_counter()
    on_shape = request.replace(mesh=Mesh(shape))
    with hand_plans_deferred(), step_to_beat(to_beat):
        if axis is None:
            try:
                prog = plan_with_hand_plans(on_shape)
            except AutoshardError as exc:  # e.g. no flat plan fits the budget: a pipeline may
                return PartResult(shape, None, [{"axis": None, "error": str(exc).splitlines()[0]}],
                                  [picklable(exc)], seconds=time.perf_counter() - started)
            row = {"axis": None, "predicted_step_s": prog.plan.predicted.step_time_s}
            return _part(shape, None, [row], [], prog, started)
        found = search_axis(on_shape, axis, check_options(pipeline), best_step)
    return _part(shape, axis, found.rows, [picklable(e) for e in found.errors], found.best, started)


def _part(shape: tuple, axis, rows: list, errors: list, prog, started: float) -> PartResult:
    if prog is None:  # nothing planned beats the bound (or fits)
        return PartResult(shape, axis, rows, errors, seconds=time.perf_counter() - started)
    return PartResult(shape, axis, rows, errors, prog.plan.step_s, prog.plan.to_json(), figures_of(prog),
                      dict(prog.plan.search) if axis is None else None, list(prog.state.ilp_stats),
                      list(prog.state.ilp_stopped), time.perf_counter() - started)


def assembled(request: CompileRequest, parts: list[PartResult], to_beat: float) -> ShapeResult:
    """The shape's result from its tasks' (`parts`, in `shape_tasks`' order): the fastest plan (a pipeline only when
    faster than the flat plan, the first on a tie, as `_search_axes` keeps it), every candidate's row in the
    search's order (an axis of a class planned before it says so), and the refusal with the smallest footprint
    when nothing plans. `to_beat` is the bound the tasks were pruned by (the row says when it stopped the search).

    >>> result.row["mesh"], result.step == min(part.step for part in parts)
    ([2, 2], True)
    """
    flat, by_axis = parts[0], {part.axis: part for part in parts[1:]}
    shape = flat.shape
    candidates, errors = list(flat.rows), list(flat.errors)
    best = None
    for axis, same_as in pipeline_axes(request.replace(mesh=Mesh(shape))):
        if same_as is not None:
            candidates.append({"axis": axis, "same_as": same_as})
            continue
        part = by_axis[axis]
        candidates += part.rows
        errors += part.errors
        if part.step < (best.step if best is not None else flat.step):
            best = part
    seconds = round(sum(part.seconds for part in parts), 3)
    if best is None and flat.plan is None:
        error = smallest_footprint(errors)
        return ShapeResult(shape, {"mesh": list(shape), "error": str(error).splitlines()[0], "seconds": seconds},
                           error=picklable(error))
    target = best if best is not None else flat
    plan = dict(target.plan, search=pipeline_record(flat.search, target is flat, candidates,
                                                    best.axis if best is not None else None))
    flat_step = deferred_flat_step(flat.search) if flat.search is not None else None
    row = {"mesh": list(shape), **target.figures, "seconds": seconds}
    if to_beat < target.step:  # its search was pruned: what it found, not all it could
        row["bounded_by_s"] = to_beat
    return ShapeResult(shape, row, target.step, plan, None, flat_step, target.ilp_stats, target.ilp_stopped)

