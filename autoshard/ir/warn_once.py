"""Warnings given once per `parallelize` call: a model planned again in the same process is told again (a
process-wide "seen" set silenced every later call), while one call's many compiles (hand plans, pipeline
candidates, repeated layers) say each thing once.

`parallelize` opens a scope; outside any scope (a pass run by hand) each warning is given every time.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     with warning_scope():
...         warn_once("autoshard: example")
...         warn_once("autoshard: example")  # the same call: quiet
...     with warning_scope():
...         warn_once("autoshard: example")  # a new call: told again
>>> len(caught)
2
"""
from __future__ import annotations

import contextlib
import contextvars
import warnings

_SEEN: contextvars.ContextVar = contextvars.ContextVar("autoshard_warnings_seen", default=None)


@contextlib.contextmanager
def warning_scope(fresh: bool = False):
    """A scope inside which each distinct warning of `warn_once` is given once. A nested scope shares the outer
    one's, unless `fresh` (a candidate plan whose warnings are caught, and told only if it is chosen).

    >>> with warning_scope():
    ...     pass
    """
    if _SEEN.get() is not None and not fresh:
        yield
        return
    token = _SEEN.set(set())
    try:
        yield
    finally:
        _SEEN.reset(token)


@contextlib.contextmanager
def caught_warnings():
    """A candidate's warnings, kept rather than shown: every warning inside the block (each of `warn_once`'s told
    in a fresh scope, whatever was told before) lands in the list it yields; the caller tells them or drops them.

    >>> with caught_warnings() as caught:
    ...     warn_once("autoshard: kept")
    >>> [str(w.message) for w in caught]
    ['autoshard: kept']
    """
    with warnings.catch_warnings(record=True) as caught, warning_scope(fresh=True):
        warnings.simplefilter("always")
        yield caught


def warn_once(message: str, category=UserWarning, stacklevel: int = 3, key: str | None = None) -> None:
    """`warnings.warn(message)` unless the current scope gave the same `key` (default: the message) already.

    >>> with warning_scope():
    ...     warn_once("autoshard: told once", key="k")
    ...     warn_once("autoshard: told once, again", key="k")  # doctest: +SKIP
    """
    seen = _SEEN.get()
    key = message if key is None else key
    if seen is not None:
        if key in seen:
            return
        seen.add(key)
    warnings.warn(message, category, stacklevel=stacklevel)
