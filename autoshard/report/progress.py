"""Progress bars for long planning work: shown only when a step runs over a second, and only interactively.

A bar for quick work is noise, and one in a log file or a CI run is worse, so `StepProgress` draws a
tqdm bar (on stderr) only once some step has been running for `delay_s` seconds, and never when the
session is not interactive: stderr is not a terminal and this is not a Jupyter kernel.
`AUTOSHARD_PROGRESS=1` or `=0` forces it on or off. Without tqdm installed (`pip install autoshard[viz]`)
there is no bar.

>>> import time
>>> with StepProgress(2, "planning") as progress:
...     with progress.step("solve"):
...         time.sleep(0.01)  # quick: no bar
...     with progress.step("codegen"):
...         pass
"""
from __future__ import annotations

import importlib.util
import os
import sys
import threading
from contextlib import contextmanager


def interactive() -> bool:
    """True in a terminal (stderr is a tty) or a Jupyter kernel; `AUTOSHARD_PROGRESS=0/1` overrides.

    >>> import os; os.environ["AUTOSHARD_PROGRESS"] = "0"; interactive()
    False
    >>> del os.environ["AUTOSHARD_PROGRESS"]
    """
    forced = os.environ.get("AUTOSHARD_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    shell = sys.modules.get("IPython") and _ipython_shell()
    if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":  # a Jupyter kernel
        return True
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def _ipython_shell():
    from IPython import get_ipython
    return get_ipython()


class StepProgress:
    """A tqdm bar over `total` named steps that appears once a step has run `delay_s` seconds.

    `enabled=None` asks `interactive()`; `file` is where the bar is drawn (stderr by default).

    >>> progress = StepProgress(3, "planning", enabled=False)
    >>> with progress.step("normalize"):
    ...     pass
    >>> progress.done, progress.bar is None
    (1, True)
    """

    def __init__(self, total: int, desc: str, delay_s: float = 1.0, enabled: bool | None = None, file=None):
        self.total = total
        self.desc = desc
        self.delay_s = delay_s
        # tqdm is optional (the `viz` extra): without it planning is just silent.
        self.enabled = (interactive() if enabled is None else enabled) and importlib.util.find_spec("tqdm") is not None
        self.file = file
        self.bar = None
        self.done = 0
        self._current = ""
        self._timer = None
        self._closed = False
        self._lock = threading.Lock()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def step(self, name: str):
        """Run one step; the bar appears if this step is still running after `delay_s` seconds.

        >>> with StepProgress(1, "x", enabled=False).step("solve"):
        ...     pass
        """
        self._current = name
        if self.enabled:
            with self._lock:
                if self.bar is not None:
                    self.bar.set_postfix_str(name)
            self._timer = threading.Timer(self.delay_s, self._show)
            self._timer.daemon = True
            self._timer.start()
        try:
            yield self
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            with self._lock:
                self.done += 1
                if self.bar is not None:
                    self.bar.update(1)

    def _show(self) -> None:
        from tqdm import tqdm
        with self._lock:
            if self._closed:  # the timer fired while the work was finishing
                return
            if self.bar is None:
                self.bar = tqdm(total=self.total, initial=self.done, desc=self.desc, unit="step",
                                file=self.file or sys.stderr, leave=False, dynamic_ncols=True)
            self.bar.set_postfix_str(self._current)

    def close(self) -> None:
        """Stop the timer and remove the bar (it is transient: the history keeps the timings).

        >>> StepProgress(1, "x", enabled=False).close()
        """
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._closed = True
            if self.bar is not None:
                self.bar.close()
                self.bar = None
