"""A HiGHS instance fit for a compiler's process: its copyright banner kept off stdout (it would corrupt
`plan --json`), its worker threads stopped before the process exits or forks, and as many threads as this process's
share of the cores (`set_solver_threads`: planning workers solve side by side).

>>> quiet_highs().getNumCol()
0
"""
from __future__ import annotations

import atexit
import os
import sys

import highspy

_banner_shown = False
# HiGHS's threads per solve in this process; None: its default (one per core). Every instance must ask for the same
# number (HiGHS refuses a run whose count differs from its running scheduler's), so quiet_highs sets it on each.
_threads: int | None = None


def set_solver_threads(threads: int | None) -> None:
    """Solve with `threads` HiGHS threads in this process (None: HiGHS's default, one per core), from its next
    scheduler on: a planning worker forked beside others takes its share of the cores (two workers on two cores,
    each solving on both, took 39 s over the Llama-3-70B plan's 40 slowest solves where one thread each took 33).

    >>> set_solver_threads(None)
    """
    global _threads
    if getattr(highspy.Highs, "resetGlobalScheduler", None) is None:  # highspy < 1.8 cannot restart its scheduler
        return
    stop_solver_threads()  # the running scheduler keeps its count: the next solve starts one with the new count
    _threads = threads


def quiet_highs():
    """A `highspy.Highs` without the copyright banner HiGHS prints on stdout at its first construction in
    a process (it would corrupt `plan --json`): that one construction runs with file descriptor 1 on
    /dev/null.

    >>> type(quiet_highs()).__name__
    'Highs'
    """
    global _banner_shown
    if _banner_shown:
        return _with_threads(highspy.Highs())
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    _banner_shown = True
    # HiGHS's worker threads live in a static scheduler; a process that exits with them running aborts
    # ("terminate called without an active exception", seen under torchrun): stop them first.
    atexit.register(stop_solver_threads)
    return _with_threads(h)


def _with_threads(h):
    if _threads is not None:
        h.setOptionValue("threads", _threads)
    return h


def stop_solver_threads() -> None:
    """Stop HiGHS's worker threads (the next solve starts them again): before the process exits, and before it
    forks (a child would inherit a scheduler whose threads it does not have, and spin on them for ever).

    >>> stop_solver_threads()
    """
    stop = getattr(highspy.Highs, "resetGlobalScheduler", None)  # highspy >= 1.8
    if stop is not None:
        stop(True)
