"""A HiGHS instance fit for a compiler's process: its copyright banner kept off stdout (it would corrupt
`plan --json`) and its worker threads stopped before the process exits or forks.

>>> quiet_highs().getNumCol()
0
"""
from __future__ import annotations

import atexit
import os
import sys

import highspy

_banner_shown = False


def quiet_highs():
    """A `highspy.Highs` without the copyright banner HiGHS prints on stdout at its first construction in
    a process (it would corrupt `plan --json`): that one construction runs with file descriptor 1 on
    /dev/null.

    >>> type(quiet_highs()).__name__
    'Highs'
    """
    global _banner_shown
    if _banner_shown:
        return highspy.Highs()
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
    return h


def stop_solver_threads() -> None:
    """Stop HiGHS's worker threads (the next solve starts them again): before the process exits, and before it
    forks (a child would inherit a scheduler whose threads it does not have, and spin on them for ever).

    >>> stop_solver_threads()
    """
    stop = getattr(highspy.Highs, "resetGlobalScheduler", None)  # highspy >= 1.8
    if stop is not None:
        stop(True)
