"""The compiler's pass lists, declared by name as data (PASS_LISTS: each a PassList of its passes in order;
PASSES is "plan"'s): the variants apply a saved plan, plan a pipeline's micro-batch program, or price a
catalogue plan;
`compile_state` (trace, then run a pass list: the one compile driver) and `state_before` (the state a pass sees, for watching one
pass at work).

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, mesh=(2,), axis_names=("dp",), example_inputs=inputs,
...                              loss_fn=loss_fn, hints={"input:0": {"dp": "S(0)"}})
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from autoshard.cost.pipeline_schedule import activation_share
from autoshard.frontend.fold import check_folded_trace, fold_model, mark_carried
from autoshard.frontend.request import CompileOptions, CompileRequest
from autoshard.frontend.trace import trace
from autoshard.ir import meta
from autoshard.ir.errors import UserInputError
from autoshard.ir.gc_tuning import fewer_collections
from autoshard.ir.mesh import Mesh
from autoshard.ir.placement import (
    describe_type,
)
from autoshard.passes.annotate import annotate
from autoshard.passes.apply_plan import ApplyPlan, CheckPlan, resolve_plan
from autoshard.passes.candidates import strategies
from autoshard.passes.codegen import codegen
from autoshard.passes.contract import TRACED
from autoshard.passes.contract import pass_name as pass_name_of
from autoshard.passes.cut_stages import cut_stages
from autoshard.passes.fuse_comm import fuse_comm
from autoshard.passes.hint_check import check_hints
from autoshard.passes.insert_comm import insert_comm
from autoshard.passes.manager import CompileState, History, run_passes
from autoshard.passes.normalize import normalize
from autoshard.passes.predict import predict
from autoshard.passes.recompute import recompute
from autoshard.passes.solve import solve
from autoshard.passes.unfold import unfold
from autoshard.passes.zero import AllowPlannedZeroShards
from autoshard.passes.zero import zero as zero_pass
from autoshard.solver.session import solver_session

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class PassList:
    """One declared pass list: what it is for, its passes in order (CheckPlan, AllowPlannedZeroShards and ApplyPlan
    stand for the passes made from the saved plan it applies), and what the state holds before the first.

    >>> [p.name for p in PASS_LISTS["hand_plan"].passes][-3:]  # no check_hints: its hints are the planner's
    ['predict', 'recompute', 'codegen']
    """

    description: str
    passes: tuple
    provided: tuple = TRACED


_SOLVED = (normalize, annotate, strategies, solve, zero_pass, unfold, insert_comm, fuse_comm, predict, recompute)
# A saved plan: a folded trace is unfolded first (the plan's rows are the whole model's) and checked against it.
_APPLIED = (normalize, unfold, CheckPlan, annotate, strategies, AllowPlannedZeroShards, ApplyPlan, zero_pass,
            insert_comm, fuse_comm, predict, recompute)

PASS_LISTS = {
    "plan": PassList("solve every node's strategy by the ILP", (*_SOLVED, check_hints, codegen)),
    "apply_plan": PassList("a saved plan's decisions in solve's place, checked against the graph first",
                           (*_APPLIED, check_hints, codegen)),
    "microbatch": PassList("a pipeline's micro-batch program and its stage cut",
                           (*_SOLVED, cut_stages, check_hints, codegen)),
    "microbatch_apply_plan": PassList("a saved pipeline plan", (*_APPLIED, cut_stages, check_hints, codegen)),
    "hand_plan": PassList("a catalogue plan the search compares: no hint check (its hints are the planner's)",
                          (*_SOLVED, codegen)),
}
PASSES = list(PASS_LISTS["plan"].passes)


def declared_pass_list(name: str, plan=None, same_shapes: bool = True) -> tuple[list, tuple]:
    """(passes, what the state holds before the first) of pass list `name` (one of PASS_LISTS); the
    apply_plan variants need the `plan` (made for these input shapes, or with `same_shapes=False` for others
    of the same ranks: its decisions re-specialised, not re-solved).

    >>> passes, provided = declared_pass_list("microbatch")
    >>> [p.name for p in passes][-4:]
    ['recompute', 'cut_stages', 'check_hints', 'codegen']
    """
    if name not in PASS_LISTS:
        raise UserInputError(f"no pass list named {name!r}; the pass lists are {sorted(PASS_LISTS)}")
    made = {CheckPlan: lambda: CheckPlan(plan, same_shapes), ApplyPlan: lambda: ApplyPlan(plan, same_shapes),
            AllowPlannedZeroShards: lambda: AllowPlannedZeroShards(plan)}
    declared = PASS_LISTS[name]
    return [made[p]() if p in made else p for p in declared.passes], declared.provided


def compile_state(request: CompileRequest, pipeline: bool = False, hand_plan: bool = False):
    """Trace and run the declared pass list (with cut_stages for a pipeline's micro-batch program; applying
    `request.plan` when given; without the hint check for a catalogue plan the search compares):
    (state, history). Its ILPs share a solver session (autoshard/solver/session.py); `state.ilp_stopped` lists those
    the time limit stopped.

    >>> request = CompileRequest(model, Mesh.of((2,), ("dp",)), inputs, {"input:0": {"dp": "S(0)"}}, loss_fn)
    >>> state, history = compile_state(request)
    >>> [entry.name for entry in history] == [p.name for p in PASSES]
    True
    """
    plan, hints = request.plan, request.hints
    if plan is not None:
        plan, hints = resolve_plan(plan, request.mesh, hints)
    applied = plan is not None
    name = {(False, False): "plan", (False, True): "apply_plan", (True, False): "microbatch",
            (True, True): "microbatch_apply_plan"}[(bool(pipeline), applied)]
    if hand_plan and name == "plan":
        name = "hand_plan"
    passes, _ = declared_pass_list(name, plan, same_shapes=not request.plan_other_shapes)
    debug = request.debug or os.environ.get("AUTOSHARD_DEBUG") == "1"  # the test suite verifies every compile
    options = CompileOptions.of(request.options)
    # parallelize plans inside fewer_collections too; a compile called on its own (the search's parts, notebooks,
    # pass tests) gets it here: a budget-bound joint ILP's build otherwise spent half its time in full collections
    with fewer_collections():
        traced, fold, history = _normalized_trace(request, hints, options, debug)
        state = CompileState(traced.gm, request.mesh, traced, hints, options, model=request.model, fold=fold)
        assert passes[0] is normalize, "every declared pass list that traces starts with normalize"
        with solver_session(options.ilp_time_limit) as session:  # the caller's, when it opened one (parallelize does)
            first = len(session.stopped)
            history += run_passes(state, passes[1:], verify=debug, describe=describe_graph,
                                  provided=TRACED + normalize.contract.writes)
            state.ilp_stopped = session.stopped[first:]
    return state, history


def recuttable(planned, config) -> bool:
    """Whether a micro-batch program planned under pipeline config `planned` can be cut again under `config`
    (`recut`): the same axis, pp size and micro-batch count, and as many activations in flight.

    >>> from autoshard.program.pipeline import PipelineConfig
    >>> one = PipelineConfig("pp", 2, 4, "1F1B")
    >>> recuttable(one, PipelineConfig("pp", 2, 4, "ZBVZeroBubble", virtual=2)), recuttable(one, PipelineConfig("pp", 2, 4, "GPipe"))
    (True, False)
    """
    return ((config.pp_size, config.microbatches, config.axis) == (planned.pp_size, planned.microbatches, planned.axis)
            and activation_share(config) == activation_share(planned))


def recut(state: CompileState, history: History, config) -> tuple[CompileState, History]:
    """A pipeline's compiled micro-batch program cut again under `config` (another schedule or number of stages
    per rank of the same pp axis and micro-batch count, keeping as many activations in flight): the passes before
    cut_stages read of the pipeline only the pp size, the micro-batch count and `activation_share` (solve's memory
    row), so their work is kept and cut_stages and the passes after it run on a copy, as a fresh compile would
    (the schedule search weighs each schedule this way).

    >>> from autoshard.program.pipeline import PipelineConfig
    >>> micro = CompileRequest(model, Mesh.of((2,), ("dp",)), inputs, loss_fn=loss_fn,
    ...                        options=CompileOptions(pipeline=PipelineConfig("pp", 1, 2, "1F1B")))
    >>> state, history = compile_state(micro, pipeline=True)
    >>> again, again_history = recut(state, history, PipelineConfig("pp", 1, 2, "Interleaved1F1B", virtual=2))
    >>> again.options.pipeline.schedule, again.gm is not state.gm, [e.name for e in again_history][-3:]
    ('Interleaved1F1B', True, ['cut_stages', 'check_hints', 'codegen'])
    """
    current = state.options.pipeline
    if not recuttable(current, config):
        raise ValueError(f"recut keeps the pp size, micro-batch count and activations in flight ({current.pp_size}, "
                         f"{current.microbatches}, {activation_share(current)}); got ({config.pp_size}, "
                         f"{config.microbatches}, {activation_share(config)}): compile the micro-batch program again")
    passes = list(PASS_LISTS["microbatch"].passes)
    at = passes.index(cut_stages)
    provided = TRACED + tuple(w for p in passes[:at] for w in p.contract.writes)
    copied = dataclasses.replace(state, gm=copy.deepcopy(state.gm), predicted=copy.deepcopy(state.predicted),
                                 options=state.options.replace(pipeline=config), pipeline_stages=None)
    kept = History(e for e in history if e.name not in {pass_name_of(p) for p in passes[at:]})
    return copied, History([*kept, *run_passes(copied, passes[at:], provided=provided, describe=describe_graph)])


# Inside `reuse_normalized()` (one planning call): the traced graph after normalize, per model, loss, input shapes,
# dtype policy, random-op mode and fold, kept unmodified. normalize reads neither the mesh nor the hints, so the
# programs a search compiles (candidate meshes, hand plans, pipeline axes) start from copies of one.
_NORMALIZED: contextvars.ContextVar = contextvars.ContextVar("autoshard_normalized", default=None)


@contextlib.contextmanager
def reuse_normalized():
    """Within the block, compiles of one model at the same input shapes trace and normalize it once; each gets its
    own copy of the normalized graph (the passes rewrite it in place).

    >>> request = CompileRequest(model, Mesh.of((2,), ("dp",)), inputs, loss_fn=loss_fn)
    >>> with reuse_normalized():
    ...     first, second = compile_state(request)[0], compile_state(request.replace(mesh=Mesh.of((2,), ("tp",))))[0]
    >>> first.gm is not second.gm and first.traced.params is second.traced.params
    True
    """
    token = _NORMALIZED.set(_NORMALIZED.get() if _NORMALIZED.get() is not None else {})
    try:
        yield
    finally:
        _NORMALIZED.reset(token)


def trace_ahead(request: CompileRequest) -> None:
    """Inside `reuse_normalized()`: trace and normalize `request`'s model now, so that processes forked next (the
    mesh search's workers, autoshard/search/planning_workers.py) start from the cached trace.

    >>> with reuse_normalized():
    ...     trace_ahead(CompileRequest(model, Mesh.of((2,), ("dp",)), inputs, loss_fn=loss_fn))
    """
    plan, hints = request.plan, request.hints
    if plan is not None:
        plan, hints = resolve_plan(plan, request.mesh, hints)
    _normalized_trace(request, hints, CompileOptions.of(request.options),
                      request.debug or os.environ.get("AUTOSHARD_DEBUG") == "1")


def _normalized_trace(request: CompileRequest, hints, options: CompileOptions, debug: bool):
    """(Traced after normalize, Fold or None, normalize's History): from the call's cache when it holds this trace."""
    cache = _NORMALIZED.get()
    fold = fold_model(request.model, hints) if options.fold_layers else None
    inputs = request.example_inputs if isinstance(request.example_inputs, (tuple, list)) else (request.example_inputs,)
    key = (id(request.model), id(request.loss_fn), options.mixed_precision, options.rng,
           id(fold.model) if fold is not None else None,
           tuple((tuple(v.shape), v.dtype, str(v.device)) if isinstance(v, torch.Tensor) else repr(v) for v in inputs))
    if cache is not None and key in cache:
        traced, used_fold, entries = cache[key]
        return dataclasses.replace(traced, gm=copy.deepcopy(traced.gm)), used_fold, History(entries)
    traced, used_fold = trace_for_plan(request, hints, options)
    state = CompileState(traced.gm, request.mesh, traced, hints, options, model=request.model, fold=used_fold)
    history = run_passes(state, [normalize], verify=debug, describe=describe_graph)
    if cache is not None:
        cache[key] = (dataclasses.replace(traced, gm=copy.deepcopy(state.gm)), used_fold, list(history))
    return traced, used_fold, history


def trace_for_plan(request: CompileRequest, hints, options: CompileOptions):
    """(Traced, Fold or None): the model folded to three of its repeated layers when it has many
    (autoshard/frontend/fold.py), else traced whole; a folded trace that does not stand for the whole
    model is discarded for the whole one.

    >>> request = CompileRequest(model, Mesh.of((2,), ("dp",)), inputs, loss_fn=loss_fn)
    >>> traced, fold = trace_for_plan(request, None, request.options)
    >>> fold is None, list(traced.params)[:1]  # two layers: nothing to fold
    (True, ['layers.0.weight'])
    """
    fold = fold_model(request.model, hints) if options.fold_layers else None
    if fold is not None:
        try:
            traced = trace(fold.model, request.example_inputs, request.loss_fn, options.mixed_precision)
        except Exception as exc:  # noqa: BLE001 -- the folded copy is ours: whatever it breaks, the model is traced whole
            log.info("the folded copy of %s does not trace (%s); tracing all %d layers", fold.container,
                     str(exc).splitlines()[0] if str(exc) else type(exc).__name__, fold.n_layers)
            traced = None
        if traced is not None:
            mark_carried(fold, traced.gm)  # a running value the layers feed (a summed load-balancing loss)
            if check_folded_trace(fold, traced.gm):
                return traced, fold
        log.info("the repeated layers of %s do not trace alike; tracing all %d", fold.container, fold.n_layers)
    return trace(request.model, request.example_inputs, request.loss_fn, options.mixed_precision), None


def state_before(pass_name: str, model, mesh, example_inputs, hints=None, loss_fn=None, axis_names=None,
                 **options) -> CompileState:
    """The CompileState that pass `pass_name` (one of PASSES) sees: `model` traced and the passes before it
    run. For watching one pass at work on a small graph (the passes' docstring examples use it).

    >>> state = state_before("insert_comm", model, (2,), inputs, hints={"input:0": {"dp": "S(0)"}},
    ...                      axis_names=("dp",))
    >>> next(n for n in state.gm.graph.nodes if n.op == "placeholder").meta["autoshard.spec"]
    [R]
    """
    names = [pass_name_of(p) for p in PASSES]
    if pass_name not in names:
        raise UserInputError(f"no pass named {pass_name!r}; the passes are {names}")
    options = CompileOptions.parse(**options)
    traced = trace(model, example_inputs, loss_fn, options.mixed_precision)
    state = CompileState(traced.gm, Mesh.of(mesh, axis_names), traced, hints, options)
    for pass_ in PASSES[:names.index(pass_name)]:
        pass_(state)
    return state


def describe_graph(state) -> str:
    """The graph's code with sharding-annotated types on every line that has a spec (`prog.history`'s text).

    >>> print(next(line for line in describe_graph(prog.state).splitlines() if line.startswith("linear_default:")))
    linear_default: f32[8@dp, 128] = call_function[target=torch.ops.aten.linear.default](args = (%inputs_0, ...)
    """
    lines = []
    for node in state.gm.graph.nodes:
        spec = node.meta.get(meta.SPEC)
        val = node.meta.get("val")
        if node.op == "output":
            lines.append(f"return {node.args[0]}")
            continue
        typ = describe_type(tuple(val.shape), spec, state.mesh.names, val.dtype) if isinstance(val, torch.Tensor) \
            else ""
        call = node.format_node() or node.name
        call = call.split(" = ", 1)[1] if " = " in call else call
        lines.append(f"{node.name}: {typ} = {call}" if typ else f"{node.name} = {call}")
    return "\n".join(lines)
