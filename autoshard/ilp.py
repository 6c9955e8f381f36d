"""The sharding ILP in Alpa's formulation, solved by HiGHS (highspy).

Variables: one-hot binaries x[c, s] per decision class c (a node, or all copies of a node in
repeated layers) and candidate s; per edge (c, d) a joint distribution e[s, t] >= 0 whose marginals
are x[c, :] and x[d, :] (tighter than e >= x_s + x_t - 1, so branch and bound has little to do).
Forbidden pairs fix e[s, t] = 0; edges with a single-candidate end fold into the other end's costs.
An optional memory row bounds sum(memory[c, s] * x[c, s]). A shared charge is paid once when any of
its groups is chosen: a variable y in [0, 1] with y >= sum(x over the group) for every group, costing
`cost * y` (the backward all-reduce of a value used by several split ops happens once).

Two classes with two candidates each; the edge forbids mixing candidate 0 of one with candidate 1 of
the other. The cheapest consistent choice is candidate 1 for both:

>>> problem = IlpProblem(sizes=[2, 2], costs=[[1.0, 2.0], [5.0, 1.0]], edges={(0, 1): [[0.0, INF], [INF, 0.0]]})
>>> solve_ilp(problem).choice
[1, 1]
"""
from __future__ import annotations

from dataclasses import dataclass, field

import highspy
import numpy as np

from .cost import INF
from .errors import PlanError


@dataclass
class IlpProblem:
    """Costs in any consistent unit (the solver works in microseconds).

    >>> IlpProblem(sizes=[3, 2], costs=[[1.0, 2.0, 3.0], [0.0, 1.0]]).n_classes
    2
    """

    sizes: list[int]  # candidates per class
    costs: list[list[float]]  # [class][candidate]
    edges: dict = field(default_factory=dict)  # (class, class) -> [[cost]] (INF = forbidden)
    memory: list[list[float]] | None = None  # [class][candidate] bytes
    budget: float | None = None
    shared: list = field(default_factory=list)  # [(cost, [[(class, candidate), ...], ...])]
    names: list[str] = field(default_factory=list)  # for error messages

    @property
    def n_classes(self) -> int:
        """How many decision classes (one-hot groups of candidates) the problem has.

        >>> problem.n_classes
        2
        """
        return len(self.sizes)


@dataclass
class IlpResult:
    """The chosen candidate per class, the objective, and the ILP's size.

    >>> result = solve_ilp(problem)
    >>> result.objective, result.variables, result.constraints
    (3.0, 8, 6)
    """

    choice: list[int]
    objective: float
    variables: int
    constraints: int


def solve_ilp(problem: IlpProblem) -> IlpResult:
    """Solve `problem` exactly (HiGHS, one thread, fixed seed: the same choice on every rank).

    A memory budget the cheapest choice exceeds forces the other one:

    >>> tight = IlpProblem(sizes=[2], costs=[[1.0, 3.0]], memory=[[100.0, 10.0]], budget=50.0)
    >>> solve_ilp(tight).choice
    [1]
    """
    costs = [list(c) for c in problem.costs]
    allowed = [[True] * n for n in problem.sizes]
    joint = []
    for (c, d), matrix in sorted(problem.edges.items()):
        if problem.sizes[c] == 1 or problem.sizes[d] == 1:
            free = d if problem.sizes[c] == 1 else c
            for a, row in enumerate(matrix):
                for b, cost in enumerate(row):
                    index = b if free == d else a
                    if cost == INF:
                        allowed[free][index] = False
                    else:
                        costs[free][index] += cost
        else:
            joint.append((c, d, matrix))
    for c, ok in enumerate(allowed):
        if not any(ok):
            name = problem.names[c] if problem.names else str(c)
            raise PlanError(f"no sharding of {name} is compatible with its fixed neighbours (a multi-output or "
                            "in-place operand would need resharding)")
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", 0.0)  # exact optimum: compute can dwarf the communication differences
    start, obj, upper = [], [], []
    for c in range(problem.n_classes):
        start.append(len(obj))
        obj += costs[c]
        upper += [1.0 if ok else 0.0 for ok in allowed[c]]
    n_choice = len(obj)
    edge_start = []
    for _, _, matrix in joint:
        edge_start.append(len(obj))
        for row in matrix:
            for cost in row:
                obj.append(0.0 if cost == INF else cost)
                upper.append(0.0 if cost == INF else 1.0)
    shared_start = len(obj)
    for cost, _ in problem.shared:
        obj.append(cost)
        upper.append(1.0)
    n_var = len(obj)
    h.addVars(n_var, np.zeros(n_var), np.array(upper))
    h.changeColsCost(n_var, np.arange(n_var, dtype=np.int32), np.array(obj, dtype=np.float64))
    h.changeColsIntegrality(n_choice, np.arange(n_choice, dtype=np.int32),
                            np.array([highspy.HighsVarType.kInteger] * n_choice))
    rows = _Rows()
    for c, n in enumerate(problem.sizes):
        rows.add(1.0, 1.0, range(start[c], start[c] + n), [1.0] * n)
    for (c, d, _), e0 in zip(joint, edge_start):
        nu, nv = problem.sizes[c], problem.sizes[d]
        for a in range(nu):
            rows.add(0.0, 0.0, [e0 + a * nv + b for b in range(nv)] + [start[c] + a], [1.0] * nv + [-1.0])
        for b in range(nv):
            rows.add(0.0, 0.0, [e0 + a * nv + b for a in range(nu)] + [start[d] + b], [1.0] * nu + [-1.0])
    for i, (_, groups) in enumerate(problem.shared):
        for group in groups:
            idx = [start[c] + s for c, s in group]
            rows.add(-highspy.kHighsInf, 0.0, idx + [shared_start + i], [1.0] * len(idx) + [-1.0])
    if problem.budget is not None and problem.memory is not None:
        idx = [start[c] + s for c, n in enumerate(problem.sizes) for s in range(n)]
        rows.add(-highspy.kHighsInf, problem.budget, idx, [m for per in problem.memory for m in per])
    rows.flush(h)
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        raise MemoryBudgetError(problem)
    if status != highspy.HighsModelStatus.kOptimal:
        raise PlanError(f"the sharding ILP found no plan ({h.modelStatusToString(status)})")
    values = h.getSolution().col_value
    choice = [max(range(n), key=lambda s: values[start[c] + s]) for c, n in enumerate(problem.sizes)]
    return IlpResult(choice, h.getInfo().objective_function_value, n_var, rows.count)


class MemoryBudgetError(PlanError):
    """No plan fits the per-device memory budget; says the budget and the smallest footprint found.

    >>> solve_ilp(IlpProblem(sizes=[2], costs=[[1.0, 3.0]], memory=[[100.0, 60.0]], budget=50.0))
    Traceback (most recent call last):
    ...
    autoshard.ilp.MemoryBudgetError: no plan fits the memory budget of 0.000 GiB (50 bytes) per device: ... 0.000 GiB (60 bytes). ...
    """

    def __init__(self, problem: IlpProblem):
        self.problem = problem
        self.minimum = sum(min(per) for per in problem.memory or [])
        super().__init__(f"no plan fits the memory budget of {_gib(problem.budget)} per device: the smallest "
                         f"footprint the sharding search can reach is {_gib(self.minimum)}. Raise the budget, "
                         "use a larger mesh, or add ZeRO / activation checkpointing.")


def _gib(nbytes) -> str:
    return f"{nbytes / 2**30:.3f} GiB ({int(nbytes)} bytes)"


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
