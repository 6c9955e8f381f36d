"""The balanced cut: a sequence split into contiguous pipeline stages so that the slowest stage is as fast as
possible (then the fewest bytes cross the cuts). cut_stages cuts a program's ops with it, giving its stage-time
function over the positions it may cut at.

>>> times = [1, 3, 3, 1, 1]
>>> prefix = [sum(times[:i]) for i in range(len(times) + 1)]
>>> min_max_cut(lambda a, b: prefix[b] - prefix[a], list(range(6)), stages=2)
[2]
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np


def min_max_cut(stage_time: Callable, positions: list, stages: int, crossing: Callable | None = None,
                fits: Callable | None = None) -> list | None:
    """The `stages - 1` cut positions, chosen from `positions` (its first and last are the sequence's ends),
    minimising the slowest `stage_time(a, b)` of the stages [a, b), then the summed `crossing(b)` of the cuts
    (the earliest cuts among equals), by dynamic programming over the positions, once for each (exact: O(stages x
    positions^2); each stage's time asked once, the recurrences in numpy: a 32-stage cut of a 126-layer model
    asked stage_time half a million times). The caller checks that there are enough positions. With
    `fits(stage, a, b)` only stages it accepts are cut (a pipeline rank's memory cap); None when no cut fits.

    >>> min_max_cut(lambda a, b: b - a, [0, 1, 2, 3, 4], stages=2, crossing=lambda b: 0)
    [2]
    >>> min_max_cut(lambda a, b: b - a, [0, 1, 2, 3, 4], stages=2, fits=lambda s, a, b: s == 1 or b - a <= 1)
    [1]
    """
    crossing = crossing or (lambda b: 0)
    n, last = len(positions), positions[-1]
    times = np.full((n, n), np.inf)
    for j in range(1, n):
        for i in range(j):
            times[i, j] = stage_time(positions[i], positions[j])
    cost = np.array([crossing(b) if b < last else 0 for b in positions], dtype=np.float64)

    def allowed(s: int, j: int, reached) -> np.ndarray:
        """Which predecessors i (s - 1 <= i < j) stage s - 1 = [positions[i], positions[j]) may start from."""
        ok = reached[s - 1:j].copy()
        if fits is not None:
            ok &= [bool(r) and fits(s - 1, positions[i], positions[j]) for i, r in zip(range(s - 1, j), ok)]
        return ok

    # First the slowest stage's least time (the stages' maxima: a cut's crossing bytes do not enter it) ...
    worst = np.full(n, np.inf)
    reached = np.zeros(n, dtype=bool)
    worst[0], reached[0] = 0.0, True
    for s in range(1, stages + 1):
        next_worst, next_reached = np.full(n, np.inf), np.zeros(n, dtype=bool)
        for j in range(s, n):
            ok = allowed(s, j, reached)
            if ok.any():
                next_worst[j] = np.maximum(worst[s - 1:j], times[s - 1:j, j])[ok].min()
                next_reached[j] = True
        worst, reached = next_worst, next_reached
    if not reached[n - 1]:
        return None
    slowest = worst[n - 1]
    # ... then the fewest crossing bytes among the cuts whose every stage takes at most that (the earliest cuts
    # among equals): kept per position, a partial cut's own slowest stage would decide too early.
    crossed = np.full(n, np.inf)
    crossed[0] = 0.0
    back = np.zeros((stages + 1, n), dtype=np.int64)
    for s in range(1, stages + 1):
        next_crossed = np.full(n, np.inf)
        for j in range(s, n):
            ok = allowed(s, j, np.isfinite(crossed)) & (times[s - 1:j, j] <= slowest)
            if ok.any():
                sums = np.where(ok, crossed[s - 1:j], np.inf)
                k = int(np.argmin(sums))
                next_crossed[j], back[s, j] = sums[k] + cost[j], s - 1 + k
        crossed = next_crossed
    cuts, j = [], n - 1
    for s in range(stages, 0, -1):
        j = int(back[s, j])
        cuts.append(positions[j])
    return sorted(cuts)[1:]
