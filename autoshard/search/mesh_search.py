"""The mesh shape for a number of devices: `parallelize(model, devices=N)` plans the model on each candidate shape
and keeps the plan with the fastest predicted step.

Each candidate is an unnamed mesh, so everything else is the compiler's usual search on it: the ILP gives each axis
its role (data, tensor, sequence, expert parallelism; a degree may span several axes, e.g. data parallelism over
two), the pipeline search decides whether one axis pipelines and with how many micro-batches, and the memory
ladder adds ZeRO and recomputation where the budget needs them. The hand-plan catalogue (FSDP x TP, Megatron-SP,
EP inside dp, ...) is compared with the automatic plan on every shape whose flat automatic plan comes within
`HAND_PLAN_REACH` of the best step, the kept one first (not on every shape: it took a third of the search's time; nor
on the kept shape when its pipeline is far faster than its flat plans can be: `plan.search["hand_plans_not_compared"]`
says so).
The first `FIRST_SHAPES` shapes are planned first; the others' pipeline searches then skip a re-plan or a schedule
that cannot beat the best step among those (`step_to_beat`: on Llama 3 8B over 64 devices 48.9 -> 37.7 s of
planning work, the same plan), and their rows say so (`bounded_by_s`). Every candidate's figures are kept
(`plan.search["mesh_candidates"]`) and the choice is explained (`plan.search["why_mesh"]`).

With several cores the shapes are planned in forked workers (`_plan_in_workers`): the model is traced first, at the
whole batch and at the micro-batches the shapes' pipeline searches plan first (each worker traced them again). A
later shape's search is split into tasks, its flat plan and the pipeline over each axis (`_later_tasks`,
autoshard/search/shape_parts.py): the flat plans fill the workers while the first shapes finish, and the workers
end together (one task per shape left a worker idle 9 s of the MoE's 70 over 256 devices); a worker they leave
idle compares the hand plans of the best shape so far, one task per catalogue plan (autoshard/search/hand_parts.py:
the shape's flat plan is not planned again); the kept plan is applied in this process while the last hand plans
run. On this 2-core machine, the same plans: Llama 3 8B over 64 devices 26.0 -> 19.6 s, 70B over 512
78.8 -> 60.4 s, 405B over 512 87.8 -> 63.4 s with the shapes as workers' tasks; the MoE 68.8 -> 61.4 s with them
split (benchmarks/RESULTS.md sections 9 and 17).

The candidates (`candidate_shapes`): axes run from the slowest links to the fastest (the profile's node rule,
`HardwareProfile.link`). The innermost axis holds `d` devices of one node, `d` the node's size or half of it (tensor
parallelism inside a node, Megatron's rule); the devices outside it form one axis or two (two: one of them may
pipeline while the other carries data). Shapes whose axes have the same sizes and links in another order plan alike
and are tried once; within a node the same rule applies to the whole mesh. At most `MAX_SHAPES` are planned, fewest
axes first: a shape with more axes costs more planning and is kept for last; when there are more three-axis shapes
than room, those of whole-node inner axes are spread evenly from the shallowest first axis to the most balanced split
(on 1920 devices (2, 120, 8), (5, 48, 8), (8, 30, 8), (15, 16, 8): either outer axis may pipeline, so pipelines of
2 to 120 stages are weighed).

>>> candidate_shapes(64, 8)
[(8, 8), (16, 4), (2, 4, 8), (2, 8, 4), (4, 4, 4), (8, 2, 4)]
>>> candidate_shapes(8, 8)  # inside one node (2, 4) and (4, 2) plan alike
[(8,), (2, 4), (2, 2, 2)]
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import time

from autoshard.cost.profiles import HardwareProfile
from autoshard.frontend.request import CompileRequest
from autoshard.ir.errors import AutoshardError, UserInputError
from autoshard.ir.mesh import Mesh
from autoshard.ir.warn_once import caught_warnings
from autoshard.passes.pass_lists import trace_ahead
from autoshard.plan.plan import Plan
from autoshard.program.pipeline import batch_size, microbatch_inputs
from autoshard.search.hand_parts import (
    HandComparison,
    compared_hand_plans,
    hand_tasks,
    plan_hand_part,
)
from autoshard.search.hand_plan_search import hand_plans_deferred
from autoshard.search.microbatch_search import first_microbatch_counts
from autoshard.search.pipeline_search import step_to_beat
from autoshard.search.planning_workers import (
    picklable,
    planning_workers,
    run_tasks,
    tell,
    worker_pool,
)
from autoshard.search.shape_parts import (
    FIRST_TASKS,
    assembled,
    plan_part,
    shape_tasks,
    step_found,
)
from autoshard.search.shape_result import (
    ShapeResult,
    deferred_flat_step,
    shape_result,
)
from autoshard.solver.errors import MemoryBudgetError

log = logging.getLogger(__name__)

MAX_SHAPES = 6  # each shape is a full plan (the pipeline search inside it)
# Planned before the others, whose pipeline searches then skip what cannot beat the best of these (the shapes of
# fewest axes come first: the cheapest to plan; Llama 3 8B on 64 and the MoE on 256 keep one of them, 70B on 512
# finds a 22% faster step later).
FIRST_SHAPES = 2
# The hand plans (a third of a shape's planning time) are compared on the kept shape and on each shape whose flat
# automatic plan predicts a step within this factor of the best: on the benchmarks' shapes a hand plan beat the
# ILP's flat plan by at most 11% (ZeRO-3 over a binding budget).
HAND_PLAN_REACH = 1.25


def candidate_shapes(devices: int, devices_per_node: int, max_shapes: int = MAX_SHAPES) -> list[tuple[int, ...]]:
    """The mesh shapes `parallelize(devices=...)` plans (see the module docstring), fewest axes first.

    >>> candidate_shapes(2, 8), candidate_shapes(16, 8)
    ([(2,)], [(2, 8), (4, 4), (2, 2, 4)])
    """
    check_devices(devices)
    if devices == 1:
        return [(1,)]
    profile = HardwareProfile(devices_per_node=devices_per_node)
    inner_sizes = [d for d in (devices_per_node, devices_per_node // 2) if d >= 2 and devices % d == 0]
    if devices <= devices_per_node:
        inner_sizes = sorted({d for d in range(2, devices + 1) if devices % d == 0}, reverse=True)
    shapes = []
    for d in inner_sizes:
        outer = devices // d
        shapes.append((d,) if outer == 1 else (outer, d))
        shapes += [(a, outer // a, d) for a in range(2, outer) if outer % a == 0 and outer // a >= 2]
    kept, seen = [], set()
    for shape in sorted(shapes, key=lambda s: (len(s), -s[-1], s)):
        key = tuple(sorted((size, profile.link(shape, axis) == profile.intra_node) for axis, size in enumerate(shape)))
        if key not in seen:
            seen.add(key)
            kept.append(shape)
    if len(kept) <= max_shapes:
        return kept
    # Too many: the shapes of fewer axes, then three-axis shapes spread evenly from the shallowest first axis to
    # the most balanced split (large device counts offer deep pipelines too: Megatron runs 16 to 64 stages).
    flat = [shape for shape in kept if len(shape) < 3]
    deep = [shape for shape in kept if len(shape) == 3]
    room = max(max_shapes - len(flat), 0)
    whole_node = [shape for shape in deep if shape[-1] == deep[0][-1]]
    picked = _spread(whole_node, room)
    picked += [shape for shape in deep if shape not in picked][:room - len(picked)]
    return (flat + sorted(picked, key=deep.index))[:max_shapes]


def _spread(items: list, count: int) -> list:
    """`count` of `items` spread evenly over the list, both ends included.

    >>> _spread([2, 3, 4, 5, 6, 8, 10, 12, 15], 4)
    [2, 5, 8, 15]
    """
    if len(items) <= count:
        return list(items)
    if count <= 1:
        return items[:count]
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)]


def check_devices(devices) -> None:
    """`devices=` must be a positive int.

    >>> check_devices(0)
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: devices=0 must be a positive number of devices, e.g. devices=64
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise UserInputError(f"devices={devices!r} must be a positive number of devices, e.g. devices=64")


