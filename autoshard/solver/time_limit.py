"""How long one solve of the sharding ILP may take, and how HiGHS is stopped at that time.

Every solve has a time limit (`default_time_limit`, scaled to the problem's size; a planning call's
`ilp_time_limit` option, through `solver_session`). When it stops the search, the best plan found is returned with
its optimality gap (`IlpResult.stopped`, `IlpResult.gap`); when it stops the choice among equally good plans, the
optimum found is kept (the plan is optimal, but another process could pick another of the ties); when no plan was
found by then, IlpTimeLimitError says so. Past a soft limit, a plan close enough to the best bound ends the search.

>>> problem = IlpProblem(sizes=[2, 2], costs=[[1.0, 2.0], [5.0, 1.0]], edges={(0, 1): [[0.0, 1.0], [1.0, 0.0]]})
>>> default_time_limit(problem)
10.0008
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import highspy

from autoshard.ir.errors import PlanError
from autoshard.solver.errors import IlpTimeLimitError, MemoryBudgetError
from autoshard.solver.problem import IlpProblem, IlpResult

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
# Under the default time limit, a MIP over more columns than this (a binding memory budget: its relaxation is
# fractional) is not searched: its start plan is the answer. At that size HiGHS does not finish in the limit and ends
# where it started (2 cores): the zoo Llama on (2, 2) under the Megatron plan's memory, a joint ILP of 80,366 columns,
# spent its 17.6 s limit (6.9 s of it the relaxation) and returned the axis-by-axis plan it was handed; a catalogue
# plan's joint ILP of 58,500 columns stopped at its 5 s soft limit on its start plan. The zoo GPT-2's of 29,837 columns
# finds a plan 36% cheaper than its start in 12.9 s, and is searched. A planning call's ilp_time_limit searches any size.
MIP_SEARCH_MAX_COLUMNS = 50_000


def default_time_limit(problem: IlpProblem) -> float:
    """Seconds one solve of `problem` may take unless the planning call says otherwise: TIME_LIMIT_BASE_S plus
    TIME_LIMIT_PER_VARIABLE_S per variable (candidates and edge pairs), at most TIME_LIMIT_MAX_S.

    >>> default_time_limit(IlpProblem(sizes=[2] * 1000, costs=[[0.0, 0.0]] * 1000))
    10.2
    """
    variables = sum(problem.sizes) + sum(len(m) * len(m[0]) for m in problem.edges.values() if m)
    return min(TIME_LIMIT_MAX_S, TIME_LIMIT_BASE_S + TIME_LIMIT_PER_VARIABLE_S * variables)


@dataclass(frozen=True)
class SolveClock:
    """A solve's time: it started at `started` (perf_counter seconds) and may take `limit` seconds; after `soft`
    seconds a plan good enough ends it (GOOD_ENOUGH_GAP).

    >>> SolveClock(started=100.0, limit=60.0)
    SolveClock(started=100.0, limit=60.0)
    """

    started: float
    limit: float

    @property
    def deadline(self) -> float:
        """When the solve must end (perf_counter seconds).

        >>> SolveClock(100.0, 60.0).deadline
        160.0
        """
        return self.started + self.limit

    @property
    def soft(self) -> float:
        """From when a plan within GOOD_ENOUGH_GAP of the best bound ends the search (perf_counter seconds).

        >>> SolveClock(100.0, 60.0).soft, SolveClock(100.0, 10.0).soft
        (115.0, 105.0)
        """
        return self.started + max(SOFT_LIMIT_MIN_S, SOFT_LIMIT_SHARE * self.limit)


# Statuses of a run a limit stopped: the time limit, the good-enough callback, or a limit set with highs_options.
_STOPPED = (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kInterrupt,
            highspy.HighsModelStatus.kSolutionLimit, highspy.HighsModelStatus.kIterationLimit)


def run_highs(h, problem: IlpProblem, clock: SolveClock, mip: bool = True, enough: float | None = None) -> bool:
    """Run HiGHS until the clock's deadline: True when it finished, False when the time limit stopped it with a
    feasible solution (or, after the soft limit, a MIP's relative gap came within `enough`); IlpTimeLimitError when
    it stopped without one; MemoryBudgetError when the model is infeasible.

    One of two columns, the cheaper:

    >>> import numpy as np
    >>> from autoshard.solver.highs import quiet_highs
    >>> h = quiet_highs()
    >>> _ = h.setOptionValue("output_flag", False)
    >>> _ = h.addVars(2, np.zeros(2), np.ones(2))
    >>> _ = h.changeColsCost(2, np.arange(2, dtype=np.int32), np.array([3.0, 1.0]))
    >>> _ = h.addRow(1.0, 1.0, 2, np.arange(2, dtype=np.int32), np.ones(2))
    >>> run_highs(h, problem, SolveClock(time.perf_counter(), 10.0), mip=False), list(h.getSolution().col_value)
    (True, [0.0, 1.0])
    """
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
        if problem.budget is None:  # no memory row: the forbidden pairs alone leave no consistent choice
            raise PlanError("the sharding ILP has no plan: the candidates' forbidden pairs leave no consistent "
                            "choice (an autoshard bug: a node with no candidate compatible with its neighbours); "
                            "report it with the model, or pin the placements with hints")
        raise MemoryBudgetError(problem)
    if status in _STOPPED:
        if h.getInfo().primal_solution_status == 2:  # kSolutionStatusFeasible
            return False
        raise IlpTimeLimitError(problem, clock.limit, time.perf_counter() - clock.started, h.getNumCol(),
                                h.getNumRow())
    if status != highspy.HighsModelStatus.kOptimal:
        raise PlanError(f"the sharding ILP found no plan ({h.modelStatusToString(status)})")
    return True


def describe_stopped(stopped: list[IlpResult]) -> str:
    """What the plan's summary and the warning say of the solves (IlpResults) the time limit stopped, or whose search
    was not run at their size (`MIP_SEARCH_MAX_COLUMNS`).

    >>> print(describe_stopped([IlpResult([0], 1.0, 8, 6, "search", 0.0125, 10.02, 10.0)]))
    the sharding ILP stopped early in 1 solve (time limit 10 s; past a quarter of it, a plan within 2% of the best bound ends the search): the plan is the best found, its predicted step within 1.25% of the best bound; raise ilp_time_limit= (--ilp-time-limit) to search longer
    >>> print(describe_stopped([IlpResult([0], 1.0, 80366, 23964, "size", 0.137, 7.1, 17.6)]))
    the sharding ILP did not search 1 solve (80366 columns under a binding memory budget: more than 50000 do not finish in the default time limit): the plan is its start (the axes solved one after another, or the one read off the LP relaxation), its predicted step within 13.70% of the best bound; set ilp_time_limit= (--ilp-time-limit) to search it
    """
    parts = []
    timed = [r for r in stopped if r.stopped != "size"]
    if timed:
        searches = [r for r in timed if r.stopped == "search"]
        limits = "/".join(f"{limit:.3g}" for limit in sorted({round(r.time_limit, 1) for r in timed}))
        if searches:
            gap = max(r.gap for r in searches)
            what = f"the plan is the best found, its predicted step within {gap:.2%} of the best bound" \
                if math.isfinite(gap) else "the plan is the best found (no bound on the optimum was reached in time)"
        else:
            what = "the plan is optimal, but its choice among equally good plans was not finished"
        parts.append(f"the sharding ILP stopped early in {_solves(timed)} (time limit {limits} s; past a quarter of it, "
                     f"a plan within {GOOD_ENOUGH_GAP:.0%} of the best bound ends the search): {what}; raise "
                     "ilp_time_limit= (--ilp-time-limit) to search longer")
    unsearched = [r for r in stopped if r.stopped == "size"]
    if unsearched:
        gap = max(r.gap for r in unsearched)
        columns = "/".join(str(n) for n in sorted({r.variables for r in unsearched}))
        within = f", its predicted step within {gap:.2%} of the best bound" if math.isfinite(gap) else ""
        parts.append(f"the sharding ILP did not search {_solves(unsearched)} ({columns} columns under a binding memory "
                     f"budget: more than {MIP_SEARCH_MAX_COLUMNS} do not finish in the default time limit): the plan is "
                     f"its start (the axes solved one after another, or the one read off the LP relaxation){within}; "
                     "set ilp_time_limit= (--ilp-time-limit) to search it")
    return "; ".join(parts)


def _solves(results: list) -> str:
    return f"{len(results)} solve{'s' if len(results) > 1 else ''}"
