"""The canonical plan among equally good ones: a second solve keeps the objective within `tie_slack` of the
optimum and minimises `tie_order` (fewest bytes kept per device, then the candidates' fixed order), so the choice
depends on the problem alone, not on the HiGHS version, seed, presolve or thread count
(tests/properties/test_solver_reproducible.py).

Two candidates of equal cost; the one keeping fewer bytes ranks first:

>>> problem = IlpProblem(sizes=[2, 2], costs=[[1.0, 1.0], [0.0, 0.0]], memory=[[8.0, 4.0], [1.0, 1.0]])
>>> tie_order(problem)
[[1.0, 0.0], [0.0, 1.5]]
"""
from __future__ import annotations

import math

import highspy
import numpy as np

from autoshard.ir.errors import PlanError
from autoshard.solver.errors import IlpTimeLimitError, MemoryBudgetError
from autoshard.solver.lp_bounds import fix_by_reduced_costs
from autoshard.solver.model import IlpModel
from autoshard.solver.problem import IlpProblem
from autoshard.solver.relaxation import Relaxation, solve_relaxation
from autoshard.solver.time_limit import SolveClock, run_highs

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


def class_floor(model: IlpModel) -> list[float]:
    """Each class's cheapest allowed candidate: every plan pays it, so the tie row and the slack count only what a
    plan pays above it (cost all plans share, compute mostly, must not drown their differences).

    >>> from autoshard.solver.model import build_model
    >>> class_floor(build_model(problem, {}))
    [1.0, 0.0]
    """
    return [min(cost for cost, ok in zip(model.costs[c], model.allowed[c]) if ok) for c in range(model.problem.n_classes)]


def tie_bound(model: IlpModel, objective: float) -> float:
    """The highest objective that still ties with `objective`: `objective` plus its tie slack.

    >>> from autoshard.solver.model import build_model
    >>> round(tie_bound(build_model(problem, {}), 3.0), 7)  # 2.0 above the floor (1 + 0): its slack 1e-3 + 2e-7
    3.0010002
    """
    return objective + tie_slack(objective - sum(class_floor(model)))


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


def break_ties(model: IlpModel, clock: SolveClock, objective: float, values: list,
               optimum: list[int], relaxation_first: bool = True) -> tuple[list[int], str]:
    """Among the plans within tie_slack of the optimum the model's solve found (`objective`, its columns `values`,
    its choice `optimum`), the canonical one (see tie_order), so that the plan does not depend on the solver's
    build, seed or options. Returns the choice and what the time limit stopped ("" or "ties": the optimum is kept).

    >>> import time
    >>> from autoshard.solver.model import build_model
    >>> model, clock = build_model(problem, {}), SolveClock(time.perf_counter(), 10.0)
    >>> run_highs(model.highs, problem, clock)
    True
    >>> values = model.highs.getSolution().col_value
    >>> break_ties(model, clock, model.highs.getInfo().objective_function_value, values, model.choice(values))
    ([1, 0], '')
    """
    problem, h = model.problem, model.highs
    floor = class_floor(model)
    shift = sum(floor)
    bound = tie_bound(model, objective)
    fixed = fix_by_reduced_costs(model, bound, clock)
    if fixed is None:  # the time limit stopped the relaxation
        return optimum, "ties"
    open_choices = [[s for s in range(n) if model.allowed[c][s] and model.start[c] + s not in fixed]
                    for c, n in enumerate(problem.sizes)]
    if all(len(left) == 1 for left in open_choices):  # no other plan can tie: the optimum is the plan
        return optimum, ""
    _add_tie_row(model, floor, fixed, bound - shift)
    order = tie_order(problem)
    secondary = np.zeros(model.n_var)
    for c, ranks in enumerate(order):
        secondary[model.start[c]:model.start[c] + len(ranks)] = ranks
    h.changeColsCost(model.n_var, np.arange(model.n_var, dtype=np.int32), secondary)
    relaxed = _relaxed_tie(model, clock) if relaxation_first else None
    if relaxed is not None:
        return _within_ties(problem, model.choice(relaxed.values), optimum, objective - shift), ""
    # The optimum satisfies the tie row: handed over as the first incumbent, it spares the search finding one
    # (measured: 2.5 -> 2.2 s on each of the Llama-3-70B plan's budgeted solves; the same plans).
    incumbent = h.getSolution()
    incumbent.col_value = list(values)  # the first solve's columns (the model has changed since)
    h.setSolution(incumbent)
    try:
        finished = _run_tie_solve(h, problem, clock)
        choice = model.choice(h.getSolution().col_value)
        if choice == optimum and finished:
            # HiGHS (1.16) can declare the incumbent optimal when its presolve starts from it, missing a tie that
            # ranks first (one of the 44 budgeted solves of Llama-3-70B over 512 devices: rank 181.2 kept where
            # 172.1 ties); the tie solve rarely ends at the incumbent otherwise (that one of 44), so it is solved
            # again without it.
            h.clearSolver()
            finished = _run_tie_solve(h, problem, clock)
            choice = model.choice(h.getSolution().col_value)
    except IlpTimeLimitError:  # no tie found before the limit: the optimum itself
        return optimum, "ties"
    return _within_ties(problem, choice, optimum, objective - shift), "" if finished else "ties"