def plan_on_devices(request: CompileRequest, devices: int, compile_on_mesh, pipeline=None):
    """The Program with the fastest predicted step over `candidate_shapes(devices, ...)`: `compile_on_mesh(request)`
    plans `request` on one candidate mesh (parallelize's own compile). A shape no plan fits is skipped; when none
    fits, the refusal with the smallest footprint is raised. The shapes are planned side by side in worker processes
    where there are cores for them (autoshard/search/planning_workers.py); the plan kept is applied here. `pipeline`
    is parallelize's option, which `compile_on_mesh` applies too (it decides whether a shape's search weighs each
    axis as the pipeline's, and those are planned as tasks of their own: autoshard/search/shape_parts.py).

    >>> import autoshard
    >>> from autoshard.zoo import mlp
    >>> model, inputs, loss_fn = mlp(n_layers=2)
    >>> prog = autoshard.parallelize(model, example_inputs=inputs, loss_fn=loss_fn, devices=4)
    >>> prog.mesh, [row["mesh"] for row in prog.plan.search["mesh_candidates"]]
    (Mesh(a0=4), [[4], [2, 2]])
    """
    shapes = candidate_shapes(devices, request.options.profile.devices_per_node)
    workers = planning_workers(len(shapes))
    trace_ahead(request.replace(mesh=Mesh(shapes[0])))  # every shape (and worker) starts from this trace
    if workers > 1:
        _trace_microbatches_ahead(request, shapes)
        planned, compared, applied = _plan_in_workers(request, compile_on_mesh, pipeline, shapes, workers)
    else:
        planned, compared, applied = _plan_here(request, compile_on_mesh, pipeline, shapes)
    results = [result for result, _ in planned]
    kept, reach = _kept_and_reach(results)
    kept.program = kept.program or applied
    caught = {result.shape: told for result, told in planned}  # each shape's warnings (tell those of the one kept)
    best, best_caught = kept, caught[kept.shape]
    for result in reach:
        comparison = compared[result.shape]
        result.row["seconds"] = round(result.row["seconds"] + comparison.seconds, 3)
        hand = comparison.hand
        if hand is None:  # the shape's own plan stands
            result.plan["search"] = _with_hand_plans(result, comparison)
            continue
        hand.plan["search"] = _with_hand_plans(result, comparison, hand.plan.get("search", {}))
        result.row.update(_row_figures(hand))
        if hand.step < best.step:  # the shape's warnings, then its hand plan's (told once each)
            best, best_caught = hand, caught[result.shape] + comparison.caught
    if kept not in reach and kept.flat_step is not None:
        kept.plan["search"] = _hand_plans_out_of_reach(kept)
    rows = [result.row for result in results]
    prog = best.program if best.program is not None else _applied(request, best, compile_on_mesh)
    tell(best_caught)
    why = _why(rows, list(prog.mesh.shape))
    prog.plan.search = {**best.plan.get("search", {}), "mesh_candidates": rows, "chosen_mesh": list(prog.mesh.shape),
                        "why_mesh": why}
    log.info(why)
    return prog


