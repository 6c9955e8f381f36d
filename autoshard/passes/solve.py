"""solve: choose one strategy per node on every mesh axis by an ILP (Alpa's formulation) on HiGHS.

Reads `autoshard.candidates`, `autoshard.hint`, `autoshard.input_hint`, FakeTensor vals and the cost
model. Writes `autoshard.choice` ([per axis: AxisStrategy]), `autoshard.spec`, `autoshard.in_specs`
and `autoshard.grad_partial` (per input position: axes where its gradient comes back partial).

Axes are solved one after another (outer first); each axis's ILP (autoshard/solver/ilp.py) sees tensor sizes
already divided by the earlier axes' choices. Copies of a node in repeated layers share one decision
(autoshard/solver/layers.py), so the ILP does not grow with depth. A conversion is charged once per chain
insert_comm emits (one per value, wanted placement and partial axes, shared by its consumers), so the
chosen plan's objective is predict's step; edges forbid resharding multi-output producers and mutated
inputs. Hints are hard constraints. Node costs
(autoshard/cost/axis_cost.py) count compute, the backward all-reduces implied by the duality rule and, in
auto mode, gradient sync. A per-device memory budget (`memory_budget` option) bounds the parameters
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
sharded tensor back to replicated, cost `PROPAGATION_PENALTY` times their price (so they happen only
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

import torch

from autoshard.cost.axis_cost import AxisCostModel, needs_grad
from autoshard.cost.collective_time import (
    INF,
    all_gather_time,
    all_reduce_time,
    fused_gather_saving,
    redistribution_time,
)
from autoshard.cost.conversion_memory import conversion_memory
from autoshard.cost.flops import node_bytes
from autoshard.cost.pipeline_schedule import param_share
from autoshard.cost.saved_tensors import kept_split
from autoshard.cost.zero_cost import memory_scale
from autoshard.ir import meta
from autoshard.ir.graph_utils import data_parallel_axes
from autoshard.ir.mixed_precision import cast_parameter
from autoshard.ir.placement import Replicate, Shard, Spec
from autoshard.passes.choice import (
    joint_candidates,
    record_choice,
    sequential_candidates,
)
from autoshard.passes.contract import compiler_pass
from autoshard.passes.memory_fit import MemorySavers, fit_memory, planned_dropped
from autoshard.passes.zero import planned_zero
from autoshard.solver.errors import MemoryBudgetError
from autoshard.solver.ilp import solve_ilp
from autoshard.solver.layers import decision_classes
from autoshard.solver.problem import IlpProblem
from autoshard.strategies import tensor_inputs

aten = torch.ops.aten
_SCALE = 1e6  # seconds -> microseconds keeps HiGHS's tolerances meaningful
PROPAGATION_PENALTY = 1e3
def mutated_positions(node) -> tuple[int, ...]:
    """Positions (among the node's tensor inputs) of the operands its op writes in place, from the op's
    schema: they cannot be resharded (the write would land on a copy).

    >>> graph = torch.fx.Graph()
    >>> x, y = graph.placeholder("x"), graph.placeholder("y")
    >>> x.meta["val"] = y.meta["val"] = torch.zeros(2)
    >>> add_ = graph.call_function(torch.ops.aten.add_.Tensor, (x, y))
    >>> mutated_positions(add_), mutated_positions(graph.call_function(torch.ops.aten.add.Tensor, (x, y)))
    ((0,), ())
    """
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return ()
    written = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, torch.fx.Node):
                written.append(value)
    inputs = tensor_inputs(node)
    return tuple(pos for pos, value in enumerate(inputs) if value in written)


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
        models = [AxisCostModel(mesh, a, state.options.profile, grad, state.options.optimizer_state_factor,
                                split.own) for a in range(mesh.ndim)]
        copies = state.fold.copies if state.fold is not None else lambda node: 1
        shared.analyses = (nodes, grad, split, models, _joint_combos(nodes, mesh, copies) if mesh.ndim > 1 else None)
    nodes, grad, split, models, joint = shared.analyses
    state.ilp_stats = []
    choices: dict = {n: [] for n in nodes}
    if joint is not None:
        picked = _solve_axes(nodes, tuple(range(mesh.ndim)), joint, choices, state, models, semi_auto, split,
                             shared=shared)
        for node in nodes:
            choices[node] = [picked[node][a] for a in range(mesh.ndim)]
    else:
        choices = _solve_sequential(nodes, state, models, semi_auto, split, shared)
    for node in nodes:
        record_choice(node, choices[node], grad)
    chosen = _chosen_problem(state, split)
    state.objective_s = chosen.evaluate([0] * chosen.n_classes) / _SCALE
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


def is_view(node) -> bool:
    """Whether the node's op returns a view of its first argument (its schema's alias annotation).

    >>> graph = torch.fx.Graph()
    >>> x = graph.placeholder("x")
    >>> is_view(graph.call_function(torch.ops.aten.slice.Tensor, (x, 1, 1))), is_view(x)
    (True, False)
    """
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None or not schema.returns or not schema.arguments:
        return False
    out, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return out is not None and not out.is_write and first is not None and first.before_set == out.before_set


def written_through_views(graph) -> set:
    """Values written in place through a view (`shifted[:, 1:] = labels[:, :-1]` in transformers'
    shift_tokens_right), with the views between: none of them may be resharded, or the write would land
    on a rank's fresh copy and later reads of the base would miss it.

    >>> graph = torch.fx.Graph()
    >>> base, src = graph.placeholder("base"), graph.placeholder("src")
    >>> base.meta["val"] = src.meta["val"] = torch.zeros(2, 4)
    >>> view = graph.call_function(torch.ops.aten.slice.Tensor, (base, 1, 1))
    >>> view.meta["val"] = torch.zeros(2, 3)
    >>> write = graph.call_function(torch.ops.aten.copy_.default, (view, src))
    >>> sorted(n.name for n in written_through_views(graph))
    ['base', 'slice_tensor']
    """
    frozen = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for pos in mutated_positions(node):
            value, chain = tensor_inputs(node)[pos], []
            while is_view(value):
                chain.append(value)
                value = value.args[0]
            if chain:
                frozen.update([*chain, value])
    return frozen


def _edge_cost(u, cu, have, want, mutated, axes, models, others, semi_auto, mesh, profile, nbytes) -> float:
    """Scaled cost of turning placements `have` into `want` on `axes` (one tuple entry per axis); `nbytes`
    is node_bytes(u). On several axes it depends on `u` only through `_value_kind(u, ...)` and `nbytes`."""
    if mutated:
        return INF
    if len(axes) == 1:
        cost = models[axes[0]].edge(u, have[0], want[0], others(u, cu, axes[0]))
    elif isinstance(u.meta.get("val"), (tuple, list)):
        cost = INF  # multi-output values are never resharded: their getitem follows them
    else:  # several axes at once: price the exact collectives insert_comm will emit
        cost = redistribution_time(Spec(have), Spec(want), nbytes, mesh.shape, profile,
                                   models[0].grad.get(u, False))
    is_param = u.op == "placeholder" and u.meta.get(meta.KIND) != "input"
    gathers = any(isinstance(h, Shard) and isinstance(w, Replicate) for h, w in zip(have, want))
    if semi_auto and (is_param or gathers):
        cost *= PROPAGATION_PENALTY
    return cost * _SCALE


def _value_kind(u, models) -> tuple:
    """What _edge_cost and _fused_gather_refund read of a value besides its bytes, on several axes:
    values alike in these (the copies in repeated layers, most of all) share one priced conversion."""
    return (u.op == "placeholder", u.meta.get(meta.KIND) != "input", isinstance(u.meta.get("val"), (tuple, list)),
            bool(models[0].grad.get(u, False)), cast_parameter(u) is not None)


def _partial_gradient_charges(nodes, axes, combos, class_of, models, others, free_sync, sync_share=1.0,
                              copies=lambda node: 1) -> list:
    """The duality rule's backward all-reduce, charged once per value and axis however many split ops
    use it replicated (insert_comm emits one grad_all_reduce per value; a parameter is synced once).
    A parameter's charge is its gradient sync, paid once per step: a pipeline's micro-batch program
    pays `sync_share` = 1/micro-batches of it (its other costs recur every micro-batch). `copies(u)`: how many
    values of the whole model u stands for (a folded trace, autoshard/frontend/fold.py).

    One charge per (value, axis, bytes after the other axes); a consumer candidate that takes the value
    replicated on that axis while splitting its work joins the charge's groups.
    """
    charges: dict = {}
    for v in nodes:
        if v.op != "call_function":
            continue
        for pos, u in enumerate(tensor_inputs(v)):
            if u not in combos or not models[0].grad.get(u, False):
                continue
            # A parameter's per-use cast (mixed precision) is synced as its float32 master after backward.
            master = cast_parameter(u)
            synced = u.op == "placeholder" or master is not None
            for axis in axes:
                if axis in free_sync and synced:
                    continue
                model = models[axis]
                for t, cv in enumerate(combos[v]):
                    strategy = cv[axis]
                    if not strategy.partial_grad(pos):
                        continue
                    nbytes = model.input_bytes(u, pos, others(v, cv, axis))
                    if master is not None:
                        nbytes = nbytes * master.meta["val"].element_size() // u.meta["val"].element_size()
                    key = (u, axis, nbytes)
                    groups = charges.setdefault(key, {})
                    groups.setdefault(v, set()).add((class_of[v], t))
    shared, seen = [], {}
    for (u, axis, nbytes), groups in charges.items():
        # Copies of u in repeated layers are tied: their identical charges merge into one, paid per copy.
        signature = (class_of[u], axis, nbytes, tuple(sorted(tuple(sorted(g)) for g in groups.values())))
        cost = all_reduce_time(nbytes, models[axis].k, models[axis].link) * _SCALE
        cost *= sync_share if u.op == "placeholder" or cast_parameter(u) is not None else 1.0
        cost *= copies(u)
        if signature in seen:
            shared[seen[signature]][0] += cost
            continue
        seen[signature] = len(shared)
        shared.append([cost, [sorted(g) for g in groups.values()]])
    return [(cost, groups) for cost, groups in shared]


def _fused_gather_refund(u, v, pos, cv, have, want, axes, models, others, partial_axes, nbytes,
                         sync_share: float = 1.0) -> tuple[float, dict]:
    """What the ILP over-counts when an edge gathers `u` on an axis where `v` splits its work with that input
    replicated: the shared charge prices the gradient's reduction as an all-reduce, but fuse_comm turns gather +
    all-reduce into one all_gather_sum_grad (a reduce-scatter backward). Scaled seconds (the chain's refund,
    {axis: the all-reduce refunded}): each chain pays the fused op instead of the gather; the all-reduce is the
    value's one gradient sync on that axis, refunded once however many chains gather it (a conjunction charge).
    A parameter (or its per-use cast) gathered per use is ZeRO-3 without the re-gather, whose true cost is the
    gathered copy kept for backward, which the memory row does not count -- refunding it would make the solver
    prefer it to data parallelism on a tie it cannot see; but in a pipeline's micro-batch program its all-reduce
    was priced at `sync_share` (once per step) while the reduce-scatter runs every micro-batch: that difference is
    charged to the chain (a negative refund), never refunded.
    When `axes` are the whole mesh, the chain insert_comm emits is known step by step and the saving is
    exact (cost.fused_gather_saving); one axis of several is priced on that axis alone."""
    if not models[0].grad.get(u, False):
        return 0.0, {}
    parameter = u.op == "placeholder" or cast_parameter(u) is not None
    if parameter and sync_share == 1.0:
        return 0.0, {}
    mesh = models[0].mesh
    if len(axes) == mesh.ndim and len(axes) > 1:
        parts = fused_gather_saving(Spec(have), Spec(want), partial_axes, nbytes, mesh.shape, models[0].profile)
    else:
        parts = {}
        for i, axis in enumerate(axes):
            strategy = cv[axis]
            if isinstance(have[i], Shard) and isinstance(want[i], Replicate) and strategy.partial_grad(pos):
                model = models[axis]
                nbytes = model.input_bytes(u, pos, others(v, cv, axis))
                parts[axis] = (all_reduce_time(nbytes, model.k, model.link), -all_gather_time(nbytes, model.k,
                                                                                               model.link))
    if parameter:
        return min(sum(sync_share * sync + change for sync, change in parts.values()), 0.0) * _SCALE, {}
    return sum(change for _, change in parts.values()) * _SCALE, {axis: sync * _SCALE for axis, (sync, _) in
                                                                   parts.items()}


def _partial_axes(u, pos, strategies, models) -> tuple:
    """Axes where a consumer with these strategies (axis -> AxisStrategy) gets `u`'s gradient back
    partial: it splits its work with the input replicated. insert_comm builds one chain per (value,
    wanted placement, these axes)."""
    if not models[0].grad.get(u, False):
        return ()
    return tuple(sorted(a for a, s in strategies.items() if s.partial_grad(pos)))


def _conversion_charges(conversions, edges) -> list:
    """Conjunction charges (autoshard/solver/model.py) for the conversions: insert_comm emits one chain per value,
    wanted placement and partial axes, shared by every consumer that asks for it, so its cost is paid
    once when any consumer pair chooses it. Copies of a value in repeated layers whose charges span the
    same class pairs merge into one charge that costs their sum. A chain only one input of one consumer
    can use goes on that edge's matrix instead: there, at most one of its pairs is chosen, so the edge
    already pays it once, and the ILP stays as small as Alpa's (most values have one consumer)."""
    merged: dict = {}
    for (_, _, _, _, _, cost), (terms, uses) in conversions.items():
        if cost == 0.0:
            continue
        if len(uses) == 1:
            (key, pairs), = terms.items()
            for a, b in pairs:
                if edges[key][a][b] != INF:
                    edges[key][a][b] += cost
            continue
        if any(edges[key][a][b] == INF for key, pairs in terms.items() for a, b in pairs):
            terms = {key: {(a, b) for a, b in pairs if edges[key][a][b] != INF} for key, pairs in terms.items()}
        signature = (cost > 0, tuple(sorted((key, tuple(sorted(pairs))) for key, pairs in terms.items() if pairs)))
        if signature[1]:
            merged[signature] = merged.get(signature, 0.0) + cost
    return [(cost, [(c, d, list(pairs)) for (c, d), pairs in signature[1]]) for signature, cost in merged.items()]


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
                shared: _SharedParts | None = None):
    """One ILP deciding `axes` for every node; `choices` holds the strategies of axes decided before."""
    problem, classes, class_of = _build_problem(nodes, axes, combos, choices, state, models, semi_auto, split,
                                                optimism, shared)
    result = solve_ilp(problem)
    state.ilp_stats.append({"axes": [state.mesh.names[a] for a in axes], "nodes": len(nodes), "classes": len(classes),
                            "variables": result.variables, "constraints": result.constraints,
                            "objective_s": result.objective / _SCALE})
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
    return problem.evaluate(choice) / _SCALE, problem.evaluate_memory(choice)


