"""solve: choose one strategy per node on every mesh axis by an ILP (Alpa's formulation) on HiGHS.

Reads `autoshard.candidates`, `autoshard.hint`, `autoshard.input_hint`, FakeTensor vals and the cost
model. Writes `autoshard.choice` ([per axis: AxisStrategy]), `autoshard.spec`, `autoshard.in_specs`
and `autoshard.grad_partial` (per input position: axes where its gradient comes back partial).

Axes are solved one after another (outer first); each axis's ILP (autoshard/solver/ilp.py) sees tensor sizes
already divided by the earlier axes' choices. Copies of a node in repeated layers share one decision
(autoshard/solver/layers.py), so the ILP does not grow with depth. Its costs (autoshard/passes/ilp_costs.py:
compute, each conversion once per chain insert_comm emits, the duality rule's backward all-reduces and gradient
sync, fused gathers) are predict's, so the chosen plan's objective is predict's step; edges forbid resharding
multi-output producers and mutated inputs. Hints are hard constraints. A per-device memory budget (`memory_budget` option) bounds the parameters
(with gradients and optimizer state), inputs and saved activations, the converted copies consumers keep
for backward charged on the edges (autoshard/cost/conversion_memory.py: the row is predict's memory); on
axis a the bound is the budget times the sizes of the axes still to come (they can only shard further), so
the chosen plan's row over every axis is checked again after the last axis (the ladder climbs if it fails). When the strategy
combinations of all axes fit (JOINT_MAX_VARIABLES), every axis is decided in one ILP with the exact
cost of multi-axis resharding; otherwise axes are solved outer to inner. Writes `state.ilp_stats`.
When no plan fits the budget, the ladder of autoshard/passes/memory_fit.py tries ZeRO stages 1, 2, 3 on the
batch axis and recomputation of repeated layers (alone and with ZeRO) and keeps the first that fits.

Semi-auto mode (any hint given) behaves like GSPMD propagation: hinted shardings flow through the
graph instead of being traded away for a cheaper plan. Resharding a parameter, and gathering a
sharded tensor back to replicated, cost `PROPAGATION_PENALTY` (autoshard/passes/ilp_costs.py) times their price (so they happen only
where no op can keep the sharding), and on axes where the user sharded an input the gradient
reduction of replicated parameters is not charged (sharding the batch *is* the user's choice of data
parallelism).

>>> import torch
>>> from autoshard.passes.pass_lists import state_before
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> megatron = {"0.weight": {"tp": "S(0)"}, "2.weight": {"tp": "S(1)"}}
>>> state = state_before("solve", mlp, (2,), (torch.randn(8, 4),), axis_names=("tp",), hints=megatron)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from autoshard.cost.axis_cost import AxisCostModel, needs_grad
from autoshard.cost.conversion_memory import conversion_memory
from autoshard.cost.pipeline_schedule import activation_share, param_share
from autoshard.cost.saved_tensors import kept_split
from autoshard.cost.zero_cost import memory_scale
from autoshard.ir import meta
from autoshard.ir.errors import AutoshardError
from autoshard.ir.placement import Replicate, Shard
from autoshard.passes.choice import (
    joint_candidates,
    record_choice,
    sequential_candidates,
)
from autoshard.passes.contract import compiler_pass
from autoshard.passes.ilp_costs import SCALE, ilp_costs
from autoshard.passes.memory_fit import MemorySavers, fit_memory, planned_dropped
from autoshard.passes.zero import planned_zero
from autoshard.solver.errors import MemoryBudgetError
from autoshard.solver.ilp import solve_ilp
from autoshard.solver.layers import layer_key
from autoshard.solver.problem import IlpProblem
from autoshard.strategies import tensor_inputs

JOINT_MAX_VARIABLES = 150_000


@compiler_pass("solve", reads=(meta.CANDIDATES, meta.HINT, meta.INPUT_HINT),
               writes=(meta.CHOICE, meta.SPEC, meta.IN_SPECS, meta.GRAD_PARTIAL, "state.ilp_stats",
                       "state.objective_s", "state.memory_row_bytes", "state.memory_savers"))
def solve(state) -> None:
    """The pass: one strategy per node and mesh axis (see the module docstring). The column-parallel
    layer's unhinted bias follows its weight's sharding; the row-parallel one's is added once, replicated:

    >>> solve(state)
    >>> {n.meta["autoshard.path"]: str(n.meta["autoshard.spec"]) for n in state.gm.graph.nodes if n.op == "placeholder"}
    {'0.weight': '[S(0)]', '0.bias': '[S(0)]', '2.weight': '[S(1)]', '2.bias': '[R]', 'input:0': '[R]'}
    """
    state.memory_savers = MemorySavers(planned_zero(state))  # a requested ZeRO shrinks the memory row from the start
    # The memory ladder's rungs change only the ILP's memory row: what the costs are made of is built once.
    solve_once = functools.partial(_solve, shared=_SharedParts())
    try:
        solve_once(state)
    except MemoryBudgetError as error:
        fit_memory(state, solve_once, error)  # ZeRO and/or recomputation, or a refusal naming the smallest footprint


@dataclass
class _SharedParts:
    """What every solve of one compile shares (the graph and the options the costs read do not change between
    the memory ladder's rungs): the analyses, the cost models, the joint candidates, and each ILP's cost parts
    by (axes, the earlier axes' choices)."""

    analyses: tuple | None = None  # (nodes, grad, split, models, joint combos or None)
    costs: dict = field(default_factory=dict)


def _solve(state, shared: _SharedParts | None = None) -> None:
    graph = state.gm.graph
    shared = shared or _SharedParts()
    semi_auto = state.semi_auto
    mesh = state.mesh
    if shared.analyses is None:
        nodes = [n for n in graph.nodes if meta.CANDIDATES in n.meta]
        grad = needs_grad(graph)
        split = kept_split(graph, grad)  # what autograd keeps: the node's own part here, its consumers' on the edges
        copies = state.fold.copies if state.fold is not None else lambda node: 1
        models = [AxisCostModel(mesh, a, state.options.profile, grad, state.options.optimizer_state_factor,
                                split.own, copies) for a in range(mesh.ndim)]
        shared.analyses = (nodes, grad, split, models, _joint_combos(nodes, mesh, copies) if mesh.ndim > 1 else None)
    nodes, grad, split, models, joint = shared.analyses
    state.ilp_stats = []
    choices: dict = {n: [] for n in nodes}
    if joint is not None:
        picked = _solve_axes(nodes, tuple(range(mesh.ndim)), joint, choices, state, models, semi_auto, split,
                             shared=shared, start=lambda: _axis_by_axis(nodes, state, models, semi_auto, split, shared))
        for node in nodes:
            choices[node] = [picked[node][a] for a in range(mesh.ndim)]
    else:
        choices = _solve_sequential(nodes, state, models, semi_auto, split, shared)
    for node in nodes:
        record_choice(node, choices[node], grad)
    chosen = _chosen_problem(state, split)
    state.objective_s = chosen.evaluate([0] * chosen.n_classes) / SCALE
    state.memory_row_bytes = chosen.evaluate_memory([0] * chosen.n_classes)
    _check_memory(chosen, state.memory_row_bytes)



# How much of the later axes' size an earlier axis may count on to shrink memory: all of it first; when
# that leaves a later axis with no plan inside the budget, the earlier axes are solved again less
# optimistically (down to fitting the budget on their own).
_BUDGET_OPTIMISM = (1.0, 0.5, 0.0)


def _solve_sequential(nodes, state, models, semi_auto, split, shared: _SharedParts | None = None) -> dict:
    mesh = state.mesh
    for attempt, optimism in enumerate(_BUDGET_OPTIMISM):
        choices: dict = {n: [] for n in nodes}
        state.ilp_stats = []
        try:
            for axis in range(mesh.ndim):
                combos = {n: [{axis: c} for c in sequential_candidates(n, axis, mesh, choices)] for n in nodes}
                picked = _solve_axes(nodes, (axis,), combos, choices, state, models, semi_auto, split, optimism,
                                     shared)
                for node in nodes:
                    choices[node].append(picked[node][axis])
            return choices
        except MemoryBudgetError:
            if axis == 0 or attempt == len(_BUDGET_OPTIMISM) - 1:
                raise
    raise AssertionError("unreachable")


def _axis_by_axis(nodes, state, models, semi_auto, split, shared) -> dict | None:
    """The plan of the axes solved one after another (each node's strategy per axis), or None when that finds none
    (the budget, the time limit, or a hint an earlier axis cannot leave room for): the joint ILP's first incumbent
    when its search must branch (a binding budget), so that however early its time limit stops it, its plan is no
    worse than this one."""
    stats = state.ilp_stats
    try:
        return _solve_sequential(nodes, state, models, semi_auto, split, shared)
    except AutoshardError:  # no start: the joint search stands alone, as it does when it needs none
        return None
    finally:
        state.ilp_stats = stats


def _joint_combos(nodes, mesh, copies):
    """Every node's feasible strategy combinations over all axes, or None when the joint ILP would be
    too large (then axes are solved one after another). The size is the whole model's (a folded trace's
    middle layer counts `copies` times), so folding never changes which way a model is solved."""
    combos, size = {}, 0
    for node in nodes:  # in graph order, so a node's inputs have their combinations; stop once over the limit
        combos[node] = [dict(enumerate(f)) for f in joint_candidates(node, mesh)]
        size += copies(node) * len(combos[node])
        if node.op == "call_function":
            size += sum(copies(node) * len(combos[u]) * len(combos[node]) for u in tensor_inputs(node) if u in combos)
        if size > JOINT_MAX_VARIABLES:
            return None
    return combos


def _memory_kind(node) -> str:
    """What a node's memory row entry holds, for the refusal's breakdown."""
    if node.op != "placeholder":
        return "saved activations"
    return "inputs" if node.meta.get(meta.KIND) == "input" else "parameters, gradients and optimizer state"


def _zero_memory_scale(node, combo, prior, state, models) -> float:
    """A parameter's memory under the ZeRO stage being planned for (`state.memory_savers`), relative to
    without; its placement on the ZeRO axis is the candidate's, the earlier decision's, or R (undecided)."""
    zero = state.memory_savers.zero
    if zero is None or node.op != "placeholder" or node.meta.get(meta.KIND) != "param" or not models[0].grad.get(node):
        return 1.0
    axis = state.mesh.axis(zero.axis)
    placement = combo[axis].output if axis in combo else prior[axis].output if axis < len(prior) else Replicate()
    return memory_scale(zero.stage, state.mesh.shape[axis], models[0].optimizer_state_factor,
                        isinstance(placement, Shard))


def _solve_axes(nodes, axes, combos, choices, state, models, semi_auto, split, optimism: float = 1.0,
                shared: _SharedParts | None = None, start=None):
    """One ILP deciding `axes` for every node; `choices` holds the strategies of axes decided before. `start`,
    when given, finds a plan another way (each node's strategy per axis, or None) for the ILP's search to start from."""
    problem, classes, class_of = _build_problem(nodes, axes, combos, choices, state, models, semi_auto, split,
                                                optimism, shared)

    def candidates() -> list[int] | None:  # `start`'s plan as each class's candidate index
        found = start()
        if found is None:
            return None
        picked = []
        for members in classes:
            wanted = {tuple(found[n][a] for a in axes) for n in members}
            if len(wanted) > 1:  # tied copies that plan apart
                return None
            index = next((i for i, combo in enumerate(combos[members[0]]) if tuple(combo[a] for a in axes) in wanted),
                         None)
            if index is None:  # a combination the ILP lacks
                return None
            picked.append(index)
        return picked
    result = solve_ilp(problem, start=candidates if start is not None else None)
    state.ilp_stats.append({"axes": [state.mesh.names[a] for a in axes], "nodes": len(nodes), "classes": len(classes),
                            "variables": result.variables, "constraints": result.constraints,
                            "objective_s": result.objective / SCALE})
    return {n: combos[n][result.choice[class_of[n]]] for n in nodes}


def plan_figures(state) -> tuple[float, float]:
    """(seconds per step, bytes per device) the ILP gives the chosen plan: the objective of the joint ILP over
    every mesh axis (what `solve` minimises, without semi-auto's propagation preferences) and its memory row,
    evaluated at the chosen strategies on the graph solve sees (before insert_comm). `predict` prices the
    emitted program; tests keep the step equal to the objective, and the memory to the row but for ZeRO's
    padding and ZeRO-3's gathered copies and, under recomputation, the layers the recompute pass keeps (the row
    drops every repeated layer but one). solve records them as `state.objective_s` and `state.memory_row_bytes`.

    >>> solved = state_before("zero", mlp, (2,), (torch.randn(8, 4),), axis_names=("tp",), hints=megatron)
    >>> plan_figures(solved) == (solved.objective_s, solved.memory_row_bytes)  # what solve recorded
    True
    >>> round(solved.objective_s * 1e6, 3)  # microseconds
    10.001
    >>> predicted = state_before("check_hints", mlp, (2,), (torch.randn(8, 4),), axis_names=("tp",), hints=megatron)
    >>> solved.memory_row_bytes == predicted.predicted["memory_bytes_per_rank"]
    True
    """
    problem = _chosen_problem(state)
    choice = [0] * problem.n_classes
    return problem.evaluate(choice) / SCALE, problem.evaluate_memory(choice)


def _chosen_problem(state, split=None):
    """The joint ILP over every mesh axis with the chosen strategies as each node's only candidate (`split`:
    the graph's kept_split, when known)."""
    nodes = [n for n in state.gm.graph.nodes if meta.CANDIDATES in n.meta]
    grad = needs_grad(state.gm.graph)
    split = split or kept_split(state.gm.graph, grad)
    copies = state.fold.copies if state.fold is not None else lambda node: 1
    models = [AxisCostModel(state.mesh, a, state.options.profile, grad, state.options.optimizer_state_factor,
                            split.own, copies) for a in range(state.mesh.ndim)]
    combos = {n: [dict(enumerate(n.meta[meta.CHOICE]))] for n in nodes}
    problem, _, _ = _build_problem(nodes, tuple(range(state.mesh.ndim)), combos, {n: [] for n in nodes}, state,
                                   models, False, split)
    return problem


def _check_memory(chosen, kept: float) -> None:
    """Raise MemoryBudgetError (the ladder climbs) when the chosen plan's memory over every axis (`kept`) exceeds
    the budget: an axis solved before the others can only guess what the later ones shard."""
    if chosen.budget is None or kept <= chosen.budget * (1 + 1e-9):
        return
    memory = [list(per) for per in chosen.memory] + [[kept - sum(per[0] for per in chosen.memory)]]
    raise MemoryBudgetError(IlpProblem([1] * len(memory), [[0.0]] * len(memory), memory=memory, budget=chosen.budget,
                                       names=[*chosen.names, "converted copies kept for backward"],
                                       kinds=[*chosen.kinds, "saved activations"]))


def _build_problem(nodes, axes, combos, choices, state, models, semi_auto, split, optimism: float = 1.0,
                   shared: _SharedParts | None = None):
    """The ILP deciding `axes` (see _solve_axes): (IlpProblem, decision classes, class of each node). Its cost
    parts depend on the axes and the earlier axes' choices only (`shared` keeps them for the compile's other
    solves); its memory row on the memory saver being tried."""
    key = (axes, tuple(tuple(choices[n]) for n in nodes))
    parts = shared.costs.get(key) if shared is not None else None
    if parts is None:
        parts = ilp_costs(nodes, axes, combos, choices, state, models, semi_auto)
        if shared is not None:
            shared.costs[key] = parts
    classes, class_of, sizes, costs, edges, shared_charges, conjunctions, breakdowns = parts
    mesh = state.mesh
    memory = [[0.0] * size for size in sizes]
    dropped = planned_dropped(state, nodes)
    copies = state.fold.copies if state.fold is not None else lambda node: 1  # a folded trace's middle layer
    pipeline = state.options.pipeline
    in_flight = activation_share(pipeline)  # a pp rank keeps its micro-batches in flight, not one
    for n in nodes:
        c = class_of[n]
        if n.op == "placeholder" and n.meta.get(meta.KIND) != "input":  # a pp rank holds its stages' only
            kept = param_share(pipeline, in_layer=bool(layer_key(n.meta.get(meta.PATH, ""))[1]))
        elif n.op == "placeholder":
            kept = 1.0
        else:  # a recomputed layer's activations are not kept for backward
            kept = 0.0 if n in dropped else in_flight
        for s, per_axis in enumerate(breakdowns[n]):
            memory[c][s] += copies(n) * kept * per_axis[0].memory * _zero_memory_scale(n, combos[n][s], choices[n],
                                                                                     state, models)
    zero = state.memory_savers.zero
    zero_axis = mesh.axis(zero.axis) if zero is not None and zero.stage == 3 else None
    fixed, edge_memory, memory_charges = conversion_memory(
        nodes, axes, combos, choices, class_of, split, models[0].grad, mesh.shape, copies, dropped,
        lambda u: zero_axis if u.op == "placeholder" and u.meta.get(meta.KIND) == "param" else None)
    for u, per_candidate in fixed.items():
        for s, nbytes in enumerate(per_candidate):
            memory[class_of[u]][s] += nbytes * in_flight
    if in_flight != 1.0:  # the copies kept for backward are in flight as the activations are
        edge_memory = {key: [[nbytes * in_flight for nbytes in row] for row in matrix]
                       for key, matrix in edge_memory.items()}
        memory_charges = [(nbytes * in_flight, terms) for nbytes, terms in memory_charges]
    budget = state.options.budget_bytes if state.memory_savers.bounded else math.inf
    later = math.prod(mesh.shape[max(axes) + 1:]) ** optimism
    budget = None if math.isinf(budget) else budget * later
    problem = IlpProblem(sizes, costs, edges, memory, budget, shared=shared_charges,
                         conjunctions=conjunctions, edge_memory=edge_memory,
                         memory_charges=memory_charges,
                         names=[f"{m[0].meta.get(meta.PATH) or m[0].name} (node {m[0].name!r}"
                                + (f" and its {len(m) - 1} copies)" if len(m) > 2 else " and its copy)" if len(m) > 1
                                   else ")") for m in classes],
                         kinds=[_memory_kind(m[0]) for m in classes], later_ways=later if budget is not None else 1.0)
    return problem, classes, class_of
