"""Python's cyclic garbage collector while a plan is made.

Planning allocates millions of small objects that stay alive until the plan is made (graph nodes and their
meta, strategies, cost tables): with the default thresholds the collector scans them again and again, and
its full collections were 5.1 s of the Llama-3-70B (8,8,8) plan's 32.7 CPU seconds (and 1.4 s of 8 for the
8B one). Inside `fewer_collections` young collections come every 50,000 allocations instead of every 700,
so the long-lived objects seldom reach the full scans; garbage is still collected, and the caller's
thresholds come back afterwards. `parallelize` plans inside it, the command line runs inside it, and so
does every compile (`compile_state`, which the search's parts, notebooks and pass tests call on their own: the
hand-plan doctests on a budget-bound 2-layer Llama spent 7 of their 15 s in full collections without it).
"""
from __future__ import annotations

import contextlib
import gc

YOUNG_THRESHOLD = 50_000  # allocations between young collections while planning (Python's default: 700)


@contextlib.contextmanager
def fewer_collections():
    """Within the block, the young generation is collected every YOUNG_THRESHOLD allocations (or the caller's
    threshold, when higher); see the module docstring.

    >>> import gc
    >>> before = gc.get_threshold()
    >>> with fewer_collections():
    ...     gc.get_threshold()[0]
    50000
    >>> gc.get_threshold() == before
    True
    """
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], YOUNG_THRESHOLD), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)
