"""Tier 2: the balanced cut (autoshard/solver/balanced_cut.py) against brute force on random stage times, crossing
bytes and memory caps: its cut is optimal (the slowest stage, then the summed crossing bytes) and fits. (The one
recurrence over (slowest, crossing) pairs it had before kept a partial cut's own slowest stage first and could
miss the fewest crossing bytes: stage times (0, 0, 0, 0, 1) cut into four.)
"""
from __future__ import annotations

import itertools

from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from autoshard.solver.balanced_cut import min_max_cut


@st.composite
def cut_problems(draw):
    n = draw(st.integers(2, 12))
    times = draw(st.lists(st.sampled_from([0.0, 1.0, 2.0]), min_size=n, max_size=n))
    sends = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n + 1, max_size=n + 1))
    bytes_ = draw(st.lists(st.integers(0, 4), min_size=n + 1, max_size=n + 1))
    inner = draw(st.sets(st.integers(1, n - 1))) if n > 1 else set()
    positions = sorted({0, n} | inner)
    stages = draw(st.integers(1, len(positions) - 1))
    cap = draw(st.sampled_from([None, 1.0, 2.0, 4.0]))
    return times, sends, bytes_, positions, stages, cap


@fuzz_settings(1000)
@given(cut_problems())
def test_the_cut_is_optimal_and_fits(problem):
    times, sends, bytes_, positions, stages, cap = problem
    prefix = [sum(times[:i]) for i in range(len(times) + 1)]

    def stage_time(a, b):
        return prefix[b] - prefix[a] + sends[a] + sends[b]

    def fits(s, a, b):  # odd stages hold twice their ops' time in bytes
        return cap is None or (prefix[b] - prefix[a]) * (1 + s % 2) <= cap

    def value(cuts):
        bounds = [positions[0], *cuts, positions[-1]]
        return (max(stage_time(a, b) for a, b in itertools.pairwise(bounds)), sum(bytes_[c] for c in cuts))

    def feasible(cuts):
        bounds = [positions[0], *cuts, positions[-1]]
        return all(fits(s, a, b) for s, (a, b) in enumerate(itertools.pairwise(bounds)))

    got = min_max_cut(stage_time, positions, stages, bytes_.__getitem__, fits if cap is not None else None)
    every = [list(c) for c in itertools.combinations(positions[1:-1], stages - 1) if feasible(list(c))]
    if not every:
        assert got is None
        return
    assert got is not None and feasible(got)
    assert value(got) == min(value(c) for c in every)
