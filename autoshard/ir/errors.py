"""Errors users see: each says what is wrong, where, and what to do."""
from __future__ import annotations

import os
import re
import sys
import sysconfig
import traceback


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

    >>> from autoshard.ir.mesh import Mesh
    >>> Mesh((2, 4), ("dp",))
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: mesh=(2, 4) has 2 axes but axis_names=('dp',) has 1; give one name per axis, e.g. mesh=(2, 4), axis_names=('dp', 'tp')
    """


class HintError(UserInputError):
    """A sharding hint that names nothing, is malformed, contradicts another or cannot be met.

    >>> from autoshard.frontend.hints import Hints
    >>> Hints.parse({"fc.weight": {"tp": "S(x)"}})
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.HintError: malformed placement 'S(x)' in hints key 'fc.weight' axis 'tp': write 'S(<dim>)', 'R' or 'P', e.g. 'S(0)'
    """


class PlanError(AutoshardError):
    """No valid plan exists for the given constraints.

    >>> raise PlanError("no plan fits in memory_budget=1e6 bytes per device; raise the budget or use a larger mesh")
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.PlanError: no plan fits in memory_budget=1e6 bytes per device; raise the budget or use a larger mesh
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

    _LOSS_ADVICE = ("autoshard calls loss_fn(outputs, *example_inputs): the model's outputs first, then every example "
                    "input; run loss_fn(model(*example_inputs), *example_inputs) on its own to see the failure")

    @classmethod
    def from_exception(cls, exc: Exception, culprit: str = "the model") -> ExportError:
        """The ExportError for an exception torch.export raised: its first line, the innermost line of the
        user's own code (model or loss) when one can be found, and advice matched to the kind of failure.
        `culprit` names whose code was running ("the model", or "the loss function <name>").

        >>> str(ExportError.from_exception(ValueError("boom"))).splitlines()[0]
        'torch.export could not trace the model: ValueError: boom'
        """
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        lowered = text.lower()
        default = cls._DEFAULT_ADVICE if culprit == "the model" else cls._LOSS_ADVICE
        advice = next((a for key, a in cls._ADVICE if key in lowered), default)
        where = _user_frame(text) or _user_frame_from_traceback(exc)
        return cls(f"torch.export could not trace {culprit}: {type(exc).__name__}: {first}"
                   f"{where}\nWhat to do: {advice}. (The original error is chained below.)")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Code that is never the user's: torch, what torch calls into, and Python's own library. Other installed
# packages (transformers, ...) hold the user's model code and count as theirs.
_INFRASTRUCTURE = ("torch", "functorch", "sympy", "typing_extensions", "_pytest", "pluggy")
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})


def _is_library(where: str) -> bool:
    """Frames of torch (and what it calls), Python's standard library or autoshard's own machinery (the
    zoo's models count as user code).

    >>> import torch
    >>> _is_library(torch.nn.Linear.forward.__code__.co_filename), _is_library(os.__file__)
    (True, True)
    >>> _is_library(os.path.join(_PACKAGE_DIR, "zoo", "mlp.py")), _is_library("/home/me/model.py")
    (False, False)
    """
    path = where.removeprefix("File ").strip().strip('"')
    if path.startswith("<"):  # <frozen ...>, <string>, fx's generated <eval_with_key>
        return True
    if any(path.startswith(root) for root in _infrastructure_roots()):
        return True
    if path.startswith(_STDLIB) and not any(d in path for d in ("site-packages", "dist-packages")):
        return True
    return path.startswith(_PACKAGE_DIR + os.sep) and not path.startswith(os.path.join(_PACKAGE_DIR, "zoo") + os.sep)


def _infrastructure_roots() -> list[str]:
    """The directory of each imported infrastructure package (the file itself for a one-file module)."""
    roots = []
    for name in _INFRASTRUCTURE:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            file = os.path.abspath(file)
            roots.append(os.path.dirname(file) + os.sep if os.path.basename(file) == "__init__.py" else file)
    return roots


_FRAME = re.compile(r'^File "(?P<path>[^"]+)", line (?P<line>\d+)(?:, in (?P<name>\S+))?')


def _user_frame(text: str) -> str:
    """The innermost 'File ... line ...' of user code that export's message names (stacks in it run from
    the outermost call to the innermost), with its source line if given.

    >>> message = ('File "/home/me/model.py", line 9, in forward\\n  y = self.block(x)\\n'
    ...            'File "/home/me/block.py", line 4, in forward\\n  if x.sum() > 0:')
    >>> print(_user_frame(message).strip())
    Where: File "/home/me/block.py", line 4, in forward: if x.sum() > 0:
    """
    lines = text.splitlines()
    found = ""
    for i, line in enumerate(lines):
        stripped = line.strip()
        match = _FRAME.match(stripped)
        if match and not _is_library(match["path"]):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            found = f"\nWhere: {stripped}" + (f": {code}" if code and not code.startswith("File ") else "")
    return found


def _user_frame_from_traceback(exc: BaseException) -> str:
    """The innermost user-code frame of the exception's traceback (export's message did not name one).

    >>> import torch
    >>> from autoshard.zoo.mlp import MLP, MLPConfig
    >>> try:
    ...     MLP(MLPConfig())(torch.ones(2, 5))  # the zoo's models count as user code
    ... except RuntimeError as exc:
    ...     print(_user_frame_from_traceback(exc).split(", line")[0].strip())
    Where: File ".../autoshard/zoo/mlp.py"
    """
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _is_library(f.filename)]
    if not frames:
        return ""
    frame = frames[-1]
    code = f": {frame.line.strip()}" if frame.line else ""
    return f'\nWhere: File "{frame.filename}", line {frame.lineno}, in {frame.name}{code}'
