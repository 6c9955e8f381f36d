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

Every solve has a time limit (`default_time_limit`, scaled to the problem's size; a planning call's
`ilp_time_limit` option, through `solver_session`). When it stops the search, the best plan found is returned with
its optimality gap (`IlpResult.stopped`, `IlpResult.gap`); when it stops the choice among equally good plans, the
optimum found is kept (the plan is optimal, but another process could pick another of the ties); when no plan was
found by then, IlpTimeLimitError says so. Inside a `solver_session` (one per planning call) a problem met again is
not solved again: the memory ladder and the hand-plan search meet the same problems.

Two classes with two candidates each; the edge forbids mixing candidate 0 of one with candidate 1 of
the other. The cheapest consistent choice is candidate 1 for both:

>>> problem = IlpProblem(sizes=[2, 2], costs=[[1.0, 2.0], [5.0, 1.0]], edges={(0, 1): [[0.0, INF], [INF, 0.0]]})
>>> solve_ilp(problem).choice
[1, 1]
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import hashlib
import math
import os
import pickle
import sys
import time
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
    """The chosen candidate per class, the objective, the ILP's size, and whether its time limit stopped it:
    `stopped` is "" (solved exactly), "search" (the best plan found, `gap` its relative distance to the best
    bound) or "ties" (optimal, the canonical choice among equally good plans not finished).

    >>> result = solve_ilp(problem)
    >>> result.objective, result.variables, result.constraints, result.stopped
    (3.0, 8, 6, '')
    """

    choice: list[int]
    objective: float
    variables: int
    constraints: int
    stopped: str = ""
    gap: float = 0.0
    seconds: float = 0.0
    time_limit: float = 0.0

    def to_json(self) -> dict:
        """What a plan's summary and `plan --json` say of a solve the time limit stopped.

        >>> IlpResult([0], 1.0, 8, 6, "search", 0.0125, 10.02, 10.0).to_json()
        {'stopped': 'search', 'gap': 0.0125, 'seconds': 10.02, 'time_limit': 10.0, 'variables': 8, 'constraints': 6}
        """
        return {"stopped": self.stopped, "gap": self.gap, "seconds": round(self.seconds, 2),
                "time_limit": self.time_limit, "variables": self.variables, "constraints": self.constraints}


# Default time limit of one solve: a base plus a share per variable, capped. Measured on this repository's models
# (2 cores): every solve of the zoo, the transformers families and Llama-3 8B/70B takes under 4 s (the largest,
# 85k variables, 2.3 s); a WavLM under a tight budget takes 15-25 s per solve, or minutes for its larger configs.
TIME_LIMIT_BASE_S = 10.0
TIME_LIMIT_PER_VARIABLE_S = 1e-4
TIME_LIMIT_MAX_S = 60.0
# Past a quarter of its limit (and SOFT_LIMIT_MIN_S), a search ends at a plan within GOOD_ENOUGH_GAP of the best bound
# (the cost model is not more accurate than that), and the choice among ties at its first optimal plan. On a WavLM
# under a tight budget: first plan at 1.8 s 99% above the bound, 6.5 s 1.1%, 10.1 s 0.9%, optimal at 18.7 s.
SOFT_LIMIT_SHARE = 0.25
SOFT_LIMIT_MIN_S = 5.0
GOOD_ENOUGH_GAP = 0.02


def default_time_limit(problem: IlpProblem) -> float:
    """Seconds one solve of `problem` may take unless the planning call says otherwise: TIME_LIMIT_BASE_S plus
    TIME_LIMIT_PER_VARIABLE_S per variable (candidates and edge pairs), at most TIME_LIMIT_MAX_S.

    >>> default_time_limit(problem)
    10.0008
    """
    variables = sum(problem.sizes) + sum(len(m) * len(m[0]) for m in problem.edges.values() if m)
    return min(TIME_LIMIT_MAX_S, TIME_LIMIT_BASE_S + TIME_LIMIT_PER_VARIABLE_S * variables)


@dataclass
class SolverSession:
    """What the solves of one planning call share (`solver_session`): their time limit (None: each problem's
    `default_time_limit`), the outcome of every problem solved (met again, it is not solved again) and the solves
    the time limit stopped, in order.

    >>> with solver_session(time_limit=5.0) as session:
    ...     solve_ilp(problem).choice, solve_ilp(problem).choice, len(session.solved)
    ([1, 1], [1, 1], 1)
    """

    time_limit: float | None = None
    solved: dict = field(default_factory=dict)
    stopped: list = field(default_factory=list)


