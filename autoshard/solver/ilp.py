"""The sharding ILP in Alpa's formulation, solved by HiGHS (highspy).

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

Plans are canonical: a second solve keeps the objective within `tie_slack` of the optimum and minimises
`tie_order` (fewest bytes kept per device, then the candidates' fixed order), so the choice depends on
the problem alone, not on the HiGHS version, seed, presolve or thread count
(tests/properties/test_solver_reproducible.py).

Two classes with two candidates each; the edge forbids mixing candidate 0 of one with candidate 1 of
the other. The cheapest consistent choice is candidate 1 for both:

>>> problem = IlpProblem(sizes=[2, 2], costs=[[1.0, 2.0], [5.0, 1.0]], edges={(0, 1): [[0.0, INF], [INF, 0.0]]})
>>> solve_ilp(problem).choice
[1, 1]
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
from dataclasses import dataclass, field

import highspy
import numpy as np

from autoshard.cost.model import INF
from autoshard.ir.errors import PlanError


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
    conjunctions: list = field(default_factory=list)  # [(cost, [(class c, class d, [(s, t), ...]), ...])]
    edge_memory: dict = field(default_factory=dict)  # (class, class) -> [[bytes]] on the edge's pairs
    memory_charges: list = field(default_factory=list)  # [(bytes, [(class c, class d, [(s, t), ...]), ...])]
    names: list[str] = field(default_factory=list)  # for error messages
    kinds: list[str] = field(default_factory=list)  # what each class's memory is, for error messages
    # The memory rows count bytes before `later_ways` more ways of sharding (mesh axes decided after this problem);
    # the budget was scaled by it, and a refusal divides both back to bytes per device.
    later_ways: float = 1.0

    @property
    def n_classes(self) -> int:
        """How many decision classes (one-hot groups of candidates) the problem has.

        >>> problem.n_classes
        2
        """
        return len(self.sizes)

    def evaluate(self, choice) -> float:
        """The objective of one choice per class (what the solver minimises): candidate costs, the edges
        between the chosen pairs, each shared charge once when any of its groups is chosen and each
        conjunction charge once when any of its terms holds.

        >>> problem.evaluate([1, 1]), problem.evaluate([0, 0])
        (3.0, 6.0)
        """
        total = sum(self.costs[c][s] for c, s in enumerate(choice))
        total += sum(matrix[choice[c]][choice[d]] for (c, d), matrix in self.edges.items())
        chosen = set(enumerate(choice))
        total += sum(cost for cost, groups in self.shared if any(chosen.intersection(g) for g in groups))
        total += sum(cost for cost, terms in self.conjunctions
                     if any((choice[c], choice[d]) in pairs for c, d, pairs in terms))
        return total

    def evaluate_memory(self, choice) -> float:
        """The memory row at one choice per class: the candidates' bytes, the edges' between the chosen pairs and
        each memory charge once when any of its terms holds.

        >>> kept = IlpProblem(sizes=[2, 2], costs=[[0.0, 0.0]] * 2, memory=[[8.0, 4.0], [2.0, 2.0]],
        ...                   edge_memory={(0, 1): [[0.0, 16.0], [0.0, 0.0]]}, memory_charges=[(1.0, [(0, 1, [(1, 1)])])])
        >>> kept.evaluate_memory([0, 1]), kept.evaluate_memory([1, 1])
        (26.0, 7.0)
        """
        total = sum(self.memory[c][s] for c, s in enumerate(choice)) if self.memory else 0.0
        total += sum(matrix[choice[c]][choice[d]] for (c, d), matrix in self.edge_memory.items())
        total += sum(nbytes for nbytes, terms in self.memory_charges
                     if any((choice[c], choice[d]) in pairs for c, d, pairs in terms))
        return total


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


def solve_ilp(problem: IlpProblem, options: dict | None = None) -> IlpResult:
    """Solve `problem` exactly and canonically (the same choice on every rank and installation).

    A memory budget the cheapest choice exceeds forces the other one:

    >>> tight = IlpProblem(sizes=[2], costs=[[1.0, 3.0]], memory=[[100.0, 10.0]], budget=50.0)
    >>> solve_ilp(tight).choice
    [1]
    """
    if problem.budget is not None and problem.memory and sum(min(per) for per in problem.memory) > problem.budget:
        raise MemoryBudgetError(problem)  # even the smallest candidate of every class is too big: no need to solve
    costs = [list(c) for c in problem.costs]
    bounded = problem.budget is not None and problem.memory is not None
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
    for c, ok in enumerate(allowed):
        if not any(ok):
            name = problem.names[c] if problem.names else str(c)
            raise PlanError(f"no sharding of {name} is compatible with its fixed neighbours (a multi-output or "
                            "in-place operand would need resharding)")
    h = quiet_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("mip_rel_gap", 0.0)  # exact optimum: compute can dwarf the communication differences
    for key, value in {**_OVERRIDES, **(options or {})}.items():
        h.setOptionValue(key, value)
    start, obj, upper = [], [], []
    for c in range(problem.n_classes):
        start.append(len(obj))
        obj += costs[c]
        upper += [1.0 if ok else 0.0 for ok in allowed[c]]
    n_choice = len(obj)
    edge_start = []
    for _, _, matrix, _ in joint:
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
    charges = problem.memory_charges if bounded else []
    charge_start = len(obj)
    obj += [0.0] * len(charges)
    upper += [1.0] * len(charges)
    n_var = len(obj)
    h.addVars(n_var, np.zeros(n_var), np.array(upper))
    h.changeColsCost(n_var, np.arange(n_var, dtype=np.int32), np.array(obj, dtype=np.float64))
    h.changeColsIntegrality(n_choice, np.arange(n_choice, dtype=np.int32),
                            np.array([highspy.HighsVarType.kInteger] * n_choice))
    rows = _Rows()
    for c, n in enumerate(problem.sizes):
        rows.add(1.0, 1.0, range(start[c], start[c] + n), [1.0] * n)
    for (c, d, _, _), e0 in zip(joint, edge_start):
        nu, nv = problem.sizes[c], problem.sizes[d]
        for a in range(nu):
            rows.add(0.0, 0.0, [e0 + a * nv + b for b in range(nv)] + [start[c] + a], [1.0] * nv + [-1.0])
        for b in range(nv):
            rows.add(0.0, 0.0, [e0 + a * nv + b for a in range(nu)] + [start[d] + b], [1.0] * nu + [-1.0])
    for i, (_, groups) in enumerate(problem.shared):
        for group in groups:
            idx = [start[c] + s for c, s in group]
            rows.add(-highspy.kHighsInf, 0.0, idx + [shared_start + i], [1.0] * len(idx) + [-1.0])
    joint_start = {(c, d): e0 for (c, d, _, _), e0 in zip(joint, edge_start)}
    for i, (cost, terms) in enumerate(problem.conjunctions):
        y = conjunction_start + i
        indicators = [_pair_indicator(problem.sizes, start, joint_start, c, d, pairs) for c, d, pairs in terms]
        if cost >= 0:  # y >= each term's indicator
            for idx, constant in indicators:
                rows.add(-highspy.kHighsInf, -constant, idx + [y], [1.0] * len(idx) + [-1.0])
        else:  # y <= the sum of the indicators (and y <= 1 by its bound)
            idx = [j for term, _ in indicators for j in term]
            rows.add(-highspy.kHighsInf, sum(constant for _, constant in indicators), [y] + idx,
                     [1.0] + [-1.0] * len(idx))
    for i, (_, terms) in enumerate(charges):  # a memory charge is held once any of its terms holds
        for c, d, pairs in terms:
            idx, constant = _pair_indicator(problem.sizes, start, joint_start, c, d, pairs)
            rows.add(-highspy.kHighsInf, -constant, idx + [charge_start + i], [1.0] * len(idx) + [-1.0])
    if bounded:
        idx = [start[c] + s for c, n in enumerate(problem.sizes) for s in range(n)]
        value = [m for per in memory for m in per]
        for (_, _, matrix, kept), e0 in zip(joint, edge_start):
            if kept:
                pairs = [(a * len(matrix[0]) + b, m) for a, row in enumerate(kept) for b, m in enumerate(row) if m]
                idx += [e0 + j for j, _ in pairs]
                value += [m for _, m in pairs]
        idx += [charge_start + i for i in range(len(charges))]
        value += [nbytes for nbytes, _ in charges]
        rows.add(-highspy.kHighsInf, problem.budget, idx, value)
    n_rows = rows.count
    rows.flush(h)
    # HiGHS's presolve spends longer than it saves on these 0/1 assignment problems (zoo and transformers
    # models: solver time 18.9 s -> 10.5 s over 22 plans, plans byte-identical); the tie-breaking solve
    # below, whose extra row presolve does reduce, keeps it.
    h.setOptionValue("presolve", _OVERRIDES.get("presolve", "off"))
    _run(h, problem)
    h.setOptionValue("presolve", _OVERRIDES.get("presolve", "choose"))
    objective = h.getInfo().objective_function_value
    values = h.getSolution().col_value
    optimum = [max(range(n), key=lambda s: values[start[c] + s]) for c, n in enumerate(problem.sizes)]
    # Ties: among the plans within tie_slack of the optimum, take the canonical one (see tie_order), so
    # that the plan does not depend on the solver's build, seed or options.
    # Every plan pays each class's cheapest candidate: the row and the slack count only what a plan pays
    # above that, so that cost all plans share (compute, mostly) does not drown their differences.
    floor = [min(cost for cost, ok in zip(costs[c], allowed[c]) if ok) for c in range(problem.n_classes)]
    shift = sum(floor)
    bound = objective + tie_slack(objective - shift)
    fixed = _fix_by_reduced_costs(h, n_var, n_choice, bound, problem)
    open_choices = [[s for s in range(n) if allowed[c][s] and start[c] + s not in fixed]
                    for c, n in enumerate(problem.sizes)]
    if all(len(left) == 1 for left in open_choices):  # no other plan can tie: the optimum is the plan
        return IlpResult(optimum, problem.evaluate(optimum), n_var, n_rows)
    row = list(obj)
    for c in range(problem.n_classes):
        for s in range(problem.sizes[c]):
            row[start[c] + s] -= floor[c]
    nonzero = [i for i, cost in enumerate(row) if cost != 0.0 and i not in fixed and upper[i] > 0]
    # HiGHS refuses matrix entries above 1e15 (a replicated op at a slow peak): the row is scaled down.
    scale = min(1.0, 1e9 / max((abs(row[i]) for i in nonzero), default=1.0))
    status = h.addRow(-highspy.kHighsInf, (bound - shift) * scale, len(nonzero), np.array(nonzero, dtype=np.int32),
                      np.array([row[i] * scale for i in nonzero], dtype=np.float64))
    if status == highspy.HighsStatus.kError:
        raise PlanError("the sharding ILP's tie-breaking row was refused by HiGHS; please report this model")
    order = tie_order(problem)
    secondary = np.zeros(n_var)
    for c, ranks in enumerate(order):
        secondary[start[c]:start[c] + len(ranks)] = ranks
    h.changeColsCost(n_var, np.arange(n_var, dtype=np.int32), secondary)
    try:
        _run(h, problem)
    except MemoryBudgetError:  # the optimum satisfies the row: older HiGHS presolves it away wrongly
        h.setOptionValue("presolve", "off")
        _run(h, problem)
    values = h.getSolution().col_value
    choice = [max(range(n), key=lambda s: values[start[c] + s]) for c, n in enumerate(problem.sizes)]
    if problem.evaluate(choice) > problem.evaluate(optimum) + tie_slack(objective - shift):
        choice = optimum  # the row held only within the solver's tolerance: keep the optimum itself
    return IlpResult(choice, problem.evaluate(choice), n_var, n_rows)


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


def _fix_by_reduced_costs(h, n_var, n_choice, bound, problem) -> set:
    """Fix to 0 every variable that no plan with objective <= `bound` can use: in the LP relaxation, a
    variable at 0 with reduced cost r raises the objective by at least r when set to 1. The tie-breaking
    solve then sees only the candidates that can still tie (usually a few), so it costs little. Returns
    the fixed variables."""
    everything = np.arange(n_var, dtype=np.int32)
    h.changeColsIntegrality(n_var, everything, np.array([highspy.HighsVarType.kContinuous] * n_var))
    try:
        _run(h, problem)
    except PlanError:  # HiGHS 1.7 can end this LP with status "Unknown": fix nothing (it only saves time)
        h.changeColsIntegrality(n_choice, everything[:n_choice], np.array([highspy.HighsVarType.kInteger] * n_choice))
        return set()
    lp_bound = h.getInfo().objective_function_value
    solution = h.getSolution()
    margin = 1e-6 * abs(bound) + 1e-2  # LP round-off must not fix a variable some tied plan uses
    fixed = [j for j, (value, reduced) in enumerate(zip(solution.col_value, solution.col_dual))
             if value < 1e-9 and lp_bound + reduced > bound + margin]
    if fixed:
        h.changeColsBounds(len(fixed), np.array(fixed, dtype=np.int32), np.zeros(len(fixed)), np.zeros(len(fixed)))
    h.changeColsIntegrality(n_choice, everything[:n_choice], np.array([highspy.HighsVarType.kInteger] * n_choice))
    return set(fixed)


_OVERRIDES: dict = {}


@contextlib.contextmanager
def highs_options(**options):
    """HiGHS options for every ILP solved inside the block (tests use it to show that the plan does not
    depend on the solver's seed, presolve or threads).

    >>> with highs_options(random_seed=7, presolve="off"):
    ...     solve_ilp(problem).choice
    [1, 1]
    """
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(options)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


# Plans whose objectives differ by less than this share (plus 1 ns) of what the optimum pays above every
# class's cheapest candidate are equally good: HiGHS's feasibility tolerances cannot resolve finer
# differences in the tie-breaking solve's objective row.
TIE_RELATIVE = 1e-7


def tie_slack(objective: float) -> float:
    """How far above the optimum (in the solver's microseconds) a plan still counts as a tie; `objective`
    is what the optimum pays above every class's cheapest candidate.

    >>> tie_slack(0.0), round(tie_slack(1e6), 9)
    (0.001, 0.101)
    """
    return TIE_RELATIVE * abs(objective) + 1e-3


def tie_order(problem: IlpProblem) -> list[list[float]]:
    """The second objective that makes the plan canonical: per class, each candidate's rank when its
    candidates are ordered by bytes kept per device, then by their position in the candidate list (a
    fixed order: the strategy registry's); class c's ranks weigh 1 + c / classes, so that two plans rarely
    tie on the sum.

    >>> tie_order(IlpProblem(sizes=[2, 2], costs=[[0.0, 0.0]] * 2, memory=[[8.0, 4.0], [1.0, 1.0]]))
    [[1.0, 0.0], [0.0, 1.5]]
    """
    out = []
    n = problem.n_classes
    for c, size in enumerate(problem.sizes):
        memory = problem.memory[c] if problem.memory is not None else [0.0] * size
        ranked = sorted(range(size), key=lambda s: (memory[s], s))
        weight = 1.0 + c / n
        ranks = [0.0] * size
        for r, s in enumerate(ranked):
            ranks[s] = r * weight
        out.append(ranks)
    return out


def _run(h, problem) -> None:
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        raise MemoryBudgetError(problem)
    if status != highspy.HighsModelStatus.kOptimal:
        raise PlanError(f"the sharding ILP found no plan ({h.modelStatusToString(status)})")


_banner_shown = False


def quiet_highs():
    """A `highspy.Highs` without the copyright banner HiGHS prints on stdout at its first construction in
    a process (it would corrupt `plan --json`): that one construction runs with file descriptor 1 on
    /dev/null.

    >>> type(quiet_highs()).__name__
    'Highs'
    """
    global _banner_shown
    if _banner_shown:
        return highspy.Highs()
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    _banner_shown = True
    # HiGHS's worker threads live in a static scheduler; a process that exits with them running aborts
    # ("terminate called without an active exception", seen under torchrun): stop them first.
    stop = getattr(highspy.Highs, "resetGlobalScheduler", None)  # highspy >= 1.8
    if stop is not None:
        atexit.register(stop, True)
    return h


class MemoryBudgetError(PlanError):
    """No plan fits the per-device memory budget; says the budget, the smallest footprint found (`minimum`: the
    memory row of the plan taking each class's smallest candidate, its edges' copies and charges included) and what
    dominates it (`parts`: bytes per kind of class at that footprint; `searched`: what the search tried).

    >>> solve_ilp(IlpProblem(sizes=[2], costs=[[1.0, 3.0]], memory=[[100.0, 60.0]], budget=50.0))
    Traceback (most recent call last):
    ...
    autoshard.solver.ilp.MemoryBudgetError: no plan fits the memory budget of 0.000 GiB (50 bytes) per device: ... 0.000 GiB (60 bytes). ...
    """

    def __init__(self, problem: IlpProblem, searched: str = "", advice: str = ""):
        self.problem = problem
        memory = problem.memory or []
        choice = [min(range(len(per)), key=per.__getitem__) for per in memory]
        cheapest = [per[s] for per, s in zip(memory, choice)]
        for (c, d), matrix in problem.edge_memory.items():  # a copy counts with its producer's class
            cheapest[c] += matrix[choice[c]][choice[d]]
        for nbytes, terms in problem.memory_charges:
            if any((choice[c], choice[d]) in pairs for c, d, pairs in terms):
                cheapest[terms[0][0]] += nbytes
        cheapest = [nbytes / problem.later_ways for nbytes in cheapest]  # per device
        self.minimum = sum(cheapest)
        self.parts: dict = {}
        for c, nbytes in enumerate(cheapest):
            kind = problem.kinds[c] if problem.kinds else "tensors"
            self.parts[kind] = self.parts.get(kind, 0.0) + nbytes
        dominant = ""
        if len(self.parts) > 1 and self.minimum > 0:
            ranked = sorted(self.parts.items(), key=lambda item: -item[1])
            dominant = " (" + ", ".join(f"{kind} {_readable(nbytes)} = {nbytes / self.minimum:.0%}"
                                         for kind, nbytes in ranked if nbytes >= 0.005 * self.minimum) + ")"
        largest = max(range(len(cheapest)), key=cheapest.__getitem__, default=None)
        if largest is not None and problem.names and cheapest[largest] > 0.05 * self.minimum:
            dominant += f"; the largest part: {problem.names[largest]}, {_readable(cheapest[largest])}"
        how = f" ({searched})" if searched else ""
        advice = advice or "Raise the budget, use a larger mesh, or add ZeRO / activation checkpointing."
        later = f" (if the mesh axes decided after {problem.later_ways:g}x shard it all)" \
            if problem.later_ways > 1 else ""
        super().__init__(f"no plan fits the memory budget of {_gib(problem.budget / problem.later_ways)} per "
                         f"device: the smallest footprint the sharding search can reach{how} is "
                         f"{_gib(self.minimum)}{later}{dominant}. {advice}")


def _readable(nbytes) -> str:
    """Bytes in GiB, MiB or KiB, whichever reads best."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


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
