"""The sharding ILP's LP relaxation, solved before its MIP: where the relaxation's optimum picks one candidate per
class (every choice column 0 or 1), that point is the MIP's optimum too (the relaxation's bound is met by a plan),
and the MIP is not run (`integral_optimum`).

In Alpa's formulation with joint edge distributions (autoshard/solver/model.py) the relaxation is tight: on every
solve of Llama 3 8B over 64 devices (48 of them, each under a memory budget) it was integral, and solving it took
0.46 s in all where the MIPs took 2.2 s (HiGHS's MIP adds symmetry detection, probing and cuts around the same
root LP). A fractional optimum (a budget that splits a choice) leaves the MIP to run as before: 64 of Llama 3 70B's
104 solves over 512 devices, among them all its slow ones (a binding memory row), where the relaxation adds 1-4%.

>>> import time
>>> from autoshard.solver.model import build_model
>>> from autoshard.solver.problem import IlpProblem
>>> from autoshard.solver.time_limit import SolveClock
>>> problem = IlpProblem(sizes=[2, 2], costs=[[1.0, 2.0], [5.0, 1.0]], edges={(0, 1): [[0.0, 9.0], [9.0, 0.0]]})
>>> clock = SolveClock(time.perf_counter(), 10.0)
>>> objective, values = integral_optimum(build_model(problem, {}), clock)
>>> objective, build_model(problem, {}).choice(values)
(3.0, [1, 1])

Two classes, each cheaper keeping 6 bytes than 1, under a budget of 8: the relaxation's optimum splits a choice.

>>> tight = build_model(IlpProblem(sizes=[2, 2], costs=[[1.0, 3.0]] * 2, memory=[[6.0, 1.0]] * 2, budget=8.0), {})
>>> integral_optimum(tight, clock) is None
True
"""
from __future__ import annotations

import contextlib

import highspy
import numpy as np

from autoshard.ir.errors import PlanError
from autoshard.solver.errors import IlpTimeLimitError
from autoshard.solver.time_limit import SolveClock, run_highs

# A choice column this close to 0 or 1 counts as integral (HiGHS's own MIP feasibility tolerance).
INTEGRALITY_TOLERANCE = 1e-6


@contextlib.contextmanager
def continuous_choices(model):
    """Within the block the model's choice columns (its `n_choice` integer columns) are continuous: HiGHS runs its
    LP relaxation; they are integer again after it, however the block ends.

    `tight` (the module's example): the relaxation splits the cheap share (6 - 2 x 1.2), a plan takes one cheap
    candidate (6 - 2):

    >>> with continuous_choices(tight):
    ...     _ = tight.highs.run()
    ...     round(tight.highs.getInfo().objective_function_value, 6)
    3.6
    >>> _ = tight.highs.run()
    >>> tight.highs.getInfo().objective_function_value
    4.0
    """
    h, n_choice = model.highs, model.n_choice
    columns = np.arange(n_choice, dtype=np.int32)
    h.changeColsIntegrality(n_choice, columns, np.array([highspy.HighsVarType.kContinuous] * n_choice))
    try:
        yield
    finally:
        h.changeColsIntegrality(n_choice, columns, np.array([highspy.HighsVarType.kInteger] * n_choice))


def integral_optimum(model, clock: SolveClock) -> tuple[float, list[float]] | None:
    """(objective, column values) of the model's LP relaxation (its `n_choice` integer columns made continuous for
    the run, then integer again) when that optimum is integral: the MIP's optimum, found without the MIP. None when
    it is fractional, or the LP did not finish (the MIP then runs as before). A budget no point of the relaxation
    meets raises MemoryBudgetError (run_highs): no plan meets it either.

    `tight` (the module's example) has a fractional one:

    >>> integral_optimum(tight, clock) is None
    True
    """
    h = model.highs
    with continuous_choices(model):
        try:
            if not run_highs(h, model.problem, clock, mip=False):
                return None
        except (IlpTimeLimitError, PlanError):  # stopped without a point, or an "Unknown" end: the MIP decides
            return None
        values = list(h.getSolution().col_value)  # read before the columns are made integer again
        objective = h.getInfo().objective_function_value
    chosen = np.asarray(values[:model.n_choice])
    if np.any((chosen > INTEGRALITY_TOLERANCE) & (chosen < 1.0 - INTEGRALITY_TOLERANCE)):
        # The MIP starts afresh: run after the relaxation's basis, it took 0.7-0.9 s where it takes 0.4 (two of
        # Llama 3 70B's budget-bound solves).
        h.clearSolver()
        return None
    return objective, values
