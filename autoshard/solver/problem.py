"""What the sharding ILP is asked and what it answers: IlpProblem (classes, candidates, costs, edges, the memory
row and its charges) and IlpResult (the choice, its objective, the ILP's size, whether a time limit stopped it).

Two classes with two candidates each; the edge forbids mixing candidate 0 of one with candidate 1 of the other:

>>> from autoshard.cost.collective_time import INF
>>> problem = IlpProblem(sizes=[2, 2], costs=[[1.0, 2.0], [5.0, 1.0]], edges={(0, 1): [[0.0, INF], [INF, 0.0]]})
>>> problem.evaluate([1, 1])
3.0
"""
from __future__ import annotations

from dataclasses import dataclass, field


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

    def smallest_fits(self) -> bool:
        """Whether the plan of every class's smallest candidate is a plan (no forbidden pair: its objective is
        finite) within the budget: then some plan fits, and no LP need bound the memory from below.

        >>> kept = IlpProblem(sizes=[2, 2], costs=[[0.0, 0.0]] * 2, memory=[[8.0, 4.0], [2.0, 2.0]], budget=6.0)
        >>> kept.smallest_fits(), IlpProblem(sizes=[2], costs=[[0.0, 0.0]], memory=[[8.0, 7.0]], budget=6.0).smallest_fits()
        (True, False)
        """
        if self.budget is None:
            return True
        choice = [min(range(len(per)), key=per.__getitem__) for per in self.memory] if self.memory else \
            [0] * len(self.sizes)
        return self.evaluate(choice) < float("inf") and self.evaluate_memory(choice) <= self.budget


@dataclass
class IlpResult:
    """The chosen candidate per class, the objective, the ILP's size, and whether its time limit stopped it:
    `stopped` is "" (solved exactly), "search" (the best plan found, `gap` its relative distance to the best
    bound), "size" (a search too large for the default time limit not run: its start plan, `gap` as for "search";
    autoshard/solver/time_limit.py MIP_SEARCH_MAX_COLUMNS) or "ties" (optimal, the canonical choice among equally
    good plans not finished).

    >>> from autoshard.solver.ilp import solve_ilp
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