def describe_stopped(stopped: list) -> str:
    """What the plan's summary and the warning say of the solves (IlpResults) the time limit stopped.

    >>> print(describe_stopped([IlpResult([0], 1.0, 8, 6, "search", 0.0125, 10.02, 10.0)]))
    the sharding ILP stopped early in 1 solve (time limit 10 s; past a quarter of it, a plan within 2% of the best bound ends the search): the plan is the best found, its predicted step within 1.25% of the best bound; raise ilp_time_limit= (--ilp-time-limit) to search longer
    """
    searches = [r for r in stopped if r.stopped == "search"]
    limits = "/".join(f"{limit:.3g}" for limit in sorted({round(r.time_limit, 1) for r in stopped}))
    solves = f"{len(stopped)} solve{'s' if len(stopped) > 1 else ''}"
    if searches:
        gap = max(r.gap for r in searches)
        what = f"the plan is the best found, its predicted step within {gap:.2%} of the best bound"
    else:
        what = "the plan is optimal, but its choice among equally good plans was not finished"
    return (f"the sharding ILP stopped early in {solves} (time limit {limits} s; past a quarter of it, a plan within "
            f"{GOOD_ENOUGH_GAP:.0%} of the best bound ends the search): {what}; raise ilp_time_limit= "
            "(--ilp-time-limit) to search longer")


_SESSION: contextvars.ContextVar = contextvars.ContextVar("autoshard_solver_session", default=None)


@contextlib.contextmanager
def solver_session(time_limit: float | None = None):
    """The SolverSession of the solves inside the block; inside another one, that one (a planning call's
    compiles share their caller's).

    >>> with solver_session() as outer, solver_session(time_limit=1.0) as inner:
    ...     inner is outer, outer.time_limit
    (True, None)
    """
    current = _SESSION.get()
    if current is not None:
        yield current
        return
    session = SolverSession(time_limit)
    token = _SESSION.set(session)
    try:
        yield session
    finally:
        _SESSION.reset(token)


def solve_ilp(problem: IlpProblem, options: dict | None = None) -> IlpResult:
    """Solve `problem` exactly and canonically (the same choice on every rank and installation), within its time
    limit (`options["time_limit"]` in seconds, else the session's, else `default_time_limit`; see the module
    docstring for what a stopped solve returns).

    A memory budget the cheapest choice exceeds forces the other one:

    >>> tight = IlpProblem(sizes=[2], costs=[[1.0, 3.0]], memory=[[100.0, 10.0]], budget=50.0)
    >>> solve_ilp(tight).choice
    [1]
    """
    options = {**(_OVERRIDES.get() or {}), **(options or {})}
    session = _SESSION.get()
    key = _digest(problem, options) if session is not None else None
    if key is not None and key in session.solved:
        outcome = session.solved[key]
        if isinstance(outcome, Exception):
            raise outcome
    else:
        limit = options.pop("time_limit", None) or (session.time_limit if session is not None else None) \
            or default_time_limit(problem)
        try:
            outcome = _solve(problem, options, time.perf_counter(), float(limit))
        except (MemoryBudgetError, IlpTimeLimitError) as error:
            if key is not None:
                session.solved[key] = error
            raise
        if key is not None:
            session.solved[key] = outcome
    if outcome.stopped and session is not None:
        session.stopped.append(outcome)
    return outcome


def _digest(problem: IlpProblem, options: dict) -> str:
    """Equal for equal problems (and solver options): what a session's cache is keyed by."""
    fields = (problem.sizes, problem.costs, problem.edges, problem.memory, problem.budget, problem.shared,
              problem.conjunctions, problem.edge_memory, problem.memory_charges, problem.later_ways,
              sorted(options.items()))
    return hashlib.blake2b(pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL), digest_size=16).hexdigest()


@dataclass(frozen=True)
class _Clock:
    """A solve's time: it started at `started` (perf_counter seconds) and may take `limit` seconds; after `soft`
    seconds a plan good enough ends it (GOOD_ENOUGH_GAP)."""

    started: float
    limit: float

    @property
    def deadline(self) -> float:
        return self.started + self.limit

    @property
    def soft(self) -> float:
        return self.started + max(SOFT_LIMIT_MIN_S, SOFT_LIMIT_SHARE * self.limit)


