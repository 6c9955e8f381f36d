"""The hand plans the mesh search compares on a shape, as tasks of their own: one per candidate of
`hand_candidates` (each catalogue plan with its recomputation variant, the automatic plan with recomputation), so
that the workers share them. The shape's automatic flat plan is not planned again: its row of the record and whether
its recomputation variant is a candidate came with the shape's plan (`plan.search["hand_plans_deferred"]`). Compared
as one task per shape, Llama 3 70B over 512 devices ended on two such tasks of 8-10 s each, each planning its
shape's flat plan again first.

A task's Program is made a plan file only when its step beats the step the search has reached (`to_beat`): only
then can it be the plan returned (building a Plan of Llama 3 70B takes a second).

>>> import autoshard
>>> from autoshard.zoo import llama
>>> from autoshard.frontend.request import CompileOptions, CompileRequest
>>> from autoshard.search.hand_plan_search import hand_plans_deferred, plan_with_hand_plans
>>> from autoshard.search.shape_result import shape_result
>>> model, inputs, loss_fn = llama(n_layers=2)
>>> request = CompileRequest(model, autoshard.Mesh((4,)), inputs, loss_fn=loss_fn,
...                          options=CompileOptions(memory_budget=1.2e6))
>>> with hand_plans_deferred():
...     result = shape_result((2, 2), plan_with_hand_plans(request.replace(mesh=autoshard.Mesh((2, 2)))), 0.0, False)
>>> tasks = hand_tasks(request, result, result.step)
>>> [task[1] for task in tasks]
['ddp', 'fsdp', 'dp_tp', 'fsdp_tp', 'tp_sp']
>>> comparison = compared_hand_plans(result, [plan_hand_part(request, False, task) for task in tasks])
>>> [row["name"] for row in comparison.record][:2], comparison.chosen
(['automatic', 'ddp'], 'automatic')
"""
from __future__ import annotations

import dataclasses
import math
import time

from autoshard.frontend.request import CompileRequest
from autoshard.ir.mesh import Mesh
from autoshard.search.hand_plan_search import (
    hand_candidates,
    plan_hand_candidate,
    why_plan,
)
from autoshard.search.shape_result import ShapeResult, figures_of


@dataclasses.dataclass
class HandPart:
    """One candidate of a shape's hand-plan comparison planned (`plan_hand_part`), as a worker returns it: its rows of
    the record and, of its fastest plan (itself or its recomputation variant, the first on a tie), the name and
    step, the plan file's content and row figures (only when the step beat the task's `to_beat`), the ILP solves
    that made it, its warnings as (message, category), and the Program when planned in this process.

    >>> HandPart((2, 2), "ddp", [{"name": "ddp", "error": "no plan fits"}]).step
    inf
    """
    shape: tuple
    name: str
    rows: list
    chosen: str | None = None
    step: float = math.inf
    plan: dict | None = None
    figures: dict | None = None
    ilp_stats: list = dataclasses.field(default_factory=list)
    ilp_stopped: list = dataclasses.field(default_factory=list)
    caught: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    program: object = None


@dataclasses.dataclass
class HandComparison:
    """A shape's hand-plan comparison put together (`compared_hand_plans`): the record (`plan.search["hand_plans"]`),
    the candidate chosen (the fastest flat plan, "automatic" first on a tie) and why, the chosen hand plan as a
    ShapeResult when it is not the automatic plan and beat the search's step, its warnings, and the seconds of every
    task.

    >>> HandComparison([], "automatic", "", None, [], 0.0).hand is None
    True
    """
    record: list
    chosen: str
    why: str
    hand: ShapeResult | None
    caught: list
    seconds: float


def hand_tasks(request: CompileRequest, result: ShapeResult, to_beat: float) -> list[tuple]:
    """The tasks comparing the hand plans on `result`'s shape, as (shape, name, HandPlan or None, why not planned,
    to_beat): one per candidate of `hand_candidates` (one that is not planned only gives its row); `result` was
    planned with its hand plans deferred, and `to_beat` is the step a hand plan must beat to be returned (the best
    the search has reached: a plan file is made only below it).

    >>> hand_tasks(request, result, 0.0)[0][1:]  # doctest: +ELLIPSIS
    ('ddp', HandPlan(...), '', 0.0)
    """
    on_shape = request.replace(mesh=Mesh(result.shape))
    deferred = result.plan["search"]["hand_plans_deferred"]
    return [(result.shape, name, plan, why, to_beat)
            for name, plan, why in hand_candidates(on_shape, deferred["recompute_variant"])]


def plan_hand_part(request: CompileRequest, keep_program: bool, task: tuple) -> HandPart:
    """One task of `hand_tasks` planned (a worker's task: the Program stays behind unless `keep_program`).

    >>> part = plan_hand_part(request, False, tasks[3])
    >>> part.name, [row["name"] for row in part.rows], part.chosen
    ('fsdp_tp', ['fsdp_tp'], 'fsdp_tp')
    """
    shape, name, plan, why, to_beat = task
    started = time.perf_counter()
    rows, planned = plan_hand_candidate(request.replace(mesh=Mesh(shape)), name, plan, why)
    if not planned:
        return HandPart(shape, name, rows, seconds=time.perf_counter() - started)
    prog, caught, chosen = min(planned, key=lambda entry: entry[0].state.predicted.step_time_s)  # first on a tie
    step = prog.state.predicted.step_time_s  # a hand plan is flat
    beats = step < to_beat
    return HandPart(shape, name, rows, chosen, step,
                    dict(prog.plan.to_json(), fingerprint=prog.plan.fingerprint) if beats else None,
                    figures_of(prog) if beats else None, list(prog.state.ilp_stats), list(prog.state.ilp_stopped),
                    [(str(w.message), w.category) for w in caught], time.perf_counter() - started,
                    prog if keep_program else None)


def compared_hand_plans(result: ShapeResult, parts: list[HandPart]) -> HandComparison:
    """The comparison on `result`'s shape from its tasks' parts (in `hand_tasks`' order): the record in
    `compare_hand_plans`' order (the automatic plan's row, then each candidate's rows, or why it was not planned),
    and the fastest of the automatic flat plan and the candidates, the first on a tie.

    >>> comparison.hand is None, comparison.why.startswith("plan 'automatic'")
    (True, True)
    """
    automatic = result.plan["search"]["hand_plans_deferred"]["automatic"]
    record = [automatic] + [row for part in parts for row in part.rows]
    best = None
    for part in parts:
        if part.step < (best.step if best is not None else automatic["predicted_step_s"]):
            best = part
    chosen = best.chosen if best is not None else "automatic"
    hand = None
    if best is not None and best.plan is not None:  # else it did not beat the search's step: it is not returned
        hand = ShapeResult(result.shape, {"mesh": list(result.shape), **best.figures}, best.step, best.plan,
                           best.program, None, best.ilp_stats, best.ilp_stopped)
    return HandComparison(record, chosen, why_plan(record, chosen), hand, best.caught if hand is not None else [],
                          round(sum(part.seconds for part in parts), 3))