def _chosen_problem(state, split=None):
    """The joint ILP over every mesh axis with the chosen strategies as each node's only candidate (`split`:
    the graph's kept_split, when known)."""
    nodes = [n for n in state.gm.graph.nodes if meta.CANDIDATES in n.meta]
    grad = needs_grad(state.gm.graph)
    split = split or kept_split(state.gm.graph, grad)
    models = [AxisCostModel(state.mesh, a, state.options.profile, grad, state.options.optimizer_state_factor,
                            split.own) for a in range(state.mesh.ndim)]
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


def _cost_parts(nodes, axes, combos, choices, state, models, semi_auto, split) -> tuple:
    """What the ILP deciding `axes` costs, apart from its memory row: (classes, class of each node, sizes, costs,
    edges, shared charges, conjunction charges, each node's per-candidate breakdowns)."""
    mesh = state.mesh
    free_sync = data_parallel_axes(nodes) if semi_auto else set()  # gradient sync there is the user's choice
    profile = models[0].profile

    def others(node, combo, axis):
        fixed = {b: c for b, c in enumerate(choices[node])}
        fixed.update({b: c for b, c in combo.items() if b != axis})
        return fixed

    breakdowns = {n: [[models[a].node(n, combo[a], others(n, combo, a)) for a in axes] for combo in combos[n]]
                  for n in nodes}
    classes, class_of = decision_classes(
        nodes, lambda n: (tuple(tuple(sorted(c.items())) for c in combos[n]), node_bytes(n),
                          tuple(c.output for c in choices[n])))
    sizes = [len(combos[members[0]]) for members in classes]
    costs = [[0.0] * size for size in sizes]
    copies = state.fold.copies if state.fold is not None else lambda node: 1  # a folded trace's middle layer
    for n in nodes:
        c = class_of[n]
        for s, per_axis in enumerate(breakdowns[n]):
            # compute (with a ring's messages inside the op) is per node, not per axis
            costs[c][s] += copies(n) * (per_axis[0].compute + per_axis[0].in_op_comm) * _SCALE
    pipeline = state.options.pipeline
    sync_share = 1.0 / pipeline.microbatches if pipeline is not None else 1.0
    shared = _partial_gradient_charges(nodes, axes, combos, class_of, models, others, free_sync, sync_share, copies)
    edges: dict = {}
    conversions: dict = {}  # one charge per chain insert_comm emits (see _conversion_charges)
    outs = {u: [tuple(cu[a].output for a in axes) for cu in combos[u]] for u in nodes}
    interned: dict = {}  # placement tuple -> small int: the pair loop below compares and hashes ints, not specs
    out_ids = {u: [interned.setdefault(have, len(interned)) for have in outs[u]] for u in nodes}
    frozen = written_through_views(state.gm.graph)
    size = {u: node_bytes(u) for u in nodes}
    # A conversion's price depends on the value itself on one axis, but only on its kind and bytes on several:
    # there the values of repeated layers share one price per build (and one refund, where it is exact).
    several, whole_mesh = len(axes) > 1, len(axes) > 1 and len(axes) == mesh.ndim
    priced_as = {u: (size[u], _value_kind(u, models)) if several else u for u in nodes}
    prices: dict = {}
    refunds: dict = {}
    sync_refunds: dict = {}  # (value, axis, all-reduce seconds) -> {class pair: candidate pairs that fuse it}
    for v in nodes:
        if v.op != "call_function":
            continue
        mutated = set(mutated_positions(v)) | {pos for pos, u in enumerate(tensor_inputs(v)) if u in frozen}
        for pos, u in enumerate(tensor_inputs(v)):
            if u not in combos:
                continue
            key = (class_of[u], class_of[v])
            matrix = edges.get(key)
            if matrix is None:  # made once per class pair (a default argument would be built for every use)
                matrix = edges[key] = [[0.0] * sizes[key[1]] for _ in range(sizes[key[0]])]
            wants = [tuple(cv[a].inputs[pos] for a in axes) for cv in combos[v]]
            partials = [_partial_axes(u, pos, {**dict(enumerate(choices[v])), **cv}, models) for cv in combos[v]]
            # A conversion into an input placement the user asked for (`<module>:input`) is not penalized.
            penalize = semi_auto and not any(pos in wanted for wanted in v.meta.get(meta.INPUT_HINT, {}).values())
            want_ids = [interned.setdefault(want, len(interned)) for want in wants]
            for a, have in enumerate(outs[u]):
                have_id, row = out_ids[u][a], matrix[a]
                for b, want in enumerate(wants):
                    want_id = want_ids[b]
                    if have_id == want_id or row[b] == INF:
                        continue
                    price_key = (priced_as[u], have_id, want_id, pos in mutated, penalize)
                    cost = prices.get(price_key)
                    if cost is None:
                        cost = prices[price_key] = _edge_cost(u, combos[u][a], have, want, pos in mutated, axes,
                                                              models, others, penalize, mesh, profile, size[u])
                    if cost == INF:
                        row[b] = INF
                        continue
                    refund_key = (priced_as[u], have_id, want_id, partials[b]) if whole_mesh else (v, pos, a, b)
                    found = refunds.get(refund_key)
                    if found is None:
                        found = refunds[refund_key] = _fused_gather_refund(u, v, pos, combos[v][b], have, want, axes,
                                                                           models, others, partials[b], size[u],
                                                                           sync_share)
                    refund, syncs = found
                    cost = (cost - refund) * copies(u)  # one chain per value, in every layer it stands for
                    terms, uses = conversions.setdefault((u, have_id, want_id, partials[b], penalize, cost),
                                                         ({}, set()))
                    terms.setdefault(key, set()).add((a, b))
                    uses.add((v, pos))
                    for axis, sync in syncs.items():  # the value's all-reduce on the axis, refunded once
                        sync_refunds.setdefault((u, axis, sync), {}).setdefault(key, set()).add((a, b))
    conjunctions = _conversion_charges(conversions, edges) + _sync_refunds(sync_refunds, edges, copies)
    return classes, class_of, sizes, costs, edges, shared, conjunctions, breakdowns


