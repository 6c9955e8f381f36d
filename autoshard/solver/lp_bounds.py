"""What one LP relaxation of the model proves faster than the MIP would: the least memory any plan can have (a
budget below it is refused at once: `memory_floor`) and the columns no plan within a bound on the objective can
use (fixed to 0 before the tie-breaking solve: `fix_by_reduced_costs`; before the MIP, the bound being a plan read
off a fractional relaxation: `plan_read_off`, autoshard/solver/ilp.py).

A class of three candidates costing 1, 2 and 5 (and keeping 8, 4 and 2 bytes):

>>> import time
>>> from autoshard.solver.model import build_model
>>> from autoshard.solver.problem import IlpProblem
>>> from autoshard.solver.relaxation import solve_relaxation
>>> problem = IlpProblem(sizes=[3], costs=[[1.0, 2.0, 5.0]], memory=[[8.0, 4.0, 2.0]], budget=100.0)
>>> clock = SolveClock(time.perf_counter(), 10.0)
>>> memory_floor(build_model(problem, {}), clock)
2.0

Three classes, each cheaper keeping 6 bytes than 1, under a budget of 11: the relaxation splits a choice.

>>> tight = build_model(IlpProblem(sizes=[2, 2, 2], costs=[[1.0, 3.0]] * 3, memory=[[6.0, 1.0]] * 3, budget=11.0), {})
"""
from __future__ import annotations

import math
import time

import highspy
import numpy as np

from autoshard.ir.errors import PlanError
from autoshard.solver.errors import IlpTimeLimitError
from autoshard.solver.highs import quiet_highs
from autoshard.solver.model import IlpModel
from autoshard.solver.relaxation import (
    INTEGRALITY_TOLERANCE,
    Relaxation,
    continuous_choices,
)
from autoshard.solver.time_limit import SolveClock, run_highs


def memory_floor(model: IlpModel, clock: SolveClock) -> float:
    """The least memory row any plan can have, by the LP relaxation of minimising the row (`model.memory_row`; the
    model's last row, the budget, left out): a lower bound, -inf when the LP did not finish. A budget below it
    is infeasible. Measured on a 2-layer Llama under 0.2 of its memory (80k variables): 0.7 s, where the MIP
    took 15 s to say so (its first LP, with the budget row in, is slow to find that no point satisfies it).

    Each class's smallest candidate fits a budget of 5 (2 + 2 bytes), but class 0's keeps a copy of 9 bytes: every
    plan needs 6 bytes or more.

    >>> kept = IlpProblem(sizes=[2, 2], costs=[[0.0, 1.0]] * 2, edges={(0, 1): [[0.0, 1.0], [1.0, 0.0]]},
    ...                   memory=[[4.0, 2.0], [4.0, 2.0]], edge_memory={(0, 1): [[0.0, 0.0], [9.0, 9.0]]}, budget=5.0)
    >>> memory_floor(build_model(kept, {}), clock)
    6.0
    """
    h, n_var = model.highs, model.n_var
    idx, value = model.memory_row
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


def fix_by_reduced_costs(model: IlpModel, bound: float, clock: SolveClock) -> set | None:
    """Fix to 0 every variable that no plan with objective <= `bound` can use: in the LP relaxation, a
    variable at 0 with reduced cost r raises the objective by at least r when set to 1. The tie-breaking
    solve then sees only the candidates that can still tie (usually a few), so it costs little. Returns
    the fixed variables, or None when the time limit stopped the relaxation.

    The optimum costs 1; within 2.5, the candidate costing 5 cannot be chosen:

    >>> fix_by_reduced_costs(build_model(problem, {}), 2.5, clock)
    {2}
    """
    with continuous_choices(model):
        try:
            if not run_highs(model.highs, model.problem, clock, mip=False):
                return None
        except IlpTimeLimitError:
            return None
        except PlanError:  # older HiGHS (1.7) ended this LP "Unknown": fix nothing (it only saves time)
            return set()
        fixed = Relaxation.read(model).columns_above(bound)
    fix_to_zero(model, fixed)
    return set(fixed)


def fix_to_zero(model: IlpModel, columns: list[int]) -> None:
    """Bound `columns` to 0 (HiGHS's presolve then drops them: run the model afresh, `clearSolver`).

    >>> model = build_model(problem, {})
    >>> fix_to_zero(model, [0])
    >>> list(model.highs.getLp().col_upper_)
    [0.0, 1.0, 1.0]
    """
    if columns:
        model.highs.changeColsBounds(len(columns), np.array(columns, dtype=np.int32), np.zeros(len(columns)),
                                     np.zeros(len(columns)))


def plan_read_off(model: IlpModel, relaxed: Relaxation) -> list[int] | None:
    """A plan read off a fractional relaxation, for the objective it bounds the MIP's optimum by: each class's
    largest column; where that plan breaks the budget or a forbidden pair, the classes the relaxation splits take
    their smallest candidate (bytes) among those it uses. None when neither is a plan.

    `tight` (the module's example): its relaxation keeps one class's 6 bytes and 0.6 of another's; their largest
    columns keep 13 bytes, so the split class takes its 1-byte candidate (a plan of 8 bytes costing 7):

    >>> relaxed = solve_relaxation(tight, clock)
    >>> plan = plan_read_off(tight, relaxed)
    >>> memory = tight.problem.evaluate_memory
    >>> memory(tight.choice(relaxed.values)), memory(plan), tight.problem.evaluate(plan)
    (13.0, 8.0, 7.0)
    """
    problem = model.problem
    largest = model.choice(relaxed.values)
    smallest = list(largest)
    for c, n in enumerate(problem.sizes):
        used = [s for s in range(n) if relaxed.values[model.start[c] + s] > INTEGRALITY_TOLERANCE]
        if len(used) > 1 and problem.memory:
            smallest[c] = min(used, key=lambda s: (problem.memory[c][s], s))
    for choice in (largest, smallest):
        fits = problem.budget is None or problem.evaluate_memory(choice) <= problem.budget
        if fits and math.isfinite(problem.evaluate(choice)):
            return choice
    return None
