"""Sharding hints: the JSON/dict format of DESIGN.md, parsed and checked against the traced graph.

Keys: a parameter-path glob (`layers.*.attn.q.weight`), a module-path glob with `:output`
(`layers.*.mlp:output`) or `:input` (the activations entering the module, as its ops consume them:
`layers.*.mlp.fc1:input` R on tp gathers before a column-parallel matmul), or `input:<i>`.
Values map axis names to `"S(d)"`, `"R"` or `"P"`. A module glob with `:attention` picks the context-parallel
strategy of the attentions inside (`"layers.*.attn:attention": {"cp": "ring"}`; "allgather", "ring" or
"alltoall": autoshard/strategies/attention.py); sharding the sequence (`"input:0": {"cp": "S(1)"}`) is what
makes an axis a context-parallel one.
A module glob with `:shard` takes MindSpore-style split counts for the module's one op:
`{"in_strategy": [[2, 1], [4, 1]]}`. Unmentioned axes are free. The top-level key `"zero"` asks for
ZeRO on a data-parallel axis: `{"zero": {"dp": 3}}` (stage 1, 2 or 3; autoshard/passes/zero.py); the key
`"recompute"` lists module paths whose activations are recomputed in backward (`["layers.0"]`; a plan
records the layers the memory budget made it recompute here, so that the saved plan reproduces them).

>>> hints = Hints.parse({"layers.*.mlp.fc1.weight": {"tp": "S(0)"}, "input:0": {"dp": "S(0)"}})
>>> hints.entries[0].target_kind
'param'
"""
from __future__ import annotations

import difflib
import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from autoshard.ir.errors import HintError
from autoshard.ir.json_files import parse_json_bytes
from autoshard.ir.placement import Partial, Placement, Shard, parse_placement
from autoshard.strategies.attention import SEQUENCE_METHODS

MAX_HINT_FILE_BYTES = 4 << 20
_KEY_RE = re.compile(r"^(?P<target>[A-Za-z0-9_.*?\[\]\-]+)(?::(?P<suffix>output|input|stage|shard|attention))?$")


@dataclass(frozen=True)
class HintEntry:
    """One key of the hint file: what it targets and the placements or split counts it asks for.

    >>> Hints.parse({"layers.*.mlp:output": {"tp": "R"}}).entries[0].target_kind
    'output'
    """

    key: str
    target_kind: str  # "param" | "output" | "module_input" | "input" | "shard" | "stage" | "attention"
    pattern: str
    placements: dict = field(default_factory=dict)  # axis name -> Placement (":attention": a strategy name)
    split_counts: tuple = ()


