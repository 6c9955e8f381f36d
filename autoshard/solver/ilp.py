"""The sharding ILP solved exactly and canonically within its time limit: `solve_ilp`.

A solve builds the HiGHS model (model.py, Alpa's formulation), refuses a memory budget no plan can meet (a quick
sum first, then one LP: lp_bounds.py), finds the optimum (its LP relaxation's, when that is a plan: relaxation.py;
else the MIP's), then the canonical plan among the ties (tie_break.py),
all within its time limit (time_limit.py: a stopped search returns the best plan found and its gap). Inside a
`solver_session` (session.py: one per planning call) a problem met again is not solved again.

Two classes with two candidates each; the edge forbids mixing candidate 0 of one with candidate 1 of
the other. The cheapest consistent choice is candidate 1 for both:

>>> from autoshard.cost.collective_time import INF
>>> problem = IlpProblem(sizes=[2, 2], costs=[[1.0, 2.0], [5.0, 1.0]], edges={(0, 1): [[0.0, INF], [INF, 0.0]]})
>>> solve_ilp(problem).choice
[1, 1]
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

from autoshard.solver.errors import IlpTimeLimitError, MemoryBudgetError
from autoshard.solver.lp_bounds import fix_to_zero, memory_floor, plan_read_off
from autoshard.solver.model import IlpModel, build_model
from autoshard.solver.problem import IlpProblem, IlpResult
from autoshard.solver.relaxation import Relaxation, solve_relaxation
from autoshard.solver.session import current_session, highs_overrides, problem_digest
from autoshard.solver.tie_break import break_ties, tie_bound
from autoshard.solver.time_limit import (
    GOOD_ENOUGH_GAP,
    MIP_SEARCH_MAX_COLUMNS,
    SolveClock,
    default_time_limit,
    run_highs,
)


def solve_ilp(problem: IlpProblem, options: dict | None = None,
              start: Callable[[], list[int] | None] | None = None) -> IlpResult:
    """Solve `problem` exactly and canonically (the same choice on every rank and installation), within its time
    limit (`options["time_limit"]` in seconds, else the session's, else `default_time_limit`; see
    autoshard/solver/time_limit.py for what a stopped solve returns). `start`, when given, finds a plan (one
    candidate per class, or None) some cheaper way; it is called only when the MIP must search, and the better of
    its plan and the one read off the relaxation is the search's first incumbent: a search the time limit stops
    returns a plan at least that good (a budget-bound joint ILP of 80k columns found none in 17 s, or one 12x
    slower than the axis-by-axis plan). Under the default time limit a MIP over more than `MIP_SEARCH_MAX_COLUMNS`
    columns is not searched: that plan is the answer (`IlpResult.stopped` "size").

    A memory budget the cheapest choice exceeds forces the other one:

    >>> tight = IlpProblem(sizes=[2], costs=[[1.0, 3.0]], memory=[[100.0, 10.0]], budget=50.0)
    >>> solve_ilp(tight).choice
    [1]

    A budget no plan meets is refused, saying the smallest footprint:

    >>> solve_ilp(IlpProblem(sizes=[2, 2], costs=[[0.0, 1.0]] * 2, edges={(0, 1): [[0.0, 1.0], [1.0, 0.0]]},
    ...                      memory=[[4.0, 2.0], [4.0, 2.0]], edge_memory={(0, 1): [[0.0, 0.0], [9.0, 9.0]]},
    ...                      budget=5.0))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autoshard.solver.errors.MemoryBudgetError: no plan fits the memory budget ...
    """
    options = {**highs_overrides(), **(options or {})}
    session = current_session()
    key = problem_digest(problem, options) if session is not None else None
    if key is not None and key in session.solved:
        outcome = session.solved[key]
        if isinstance(outcome, Exception):
            raise outcome
    else:
        given = options.pop("time_limit", None) or (session.time_limit if session is not None else None)
        limit = given or default_time_limit(problem)
        try:
            outcome = _solve(problem, options, SolveClock(time.perf_counter(), float(limit)), start,
                             search_any_size=given is not None)
        except (MemoryBudgetError, IlpTimeLimitError) as error:
            if key is not None:
                session.solved[key] = error
            raise
        if key is not None:
            session.solved[key] = outcome
    if outcome.stopped and session is not None:
        session.stopped.append(outcome)
    return outcome


def _solve(problem: IlpProblem, options: dict, clock: SolveClock, start=None,
           search_any_size: bool = False) -> IlpResult:
    """solve_ilp's work: the optimum, then the canonical plan among the ties, within the clock's limit (a MIP over
    more than MIP_SEARCH_MAX_COLUMNS searched only when `search_any_size`: the time limit was given)."""
    if problem.budget is not None and problem.memory and sum(min(per) for per in problem.memory) > problem.budget:
        raise MemoryBudgetError(problem)  # even the smallest candidate of every class is too big: no need to solve
    model = build_model(problem, options)
    # Proven by one LP (the MIP's own proof can take minutes); the margin is well above the LP's tolerances, so
    # a plan that fits exactly is never refused. Not needed where the smallest candidates make a plan that fits
    # (most budget-bound solves: Llama 3 8B over 64 devices, 1.1 s of the LP in 30 s of planning).
    if model.memory_row is not None and not problem.smallest_fits() \
            and memory_floor(model, clock) > problem.budget * (1 + 1e-6):
        raise MemoryBudgetError(problem)
    h = model.highs
    # The LP relaxation runs without presolve: on these 0/1 assignment problems it spent longer than it saved (zoo and
    # transformers models: solver time 18.9 s -> 10.5 s over 22 plans, plans byte-identical, when those ran the MIP);
    # past MIP_SEARCH_MAX_COLUMNS it pays (the zoo Llama's 80k-column joint ILP on (2, 2): 7.0 -> 5.2 s).
    h.setOptionValue("presolve", options.get("presolve", "on" if model.n_var > MIP_SEARCH_MAX_COLUMNS else "off"))
    relaxed = solve_relaxation(model, clock)
    # The MIP and the tie-breaking solves are presolved: it drops the columns fixed to 0 (Llama 3 70B's 104 solves:
    # 48 -> 43 s presolved, 39-42 s with the columns fixed below; the same plans).
    h.setOptionValue("presolve", options.get("presolve", "choose"))
    integral = relaxed is not None and relaxed.integral
    if integral:  # the relaxation's optimum is a plan: the MIP's optimum
        finished, objective, values = True, relaxed.objective, relaxed.values
    else:
        read_off = _fix_beyond_a_plan(model, relaxed) if relaxed is not None else None
        first = _best_plan(model, [read_off, start() if start is not None else None])
        if first is not None and model.n_var > MIP_SEARCH_MAX_COLUMNS and not search_any_size:
            return _result(model, clock, first, "size", _gap(problem.evaluate(first), -math.inf, relaxed))
        # Afresh: after the relaxation's basis the MIP took 0.7-0.9 s where it takes 0.4 (two of the 70B's
        # budget-bound solves), and HiGHS skips presolve.
        h.clearSolver()
        _set_incumbent(model, first)
        finished = run_highs(h, problem, clock, enough=GOOD_ENOUGH_GAP)
        values = h.getSolution().col_value
    optimum = model.choice(values)
    if not integral:
        # The plan's own objective, not HiGHS's report: started from a handed incumbent, HiGHS (1.16) reports one
        # 0.6% below its columns' (Llama 3 70B's FSDP x TP on (8, 8, 8)), and the tie row built on it then refused
        # the optimum itself: a rung refused, the ladder recomputing 46 layers for an 8% slower plan
        objective = problem.evaluate(optimum)
    if not finished:  # the best plan found; no time is left to choose among ties
        return _result(model, clock, optimum, "search", _gap(objective, h.getInfo().mip_dual_bound, relaxed))
    # where the first relaxation was fractional (a binding budget) the tie-breaking one is too: not tried
    choice, stopped = break_ties(model, clock, objective, values, optimum, relaxation_first=integral)
    return _result(model, clock, choice, stopped)


def _gap(objective: float, mip_bound: float, relaxed: Relaxation | None) -> float:
    """How far a stopped search's plan may be from the optimum, over its objective: from the better of the MIP's
    own bound and the relaxation's (a search stopped before its root node ends reports a bound near 0: an 80k-column
    Llama ILP read gap 1.0 where the relaxation proves 13.7%).

    >>> _gap(110.0, 0.0, Relaxation(100.0, [], [], 0))
    0.09090909090909091
    """
    bound = max(mip_bound, relaxed.objective if relaxed is not None else -math.inf)
    return max(0.0, (objective - bound) / abs(objective)) if objective else 0.0


def _fix_beyond_a_plan(model: IlpModel, relaxed: Relaxation) -> list[int] | None:
    """Before the MIP of a fractional relaxation: fix to 0 the columns no plan within a tie of a plan read off the
    relaxation can use (`Relaxation.columns_above`); the optimum and every plan that ties with it are within it, so
    neither the MIP's optimum nor the tie-breaking solve's choice changes. Llama 3 70B over 512 devices: a plan read
    off 33 of its 41 fractional relaxations, fixing 3-43% of the columns (median 16%)."""
    choice = plan_read_off(model, relaxed)
    if choice is not None:
        fix_to_zero(model, relaxed.columns_above(tie_bound(model, model.problem.evaluate(choice))))
    return choice


def _best_plan(model: IlpModel, plans: list) -> list[int] | None:
    """The cheapest of `plans` (one candidate per class each, or None) that is a plan (within the budget, no
    forbidden pair), the first on a tie; None when none is.

    >>> from autoshard.solver.model import build_model
    >>> model = build_model(IlpProblem(sizes=[2, 2], costs=[[1.0, 3.0], [0.0, 0.0]], memory=[[100.0, 10.0], [1.0, 1.0]],
    ...                                budget=50.0), {})
    >>> _best_plan(model, [None, [0, 0], [1, 1]])  # [0, 0] breaks the budget
    [1, 1]
    """
    problem = model.problem
    plans = [p for p in plans if p is not None and len(p) == problem.n_classes
             and all(model.allowed[c][s] for c, s in enumerate(p)) and math.isfinite(problem.evaluate(p))
             and (problem.budget is None or problem.evaluate_memory(p) <= problem.budget)]
    return min(plans, key=problem.evaluate) if plans else None


def _set_incumbent(model: IlpModel, plan: list[int] | None) -> None:
    """Hand the MIP `plan` (one candidate per class, from `_best_plan`; None: nothing) as its first incumbent, every
    column set (HiGHS completes a partial start by a sub-MIP, which a short time limit stops before it holds a plan).
    The MIP then ends with a plan at least that good, however early its time limit stops it.

    >>> from autoshard.solver.model import build_model
    >>> model = build_model(IlpProblem(sizes=[2, 2], costs=[[1.0, 3.0], [0.0, 0.0]]), {})
    >>> _set_incumbent(model, [1, 1])
    >>> model.highs.getSolution().col_value
    [0.0, 1.0, 0.0, 1.0]
    """
    if plan is None:
        return
    start = model.highs.getSolution()
    start.col_value = model.columns_of(plan)
    model.highs.setSolution(start)


def _result(model: IlpModel, clock: SolveClock, choice: list[int], stopped: str = "", gap: float = 0.0) -> IlpResult:
    return IlpResult(choice, model.problem.evaluate(choice), model.n_var, model.n_rows, stopped, gap,
                     time.perf_counter() - clock.started, clock.limit)