def _kept_and_reach(results: list) -> tuple:
    """(the shape kept: the fastest predicted step, the first on a tie; the shapes the hand plans are compared on:
    each whose flat automatic plan is within HAND_PLAN_REACH of the kept step, the kept one first). The kept shape
    itself is out of reach when its step is a pipeline's far below its flat plan's: a flat hand plan would have to
    beat that flat plan by more than they ever have (Llama 3 8B over 64 devices: its pipeline 0.667 s, its flat plan
    1.10 s; four hand compiles, 5.6 CPU s of 52, were planned for nothing). When no shape fits, the refusal with the
    smallest footprint is raised.

    >>> piped, flat = ShapeResult((8, 8), {}, 0.667, flat_step=1.10), ShapeResult((16, 4), {}, 0.8, flat_step=0.8)
    >>> kept, reach = _kept_and_reach([piped, flat])
    >>> kept.shape, [result.shape for result in reach]  # 0.8 <= 1.25 x 0.667; 1.10 is not
    ((8, 8), [(16, 4)])
    """
    fitting = [result for result in results if result.error is None]
    if not fitting:
        errors = [result.error for result in results]
        memory = [e for e in errors if isinstance(e, MemoryBudgetError)]
        raise min(memory, key=lambda e: e.minimum) if len(memory) == len(errors) else errors[0]
    kept = min(fitting, key=lambda result: result.step)
    reach = [result for result in fitting if result.flat_step is not None
             and result.flat_step <= HAND_PLAN_REACH * kept.step]
    return kept, sorted(reach, key=lambda result: result is not kept)


