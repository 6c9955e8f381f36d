"""annotate: resolve the user's hints onto graph nodes.

Reads: `state.hints` (parsed, in user terms), `autoshard.path`/`kind`, `autoshard.constrain` calls.
Writes: `autoshard.hint` = {axis index: Placement} on hinted placeholders and module outputs, and
`autoshard.input_hint` = {axis index: {input position: Placement}} for MindSpore-style split counts.
Invariant: every hint names a real target and axis, its dims exist and divide evenly, and no two
hints disagree about one tensor on one axis (errors name both keys).
"""
from __future__ import annotations

import itertools
import math

import torch

from .. import meta
from ..errors import HintError
from ..hints import Hints, check_placement_for, match_paths, unknown_target_error
from ..placement import Shard, parse_placement
from ..strategies import tensor_inputs

INPUT_HINT = "autoshard.input_hint"


def annotate(state) -> None:
    hints = state.hints = Hints.parse(state.hints)
    mesh = state.mesh
    for axis in sorted(hints.axis_names()):
        if axis not in mesh.names:
            keys = [e.key for e in hints.entries if axis in e.placements]
            raise HintError(f"hint {keys[0]!r} names mesh axis {axis!r}, but the mesh has axes "
                            f"{list(mesh.names)}; use one of those names (or pass axis_names=...)")
    graph = state.gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    ops = [n for n in graph.nodes if n.op == "call_function"]
    sources: dict = {}  # (node, axis) -> hint key that set it
    for entry in hints.entries:
        if entry.target_kind == "param":
            _apply_param(entry, placeholders, state, sources)
        elif entry.target_kind == "input":
            _apply_input(entry, placeholders, state, sources)
        elif entry.target_kind == "output":
            _apply_output(entry, ops, state, sources)
        elif entry.target_kind == "shard":
            _apply_split_counts(entry, ops, state, sources)
        elif entry.target_kind == "stage":
            raise HintError(f"hint {entry.key!r}: pipeline stage hints are not supported by this version; "
                            "remove the ':stage' keys (pipeline parallelism is planned, see the issues)")
    for node in ops:
        if node.target is getattr(getattr(torch.ops, "autoshard", None), "constrain", None) or \
                str(node.target).startswith("autoshard.constrain"):
            _apply_constrain(node, state, sources)
    for node in graph.nodes:
        if meta.HINT in node.meta:
            _check_nested_divisibility(node, state.mesh, sources)


annotate.name = "annotate"


def _set(node, entry_key: str, axis_name: str, placement, state, sources, what: str):
    mesh = state.mesh
    axis = mesh.axis(axis_name)
    shape = tuple(node.meta["val"].shape)
    placement = check_placement_for(entry_key, what, axis_name, placement, shape)
    if isinstance(placement, Shard) and shape[placement.dim] % mesh.shape[axis]:
        raise HintError(f"hint {entry_key!r} shards dim {placement.dim} (size {shape[placement.dim]}) of "
                        f"{_describe(node)} over axis {axis_name!r} of size {mesh.shape[axis]}, which does not "
                        "divide it; pick a divisible dim, another axis, or change the size")
    hint = node.meta.setdefault(meta.HINT, {})
    if axis in hint and hint[axis] != placement:
        raise HintError(f"hints {sources[(node, axis)]!r} and {entry_key!r} contradict on {_describe(node)} axis "
                        f"{axis_name!r}: {hint[axis]!r} vs {placement!r}; keep one of them")
    hint[axis] = placement
    sources[(node, axis)] = entry_key


def _describe(node) -> str:
    return f"{node.meta.get(meta.PATH) or node.name} (node {node.name!r})"


def _apply_param(entry, placeholders, state, sources):
    by_path = {}
    for node in placeholders:
        if node.meta.get(meta.KIND) in ("param", "buffer"):
            for path in [node.meta[meta.PATH], *node.meta.get(meta.ALIASES, [])]:
                by_path[path] = node
    matched = match_paths(entry.pattern, by_path)
    if not matched:
        raise unknown_target_error(entry, by_path, "parameter")
    for node in dict.fromkeys(by_path[p] for p in matched):
        for axis, placement in entry.placements.items():
            _set(node, entry.key, axis, placement, state, sources, "param")


def _apply_input(entry, placeholders, state, sources):
    inputs = [n for n in placeholders if n.meta.get(meta.KIND) == "input"]
    index = int(entry.pattern)
    if index >= len(inputs):
        raise HintError(f"hint {entry.key!r}: the model has {len(inputs)} inputs (input:0 .. "
                        f"input:{len(inputs) - 1})")
    for axis, placement in entry.placements.items():
        _set(inputs[index], entry.key, axis, placement, state, sources, "input")


