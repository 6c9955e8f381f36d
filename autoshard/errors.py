"""Errors users see: each says what is wrong, where, and what to do."""
from __future__ import annotations

import os


class AutoshardError(Exception):
    """Base of every error autoshard raises on purpose.

    >>> import autoshard
    >>> try:
    ...     autoshard.Mesh((0,))
    ... except autoshard.AutoshardError as exc:  # catches every error autoshard raises on purpose
    ...     print(type(exc).__name__)
    UserInputError
    """


class UserInputError(AutoshardError, ValueError):
    """A bad argument: mesh, hints, inputs, options.

    >>> from autoshard.mesh import Mesh
    >>> Mesh((2, 4), ("dp",))
    Traceback (most recent call last):
    ...
    autoshard.errors.UserInputError: mesh=(2, 4) has 2 axes but axis_names=('dp',) has 1; give one name per axis, e.g. mesh=(2, 4), axis_names=('dp', 'tp')
    """


class HintError(UserInputError):
    """A sharding hint that names nothing, is malformed, contradicts another or cannot be met.

    >>> from autoshard.hints import Hints
    >>> Hints.parse({"fc.weight": {"tp": "S(x)"}})
    Traceback (most recent call last):
    ...
    autoshard.errors.HintError: malformed placement 'S(x)' in hints key 'fc.weight' axis 'tp': write 'S(<dim>)', 'R' or 'P', e.g. 'S(0)'
    """


class PlanError(AutoshardError):
    """No valid plan exists for the given constraints.

    >>> raise PlanError("no plan fits in memory_budget=1e6 bytes per device; raise the budget or use a larger mesh")
    Traceback (most recent call last):
    ...
    autoshard.errors.PlanError: no plan fits in memory_budget=1e6 bytes per device; raise the budget or use a larger mesh
    """


class ExportError(AutoshardError):
    """torch.export could not trace the model.

    >>> err = ExportError.from_exception(RuntimeError("Could not guard on data-dependent expression"))
    >>> "torch.where" in str(err)
    True
    """

    _ADVICE = (
        ("data-dependent", ("the model branches on tensor values; use torch.where / torch.cond instead of Python "
                           "`if` on tensors, and avoid .item() / .tolist() in forward")),
        ("guard", ("the model branches on tensor values; use torch.where / torch.cond instead of Python `if` on "
                  "tensors")),
        ("unsupported", ("the model uses a Python construct torch.export cannot trace; move it out of forward() "
                        "or rewrite it with torch operations")),
        ("same device", ("put the example inputs on the model's device (for a model built on the meta device, pass "
                        "meta inputs, e.g. torch.empty(shape, device='meta'))")),
    )
    _DEFAULT_ADVICE = ("check that example_inputs match what forward() expects (count, shapes, dtypes, devices) and "
                       "that torch.export.export(model, example_inputs) works on its own")

    @classmethod
    def from_exception(cls, exc: Exception) -> ExportError:
        """The ExportError for an exception torch.export raised: its first line, the user's source line
        when one can be found, and advice matched to the kind of failure.

        >>> str(ExportError.from_exception(ValueError("boom"))).splitlines()[0]
        'torch.export could not trace the model: ValueError: boom'
        """
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        lowered = text.lower()
        advice = next((a for key, a in cls._ADVICE if key in lowered), cls._DEFAULT_ADVICE)
        where = _user_frame(text) or _user_frame_from_traceback(exc)
        return cls(f"torch.export could not trace the model: {type(exc).__name__}: {first}"
                   f"{where}\nWhat to do: {advice}. (The original error is chained below.)")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _is_library(where: str) -> bool:
    """Frames of torch, Python itself or autoshard's own machinery (the zoo's models count as user code)."""
    if any(part in where for part in ("site-packages", "dist-packages", "<frozen", "<string>",
                                      f"{os.sep}torch{os.sep}")):
        return True
    return _PACKAGE_DIR in where and os.path.join(_PACKAGE_DIR, "zoo") not in where


def _user_frame(text: str) -> str:
    """The first 'File ... line ...' of user code in export's message, with its source line if given."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("File ") and not _is_library(stripped):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"\nWhere: {stripped}" + (f": {code}" if code and not code.startswith("File ") else "")
    return ""


def _user_frame_from_traceback(exc: BaseException) -> str:
    """The innermost user-code frame of the exception's traceback (export's message did not name one)."""
    import traceback
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _is_library(f.filename)]
    if not frames:
        return ""
    frame = frames[-1]
    code = f": {frame.line.strip()}" if frame.line else ""
    return f'\nWhere: File "{frame.filename}", line {frame.lineno}, in {frame.name}{code}'
