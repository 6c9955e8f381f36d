"""Whether to pipeline, over which axis, with how many micro-batches: decided by predicted step time.

A named axis "pp" (or `pipeline={"axis": ...}`) fixes the axis; the micro-batch count, when not given,
is the candidate (p, 2p, 4p that divide the batch) with the least predicted step time. On an unnamed
mesh every axis of size >= 2 is a candidate pp axis besides not pipelining at all; each candidate is
planned (intra-op plan on the other axes + cut) and the fastest predicted step wins. The predicted
step of a pipeline is the 1F1B-family formula: sum of stage times + (m - 1) x the slowest stage + the
slowest stage's gradient sync; `plan.pipeline["search"]` keeps every candidate's figures (the why).
"""
from __future__ import annotations

import logging

from .errors import AutoshardError, UserInputError
from .pipeline import batch_size, check_options, parallelize_pipeline

log = logging.getLogger(__name__)


def predicted_step(stages: list[dict], m: int, virtual: int = 1) -> float:
    """Step time of a pipeline whose stages take `stages[s]["seconds"]` per micro-batch."""
    per_rank = max(s["seconds"] for s in stages) * virtual
    sync = max(s["sync_s"] for s in stages)
    return sum(s["seconds"] for s in stages) + (m - 1) * per_rank + sync


def choose_pipeline(model, mesh, example_inputs, hints, loss_fn, options, pipeline, plan, unnamed, debug=False):
    """The pipelined Program when the user asked for one or the search prefers one; else None."""
    if pipeline is False:
        if "pp" in mesh.names:
            raise UserInputError("pipeline=False but the mesh has an axis named 'pp'; rename the axis to shard "
                                 "on it instead")
        return None
    opts = check_options(pipeline)
    axis = opts.get("axis") or ("pp" if "pp" in mesh.names else None)
    if axis is None and pipeline is not None and not unnamed:
        raise UserInputError(f"pipeline options given but no pipeline axis: name a mesh axis 'pp' or pass "
                             f"pipeline={{'axis': ...}} (mesh axes: {list(mesh.names)})")
    if axis is None and not unnamed:
        return None
    if plan is not None:
        raise UserInputError("parallelize(plan=...) does not reproduce pipelined programs yet; plan again "
                             "(the cut is deterministic) or pass pipeline=False with a non-pipeline plan")
    if axis is not None:
        if axis not in mesh.names:
            raise UserInputError(f"pipeline axis {axis!r} is not a mesh axis; mesh axes: {list(mesh.names)}")
        return _best_microbatches(model, mesh, example_inputs, axis, opts, hints, loss_fn, options, debug)
    return _search_axes(model, mesh, example_inputs, opts, hints, loss_fn, options, debug)


def _microbatch_candidates(p: int, batch: int) -> list[int]:
    return [m for m in (p, 2 * p, 4 * p) if m <= batch and batch % m == 0] or [1]


def _best_microbatches(model, mesh, example_inputs, axis, opts, hints, loss_fn, options, debug):
    if "microbatches" in opts:
        return parallelize_pipeline(model, mesh, example_inputs, axis, opts, hints, loss_fn, debug, options)
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    p = mesh.shape[mesh.axis(axis)]
    best, tried = None, []
    for m in _microbatch_candidates(p, batch_size(inputs)):
        try:
            prog = parallelize_pipeline(model, mesh, inputs, axis, dict(opts, microbatches=m), hints, loss_fn,
                                        debug, options)
        except AutoshardError as exc:  # e.g. a micro-batch too small to shard on dp: not a candidate
            tried.append({"microbatches": m, "error": str(exc)})
            continue
        step = prog.plan.pipeline["predicted_step_s"]
        tried.append({"microbatches": m, "predicted_step_s": step})
        if best is None or step < best.plan.pipeline["predicted_step_s"]:
            best = prog
    if best is None:
        raise UserInputError(f"no micro-batch count works for pipelining over {axis!r}: " +
                             "; ".join(f"m={t['microbatches']}: {t['error']}" for t in tried))
    best.plan.pipeline["microbatch_search"] = tried
    return best


def _search_axes(model, mesh, example_inputs, opts, hints, loss_fn, options, debug):
    from .program import Program, compile_state
    state, history = compile_state(model, mesh, example_inputs, hints, loss_fn, debug, options)
    flat = Program(state, history)
    candidates = [{"axis": None, "predicted_step_s": flat.plan.predicted["step_time_s"]}]
    best, best_step = None, flat.plan.predicted["step_time_s"]
    for i, name in enumerate(mesh.names):
        if mesh.shape[i] < 2:
            continue
        try:
            prog = _best_microbatches(model, mesh, example_inputs, name, opts, hints, loss_fn, options, debug)
        except AutoshardError as exc:
            candidates.append({"axis": name, "error": str(exc).splitlines()[0]})
            continue
        step = prog.plan.pipeline["predicted_step_s"]
        candidates.append({"axis": name, "microbatches": prog.config.microbatches, "predicted_step_s": step})
        if step < best_step:
            best, best_step = prog, step
    chosen = best.config.axis if best is not None else None
    why = _why(candidates, chosen)
    log.info(why)
    target = best if best is not None else flat
    target.plan.search = {"candidates": candidates, "chosen_pipeline_axis": chosen, "why": why}
    return target if best is not None else flat


def _why(candidates, chosen) -> str:
    parts = []
    for c in candidates:
        label = "no pipeline" if c["axis"] is None else f"pipeline over {c['axis']}"
        if "error" in c:
            parts.append(f"{label}: not possible ({c['error']})")
        else:
            extra = f", {c['microbatches']} micro-batches" if c.get("microbatches") else ""
            parts.append(f"{label}{extra}: predicted step {c['predicted_step_s']:.3g} s")
    head = f"pipelined over axis {chosen!r}" if chosen else "no axis pipelined"
    return f"{head} (fastest predicted step): " + "; ".join(parts)
