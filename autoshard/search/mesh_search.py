"""The mesh shape for a number of devices: `parallelize(model, devices=N)` plans the model on each candidate shape
and keeps the plan with the fastest predicted step.

Each candidate is an unnamed mesh, so everything else is the compiler's usual search on it: the ILP gives each axis
its role (data, tensor, sequence, expert parallelism; a degree may span several axes, e.g. data parallelism over
two), the pipeline search decides whether one axis pipelines and with how many micro-batches, and the memory
ladder adds ZeRO and recomputation where the budget needs them. The hand-plan catalogue (FSDP x TP, Megatron-SP,
EP inside dp, ...) is compared with the automatic plan on the kept shape and on every shape whose flat automatic
plan comes within `HAND_PLAN_REACH` of the best step (not on every shape: it took a third of the search's time).
The first `FIRST_SHAPES` shapes are planned first; the others' pipeline searches then skip a re-plan or a schedule
that cannot beat the best step among those (`step_to_beat`: on Llama 3 8B over 64 devices 48.9 -> 37.7 s of
planning work, the same plan), and their rows say so (`bounded_by_s`). Every candidate's figures are kept
(`plan.search["mesh_candidates"]`) and the choice is explained (`plan.search["why_mesh"]`).

With several cores the shapes are planned in forked workers (`_plan_in_workers`): the model is traced first, at the
whole batch and at the micro-batches the shapes' pipeline searches plan first (each worker traced them again); the
later shapes are queued longest first, and a worker they leave idle compares the hand plans of the best shape so far;
the kept plan is applied in this process while the last hand plans run. On this 2-core machine, the same plans:
Llama 3 8B over 64 devices 26.0 -> 19.6 s, 70B over 512 78.8 -> 60.4 s, 405B over 512 87.8 -> 63.4 s.

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
import dataclasses
import functools
import logging
import math
import time

from autoshard.cost.profiles import HardwareProfile
from autoshard.frontend.request import CompileRequest
from autoshard.ir import meta
from autoshard.ir.errors import AutoshardError, UserInputError
from autoshard.ir.mesh import Mesh
from autoshard.ir.placement import Shard
from autoshard.ir.warn_once import caught_warnings
from autoshard.passes.pass_lists import trace_ahead
from autoshard.plan.plan import Plan
from autoshard.program.pipeline import batch_size, microbatch_inputs
from autoshard.report.accuracy import predicted_memory_bytes
from autoshard.search.hand_plan_search import (
    compare_hand_plans,
    hand_plans_deferred,
    plan_with_hand_plans,
)
from autoshard.search.pipeline_search import first_microbatch_counts, step_to_beat
from autoshard.search.planning_workers import (
    picklable,
    planning_workers,
    run_tasks,
    tell,
    worker_pool,
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


def predicted_step_s(prog) -> float:
    """The step a Program is predicted to take: its pipeline's (1F1B-family formula over the stages) when it
    pipelines, else its intra-op plan's.

    >>> import autoshard
    >>> from autoshard.zoo import mlp
    >>> model, inputs, loss_fn = mlp(n_layers=2)
    >>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",))
    >>> predicted_step_s(prog) == prog.plan.predicted.step_time_s
    True
    """
    pipeline = prog.plan.pipeline
    return pipeline["predicted_step_s"] if pipeline else prog.plan.predicted.step_time_s


@dataclasses.dataclass
class _ShapeResult:
    """One candidate shape planned: its row of `plan.search["mesh_candidates"]`, its predicted step, the plan (a plan
    file's content, which a worker process returns), the Program when planned in this process, the predicted step
    of its flat automatic plan when the hand plans were deferred (`flat_step`), and its refusal when none plans."""
    shape: tuple
    row: dict
    step: float = math.inf
    plan: dict | None = None
    program: object = None
    flat_step: float | None = None
    ilp_stats: list = dataclasses.field(default_factory=list)
    ilp_stopped: list = dataclasses.field(default_factory=list)
    error: AutoshardError | None = None


def plan_on_devices(request: CompileRequest, devices: int, compile_on_mesh):
    """The Program with the fastest predicted step over `candidate_shapes(devices, ...)`: `compile_on_mesh(request)`
    plans `request` on one candidate mesh (parallelize's own compile). A shape no plan fits is skipped; when none
    fits, the refusal with the smallest footprint is raised. The shapes are planned side by side in worker processes
    where there are cores for them (autoshard/search/planning_workers.py); the plan kept is applied here.

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
        planned, compared, applied = _plan_in_workers(request, compile_on_mesh, shapes, workers)
    else:
        planned, compared, applied = _plan_here(request, compile_on_mesh, shapes)
    results = [result for result, _ in planned]
    kept, reach = _kept_and_reach(results)
    kept.program = kept.program or applied
    caught = {result.shape: told for result, told in planned}  # each shape's warnings (tell those of the one kept)
    best, best_caught = kept, caught[kept.shape]
    for result in reach:
        hand, hand_caught = compared[result.shape]
        result.row["seconds"] = round(result.row["seconds"] + hand.row["seconds"], 3)
        chosen = _kept_or_hand(kept, hand) if result is kept else hand
        if result is kept or chosen.step < result.step:
            result.row.update(_row_figures(chosen))
        if (result is kept and chosen is not kept) or chosen.step < best.step:  # the shape's warnings, then its
            best, best_caught = chosen, caught[result.shape] + hand_caught      # hand plans' (told once each)
    rows = [result.row for result in results]
    prog = best.program if best.program is not None else _applied(request, best, compile_on_mesh)
    tell(best_caught)
    why = _why(rows, list(prog.mesh.shape))
    prog.plan.search = {**prog.plan.search, "mesh_candidates": rows, "chosen_mesh": list(prog.mesh.shape),
                        "why_mesh": why}
    log.info(why)
    return prog


def _kept_and_reach(results: list) -> tuple:
    """(the shape kept: the fastest predicted step, the first on a tie; the shapes the hand plans are compared on:
    the kept one and each whose flat automatic plan is within HAND_PLAN_REACH of its step, the kept one first). When
    no shape fits, the refusal with the smallest footprint is raised."""
    fitting = [result for result in results if result.error is None]
    if not fitting:
        errors = [result.error for result in results]
        memory = [e for e in errors if isinstance(e, MemoryBudgetError)]
        raise min(memory, key=lambda e: e.minimum) if len(memory) == len(errors) else errors[0]
    kept = min(fitting, key=lambda result: result.step)
    reach = [result for result in fitting if result.flat_step is not None
             and (result is kept or result.flat_step <= HAND_PLAN_REACH * kept.step)]
    return kept, sorted(reach, key=lambda result: result is not kept)


def _plan_here(request: CompileRequest, compile_on_mesh, shapes: list) -> tuple:
    """(every shape's (result, warnings), {shape: (hand plans' result, warnings)} on those in reach, None): planned
    in this process, one after the other (the first shapes, then the others bounded by the best step among them)."""
    first, later = shapes[:FIRST_SHAPES], shapes[FIRST_SHAPES:]
    planned = run_tasks(functools.partial(_plan_shape, request, compile_on_mesh, True, math.inf), first, 1)
    bound = min(result.step for result, _ in planned)
    planned += run_tasks(functools.partial(_plan_shape, request, compile_on_mesh, True, bound), later, 1)
    _, reach = _kept_and_reach([result for result, _ in planned])
    compared = run_tasks(functools.partial(_plan_hand_plans, request, True), reach, 1)
    return planned, {result.shape: hand for result, hand in zip(reach, compared)}, None


def _plan_in_workers(request: CompileRequest, compile_on_mesh, shapes: list, workers: int) -> tuple:
    """What `_plan_here` gives, planned in `workers` forked processes, and the kept shape's Program applied here
    meanwhile. The first shapes (a fixed number, whatever the number of workers, so that the pruning and the plan
    do not depend on it), then the others bounded by the best step among them, queued longest first
    (`_planning_order`); when they leave a worker idle, it compares the hand plans of the shape kept so far (then of
    those within its reach): Llama 3 70B over 512 devices spent 12 s of its 79 with one worker idle there. Once
    every shape is planned, the hand plans of the shapes in reach that were not compared yet are, and a pipelined
    kept plan is applied here meanwhile (its Program, unless a hand plan wins: then that one is applied after)."""
    first, later = shapes[:FIRST_SHAPES], shapes[FIRST_SHAPES:]
    planned = run_tasks(functools.partial(_plan_shape, request, compile_on_mesh, False, math.inf), first,
                        min(workers, len(first)))
    bound = min(result.step for result, _ in planned)
    tasks = {"shape": functools.partial(_plan_shape, request, compile_on_mesh, False, bound),
             "hand": functools.partial(_plan_hand_plans, request, False)}
    with worker_pool(tasks, workers) as pool:
        futures = {shape: pool.submit("shape", shape) for shape in _planning_order(later, request.options.profile)}
        hand: dict = {}
        pending = set(futures.values())
        while not all(future.done() for future in futures.values()):
            _, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            known = [result for result, _ in planned] + [f.result()[0] for f in futures.values() if f.done()]
            if all(result.error is not None for result in known):
                continue
            for result in _kept_and_reach(known)[1]:  # the best so far first: likely kept
                if len(pending) >= workers:
                    break
                if result.shape not in hand:
                    hand[result.shape] = pool.submit("hand", result)
                    pending.add(hand[result.shape])
        planned += [futures[shape].result() for shape in later]
        kept, reach = _kept_and_reach([result for result, _ in planned])
        needed = {result.shape for result in reach}
        for shape, future in hand.items():
            if shape not in needed:
                future.cancel()  # not needed after all (one already started runs to its end)
        for result in reach:
            if result.shape not in hand:
                hand[result.shape] = pool.submit("hand", result)
        # a flat kept plan gives way to its hand plans' comparison, which plans it again (`_kept_or_hand`)
        applied = _applied(request, kept, compile_on_mesh) if kept.plan.get("pipeline") else None
        return planned, {shape: hand[shape].result() for shape in needed}, applied


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
    """`shapes` in the order the workers take them: those with the most pipeline searches first (one per class of
    axis, `_search_axes`), so that the shortest tasks fill the end.

    >>> _planning_order([(2, 32, 8), (8, 8, 8), (2, 64, 4)], HardwareProfile())
    [(2, 32, 8), (2, 64, 4), (8, 8, 8)]
    """
    def searches(shape):
        return len({(size, profile.link(shape, i)) for i, size in enumerate(shape) if size >= 2})
    return sorted(shapes, key=lambda shape: -searches(shape))


def _plan_shape(request: CompileRequest, compile_on_mesh, keep_program: bool, to_beat: float,
                shape: tuple) -> _ShapeResult:
    """`request` planned on the mesh `shape` (run_tasks' task: in a worker the Program stays behind), its pipeline
    search pruned by `to_beat`, a step another shape reaches, and its hand plans deferred (compared on the kept
    shape and those within reach, `plan_on_devices`)."""
    started = time.perf_counter()
    try:
        with hand_plans_deferred(), step_to_beat(to_beat):
            prog = compile_on_mesh(request.replace(mesh=Mesh(shape)))
    except AutoshardError as exc:
        return _ShapeResult(shape, {"mesh": list(shape), "error": str(exc).splitlines()[0],
                                   "seconds": round(time.perf_counter() - started, 3)}, error=picklable(exc))
    result = _result(shape, prog, started, keep_program, flat_step=_deferred_flat_step(prog))
    if to_beat < result.step:  # its search was pruned: what it found, not all it could
        result.row["bounded_by_s"] = to_beat
    return result


def _plan_hand_plans(request: CompileRequest, keep_program: bool, planned: _ShapeResult) -> _ShapeResult:
    """The flat plan the hand plans and the ILP give on `planned`'s shape (run_tasks' task); a flat Program planned
    in this process is compared with the hand plans as it is, not planned again."""
    started = time.perf_counter()
    on_shape = request.replace(mesh=Mesh(planned.shape))
    prog = planned.program
    if prog is not None and not prog.plan.pipeline:
        prog.plan.search = {k: v for k, v in prog.plan.search.items() if k != "hand_plans_deferred"}
        chosen = compare_hand_plans(on_shape, prog)
        if chosen is not prog:  # a hand plan: the pipeline search's record (no axis pipelined) stays with it
            chosen.plan.search = {**prog.plan.search, **chosen.plan.search}
        return _result(planned.shape, chosen, started, keep_program)
    try:
        flat = plan_with_hand_plans(on_shape)
    except AutoshardError:  # planned before, so not expected: the shape's plan stands
        return _ShapeResult(planned.shape, {"seconds": round(time.perf_counter() - started, 3)})
    return _result(planned.shape, flat, started, keep_program)


def _result(shape: tuple, prog, started: float, keep_program: bool, flat_step: float | None = None) -> _ShapeResult:
    plan = dict(prog.plan.to_json(), fingerprint=prog.plan.fingerprint)
    return _ShapeResult(shape, {"mesh": list(shape), **_figures_of(prog),
                               "seconds": round(time.perf_counter() - started, 3)},
                       predicted_step_s(prog), plan, prog if keep_program else None, flat_step,
                       list(prog.state.ilp_stats), list(prog.state.ilp_stopped))


def _figures_of(prog) -> dict:
    return {"predicted_step_s": predicted_step_s(prog), "memory_bytes_per_rank": predicted_memory_bytes(prog),
            "plan": describe_roles(prog)}


def _row_figures(result: _ShapeResult) -> dict:
    return {k: result.row[k] for k in ("predicted_step_s", "memory_bytes_per_rank", "plan")}


def _kept_or_hand(kept: _ShapeResult, hand: _ShapeResult) -> _ShapeResult:
    """The kept shape's plan (planned with the hand plans deferred) or, when it pipelines and the flat plan of the
    hand plans predicts a faster step, that one; the search records merged (its pipeline search's, the hand plans')."""
    search = {k: v for k, v in kept.plan["search"].items() if k != "hand_plans_deferred"}
    if hand.plan is None:  # the flat plans failed this time: the pipeline stands
        chosen, merged = kept, search
    elif not kept.plan.get("pipeline"):  # compared with the hand plans as it was (`_plan_hand_plans`)
        return hand
    elif hand.step >= kept.step:
        chosen, merged = kept, dict(search, hand_plans=hand.plan["search"].get("hand_plans", []))
    else:
        why = f"{search.get('why', '')}; then the hand plans on this mesh: {hand.plan['search'].get('why_plan', '')}"
        chosen, merged = hand, {**search, **hand.plan["search"], "chosen_pipeline_axis": None, "why": why}
    chosen.plan["search"] = merged
    if chosen.program is not None:
        chosen.program.plan.search = merged
    return chosen


def _applied(request: CompileRequest, result: _ShapeResult, compile_on_mesh):
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


def _deferred_flat_step(prog) -> float | None:
    """The predicted step of the flat automatic plan of `prog`'s mesh when its hand plans were deferred, else None."""
    if not prog.plan.search.get("hand_plans_deferred"):
        return None
    if not prog.plan.pipeline:
        return predicted_step_s(prog)
    return next(c["predicted_step_s"] for c in prog.plan.search["candidates"] if c["axis"] is None)


def describe_roles(prog) -> str:
    """What each mesh axis does in `prog`'s plan, in a few words: the pipeline axis, the axes the batch is split
    on (data parallelism), the axes parameters are split on (tensor parallelism, or ZeRO-3's), the axes only other
    values are split on (a sequence, the experts' token groups; an axis in none of these only replicates), and ZeRO.

    >>> import autoshard
    >>> from autoshard.zoo import mlp
    >>> model, inputs, loss_fn = mlp(n_layers=2)
    >>> describe_roles(autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
    ...                                      hints={"input:0": {"dp": "S(0)"}}))
    "batch on ['dp']"
    """
    parts = []
    pipeline = prog.plan.pipeline
    if pipeline:
        parts.append(f"pipeline over {pipeline['axis']!r} ({pipeline['stages']} stages, "
                     f"{pipeline['microbatches']} micro-batches, {pipeline['schedule']})")
    names = [n for n in prog.mesh.names if not pipeline or n != pipeline["axis"]]
    batch = sorted({names[a] for spec in prog.input_specs for a, p in enumerate(spec) if p == Shard(0)})
    specs = prog.param_specs
    params = sorted({names[a] for fqn in prog.traced.params for a, p in enumerate(specs[fqn])
                     if isinstance(p, Shard)})
    # other values split on an axis that carries neither (a sequence, the experts' token groups)
    activations = sorted({names[a] for node in prog.state.gm.graph.nodes if node.op == "call_function"
                          for a, p in enumerate(node.meta.get(meta.SPEC, ())) if isinstance(p, Shard)}
                         - set(batch) - set(params))
    if batch:
        parts.append(f"batch on {batch}")
    if params:
        parts.append(f"parameters split on {params}")
    if activations:
        parts.append(f"activations split on {activations}")
    if prog.zero is not None:
        parts.append(repr(prog.zero))
    return ", ".join(parts) or "replicated"


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