def _solve(problem: IlpProblem, options: dict, started: float, limit: float) -> IlpResult:
    """solve_ilp's work: the optimum, then the canonical plan among the ties, within `limit` seconds of `started`."""
    clock = _Clock(started, limit)
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
    for key, value in options.items():
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
    # Proven by one LP (the MIP's own proof can take minutes); the margin is well above the LP's tolerances, so
    # a plan that fits exactly is never refused.
    if bounded and _memory_floor(h, n_var, idx, value, clock) > problem.budget * (1 + 1e-6):
        raise MemoryBudgetError(problem)
    # HiGHS's presolve spends longer than it saves on these 0/1 assignment problems (zoo and transformers
    # models: solver time 18.9 s -> 10.5 s over 22 plans, plans byte-identical); the tie-breaking solve
    # below, whose extra row presolve does reduce, keeps it.
    h.setOptionValue("presolve", options.get("presolve", "off"))
    finished = _run(h, problem, clock, enough=GOOD_ENOUGH_GAP)
    h.setOptionValue("presolve", options.get("presolve", "choose"))
    objective = h.getInfo().objective_function_value
    values = h.getSolution().col_value
    optimum = [max(range(n), key=lambda s: values[start[c] + s]) for c, n in enumerate(problem.sizes)]

    def result(choice, stopped="", gap=0.0) -> IlpResult:
        return IlpResult(choice, problem.evaluate(choice), n_var, n_rows, stopped, gap, time.perf_counter() - started,
                         limit)

    if not finished:  # the best plan found; no time is left to choose among ties
        return result(optimum, "search", max(0.0, h.getInfo().mip_gap))
    # Ties: among the plans within tie_slack of the optimum, take the canonical one (see tie_order), so
    # that the plan does not depend on the solver's build, seed or options.
    # Every plan pays each class's cheapest candidate: the row and the slack count only what a plan pays
    # above that, so that cost all plans share (compute, mostly) does not drown their differences.
    floor = [min(cost for cost, ok in zip(costs[c], allowed[c]) if ok) for c in range(problem.n_classes)]
    shift = sum(floor)
    bound = objective + tie_slack(objective - shift)
    fixed = _fix_by_reduced_costs(h, n_var, n_choice, bound, problem, clock)
    if fixed is None:  # the time limit stopped the relaxation
        return result(optimum, "ties")
    open_choices = [[s for s in range(n) if allowed[c][s] and start[c] + s not in fixed]
                    for c, n in enumerate(problem.sizes)]
    if all(len(left) == 1 for left in open_choices):  # no other plan can tie: the optimum is the plan
        return result(optimum)
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
    # The optimum satisfies the tie row: handed over as the first incumbent, it spares the search finding one
    # (measured: 2.5 -> 2.2 s on each of the Llama-3-70B plan's budgeted solves; the same plans).
    incumbent = h.getSolution()
    incumbent.col_value = list(values)  # the first solve's columns (the model has changed since)
    h.setSolution(incumbent)
    try:
        try:
            finished = _run(h, problem, clock, enough=math.inf)  # any plan it finds is optimal
        except MemoryBudgetError:  # the optimum satisfies the row: older HiGHS presolves it away wrongly
            h.setOptionValue("presolve", "off")
            finished = _run(h, problem, clock, enough=math.inf)
    except IlpTimeLimitError:  # no tie found before the limit: the optimum itself
        return result(optimum, "ties")
    values = h.getSolution().col_value
    choice = [max(range(n), key=lambda s: values[start[c] + s]) for c, n in enumerate(problem.sizes)]
    if problem.evaluate(choice) > problem.evaluate(optimum) + tie_slack(objective - shift):
        choice = optimum  # the row held only within the solver's tolerance: keep the optimum itself
    return result(choice, "" if finished else "ties")


def _memory_floor(h, n_var: int, idx: list, value: list, clock: _Clock) -> float:
    """The least memory row any plan can have, by the LP relaxation of minimising the row (`idx`, `value`; the
    model's last row, the budget, left out): a lower bound, -inf when the LP did not finish. A budget below it
    is infeasible. Measured on a 2-layer Llama under 0.2 of its memory (80k variables): 0.7 s, where the MIP
    took 15 s to say so (its first LP, with the budget row in, is slow to find that no point satisfies it).

    >>> solve_ilp(IlpProblem(sizes=[2, 2], costs=[[0.0, 1.0]] * 2, edges={(0, 1): [[0.0, 1.0], [1.0, 0.0]]},
    ...                      memory=[[4.0, 2.0], [4.0, 2.0]], edge_memory={(0, 1): [[0.0, 0.0], [9.0, 9.0]]},
    ...                      budget=5.0))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autoshard.solver.ilp.MemoryBudgetError: no plan fits the memory budget ...
    """
    lp = quiet_highs()
    lp.setOptionValue("output_flag", False)
    lp.passModel(h.getModel())
    columns = np.arange(n_var, dtype=np.int32)
    lp.changeColsIntegrality(n_var, columns, np.array([highspy.HighsVarType.kContinuous] * n_var))
    memory = np.zeros(n_var)
    np.add.at(memory, np.array(idx, dtype=np.int64), np.array(value, dtype=np.float64))
    lp.changeColsCost(n_var, columns, memory)
    lp.changeRowBounds(lp.getNumRow() - 1, -highspy.kHighsInf, highspy.kHighsInf)
    lp.setOptionValue("time_limit", max(clock.deadline - time.perf_counter(), 1e-3))
    lp.run()
    if lp.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return -math.inf
    return lp.getInfo().objective_function_value


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