def module_outputs(ops, module: str) -> list:
    """Nodes inside `module` whose values are used outside it (or returned)."""
    def inside(node):
        path = node.meta.get(meta.PATH, "")
        return node.op == "call_function" and (path == module or path.startswith(module + "."))
    return [n for n in ops if inside(n) and isinstance(n.meta.get("val"), torch.Tensor)
            and any(not inside(u) for u in n.users)]


def _module_paths(ops) -> set[str]:
    paths = set()
    for node in ops:
        parts = node.meta.get(meta.PATH, "").split(".")
        for i in range(1, len(parts) + 1):
            paths.add(".".join(parts[:i]))
    paths.discard("")
    return paths


def _apply_output(entry, ops, state, sources):
    modules = sorted(match_paths(entry.pattern, _module_paths(ops)))
    if not modules:
        raise unknown_target_error(entry, _module_paths(ops), "module")
    for module in modules:
        for node in module_outputs(ops, module):
            for axis, placement in entry.placements.items():
                _set(node, entry.key, axis, placement, state, sources, "output")


def _apply_split_counts(entry, ops, state, sources):
    """MindSpore `shard(in_strategy)`: split counts per input dim, mapped onto mesh axes."""
    modules = sorted(match_paths(entry.pattern, _module_paths(ops)))
    if not modules:
        raise unknown_target_error(entry, _module_paths(ops), "module")
    for module in modules:
        node = next((n for n in ops if n.meta.get(meta.PATH) == module and len(tensor_inputs(n)) >= 1), None)
        inputs = tensor_inputs(node) if node is not None else []
        if node is None or len(inputs) != len(entry.split_counts):
            raise HintError(f"hint {entry.key!r}: module {module!r} has an op with {len(inputs)} tensor inputs but "
                            f"in_strategy gives {len(entry.split_counts)}; give one list per input")
        wanted = node.meta.setdefault(INPUT_HINT, {})
        for pos, (producer, counts) in enumerate(zip(inputs, entry.split_counts)):
            shape = tuple(producer.meta["val"].shape)
            if len(counts) != len(shape):
                raise HintError(f"hint {entry.key!r}: input {pos} of {module!r} has {len(shape)} dims "
                                f"(shape {shape}) but in_strategy gives {len(counts)} counts")
            for axis, placement in _counts_to_axes(entry, counts, shape, state.mesh).items():
                wanted.setdefault(axis, {})[pos] = placement
                if producer.op == "placeholder" and producer.meta.get(meta.KIND) != "input":
                    _set(producer, entry.key, state.mesh.names[axis], placement, state, sources, "param")


def _counts_to_axes(entry, counts, shape, mesh) -> dict:
    """Each count > 1 takes the first unused mesh axes (fewest first) whose sizes multiply to it."""
    used, out = set(), {}
    for dim, count in enumerate(counts):
        if count == 1:
            continue
        if shape[dim] % count:
            raise HintError(f"hint {entry.key!r}: split count {count} does not divide dim {dim} of size {shape[dim]}")
        free = [a for a in range(mesh.ndim) if a not in used]
        choice = next((combo for r in range(1, len(free) + 1) for combo in itertools.combinations(free, r)
                       if math.prod(mesh.shape[a] for a in combo) == count), None)
        if choice is None:
            raise HintError(f"hint {entry.key!r}: split count {count} on dim {dim} matches no product of unused "
                            f"mesh axes {[(mesh.names[a], mesh.shape[a]) for a in free]}")
        for axis in choice:
            used.add(axis)
            out[axis] = Shard(dim)
    return out


def _apply_constrain(node, state, sources):
    spec_text = node.args[1]
    for item in filter(None, (p.strip() for p in spec_text.split(";"))):
        axis, _, placement = item.partition("=")
        _set(node, f"constrain({spec_text})", axis.strip(), parse_placement(placement, "autoshard.constrain"),
             state, sources, "output")


def _check_nested_divisibility(node, mesh, sources):
    shape = tuple(node.meta["val"].shape)
    hint = node.meta[meta.HINT]
    for dim in range(len(shape)):
        axes = [a for a, p in hint.items() if isinstance(p, Shard) and p.dim == dim]
        total = math.prod(mesh.shape[a] for a in axes)
        if axes and shape[dim] % total:
            keys = sorted({sources[(node, a)] for a in axes})
            raise HintError(f"hints {keys} shard dim {dim} (size {shape[dim]}) of {_describe(node)} over axes "
                            f"{[mesh.names[a] for a in axes]} ({total} blocks), which does not divide it")
