"""solve: choose one strategy per node on every mesh axis by an ILP (Alpa's formulation) on HiGHS.

Reads `autoshard.candidates`, `autoshard.hint`, `autoshard.input_hint`, FakeTensor vals and the cost
model. Writes `autoshard.choice` ([per axis: AxisStrategy]), `autoshard.spec`, `autoshard.in_specs`
and `autoshard.grad_partial` (per input position: axes where its gradient comes back partial).

Axes are solved one after another (outer first); each axis's ILP sees tensor sizes already divided by
the earlier axes' choices. Per axis: a one-hot binary per node candidate, an edge variable per
(producer, consumer) candidate pair with a resharding cost (linearised: e >= x_u + x_v - 1), and
forbidden pairs (multi-output producers and mutated inputs cannot be resharded). Hints are hard
constraints. Node costs count compute (divided when the work is split) and the backward all-reduce
implied by the duality rule for replicated inputs of split ops.

Semi-auto mode (any hint given) behaves like GSPMD propagation: hinted shardings flow through the
graph instead of being traded away for a cheaper plan. Resharding a parameter, and gathering a
sharded tensor back to replicated, cost `PROPAGATION_PENALTY` times their price (so they happen only
where no op can keep the sharding), and the gradient reduction of a replicated parameter used by a
split op is not charged (sharding the batch *is* the user's choice of data parallelism).
"""
from __future__ import annotations

import math

import highspy
import numpy as np
import torch

from .. import meta
from ..cost import DEFAULT_PROFILE, INF, all_reduce_time, conversion_time
from ..errors import HintError, PlanError
from ..flops import is_matmul_like, node_bytes, node_flops
from ..placement import Replicate, Shard, Spec
from ..strategies import tensor_inputs
from ..strategies.base import feasible, RuleContext, output_shapes
from .annotate import INPUT_HINT

aten = torch.ops.aten
_SCALE = 1e6
PROPAGATION_PENALTY = 1e3  # seconds -> microseconds keeps HiGHS's tolerances meaningful
MUTATED_POSITIONS = {aten.add_.Tensor: (0,), aten.copy_.default: (0,), aten.mul_.Tensor: (0,),
                     aten.fill_.Scalar: (0,), aten.zero_.default: (0,)}


def solve(state) -> None:
    graph = state.gm.graph
    profile = state.options.get("profile", DEFAULT_PROFILE)
    nodes = [n for n in graph.nodes if meta.CANDIDATES in n.meta]
    grad = needs_grad(graph)
    charge_sync = not state.hints
    choices: dict = {n: [] for n in nodes}
    for axis in range(state.mesh.ndim):
        picked = _solve_axis(nodes, axis, state.mesh, choices, grad, profile, charge_sync)
        for node in nodes:
            choices[node].append(picked[node])
    for node in nodes:
        chosen = choices[node]
        node.meta[meta.CHOICE] = chosen
        node.meta[meta.SPEC] = Spec(c.output for c in chosen)
        n_in = len(chosen[0].inputs) if chosen else 0
        node.meta[meta.IN_SPECS] = [Spec(c.inputs[i] for c in chosen) for i in range(n_in)]
        inputs = tensor_inputs(node) if node.op == "call_function" else []
        node.meta[meta.GRAD_PARTIAL] = [
            tuple(a for a, c in enumerate(chosen) if isinstance(c.inputs[i], Replicate) and c.splits_work)
            if grad.get(inputs[i], False) else () for i in range(n_in)]


solve.name = "solve"


def needs_grad(graph) -> dict:
    """Which values carry a gradient: parameters and everything float computed from them."""
    out = {}
    for node in graph.nodes:
        val = node.meta.get("val")
        is_float = isinstance(val, torch.Tensor) and val.is_floating_point() or (
            isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in val))
        if node.op == "placeholder":
            out[node] = node.meta.get(meta.KIND) == "param" and is_float
        elif node.op == "call_function":
            out[node] = bool(is_float and node.target is not aten.detach.default
                             and any(out.get(i, False) for i in node.all_input_nodes))
    return out


