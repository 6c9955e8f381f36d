"""The sharding ILP's refusals, each saying why and what to do: IlpTimeLimitError (no plan within the time limit)
and MemoryBudgetError (no plan fits the memory budget, with the smallest footprint and what dominates it).

A class whose smallest candidate keeps 60 bytes, under a budget of 50:

>>> problem = IlpProblem(sizes=[2], costs=[[1.0, 3.0]], memory=[[100.0, 60.0]], budget=50.0)
>>> MemoryBudgetError(problem).minimum
60.0
"""
from __future__ import annotations

from autoshard.ir.errors import PlanError
from autoshard.solver.problem import IlpProblem


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

    def __reduce__(self):  # a planning worker returns it to the parent process
        return type(self), (self.problem, self.time_limit, self.seconds, self.variables, self.constraints, self.where)

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

    >>> raise MemoryBudgetError(problem)
    Traceback (most recent call last):
    ...
    autoshard.solver.errors.MemoryBudgetError: no plan fits the memory budget of 0.000 GiB (50 bytes) per device: ... 0.000 GiB (60 bytes). ...
    """

    def __init__(self, problem: IlpProblem, searched: str = "", advice: str = ""):
        self.problem, self.searched, self.advice = problem, searched, advice
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

    def __reduce__(self):  # a planning worker returns it to the parent process
        return type(self), (self.problem, self.searched, self.advice)


def _readable(nbytes) -> str:
    """Bytes in GiB, MiB or KiB, whichever reads best."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def _gib(nbytes) -> str:
    return f"{nbytes / 2**30:.3f} GiB ({int(nbytes)} bytes)"
