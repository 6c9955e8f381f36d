"""JSON files users hand to autoshard (plan files, hint files, checkpoint indexes): read with a size limit,
parsed strictly (UTF-8, no NaN or Infinity, bounded nesting), every failure an error of the caller's class
naming the file and what to do; and `short`, a bounded description of a JSON value for messages.

>>> import os, tempfile
>>> from autoshard.ir.errors import UserInputError
>>> folder = tempfile.mkdtemp()
"""
from __future__ import annotations

import json
import os
import reprlib
from pathlib import Path

SHORT = reprlib.Repr()  # bounded: safe on huge or deeply nested values
SHORT.maxlevel, SHORT.maxstring, SHORT.maxother, SHORT.maxlist, SHORT.maxdict = 2, 60, 60, 4, 4


def short(value) -> str:
    """A bounded description of a JSON value for messages (safe on huge or deeply nested values).

    >>> short(list(range(1000)))
    'list [0, 1, 2, 3, ...]'
    """
    return f"{type(value).__name__} {SHORT.repr(value)}"


def read_json_file(path, what: str, limit: int, error):
    """Parse a JSON file of at most `limit` bytes; every failure raises `error` naming the file.

    >>> with open(os.path.join(folder, "small.json"), "w") as f:
    ...     _ = f.write('{"a": [1, 2]}')
    >>> read_json_file(os.path.join(folder, "small.json"), "example file", 100, UserInputError)
    {'a': [1, 2]}
    >>> read_json_file(os.path.join(folder, "small.json"), "example file", 4, UserInputError)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: example file '...small.json' is larger than the limit of 4 bytes; ...
    """
    if not isinstance(path, (str, os.PathLike)):
        raise error(f"{what} must be the path of a JSON file (str or os.PathLike), got {short(path)}")
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            raw = handle.read(limit + 1)
    except OSError as exc:
        raise error(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}; check the path") from exc
    if len(raw) > limit:
        mib = f" ({limit / 2**20:g} MiB)" if limit >= 2**20 else ""
        raise error(f"{what} {str(path)!r} is larger than the limit of {limit} bytes{mib}; it is not a file "
                    "autoshard wrote, or it was padded; check the path")
    return parse_json_bytes(raw, f"{what} {str(path)!r}", error)


def _reject_constant(name):
    raise ValueError(f"{name} is not a JSON number (write a finite number)")


def parse_json_bytes(raw: bytes, source: str, error):
    """Strict JSON from bytes: UTF-8 (a BOM is allowed), no NaN/Infinity; errors are `error`s.

    >>> parse_json_bytes('\\ufeff{"step_time_s": 1.5}'.encode(), "example", UserInputError)  # UTF-8 with a byte-order mark
    {'step_time_s': 1.5}
    >>> parse_json_bytes(b'{"step_time_s": NaN}', "example", UserInputError)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: example ...NaN...
    """
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"{source} is not UTF-8 text (byte {exc.start}: {exc.reason}); it is corrupt or not a JSON "
                    "file — check the path or write it again") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        truncated = exc.pos >= len(text.rstrip()) or (exc.msg.startswith("Unterminated string")
                                                      and '"' not in text[exc.pos + 1:])
        why = "it ends too early (truncated?)" if truncated else "it is corrupt or was edited"
        raise error(f"{source} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno}); {why} — "
                    "write it again") from None
    except RecursionError:
        raise error(f"{source} nests JSON arrays/objects too deeply to parse; it is not a file autoshard "
                    "wrote") from None
    except ValueError as exc:  # NaN/Infinity, or an integer with more digits than Python converts
        raise error(f"{source} is not valid JSON for autoshard: {exc}") from None