def _local(shape, placements, mesh, upto_axis):
    """Shape after the placements chosen on axes before `upto_axis`."""
    shape = list(shape)
    for axis, p in enumerate(placements[:upto_axis]):
        if isinstance(p, Shard) and p.dim < len(shape):
            shape[p.dim] //= mesh.shape[axis]
    return tuple(shape)


def _axis_candidates(node, axis, mesh, choices):
    """Candidates still feasible on this axis given the shapes left by earlier axes, with hints applied."""
    prior = choices[node]
    inputs = tensor_inputs(node) if node.op == "call_function" else []
    in_shapes = []
    for i, producer in enumerate(inputs):
        shapes = output_shapes(producer)
        in_shapes.append(_local(shapes[0] if shapes else (), [c.inputs[i] for c in prior], mesh, axis))
    out_shapes = [_local(s, [c.output for c in prior], mesh, axis) for s in output_shapes(node)]
    ctx = RuleContext(node, in_shapes, out_shapes, mesh.shape[axis])
    found = [c for c in node.meta[meta.CANDIDATES][axis] if feasible(c, ctx)]
    hint = node.meta.get(meta.HINT, {}).get(axis)
    if hint is not None:
        found = [c for c in found if c.output == hint]
    for pos, placement in node.meta.get(INPUT_HINT, {}).get(axis, {}).items():
        found = [c for c in found if c.inputs[pos] == placement]
    if not found:
        what = f"hint {hint!r}" if hint is not None else "the split counts given for it"
        raise HintError(f"{what} on mesh axis {mesh.names[axis]!r} cannot be met at {node.meta.get(meta.PATH) or ''} "
                        f"(node {node.name!r}, op {node.target}): after the earlier axes' choices no sharding of "
                        "this op produces it; relax the hint or shard a dim that divides evenly")
    return found


def _solve_axis(nodes, axis, mesh, choices, grad, profile, charge_sync):
    k = mesh.shape[axis]
    link = profile.link(mesh.shape, axis)
    cands = {n: _axis_candidates(n, axis, mesh, choices) for n in nodes}
    node_costs = {n: [_node_cost(n, c, k, link, profile, grad, choices, mesh, axis, charge_sync) * _SCALE
                      for c in cands[n]] for n in nodes}
    edges: dict = {}  # (u, v) -> cost matrix [len(cands[u])][len(cands[v])], INF = forbidden
    for v in nodes:
        if v.op != "call_function":
            continue
        mutated = MUTATED_POSITIONS.get(v.target, ())
        if v.target is aten.batch_norm.default and v.args[5]:
            mutated = (3, 4)
        for pos, u in enumerate(tensor_inputs(v)):
            if u not in cands:
                continue
            matrix = edges.setdefault((u, v), [[0.0] * len(cands[v]) for _ in cands[u]])
            tuple_valued = isinstance(u.meta.get("val"), (tuple, list))
            nbytes = _local_bytes(u, choices, mesh, axis)
            is_param = u.op == "placeholder" and u.meta.get(meta.KIND) != "input"
            for a, cu in enumerate(cands[u]):
                for b, cv in enumerate(cands[v]):
                    want = cv.inputs[pos]
                    if cu.output == want:
                        continue
                    if tuple_valued or pos in mutated:
                        matrix[a][b] = INF
                        continue
                    cost = conversion_time(cu.output, want, nbytes, k, link)
                    if not charge_sync and (is_param or isinstance(cu.output, Shard) and isinstance(want, Replicate)):
                        cost *= PROPAGATION_PENALTY
                    matrix[a][b] += cost * _SCALE
    chosen = _run_ilp(nodes, cands, node_costs, edges)
    return {n: cands[n][chosen[n]] for n in nodes}


def _local_bytes(node, choices, mesh, axis) -> float:
    prior = [c.output for c in choices[node]]
    total = node_bytes(node)
    for a, p in enumerate(prior[:axis]):
        if isinstance(p, Shard):
            total /= mesh.shape[a]
    return total