def _plan_here(request: CompileRequest, compile_on_mesh, pipeline, shapes: list) -> tuple:
    """(every shape's (result, warnings), {shape: its HandComparison} on those in reach, None): planned
    in this process, one after the other (the first shapes, then the others' tasks, bounded by the best step among
    the first and, after a shape's first tasks, by theirs: `_later_tasks`)."""
    first, later = shapes[:FIRST_SHAPES], shapes[FIRST_SHAPES:]
    runners = _runners(request, compile_on_mesh, pipeline, keep_program=True)
    planned = run_tasks(lambda shape: runners["shape"]((math.inf, shape)), first, 1)
    bound = min(result.step for result, _ in planned)
    opening, free, rest = _later_tasks(request, pipeline, later)
    tasks = opening + free
    done = dict(zip(tasks, run_tasks(lambda task: runners[task[0]]((bound, task[1])), tasks, 1)))
    for first_tasks, others in rest.values():
        best = step_found([done[task][0] for task in first_tasks])
        done.update(zip(others, run_tasks(lambda task, best=best: runners["part"]((bound, task[1], best)), others, 1)))
    outcomes: dict = {}
    planned += [_shape_outcome(request, pipeline, shape, done, bound, outcomes) for shape in later]
    _, reach = _kept_and_reach([result for result, _ in planned])
    hand = functools.partial(plan_hand_part, request, True)
    compared = {result.shape: compared_hand_plans(result, [part for part, _ in
                                                           run_tasks(hand, _hand_tasks(request, result), 1)])
                for result in reach}
    return planned, compared, None


