"""The sharding ILP's LP relaxation, solved before its MIP (`solve_relaxation`): where its optimum picks one candidate
per class (every choice column 0 or 1), that point is the MIP's optimum too (the relaxation's bound is met by a plan),
and the MIP is not run; where it is fractional, its reduced costs fix the columns no plan near the optimum can use
before the MIP runs (`Relaxation.columns_above`; autoshard/solver/ilp.py).

In Alpa's formulation with joint edge distributions (autoshard/solver/model.py) the relaxation is tight: on every
solve of Llama 3 8B over 64 devices (48 of them, each under a memory budget) it was integral, and solving it took
0.46 s in all where the MIPs took 2.2 s (HiGHS's MIP adds symmetry detection, probing and cuts around the same
root LP). A fractional optimum (a budget that splits a choice) leaves the MIP to run: 64 of Llama 3 70B's
104 solves over 512 devices, among them all its slow ones (a binding memory row).

>>> import time
>>> from autoshard.solver.model import build_model
>>> from autoshard.solver.problem import IlpProblem
>>> from autoshard.solver.time_limit import SolveClock
>>> problem = IlpProblem(sizes=[2, 2], costs=[[1.0, 2.0], [5.0, 1.0]], edges={(0, 1): [[0.0, 9.0], [9.0, 0.0]]})
>>> clock = SolveClock(time.perf_counter(), 10.0)
>>> model = build_model(problem, {})
>>> relaxed = solve_relaxation(model, clock)
>>> relaxed.objective, relaxed.integral, model.choice(relaxed.values)
(3.0, True, [1, 1])

Two classes, each cheaper keeping 6 bytes than 1, under a budget of 8: the relaxation's optimum splits a choice.

>>> tight = build_model(IlpProblem(sizes=[2, 2], costs=[[1.0, 3.0]] * 2, memory=[[6.0, 1.0]] * 2, budget=8.0), {})
>>> relaxed = solve_relaxation(tight, clock)
>>> round(relaxed.objective, 6), relaxed.integral
(3.6, False)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import highspy
import numpy as np

from autoshard.ir.errors import PlanError
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


@dataclass
class Relaxation:
    """The LP relaxation's optimum: its objective, every column's value and reduced cost, and whether its choice
    columns (the first `n_choice`) pick one candidate per class.

    >>> round(relaxed.objective, 6), len(relaxed.values) == tight.n_var  # `tight` (the module's example)
    (3.6, True)
    """

    objective: float
    values: list[float]
    reduced_costs: list[float]
    n_choice: int

    @classmethod
    def read(cls, model) -> Relaxation:
        """The relaxation HiGHS has just solved (read inside `continuous_choices`).

        >>> with continuous_choices(model):  # the module's first example
        ...     _ = model.highs.run()
        ...     Relaxation.read(model).objective
        3.0
        """
        solution = model.highs.getSolution()
        return cls(model.highs.getInfo().objective_function_value, list(solution.col_value), list(solution.col_dual),
                   model.n_choice)

    @property
    def integral(self) -> bool:
        """Whether every choice column is 0 or 1 (within INTEGRALITY_TOLERANCE): the optimum is a plan.

        >>> Relaxation(3.0, [0.0, 1.0, 0.5, 0.5], [2.0, 0.0, 0.0, 0.0], n_choice=2).integral  # one class, an edge
        True
        """
        chosen = np.asarray(self.values[:self.n_choice])
        return not np.any((chosen > INTEGRALITY_TOLERANCE) & (chosen < 1.0 - INTEGRALITY_TOLERANCE))

    def columns_above(self, bound: float) -> list[int]:
        """The columns no plan whose objective is within `bound` can use: at 0 here, a column with reduced cost r
        raises the objective of any point that sets it to 1 to at least this optimum + r. The margin keeps LP
        round-off from fixing a column some plan within the bound uses.

        One class of three candidates costing 1, 2 and 5: within 2.5 of its optimum (1) the third cannot be chosen.

        >>> one = solve_relaxation(build_model(IlpProblem(sizes=[3], costs=[[1.0, 2.0, 5.0]]), {}), clock)
        >>> one.reduced_costs, one.columns_above(2.5), one.columns_above(6.0)
        ([0.0, 1.0, 4.0], [2], [])
        """
        margin = 1e-6 * abs(bound) + 1e-2
        return [j for j, (value, reduced) in enumerate(zip(self.values, self.reduced_costs))
                if value < 1e-9 and self.objective + reduced > bound + margin]


def solve_relaxation(model, clock: SolveClock) -> Relaxation | None:
    """The model's LP relaxation (its choice columns continuous for the run, then integer again); None when it did
    not end at an optimum: the time limit stopped it, HiGHS ended it "Unknown", or no point meets the budget (the
    MIP then decides, and says so: a relaxation's verdict near the budget is within the LP's round-off).

    >>> solve_relaxation(build_model(IlpProblem(sizes=[2], costs=[[0.0, 1.0]], memory=[[9.0, 10.0]], budget=8.0), {}),
    ...                  clock) is None
    True
    """
    with continuous_choices(model):
        try:
            if not run_highs(model.highs, model.problem, clock, mip=False):
                return None
        except PlanError:  # IlpTimeLimitError and MemoryBudgetError among them
            return None
        return Relaxation.read(model)