def _node_cost(node, cand, k, link, profile, grad, choices, mesh, axis, charge_sync) -> float:
    if node.op != "call_function":
        return 0.0
    prior_split = math.prod(mesh.shape[a] for a, c in enumerate(choices[node]) if c.splits_work)
    split = prior_split * (k if cand.splits_work else 1)
    if is_matmul_like(node):
        compute = 3 * node_flops(node) / profile.peak_flops / split
    else:
        compute = 3 * node_bytes(node) / profile.memory_bandwidth / split
    comm = 0.0
    if cand.splits_work:
        for pos, producer in enumerate(tensor_inputs(node)):
            is_param = producer.op == "placeholder"
            if isinstance(cand.inputs[pos], Replicate) and grad.get(producer, False) and (charge_sync or not is_param):
                comm += all_reduce_time(_local_bytes(producer, choices, mesh, axis), k, link)
    return compute + comm


def _run_ilp(nodes, cands, node_costs, edges) -> dict:
    """Alpa's ILP: one-hot x per node; per edge a joint distribution e over candidate pairs whose
    marginals are the two nodes' x (a tight relaxation); forbidden pairs have e = 0. Edges with a
    single-candidate end are folded into the other end's costs first, so hinted or trivial nodes add
    no variables."""
    costs = {n: list(node_costs[n]) for n in nodes}
    allowed = {n: [True] * len(cands[n]) for n in nodes}
    joint = []
    for (u, v), matrix in edges.items():
        if len(cands[u]) == 1 or len(cands[v]) == 1:
            for a in range(len(cands[u])):
                for b in range(len(cands[v])):
                    cost = matrix[a][b]
                    free, index = (v, b) if len(cands[u]) == 1 else (u, a)
                    if cost == INF:
                        allowed[free][index] = False
                    else:
                        costs[free][index] += cost
        else:
            joint.append((u, v, matrix))
    for n in nodes:
        if not any(allowed[n]):
            raise PlanError(f"no sharding of node {n.name!r} ({n.meta.get(meta.PATH) or n.target}) is compatible "
                            "with its fixed neighbours (a multi-output or in-place operand would need resharding)")
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("threads", 1)
    start, n_var, obj, upper = {}, 0, [], []
    for n in nodes:
        start[n] = n_var
        n_var += len(cands[n])
        obj += costs[n]
        upper += [1.0 if ok else 0.0 for ok in allowed[n]]
    n_choice = n_var
    edge_start = []
    for u, v, matrix in joint:
        edge_start.append(n_var)
        for row in matrix:
            for cost in row:
                obj.append(0.0 if cost == INF else cost)
                upper.append(0.0 if cost == INF else 1.0)
                n_var += 1
    inf = highspy.kHighsInf
    h.addVars(n_var, np.zeros(n_var), np.array(upper))
    h.changeColsCost(n_var, np.arange(n_var, dtype=np.int32), np.array(obj, dtype=np.float64))
    h.changeColsIntegrality(n_choice, np.arange(n_choice, dtype=np.int32),
                            np.array([highspy.HighsVarType.kInteger] * n_choice))
    for n in nodes:
        count = len(cands[n])
        h.addRow(1.0, 1.0, count, np.arange(start[n], start[n] + count, dtype=np.int32), np.ones(count))
    for (u, v, matrix), e0 in zip(joint, edge_start):
        nu, nv = len(cands[u]), len(cands[v])
        for a in range(nu):  # sum_b e[a, b] = x_u[a]
            idx = [e0 + a * nv + b for b in range(nv)] + [start[u] + a]
            h.addRow(0.0, 0.0, nv + 1, np.array(idx, dtype=np.int32), np.array([1.0] * nv + [-1.0]))
        for b in range(nv):  # sum_a e[a, b] = x_v[b]
            idx = [e0 + a * nv + b for a in range(nu)] + [start[v] + b]
            h.addRow(0.0, 0.0, nu + 1, np.array(idx, dtype=np.int32), np.array([1.0] * nu + [-1.0]))
    h.run()
    status = h.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        raise PlanError(f"the sharding ILP found no plan ({h.modelStatusToString(status)}); the hints may "
                        "force a resharding that is impossible (e.g. turning a full tensor into a partial sum)")
    values = h.getSolution().col_value
    return {n: max(range(len(cands[n])), key=lambda j: values[start[n] + j]) for n in nodes}