def _sync_refunds(sync_refunds: dict, edges: dict, copies) -> list:
    """Conjunction charges paying back a value's gradient all-reduce on an axis (a shared charge) once when any of
    its chains fuses it into the gather (`_fused_gather_refund`)."""
    out = []
    for (u, _, sync), terms in sync_refunds.items():
        kept = [(c, d, sorted(p for p in pairs if edges[(c, d)][p[0]][p[1]] != INF)) for (c, d), pairs in terms.items()]
        kept = [term for term in kept if term[2]]
        if kept and sync:
            out.append((-sync * copies(u), kept))
    return out


def _build_problem(nodes, axes, combos, choices, state, models, semi_auto, split, optimism: float = 1.0,
                   shared: _SharedParts | None = None):
    """The ILP deciding `axes` (see _solve_axes): (IlpProblem, decision classes, class of each node). Its cost
    parts depend on the axes and the earlier axes' choices only (`shared` keeps them for the compile's other
    solves); its memory row on the memory saver being tried."""
    key = (axes, tuple(tuple(choices[n]) for n in nodes))
    parts = shared.costs.get(key) if shared is not None else None
    if parts is None:
        parts = _cost_parts(nodes, axes, combos, choices, state, models, semi_auto, split)
        if shared is not None:
            shared.costs[key] = parts
    classes, class_of, sizes, costs, edges, shared_charges, conjunctions, breakdowns = parts
    mesh = state.mesh
    memory = [[0.0] * size for size in sizes]
    dropped = planned_dropped(state, nodes)
    copies = state.fold.copies if state.fold is not None else lambda node: 1  # a folded trace's middle layer
    share = param_share(state.options.pipeline)  # a pp rank holds its stages' parameters only
    for n in nodes:
        c = class_of[n]
        if n.op == "placeholder" and n.meta.get(meta.KIND) != "input":
            kept = share
        else:
            kept = 0.0 if n in dropped else 1.0  # a recomputed layer's activations are not kept for backward
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
            memory[class_of[u]][s] += nbytes
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