@dataclass
class Hints:
    """Parsed hints, still in user terms (axis names, globs); `annotate` resolves them on a graph.

    >>> hints = Hints.parse({"input:0": {"dp": "S(0)"}, "zero": {"dp": 2}})
    >>> hints.zero, bool(hints)
    ({'dp': 2}, True)
    """

    entries: list[HintEntry] = field(default_factory=list)
    zero: dict = field(default_factory=dict)  # {axis name: ZeRO stage}, at most one axis
    recompute: list = field(default_factory=list)  # module paths whose activations are recomputed (a saved plan's)

    @classmethod
    def load(cls, path) -> Hints:
        """Read a hint file: JSON only (never code), at most 4 MiB (a dict or Hints passes through parse).

        >>> import json, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "hints.json")
        >>> with open(path, "w") as f:
        ...     json.dump({"fc.weight": {"tp": "S(0)"}}, f)
        >>> Hints.load(path).to_json()
        {'fc.weight': {'tp': 'S(0)'}}
        """
        if isinstance(path, (dict, Hints)):
            return cls.parse(path)
        if not isinstance(path, (str, os.PathLike)):
            raise HintError(f"hints must be a dict {{key: {{axis: placement}}}} or the path of a JSON hint file; "
                            f"got {type(path).__name__} {path!r:.80}")
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise HintError(f"cannot read hint file {str(path)!r}: {exc.strerror or exc}; check the path "
                            "(hints= takes a dict or the path of a JSON file)") from exc
        if len(raw) > MAX_HINT_FILE_BYTES:
            raise HintError(f"hint file {str(path)!r} is {len(raw)} bytes; the limit is {MAX_HINT_FILE_BYTES} "
                            "(4 MiB). Use globs ('layers.*.attn.q.weight') instead of one key per layer")
        # strict JSON; every failure is a HintError
        data = parse_json_bytes(raw, f"hint file {str(path)!r}", HintError)
        return cls.parse(data, source=str(path))

    @classmethod
    def parse(cls, data, source: str = "hints") -> Hints:
        """Hints from a dict in the hint-file format (None: no hints; Hints pass through); every
        malformed key or value is a HintError naming it (`source` names where the dict came from).

        >>> Hints.parse({"layers.*.weight": {"tp": "S(1)"}}).entries[0].placements
        {'tp': S(1)}
        """
        if data is None:
            return cls()
        if isinstance(data, Hints):
            return data
        if not isinstance(data, dict):
            raise HintError(f"{source} must be a JSON object mapping keys to {{axis: placement}}, "
                            f"got {type(data).__name__}")
        entries = [_parse_entry(key, value, source) for key, value in data.items()
                   if key not in (ZERO_KEY, RECOMPUTE_KEY)]
        zero = parse_zero(data[ZERO_KEY], f"{source} key 'zero'") if ZERO_KEY in data else {}
        recompute = data.get(RECOMPUTE_KEY, [])
        if not isinstance(recompute, list) or not all(isinstance(p, str) and p for p in recompute):
            raise HintError(f"{source} key 'recompute' must be a list of module paths whose activations are "
                            f"recomputed in backward, e.g. [\"layers.0\", \"layers.1\"]; got {recompute!r:.80}")
        return cls(entries, zero, list(recompute))

    def __bool__(self) -> bool:
        """Sharding constraints given (ZeRO alone leaves the plan fully automatic)."""
        return bool(self.entries)

    def axis_names(self) -> set[str]:
        """The mesh axis names the hints mention.

        >>> sorted(Hints.parse({"input:0": {"dp": "S(0)"}, "fc.weight": {"tp": "S(0)"}}).axis_names())
        ['dp', 'tp']
        """
        return {axis for e in self.entries for axis in e.placements}

    def to_json(self) -> dict:
        """The hints in the hint-file format again (what a plan file records).

        >>> Hints.parse({"input:0": {"dp": "S(0)"}}).to_json()
        {'input:0': {'dp': 'S(0)'}}
        """
        out = {}
        for e in self.entries:
            if e.target_kind == "shard":
                out[e.key] = {"in_strategy": [list(c) for c in e.split_counts]}
            elif e.target_kind == "stage":
                out[e.key] = e.split_counts[0]
            else:
                out[e.key] = {axis: p if isinstance(p, str) else repr(p) for axis, p in e.placements.items()}
        if self.zero:
            out[ZERO_KEY] = dict(self.zero)
        if self.recompute:
            out[RECOMPUTE_KEY] = list(self.recompute)
        return out


ZERO_KEY = "zero"
RECOMPUTE_KEY = "recompute"
ZERO_STAGES = (1, 2, 3)


def parse_zero(value, source: str = "zero") -> dict:
    """`{"dp": 3}` -> {"dp": 3}: one mesh axis name mapped to a ZeRO stage (1, 2 or 3).

    >>> parse_zero({"dp": 3})
    {'dp': 3}
    """
    example = 'write e.g. {"dp": 3} (stage 1: optimizer state sharded, 2: also gradients, 3: also parameters)'
    if not isinstance(value, dict) or len(value) != 1:
        raise HintError(f"{source} must map one data-parallel mesh axis name to a ZeRO stage, got {value!r:.80}; "
                        f"{example}")
    (axis, stage), = value.items()
    if not isinstance(axis, str) or not axis:
        raise HintError(f"{source}: {axis!r} is not a mesh axis name; {example}")
    if type(stage) is not int or stage not in ZERO_STAGES:
        raise HintError(f"{source}: ZeRO stage {stage!r:.40} for axis {axis!r} is not 1, 2 or 3; {example}")
    return {axis: stage}


def _parse_entry(key, value, source) -> HintEntry:
    if not isinstance(key, str):
        raise HintError(f"{source}: key {key!r} is not a string")
    if key.startswith("input:"):
        index = key[len("input:"):]
        if not re.fullmatch(r"[0-9]{1,9}", index):
            raise HintError(f"{source}: key {key!r}: write input:<index>, e.g. 'input:0'")
        return HintEntry(key, "input", index, _placements(key, value, source))
    match = _KEY_RE.match(key)
    if match is None:
        raise HintError(f"{source}: key {key!r} is not a parameter glob, '<module glob>:output', '<module glob>:input', "
                        "'<module glob>:shard', '<module glob>:stage', '<module glob>:attention' or 'input:<i>'; write e.g. "
                        "'layers.*.attn.q.weight', 'layers.*.mlp:output' or 'input:0'")
    suffix = match.group("suffix")
    if suffix == "shard":
        if not isinstance(value, dict) or "in_strategy" not in value:
            raise HintError(f"{source}: {key!r} needs {{\"in_strategy\": [[split counts per dim] per input]}}")
        counts = value["in_strategy"]
        if (not isinstance(counts, list) or not all(isinstance(c, list) for c in counts)
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for c in counts for n in c)):
            raise HintError(f"{source}: {key!r}: in_strategy must be a list of lists of positive split counts, "
                            f"e.g. [[2, 1], [4, 1]]; got {counts!r}")
        return HintEntry(key, "shard", match.group("target"), {}, tuple(tuple(c) for c in counts))
    if suffix == "stage":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise HintError(f"{source}: {key!r} maps to a pipeline stage number (int >= 0), got {value!r}")
        return HintEntry(key, "stage", match.group("target"), {}, (value,))
    if suffix == "attention":
        return HintEntry(key, "attention", match.group("target"), _attention_methods(key, value, source))
    kind = {"output": "output", "input": "module_input"}.get(suffix, "param")
    return HintEntry(key, kind, match.group("target"), _placements(key, value, source))


