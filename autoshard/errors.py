"""Errors users see: each says what is wrong, where, and what to do."""
from __future__ import annotations


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
    ]

    @classmethod
    def from_exception(cls, exc: Exception) -> "ExportError":
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        lowered = text.lower()
        advice = next((a for key, a in cls._ADVICE if key in lowered),
                      "make the model exportable with torch.export.export(model, example_inputs) first")
        where = _user_frame(text)
        return cls(f"torch.export could not trace the model: {type(exc).__name__}: {first}"
                   f"{where}\nWhat to do: {advice}. (The original error is chained below.)")


def _user_frame(text: str) -> str:
    """The first 'File ... line ...' of user code in export's message, if it gave one."""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("File ") and "site-packages" not in stripped:
            return f"\nWhere: {stripped}"
    return ""
