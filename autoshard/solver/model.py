"""An IlpProblem built into a HiGHS model, in Alpa's formulation (`build_model`).

Variables: one-hot binaries x[c, s] per decision class c (a node, or all copies of a node in
repeated layers) and candidate s; per edge (c, d) a joint distribution e[s, t] >= 0 whose marginals
are x[c, :] and x[d, :] (tighter than e >= x_s + x_t - 1, so branch and bound has little to do).
Forbidden pairs fix e[s, t] = 0; edges with a single-candidate end fold into the other end's costs.
An optional memory row bounds sum(memory[c, s] * x[c, s]) plus the bytes on edges (`edge_memory[c, d][s, t]` on
e[s, t]: a converted copy a consumer keeps) and the memory charges (bytes paid once when any of their terms holds,
as a conjunction charge; `evaluate_memory` is the row at one choice). A shared charge is paid once when any of
its groups is chosen: a variable y in [0, 1] with y >= sum(x over the group) for every group, costing
`cost * y` (the backward all-reduce of a value used by several split ops happens once).
A conjunction charge is paid once when any of its terms holds, a term being "classes c and d choose
one of these candidate pairs" (a conversion of one value shared by all consumers that ask for the same
placement: insert_comm emits one chain for them). Its variable y is tied to the edge variables
e[s, t] of the pairs, so it stays as tight as the edges: y >= sum(e over a term's pairs) per term when
it costs, y <= sum(e over every term's pairs) when it pays back (a negative cost).

Two classes with two candidates each and an edge between them: 4 x and 4 e columns, 2 one-hot rows and 4 marginal
rows.

>>> from autoshard.cost.collective_time import INF
>>> problem = IlpProblem(sizes=[2, 2], costs=[[1.0, 2.0], [5.0, 1.0]], edges={(0, 1): [[0.0, INF], [INF, 0.0]]})
>>> model = build_model(problem, {})
>>> model.n_var, model.n_rows
(8, 6)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import highspy
import numpy as np

from autoshard.cost.collective_time import INF
from autoshard.ir.errors import PlanError
from autoshard.solver.highs import quiet_highs
from autoshard.solver.problem import IlpProblem


@dataclass
class IlpModel:
    """An IlpProblem built into HiGHS (`highs`: every column and row in, not run yet) and where its columns are:
    class c's candidates are the columns from start[c] on; they come first (the `n_choice` integer columns), the
    edges' joint distributions and the charges' variables after. `costs` and `allowed` are per class and candidate
    once the edges to single-candidate classes are folded in; `objective` and `upper` are per column; `memory_row`
    is the budget row's (columns, bytes), None without a budget.

    >>> model.start, model.n_choice, model.upper
    ([0, 2], 4, [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    """

    problem: IlpProblem
    highs: highspy.Highs
    costs: list[list[float]]
    allowed: list[list[bool]]
    start: list[int]
    objective: list[float]
    upper: list[float]
    n_choice: int
    n_rows: int
    memory_row: tuple[list[int], list[float]] | None
    layout: _Columns | None = None  # where the edge and charge columns start (`columns_of`)
    charges: list = field(default_factory=list)  # the memory charges the budget row holds

    @property
    def n_var(self) -> int:
        """How many columns (variables) the model has.

        >>> model.n_var
        8
        """
        return len(self.objective)

    def choice(self, values) -> list[int]:
        """The candidate per class that a solution's column values pick.

        >>> model.choice([0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
        [1, 1]
        """
        return [max(range(n), key=lambda s: values[self.start[c] + s]) for c, n in enumerate(self.problem.sizes)]

    def columns_of(self, choice: list[int]) -> list[float]:
        """Every column's value at one candidate per class (a MIP start HiGHS need not complete): the choice columns,
        each joint edge's chosen pair, and each charge's variable at the least value its rows allow (a refund's at
        the most).

        >>> model.columns_of([1, 1])
        [0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
        """
        problem, layout = self.problem, self.layout
        values = [0.0] * self.n_var
        for c, s in enumerate(choice):
            values[self.start[c] + s] = 1.0
        for (c, d), e0 in layout.joint_start.items():
            values[e0 + choice[c] * problem.sizes[d] + choice[d]] = 1.0

        def held(terms) -> list[float]:
            out = []
            for c, d, pairs in terms:
                index, constant = _pair_indicator(problem.sizes, self.start, layout.joint_start, c, d, pairs)
                out.append(sum(values[i] for i in index) + constant)
            return out
        for i, (_, groups) in enumerate(problem.shared):
            values[layout.shared_start + i] = min(1.0, max((sum(values[self.start[c] + s] for c, s in group)
                                                            for group in groups), default=0.0))
        for i, (cost, terms) in enumerate(problem.conjunctions):
            indicators = held(terms)
            held_once = sum(indicators) if cost < 0 else max(indicators, default=0.0)  # a refund: at the most
            values[layout.conjunction_start + i] = min(1.0, held_once)
        for i, (_, terms) in enumerate(self.charges):
            values[layout.charge_start + i] = min(1.0, max(held(terms), default=0.0))
        return values


def build_model(problem: IlpProblem, options: dict) -> IlpModel:
    """`problem` as a HiGHS model with `options` (HiGHS option names) set: its columns, then its rows in one call.
    A class whose every candidate a fixed neighbour forbids is a PlanError.

    >>> build_model(IlpProblem(sizes=[1, 2], costs=[[0.0], [1.0, 1.0]], edges={(0, 1): [[INF, INF]]}), {})
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.PlanError: no sharding of 1 is compatible with its fixed neighbours (a multi-output or in-place operand would need resharding)
    """
    bounded = problem.budget is not None and problem.memory is not None
    folded = _fold_single_candidate_edges(problem, bounded)
    for c, ok in enumerate(folded.allowed):
        if not any(ok):
            name = problem.names[c] if problem.names else str(c)
            raise PlanError(f"no sharding of {name} is compatible with its fixed neighbours (a multi-output or "
                            "in-place operand would need resharding)")
    h = _new_highs(options)
    charges = problem.memory_charges if bounded else []
    columns = _lay_out_columns(problem, folded, charges)
    n_var = len(columns.objective)
    h.addVars(n_var, np.zeros(n_var), np.array(columns.upper))
    h.changeColsCost(n_var, np.arange(n_var, dtype=np.int32), np.array(columns.objective, dtype=np.float64))
    h.changeColsIntegrality(columns.n_choice, np.arange(columns.n_choice, dtype=np.int32),
                            np.array([highspy.HighsVarType.kInteger] * columns.n_choice))
    rows = _Rows()
    _add_one_hot_rows(rows, problem, columns)
    _add_marginal_rows(rows, problem, folded, columns)
    _add_shared_rows(rows, problem, columns)
    _add_conjunction_rows(rows, problem, columns)
    _add_memory_charge_rows(rows, problem, charges, columns)
    memory_row = _add_budget_row(rows, problem, folded, charges, columns) if bounded else None
    n_rows = rows.count
    rows.flush(h)
    return IlpModel(problem, h, folded.costs, folded.allowed, columns.start, columns.objective, columns.upper,
                    columns.n_choice, n_rows, memory_row, columns, charges)


@dataclass
class _Folded:
    """The costs, memory and allowed candidates per class once each edge with a single-candidate end is folded into
    its other end; `joint` holds the other edges as (c, d, costs, bytes kept or None)."""

    costs: list
    memory: list | None
    allowed: list
    joint: list


def _fold_single_candidate_edges(problem: IlpProblem, bounded: bool) -> _Folded:
    costs = [list(c) for c in problem.costs]
    memory = [list(m) for m in problem.memory] if bounded else None
    allowed = [[True] * n for n in problem.sizes]
    joint = []
    for (c, d), matrix in sorted(problem.edges.items()):
        kept = problem.edge_memory.get((c, d)) if bounded else None
        if problem.sizes[c] == 1 or problem.sizes[d] == 1:
            free = d if problem.sizes[c] == 1 else c
            for a, row in enumerate(matrix):
                for b, cost in enumerate(row):
                    index = b if free == d else a
                    if cost == INF:
                        allowed[free][index] = False
                    else:
                        costs[free][index] += cost
                        if kept:
                            memory[free][index] += kept[a][b]
        else:
            joint.append((c, d, matrix, kept))
    return _Folded(costs, memory, allowed, joint)


# HiGHS's sub-MIP heuristics (RINS, RENS) and its restart after root fixings spend more than they save on these
# problems: the one-hot rows and the joint edge variables leave the root LP close to integral, and the incumbent
# comes from the cheaper heuristics (feasibility jump, rounding). Measured on the 44 solves of Llama-3-70B over
# 512 devices that take over 0.15 s: 72 -> 43 s of solving, the same plans; a WavLM under a tight budget (the
# hard case of tests/passes/test_ilp_time_limit.py) finds the same plan in the same time.
_SEARCH_OPTIONS = {"mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False, "mip_allow_restart": False}


def _new_highs(options: dict):
    h = quiet_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("mip_rel_gap", 0.0)  # exact optimum: compute can dwarf the communication differences
    for key, value in {**_SEARCH_OPTIONS, **options}.items():  # the caller's options win
        h.setOptionValue(key, value)
    return h


@dataclass
class _Columns:
    """Where each kind of variable starts, and every column's cost and upper bound (0: forbidden)."""

    start: list  # per class
    edge_start: list  # per joint edge
    shared_start: int
    conjunction_start: int
    charge_start: int
    objective: list
    upper: list
    n_choice: int
    joint_start: dict  # (c, d) -> the first column of that joint edge's e[s, t]


def _lay_out_columns(problem: IlpProblem, folded: _Folded, charges: list) -> _Columns:
    start, obj, upper = [], [], []
    for c in range(problem.n_classes):
        start.append(len(obj))
        obj += folded.costs[c]
        upper += [1.0 if ok else 0.0 for ok in folded.allowed[c]]
    n_choice = len(obj)
    edge_start = []
    for _, _, matrix, _ in folded.joint:
        edge_start.append(len(obj))
        for row in matrix:
            for cost in row:
                obj.append(0.0 if cost == INF else cost)
                upper.append(0.0 if cost == INF else 1.0)
    shared_start = len(obj)
    for cost, _ in problem.shared:
        obj.append(cost)
        upper.append(1.0)
    conjunction_start = len(obj)
    for cost, _ in problem.conjunctions:
        obj.append(cost)
        upper.append(1.0)
    charge_start = len(obj)
    obj += [0.0] * len(charges)
    upper += [1.0] * len(charges)
    joint_start = {(c, d): e0 for (c, d, _, _), e0 in zip(folded.joint, edge_start)}
    return _Columns(start, edge_start, shared_start, conjunction_start, charge_start, obj, upper, n_choice,
                    joint_start)


def _add_one_hot_rows(rows: _Rows, problem: IlpProblem, columns: _Columns) -> None:
    for c, n in enumerate(problem.sizes):
        rows.add(1.0, 1.0, range(columns.start[c], columns.start[c] + n), [1.0] * n)


def _add_marginal_rows(rows: _Rows, problem: IlpProblem, folded: _Folded, columns: _Columns) -> None:
    """A joint edge's e[s, t] sum to x[c, s] over t and to x[d, t] over s."""
    start = columns.start
    for (c, d, _, _), e0 in zip(folded.joint, columns.edge_start):
        nu, nv = problem.sizes[c], problem.sizes[d]
        for a in range(nu):
            rows.add(0.0, 0.0, [e0 + a * nv + b for b in range(nv)] + [start[c] + a], [1.0] * nv + [-1.0])
        for b in range(nv):
            rows.add(0.0, 0.0, [e0 + a * nv + b for a in range(nu)] + [start[d] + b], [1.0] * nu + [-1.0])


def _add_shared_rows(rows: _Rows, problem: IlpProblem, columns: _Columns) -> None:
    for i, (_, groups) in enumerate(problem.shared):
        for group in groups:
            idx = [columns.start[c] + s for c, s in group]
            rows.add(-highspy.kHighsInf, 0.0, idx + [columns.shared_start + i], [1.0] * len(idx) + [-1.0])


def _add_conjunction_rows(rows: _Rows, problem: IlpProblem, columns: _Columns) -> None:
    for i, (cost, terms) in enumerate(problem.conjunctions):
        y = columns.conjunction_start + i
        indicators = [_pair_indicator(problem.sizes, columns.start, columns.joint_start, c, d, pairs)
                      for c, d, pairs in terms]
        if cost >= 0:  # y >= each term's indicator
            for idx, constant in indicators:
                rows.add(-highspy.kHighsInf, -constant, idx + [y], [1.0] * len(idx) + [-1.0])
        else:  # y <= the sum of the indicators (and y <= 1 by its bound)
            idx = [j for term, _ in indicators for j in term]
            rows.add(-highspy.kHighsInf, sum(constant for _, constant in indicators), [y] + idx,
                     [1.0] + [-1.0] * len(idx))


def _add_memory_charge_rows(rows: _Rows, problem: IlpProblem, charges: list, columns: _Columns) -> None:
    for i, (_, terms) in enumerate(charges):  # a memory charge is held once any of its terms holds
        for c, d, pairs in terms:
            idx, constant = _pair_indicator(problem.sizes, columns.start, columns.joint_start, c, d, pairs)
            rows.add(-highspy.kHighsInf, -constant, idx + [columns.charge_start + i], [1.0] * len(idx) + [-1.0])


def _add_budget_row(rows: _Rows, problem: IlpProblem, folded: _Folded, charges: list,
                    columns: _Columns) -> tuple[list[int], list[float]]:
    """The memory row, bounded by the budget (the model's last row); returns its columns and bytes."""
    idx = [columns.start[c] + s for c, n in enumerate(problem.sizes) for s in range(n)]
    value = [m for per in folded.memory for m in per]
    for (_, _, matrix, kept), e0 in zip(folded.joint, columns.edge_start):
        if kept:
            pairs = [(a * len(matrix[0]) + b, m) for a, row in enumerate(kept) for b, m in enumerate(row) if m]
            idx += [e0 + j for j, _ in pairs]
            value += [m for _, m in pairs]
    idx += [columns.charge_start + i for i in range(len(charges))]
    value += [nbytes for nbytes, _ in charges]
    rows.add(-highspy.kHighsInf, problem.budget, idx, value)
    return idx, value


def _pair_indicator(sizes, start, joint_start, c, d, pairs) -> tuple[list[int], float]:
    """Variables whose sum is 1 exactly when classes c and d choose one of `pairs` (and a constant):
    the edge variables e[s, t] of a joint edge, or one class's x when the other has one candidate."""
    if (c, d) in joint_start:
        e0, nv = joint_start[(c, d)], sizes[d]
        return [e0 + s * nv + t for s, t in pairs], 0.0
    if sizes[c] == 1 and sizes[d] == 1:
        return [], float((0, 0) in pairs)
    if sizes[c] == 1:
        return [start[d] + t for s, t in pairs if s == 0], 0.0
    if sizes[d] == 1:
        return [start[c] + s for s, t in pairs if t == 0], 0.0
    raise ValueError(f"conjunction over classes {c} and {d}, which share no edge: add it to `edges`")


class _Rows:
    """Collects rows and hands them to HiGHS in one call (row-by-row calls are slow in Python)."""

    def __init__(self):
        self.lower, self.upper, self.starts, self.index, self.value = [], [], [], [], []

    def add(self, lower, upper, index, value):
        self.lower.append(lower)
        self.upper.append(upper)
        self.starts.append(len(self.index))
        self.index.extend(index)
        self.value.extend(value)

    @property
    def count(self) -> int:
        return len(self.lower)

    def flush(self, h):
        if not self.lower:
            return
        h.addRows(len(self.lower), np.array(self.lower), np.array(self.upper), len(self.index),
                  np.array(self.starts, dtype=np.int32), np.array(self.index, dtype=np.int32),
                  np.array(self.value, dtype=np.float64))
