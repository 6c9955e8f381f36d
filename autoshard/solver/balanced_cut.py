"""The balanced cut: a sequence split into contiguous pipeline stages so that the slowest stage is as fast as
possible (then the fewest bytes cross the cuts). cut_stages cuts a program's ops with it and the scale
search cuts layers with it; each gives its own stage-time function over the positions it may cut at.

>>> times = [1, 3, 3, 1, 1]
>>> prefix = [sum(times[:i]) for i in range(len(times) + 1)]
>>> min_max_cut(lambda a, b: prefix[b] - prefix[a], list(range(6)), stages=2)
[2]
"""
from __future__ import annotations

from collections.abc import Callable


def min_max_cut(stage_time: Callable, positions: list, stages: int, crossing: Callable | None = None,
                fits: Callable | None = None) -> list | None:
    """The `stages - 1` cut positions, chosen from `positions` (its first and last are the sequence's ends),
    minimising (the slowest `stage_time(a, b)` of the stages [a, b), the summed `crossing(b)` of the cuts)
    by dynamic programming over the positions (exact: O(stages x positions^2)). The caller checks that
    there are enough positions. With `fits(stage, a, b)` only stages it accepts are cut (a pipeline rank's memory
    cap); None when no cut fits.

    >>> min_max_cut(lambda a, b: b - a, [0, 1, 2, 3, 4], stages=2, crossing=lambda b: 0)
    [2]
    >>> min_max_cut(lambda a, b: b - a, [0, 1, 2, 3, 4], stages=2, fits=lambda s, a, b: s == 1 or b - a <= 1)
    [1]
    """
    crossing = crossing or (lambda b: 0)
    last = positions[-1]
    inf = (float("inf"), float("inf"))
    best = [[inf] * len(positions) for _ in range(stages + 1)]
    back = [[0] * len(positions) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0)
    for s in range(1, stages + 1):
        for j in range(s, len(positions)):
            b = positions[j]
            cost = crossing(b) if b < last else 0
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                if prev == inf or (fits is not None and not fits(s - 1, positions[i], b)):
                    continue
                cand = (max(prev[0], stage_time(positions[i], b)), prev[1] + cost)
                if cand < best[s][j]:
                    best[s][j], back[s][j] = cand, i
    if best[stages][len(positions) - 1] == inf:
        return None
    cuts, j = [], len(positions) - 1
    for s in range(stages, 0, -1):
        j = back[s][j]
        cuts.append(positions[j])
    return sorted(cuts)[1:]
