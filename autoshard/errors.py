"""Errors users see: each says what is wrong, where, and what to do."""
from __future__ import annotations

import os


class AutoshardError(Exception):
    """Base of every error autoshard raises on purpose."""


class UserInputError(AutoshardError, ValueError):
    """A bad argument: mesh, hints, inputs, options."""


class HintError(UserInputError):
    """A sharding hint that names nothing, is malformed, contradicts another or cannot be met."""


class PlanError(AutoshardError):
    """No valid plan exists for the given constraints."""


class ExportError(AutoshardError):
    """torch.export could not trace the model."""

    _ADVICE = [
        ("data-dependent", "the model branches on tensor values; use torch.where / torch.cond instead of Python "
                           "`if` on tensors, and avoid .item() / .tolist() in forward"),
        ("guard", "the model branches on tensor values; use torch.where / torch.cond instead of Python `if` on "
                  "tensors"),
        ("unsupported", "the model uses a Python construct torch.export cannot trace; move it out of forward() "
                        "or rewrite it with torch operations"),
        ("same device", "put the example inputs on the model's device (for a model built on the meta device, pass "
                        "meta inputs, e.g. torch.empty(shape, device='meta'))"),
    ]
    _DEFAULT_ADVICE = ("check that example_inputs match what forward() expects (count, shapes, dtypes, devices) and "
                       "that torch.export.export(model, example_inputs) works on its own")

    @classmethod
    def from_exception(cls, exc: Exception) -> "ExportError":
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