def _plan_in_workers(request: CompileRequest, compile_on_mesh, pipeline, shapes: list, workers: int) -> tuple:
    """What `_plan_here` gives, planned in `workers` forked processes, and the kept shape's Program applied here
    meanwhile. The first shapes (a fixed number, whatever the number of workers, so that the pruning and the plan
    do not depend on it) and the later shapes' flat plans, which prune nothing, then the others' tasks bounded by
    the best step among the first (`_later_tasks`: a shape's other axes once its first tasks are done); when they
    leave a worker idle, it compares the hand plans of the shape kept so far (then of those within its reach):
    Llama 3 70B over 512 devices spent 12 s of its 79 with one worker idle there. Once every shape is planned, the
    hand plans of the shapes in reach that were not compared yet are, and the kept plan is applied here meanwhile
    (its Program, unless a hand plan wins: then that one is applied after)."""
    first, later = shapes[:FIRST_SHAPES], shapes[FIRST_SHAPES:]
    opening, free, rest = _later_tasks(request, pipeline, later)
    runners = _runners(request, compile_on_mesh, pipeline, keep_program=False)
    hand_parts = functools.partial(plan_hand_part, request, False)
    with worker_pool({**runners, "hand": hand_parts}, workers) as pool:
        firsts = [pool.submit("shape", (math.inf, shape)) for shape in first]
        # the flat plans fill the workers the first shapes leave idle (the bound is the slowest of those)
        futures = {task: pool.submit(task[0], (math.inf, task[1])) for task in free}
        planned = [future.result() for future in firsts]
        bound = min(result.step for result, _ in planned)
        futures.update({task: pool.submit(task[0], (bound, task[1])) for task in opening})
        hand: dict = {}  # (shape, candidate) -> the future of its hand-plan task
        listed: dict = {}  # shape -> its hand-plan tasks
        outcomes: dict = {}
        pending = {future for future in futures.values() if not future.done()}
        # until every shape is planned (not the hand plans: the kept plan is applied here while they run)
        while rest or not all(future.done() for future in futures.values()):
            _, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            done = {task: future.result() for task, future in futures.items() if future.done()}
            for shape, (first_tasks, others) in list(rest.items()):  # a shape's other axes, once its first are done
                if all(task in done for task in first_tasks):
                    best = step_found([done[task][0] for task in first_tasks])
                    for task in others:
                        futures[task] = pool.submit("part", (bound, task[1], best))
                        pending.add(futures[task])
                    del rest[shape]
            known = [result for result, _ in planned] + [
                outcome[0] for outcome in (_shape_outcome(request, pipeline, shape, done, bound, outcomes)
                                           for shape in later) if outcome is not None]
            if all(result.error is not None for result in known):
                continue
            idle = [task for result in _kept_and_reach(known)[1]  # the best so far first: likely kept
                    for task in _hand_tasks(request, result, listed) if task[:2] not in hand]
            for task in idle[:max(workers - len(pending), 0)]:
                hand[task[:2]] = pool.submit("hand", task)
                pending.add(hand[task[:2]])
        done = {task: future.result() for task, future in futures.items()}
        planned += [_shape_outcome(request, pipeline, shape, done, bound, outcomes) for shape in later]
        kept, reach = _kept_and_reach([result for result, _ in planned])
        needed = {task[:2]: task for result in reach for task in _hand_tasks(request, result, listed)}
        for key, future in hand.items():
            if key not in needed:
                future.cancel()  # not needed after all (one already started runs to its end)
        for key, task in needed.items():
            if key not in hand:
                hand[key] = pool.submit("hand", task)
        applied = _applied(request, kept, compile_on_mesh)  # while the hand plans run
        compared = {result.shape: compared_hand_plans(result, [hand[task[:2]].result()[0] for task in
                                                               _hand_tasks(request, result, listed)])
                    for result in reach}
        return planned, compared, applied


def _runners(request: CompileRequest, compile_on_mesh, pipeline, keep_program: bool) -> dict:
    """The functions that run the search's tasks, by name, each on (the step to beat, a whole shape or one task of a
    shape's search: `_later_tasks`[, the step the shape's first tasks found])."""
    return {"shape": lambda item: _plan_shape(request, compile_on_mesh, keep_program, *item),
            "part": lambda item: plan_part(request, pipeline, *item)}


def _later_tasks(request: CompileRequest, pipeline, later: list) -> tuple[list, list, dict]:
    """The tasks that plan the shapes after the first ones, as (runner name, item): each shape's search split into
    its flat plan and its pipeline axes where it weighs them one by one (autoshard/search/shape_parts.py; the
    workers then finish together instead of one idling while the other plans the last shape), else the shape as one
    task. Returns (the tasks pruned by the first shapes' step: the whole shapes and each shape's first axis, shapes
    in `_planning_order`; the flat plans, which prune nothing and may start before that step is known; {shape: (its
    first tasks, its other axes)}: those are pruned by the first tasks' step too, `step_found`).

    >>> from autoshard.zoo import mlp
    >>> model, inputs, loss_fn = mlp(n_layers=3)
    >>> opening, free, rest = _later_tasks(CompileRequest(model, Mesh((8,)), inputs, loss_fn=loss_fn), None, [(2, 4)])
    >>> opening, free, rest[(2, 4)][1]
    ([('part', ((2, 4), 'a1'))], [('part', ((2, 4), None))], [('part', ((2, 4), 'a0'))])
    """
    opening, free, rest = [], [], {}
    for shape in _planning_order(later, request.options.profile):
        parts = shape_tasks(request, pipeline, shape)
        if parts is None:
            opening.append(("shape", shape))
            continue
        tasks = [("part", part) for part in parts]
        free.append(tasks[0])
        opening += tasks[1:FIRST_TASKS]
        if tasks[FIRST_TASKS:]:
            rest[shape] = (tasks[:FIRST_TASKS], tasks[FIRST_TASKS:])
    return opening, free, rest


