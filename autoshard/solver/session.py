"""What the solves inside a block share: a planning call's SolverSession (its time limit, the outcome of every
problem solved, the solves the time limit stopped) and the HiGHS options `highs_options` sets.

Inside a `solver_session` (one per planning call) a problem met again is not solved again: the memory ladder and
the hand-plan search meet the same problems. `problem_digest` is what the session recognises a problem by.

>>> from autoshard.solver.ilp import solve_ilp
>>> problem = IlpProblem(sizes=[2, 2], costs=[[1.0, 2.0], [5.0, 1.0]], edges={(0, 1): [[0.0, 9.0], [9.0, 0.0]]})
>>> current_session() is None
True
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import pickle
from dataclasses import dataclass, field

from autoshard.solver.problem import IlpProblem


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


def current_session() -> SolverSession | None:
    """The SolverSession of the enclosing `solver_session` block, or None outside every one.

    >>> with solver_session(time_limit=2.0):
    ...     current_session().time_limit
    2.0
    """
    return _SESSION.get()


def problem_digest(problem: IlpProblem, options: dict) -> str:
    """Equal for equal problems (and solver options): what a session's outcomes are keyed by.

    >>> copy = IlpProblem(sizes=[2, 2], costs=[[1.0, 2.0], [5.0, 1.0]], edges={(0, 1): [[0.0, 9.0], [9.0, 0.0]]})
    >>> same = problem_digest(copy, {}) == problem_digest(problem, {})
    >>> seeded = problem_digest(problem, {"random_seed": 1}) == problem_digest(problem, {})
    >>> same, seeded
    (True, False)
    """
    fields = (problem.sizes, problem.costs, problem.edges, problem.memory, problem.budget, problem.shared,
              problem.conjunctions, problem.edge_memory, problem.memory_charges, problem.later_ways,
              sorted(options.items()))
    return hashlib.blake2b(pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL), digest_size=16).hexdigest()


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


def highs_overrides() -> dict:
    """The options of the enclosing `highs_options` blocks (the inner one's win), or {} outside every one.

    >>> with highs_options(random_seed=7), highs_options(presolve="off"):
    ...     highs_overrides()
    {'random_seed': 7, 'presolve': 'off'}
    """
    return _OVERRIDES.get() or {}
