"""Pipeline stage annotations in the three notations of the field, reduced to one form.

- a stage number per module: MindSpore's `cell.pipeline_stage = k`, `autoshard.stage(module, k)`, or
  `"<module glob>:stage": k` in the hint file (the innermost annotated module of an op wins);
- FairScale's `balance=[n0, n1, ...]`: the first n0 layers of the model's top-level sequence (its
  children, with ModuleList/Sequential children expanded into their items) form stage 0, and so on;
- torch pipelining's split points: `split_points={"layers.2": "beginning", "layers.5": "end"}` (or a
  list of paths, each beginning a new stage).
`StageAnnotations` is what the user said; `passes/cut_stages.py` turns it into a stage per graph node
and checks it against the graph (execution order, stage count).

>>> import torch.nn as nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
>>> collect_annotations(model, balance=[2, 1]).module_stages
{'0': 0, '1': 0, '2': 1}
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from autoshard.frontend.hints import Hints
from autoshard.ir.errors import UserInputError

STAGE_ATTR = "_autoshard_stage"
SPLIT_WHERE = ("beginning", "end")


def stage(module: nn.Module, k: int) -> nn.Module:
    """Put `module` (and everything it calls) into pipeline stage `k`; returns the module.

    >>> import torch.nn as nn
    >>> block = stage(nn.Linear(4, 4), 1)
    """
    if not isinstance(module, nn.Module):
        raise UserInputError(f"autoshard.stage takes an nn.Module, got {type(module).__name__}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise UserInputError(f"autoshard.stage(module, k): k is a pipeline stage number (int >= 0), got {k!r}")
    setattr(module, STAGE_ATTR, k)
    return module


@dataclass(frozen=True)
class StageAnnotations:
    """Stage numbers per module-path glob, or split points (path, 'beginning'|'end'), or a saved plan's stage per
    node name (`node_stages`: its cut applied as it was made); `source` names the notation for error messages.

    >>> StageAnnotations({"layers.0": 0, "layers.1": 1}, source="':stage' hints").module_stages["layers.1"]
    1
    """

    module_stages: dict = field(default_factory=dict)
    split_points: tuple = ()
    source: str = ""
    node_stages: dict = field(default_factory=dict)


def top_level_sequence(model: nn.Module) -> list[str]:
    """The model's layers in order as FairScale's `balance` counts them: top-level children, with
    ModuleList/Sequential children expanded into their items.

    >>> top_level_sequence(nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.ReLU(), nn.ReLU()])))
    ['0', '1.0', '1.1']
    """
    paths = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child):
            paths.extend(f"{name}.{item}" for item, _ in child.named_children())
        else:
            paths.append(name)
    return paths


def collect_annotations(model: nn.Module, hints=None, balance=None, split_points=None) -> StageAnnotations | None:
    """The user's stage annotations, in whichever one notation they used (None: cut automatically).

    >>> collect_annotations(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), split_points=["1"]).split_points
    (('1', 'beginning'),)
    >>> collect_annotations(nn.Sequential(nn.Linear(2, 2))) is None
    True
    """
    found = []
    attrs = _module_attributes(model)
    if attrs:
        found.append(StageAnnotations(attrs, source="module stage attributes (pipeline_stage / autoshard.stage)"))
    if isinstance(hints, dict):
        hints = Hints.parse(hints)
    from_hints = {e.pattern: e.split_counts[0] for e in getattr(hints, "entries", []) if e.target_kind == "stage"}
    if from_hints:
        found.append(StageAnnotations(from_hints, source="':stage' hints"))
    if balance is not None:
        found.append(StageAnnotations(_from_balance(model, balance), source=f"balance={list(balance)}"))
    if split_points is not None:
        found.append(StageAnnotations(split_points=_parse_split_points(split_points),
                                      source=f"split_points={split_points!r}"))
    if len(found) > 1:
        raise UserInputError("stage annotations given in more than one notation (" +
                             "; ".join(a.source for a in found) + "); use one of them")
    return found[0] if found else None


def _module_attributes(model: nn.Module) -> dict:
    out = {}
    for path, module in model.named_modules():
        k = getattr(module, STAGE_ATTR, None)
        if k is None:
            k = getattr(module, "pipeline_stage", None)  # MindSpore's Cell attribute
        if k is None:
            continue
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise UserInputError(f"module {path or '<root>'!r}: pipeline_stage must be an int >= 0, got {k!r}")
        out[path] = k
    return out


def _from_balance(model: nn.Module, balance) -> dict:
    layers = top_level_sequence(model)
    if (not isinstance(balance, (list, tuple)) or not balance
            or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in balance)):
        raise UserInputError(f"balance must be a list of positive layer counts, one per stage; got {balance!r}")
    if sum(balance) != len(layers):
        raise UserInputError(f"balance={list(balance)} covers {sum(balance)} layers but the model's top-level "
                             f"sequence has {len(layers)}: {layers}; make the counts add up to {len(layers)}")
    out, start = {}, 0
    for k, n in enumerate(balance):
        for path in layers[start:start + n]:
            out[path] = k
        start += n
    return out


def _parse_split_points(split_points) -> tuple:
    if isinstance(split_points, dict):
        items = list(split_points.items())
    elif isinstance(split_points, (list, tuple)):
        items = [(p, "beginning") for p in split_points]
    else:
        raise UserInputError("split_points is a list of module paths (each begins a stage) or a dict "
                             f"{{module path: 'beginning'|'end'}}; got {type(split_points).__name__}")
    for path, where in items:
        if not isinstance(path, str) or not path:
            raise UserInputError(f"split point {path!r}: give a module path such as 'layers.2'")
        if str(where).lower() not in SPLIT_WHERE:
            raise UserInputError(f"split point {path!r}: where must be 'beginning' or 'end', got {where!r}")
    return tuple((p, str(w).lower()) for p, w in items)