def _shape_outcome(request: CompileRequest, pipeline, shape: tuple, done: dict, bound: float, outcomes: dict):
    """(result, warnings) of a later `shape` from its tasks' in `done` ({task: (result, warnings)}; its parts put
    together once, kept in `outcomes`), or None while one of its tasks is not done."""
    if shape in outcomes:
        return outcomes[shape]
    parts = shape_tasks(request, pipeline, shape)
    tasks = [("shape", shape)] if parts is None else [("part", part) for part in parts]
    if any(task not in done for task in tasks):
        return None
    if parts is None:
        outcomes[shape] = done[tasks[0]]
    else:
        finished = [done[task] for task in tasks]
        outcomes[shape] = (assembled(request, [result for result, _ in finished], bound),
                           [warning for _, told in finished for warning in told])
    return outcomes[shape]


def _trace_microbatches_ahead(request: CompileRequest, shapes: list) -> None:
    """Trace the micro-batches the shapes' pipeline searches plan first (`first_microbatch_counts`) before the workers
    fork: each worker traced them again."""
    inputs = request.example_inputs
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    try:
        batch = batch_size(inputs)
    except UserInputError:  # no batch to split: no shape pipelines
        return
    for m in sorted({m for shape in shapes for m in first_microbatch_counts(shape, batch)} - {1}):
        trace_ahead(request.replace(mesh=Mesh(shapes[0]), example_inputs=microbatch_inputs(inputs, m)))


def _planning_order(shapes: list, profile) -> list:
    """`shapes` in the order the workers take their tasks: those with the most pipeline searches first (one per class
    of axis, `pipeline_axes`), so that the shortest tasks fill the end.

    >>> _planning_order([(2, 32, 8), (8, 8, 8), (2, 64, 4)], HardwareProfile())
    [(2, 32, 8), (2, 64, 4), (8, 8, 8)]
    """
    def searches(shape):
        return len({(size, profile.link(shape, i)) for i, size in enumerate(shape) if size >= 2})
    return sorted(shapes, key=lambda shape: -searches(shape))


def _plan_shape(request: CompileRequest, compile_on_mesh, keep_program: bool, to_beat: float,
                shape: tuple) -> ShapeResult:
    """`request` planned on the mesh `shape` (run_tasks' task: in a worker the Program stays behind), its pipeline
    search pruned by `to_beat`, a step another shape reaches, and its hand plans deferred (compared on the kept
    shape and those within reach, `plan_on_devices`)."""
    started = time.perf_counter()
    try:
        with hand_plans_deferred(), step_to_beat(to_beat):
            prog = compile_on_mesh(request.replace(mesh=Mesh(shape)))
    except AutoshardError as exc:
        return ShapeResult(shape, {"mesh": list(shape), "error": str(exc).splitlines()[0],
                                   "seconds": round(time.perf_counter() - started, 3)}, error=picklable(exc))
    result = shape_result(shape, prog, started, keep_program, flat_step=deferred_flat_step(prog.plan.search))
    if to_beat < result.step:  # its search was pruned: what it found, not all it could
        result.row["bounded_by_s"] = to_beat
    return result