def _relaxed_tie(model: IlpModel, clock: SolveClock) -> Relaxation | None:
    """The tie-breaking model's relaxed optimum when it is a plan (the canonical one:
    `solve_relaxation`), else None (the MIP then runs afresh; the optimum meets the tie row, so a relaxation found
    infeasible says round-off, not memory). It starts afresh too: run from the first relaxation's
    basis, HiGHS skips presolve and pivots over every column, those `fix_by_reduced_costs` fixed too, where presolve
    drops them first (a 2-layer Llama on (2, 2), 82k columns: 1.18 -> 0.06 s, the same plan; Llama 3 8B's and 70B's
    captured solves give the same choices).

    >>> import time
    >>> from autoshard.solver.model import build_model
    >>> model = build_model(problem, {})
    >>> model.choice(_relaxed_tie(model, SolveClock(time.perf_counter(), 10.0)).values)  # no tie row: the optimum
    [1, 1]
    """
    model.highs.clearSolver()
    relaxed = solve_relaxation(model, clock)
    if relaxed is None or not relaxed.integral:
        model.highs.clearSolver()
        return None
    return relaxed


def _within_ties(problem: IlpProblem, choice: list[int], optimum: list[int], above_floor: float) -> list[int]:
    """`choice`, the tie-breaking solve's, unless it costs more than a tie of `optimum` (`above_floor`: what the
    optimum pays above every class's cheapest candidate): the row held only within the solver's tolerance, and
    the optimum itself is kept.

    >>> _within_ties(problem, [0, 1], [1, 1], 0.0), _within_ties(IlpProblem(sizes=[2], costs=[[1.0, 2.0]]), [1], [0], 0.0)
    ([0, 1], [0])
    """
    if problem.evaluate(choice) > problem.evaluate(optimum) + tie_slack(above_floor):
        return optimum
    return choice


def _run_tie_solve(h, problem: IlpProblem, clock: SolveClock) -> bool:
    """The tie-breaking MIP run to the clock's deadline (run_highs: True when it finished)."""
    try:
        return run_highs(h, problem, clock, enough=math.inf)  # any plan it finds is optimal
    except MemoryBudgetError:  # the optimum satisfies the row: older HiGHS presolves it away wrongly
        h.setOptionValue("presolve", "off")
        return run_highs(h, problem, clock, enough=math.inf)


def _add_tie_row(model: IlpModel, floor: list[float], fixed: set, bound: float) -> None:
    """The row keeping the objective (above each class's cheapest candidate, `floor`) within `bound`, over the
    columns not fixed to 0."""
    row = list(model.objective)
    for c in range(model.problem.n_classes):
        for s in range(model.problem.sizes[c]):
            row[model.start[c] + s] -= floor[c]
    nonzero = [i for i, cost in enumerate(row) if cost != 0.0 and i not in fixed and model.upper[i] > 0]
    # HiGHS refuses matrix entries above 1e15 (a replicated op at a slow peak): the row is scaled down.
    scale = min(1.0, 1e9 / max((abs(row[i]) for i in nonzero), default=1.0))
    status = model.highs.addRow(-highspy.kHighsInf, bound * scale, len(nonzero), np.array(nonzero, dtype=np.int32),
                                np.array([row[i] * scale for i in nonzero], dtype=np.float64))
    if status == highspy.HighsStatus.kError:
        raise PlanError("the sharding ILP's tie-breaking row was refused by HiGHS; please report this model")