def _placements(key, value, source) -> dict:
    if not isinstance(value, dict) or not value:
        raise HintError(f"{source}: {key!r} must map axis names to placements, e.g. {{\"tp\": \"S(0)\"}}; "
                        f"got {value!r}")
    out = {}
    for axis, text in value.items():
        if not isinstance(axis, str):
            raise HintError(f"{source}: {key!r} maps {axis!r} to a placement, but keys there are mesh axis names, "
                            "e.g. {\"tp\": \"S(0)\"}")
        try:
            out[axis] = parse_placement(text, f"{source} key {key!r} axis {axis!r}")
        except ValueError as exc:
            raise HintError(str(exc)) from None
    return out


def _attention_methods(key, value, source) -> dict:
    names = " | ".join(f"'{m}'" for m in SEQUENCE_METHODS)
    if (not isinstance(value, dict) or not value or not all(isinstance(a, str) for a in value)
            or not all(m in SEQUENCE_METHODS for m in value.values())):
        raise HintError(f"{source}: {key!r} maps mesh axis names to a context-parallel strategy ({names}), e.g. "
                        f"{{\"cp\": \"ring\"}}; got {value!r:.80}")
    return dict(value)


def match_paths(pattern: str, paths) -> list[str]:
    """Paths matching a glob, where `*` also matches a single path component.

    >>> match_paths("layers.*.weight", ["layers.0.weight", "layers.1.bias", "head.weight"])
    ['layers.0.weight']
    """
    return [p for p in paths if fnmatch.fnmatchcase(p, pattern)]


def unknown_target_error(entry: HintEntry, known, what: str) -> HintError:
    """The HintError for a hint that matches nothing, suggesting the closest paths of the model.

    >>> entry = Hints.parse({"mlp.fc3.weight": {"tp": "S(0)"}}).entries[0]
    >>> print(unknown_target_error(entry, ["mlp.fc1.weight", "mlp.fc2.weight"], "parameter"))  # doctest: +ELLIPSIS
    hint 'mlp.fc3.weight' matches no parameter of the model. Did you mean 'mlp.fc2.weight', 'mlp.fc1.weight'? ...
    """
    close = difflib.get_close_matches(entry.pattern, list(known), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return HintError(f"hint {entry.key!r} matches no {what} of the model.{hint} "
                     f"Check the path against model.named_{'parameters' if what == 'parameter' else 'modules'}().")


def check_placement_for(key: str, kind: str, axis: str, placement: Placement, shape, target: str = "") -> Placement:
    """A hint's placement must name an existing dim; inputs and parameters cannot be partial.

    `target` names the tensor the hint landed on when the key is a glob (errors then say which).

    >>> from autoshard.ir.placement import S
    >>> check_placement_for("fc.weight", "param", "tp", S(-1), (8, 4))   # negative dims count from the end
    S(1)
    """
    what = {"param": "parameter", "buffer": "buffer", "input": "input", "output": "module output"}.get(kind, "tensor")
    at = f" for {target}," if target else ""
    if isinstance(placement, Partial) and kind in ("param", "buffer", "input"):
        raise HintError(f"hint {key!r}{at} on axis {axis!r}: {'an' if kind == 'input' else 'a'} {what} cannot be "
                        "partial ('P'): it holds whole values, not summands; use 'R' or 'S(d)'")
    if isinstance(placement, Shard):
        ndim = len(shape)
        dim = placement.dim + ndim if placement.dim < 0 else placement.dim
        if not 0 <= dim < ndim:
            fix = f"use 'S(0)' .. 'S({ndim - 1})' or 'R'" if ndim else "use 'R' (a scalar has no dim to shard)"
            raise HintError(f"hint {key!r}{at} on axis {axis!r}: {placement!r} names dim {placement.dim}, but the "
                            f"{what} has {ndim} dims (shape {tuple(shape)}); {fix}")
        return Shard(dim)
    return placement