def _hand_tasks(request: CompileRequest, result: ShapeResult, listed: dict | None = None) -> list[tuple]:
    """The hand-plan tasks of `result`'s shape (`hand_tasks`: its step is the one to beat), listed once per shape
    in `listed`. Listing them traces nothing new (the shapes' trace is cached); a warning it gives was given when the
    shape was planned."""
    listed = {} if listed is None else listed
    if result.shape not in listed:
        with caught_warnings():
            listed[result.shape] = hand_tasks(request, result, result.step)
    return listed[result.shape]


def _row_figures(result: ShapeResult) -> dict:
    return {k: result.row[k] for k in ("predicted_step_s", "memory_bytes_per_rank", "plan")}


def _hand_plans_out_of_reach(result: ShapeResult) -> dict:
    """The search record of a kept shape whose hand plans were not compared (`_kept_and_reach`), saying why.

    >>> record = {"hand_plans_deferred": {}, "why": "pipelined over axis 'a0'"}
    >>> _hand_plans_out_of_reach(ShapeResult((8, 8), {}, 0.667, {"search": record}, None, 1.1))["hand_plans_not_compared"]
    'the flat automatic plan on this mesh predicts 1.1 s, above 1.25 x the kept step 0.667 s'
    """
    search = {k: v for k, v in result.plan["search"].items() if k != "hand_plans_deferred"}
    return {**search, "hand_plans_not_compared": f"the flat automatic plan on this mesh predicts "
                                    f"{result.flat_step:.3g} s, above {HAND_PLAN_REACH} x the kept step "
                                    f"{result.step:.3g} s"}


def _with_hand_plans(result: ShapeResult, comparison: HandComparison, hand_search: dict | None = None) -> dict:
    """The search record of the plan returned for `result`'s shape once its hand plans are compared: the shape's own
    (its pipeline search's) with the comparison's record, and, when the hand plan wins (`hand_search`, its own
    record), that one's too; a pipeline the hand plan beats says so."""
    search = {k: v for k, v in result.plan["search"].items() if k != "hand_plans_deferred"}
    pipelined = bool(result.plan.get("pipeline"))
    chosen = {"chosen_plan": comparison.chosen, "why_plan": comparison.why}
    if hand_search is None:  # the shape's plan stands (a pipeline: the flat plans' choice is not it)
        return {**search, "hand_plans": comparison.record, **({} if pipelined else chosen)}
    merged = {**search, **hand_search, "hand_plans": comparison.record, **chosen}
    if pipelined:
        merged.update(chosen_pipeline_axis=None, why=f"{search.get('why', '')}; then the hand plans on this mesh: "
                                                      f"{comparison.why}")
    return merged


def _applied(request: CompileRequest, result: ShapeResult, compile_on_mesh):
    """The Program of a plan a worker made: its decisions applied on its mesh (no solving), its search records kept."""
    # no fingerprint to check: its search records were merged here after the worker made it
    plan = Plan.from_json(dict(result.plan, fingerprint=None), source=f"the plan for mesh {result.shape}")
    # the plan carries the hints and ZeRO it was made with; its warnings are the worker's (told by the caller)
    with caught_warnings():
        prog = compile_on_mesh(request.replace(mesh=Mesh(result.shape), plan=plan, hints=None,
                                               options=request.options.replace(zero=None)))
    prog.plan.search = dict(result.plan.get("search", {}))
    prog.state.ilp_stats, prog.state.ilp_stopped = result.ilp_stats, result.ilp_stopped  # the solves that made it
    return prog


def _why(rows: list, chosen: list) -> str:
    parts = []
    for row in rows:
        if "error" in row:
            parts.append(f"{tuple(row['mesh'])}: no plan ({row['error']})")
        else:
            bounded = (f"; its pipeline search stopped where it could not beat {row['bounded_by_s']:.3g} s"
                       if "bounded_by_s" in row else "")
            parts.append(f"{tuple(row['mesh'])}: step {row['predicted_step_s']:.3g} s, "
                         f"{row['memory_bytes_per_rank'] / 2**30:.3g} GiB per device ({row['plan']}{bounded})")
    return f"mesh {tuple(chosen)} (fastest predicted step): " + "; ".join(parts)