def _fix_by_reduced_costs(h, n_var, n_choice, bound, problem, clock) -> set | None:
    """Fix to 0 every variable that no plan with objective <= `bound` can use: in the LP relaxation, a
    variable at 0 with reduced cost r raises the objective by at least r when set to 1. The tie-breaking
    solve then sees only the candidates that can still tie (usually a few), so it costs little. Returns
    the fixed variables, or None when the time limit stopped the relaxation."""
    everything = np.arange(n_var, dtype=np.int32)
    h.changeColsIntegrality(n_var, everything, np.array([highspy.HighsVarType.kContinuous] * n_var))
    try:
        if not _run(h, problem, clock, mip=False):
            return None
    except IlpTimeLimitError:
        return None
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


_OVERRIDES: contextvars.ContextVar = contextvars.ContextVar("autoshard_highs_options", default=None)


@contextlib.contextmanager
def highs_options(**options):
    """HiGHS options for every ILP solved inside the block (tests use it to show that the plan does not
    depend on the solver's seed, presolve or threads; `time_limit` is the seconds of each whole solve).

    >>> with highs_options(random_seed=7, presolve="off"):
    ...     solve_ilp(problem).choice
    [1, 1]
    """
    token = _OVERRIDES.set({**(_OVERRIDES.get() or {}), **options})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


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


# Statuses of a run a limit stopped: the time limit, the good-enough callback, or a limit set with highs_options.
_STOPPED = (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kInterrupt,
            highspy.HighsModelStatus.kSolutionLimit, highspy.HighsModelStatus.kIterationLimit)


def _run(h, problem, clock: _Clock, mip: bool = True, enough: float | None = None) -> bool:
    """Run HiGHS until the clock's deadline: True when it finished, False when the time limit stopped it with a
    feasible solution (or, after the soft limit, a MIP's relative gap came within `enough`); IlpTimeLimitError when
    it stopped without one."""
    # HiGHS checks a MIP's time from that MIP's start, an LP's over every run of the model (measured: 1.16)
    remaining = max(clock.deadline - time.perf_counter(), 1e-3)
    h.setOptionValue("time_limit", remaining if mip else h.getRunTime() + remaining)

    def good_enough(event) -> None:
        found = math.isfinite(event.data_out.objective_function_value)
        if found and time.perf_counter() >= clock.soft and event.data_out.mip_gap <= enough:
            event.interrupt()

    if mip and enough is not None:
        h.cbMipInterrupt.subscribe(good_enough)
    try:
        h.run()
    finally:
        if mip and enough is not None:
            h.cbMipInterrupt.unsubscribe(good_enough)
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        raise MemoryBudgetError(problem)
    if status in _STOPPED:
        if h.getInfo().primal_solution_status == 2:  # kSolutionStatusFeasible
            return False
        raise IlpTimeLimitError(problem, clock.limit, time.perf_counter() - clock.started, h.getNumCol(),
                                h.getNumRow())
    if status != highspy.HighsModelStatus.kOptimal:
        raise PlanError(f"the sharding ILP found no plan ({h.modelStatusToString(status)})")
    return True


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


class IlpTimeLimitError(PlanError):
    """The sharding ILP found no plan before its time limit; says the limit, the seconds searched, the ILP's size,
    where it was solved (`where`: a memory ladder's rung) and what to do.

    >>> print(IlpTimeLimitError(problem, 10.0, 10.01, 8, 6, where="with ZeRO-3 on the memory ladder"))
    the sharding ILP found no plan within its time limit of 10 s (searched 10.0 s, with ZeRO-3 on the memory ladder; 8 variables, 6 constraints). Raise the limit (parallelize(ilp_time_limit=...), --ilp-time-limit on the command line), or make the search easier: hints that fix placements, a looser memory_budget, ZeRO or checkpoint= given rather than searched.
    """

    def __init__(self, problem: IlpProblem, time_limit: float, seconds: float, variables: int, constraints: int,
                 where: str = ""):
        self.problem, self.time_limit, self.seconds = problem, time_limit, seconds
        self.variables, self.constraints = variables, constraints
        self.where = where
        place = f", {where}" if where else ""
        super().__init__(f"the sharding ILP found no plan within its time limit of {time_limit:g} s (searched "
                         f"{seconds:.1f} s{place}; {variables} variables, {constraints} constraints). Raise the limit "
                         "(parallelize(ilp_time_limit=...), --ilp-time-limit on the command line), or make the search "
                         "easier: hints that fix placements, a looser memory_budget, ZeRO or checkpoint= given rather "
                         "than searched.")

    def at(self, where: str) -> IlpTimeLimitError:
        """The same error, saying where it happened.

        >>> IlpTimeLimitError(problem, 1.0, 1.0, 8, 6).at("with recomputation").where
        'with recomputation'
        """
        return IlpTimeLimitError(self.problem, self.time_limit, self.seconds, self.variables, self.constraints, where)


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
