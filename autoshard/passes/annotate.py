"""annotate: resolve the user's hints onto graph nodes.

Reads: `state.hints` (parsed, in user terms), `autoshard.path`/`kind`, `autoshard.constrain` calls.
Writes: `autoshard.hint` = {axis index: Placement} on hinted placeholders and module outputs, and
`autoshard.input_hint` = {axis index: {input position: Placement}} for MindSpore-style split counts.
Invariant: every hint names a real target and axis, its dims exist and divide evenly, and no two
hints disagree about one tensor on one axis (errors name both keys).

The examples annotate a two-layer MLP:

>>> from autoshard.passes.pass_lists import state_before
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> state = state_before("annotate", model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                      hints={"input:0": {"dp": "S(0)"}, "layers.*.weight": {"dp": "R"}})
"""
from __future__ import annotations

import itertools
import math

import torch

from autoshard.frontend.constrain import parse_spec
from autoshard.frontend.hints import (
    Hints,
    check_placement_for,
    match_paths,
    unknown_target_error,
)
from autoshard.ir import meta
from autoshard.ir.errors import HintError
from autoshard.ir.placement import R, Shard
from autoshard.passes.contract import NORMALIZED, compiler_pass
from autoshard.strategies import candidates_for, tensor_inputs
from autoshard.strategies.base import output_shapes


@compiler_pass("annotate", reads=(NORMALIZED, meta.KIND, meta.PATH, "state.hints"),
               writes=(meta.HINT, meta.INPUT_HINT, meta.ATTENTION_HINT, "state.hints"))
def annotate(state) -> None:
    """The pass: parse `state.hints` and write each hinted node's `autoshard.hint` {axis index: placement}.

    >>> annotate(state)  # the module docstring's state
    >>> {n.meta["autoshard.path"]: n.meta["autoshard.hint"] for n in state.gm.graph.nodes if "autoshard.hint" in n.meta}
    {'layers.0.weight': {0: R}, 'layers.1.weight': {0: R}, 'input:0': {0: S(0)}}
    """
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
        elif entry.target_kind == "module_input":
            _apply_module_input(entry, ops, state, sources)
        elif entry.target_kind == "shard":
            _apply_split_counts(entry, ops, state, sources)
        elif entry.target_kind == "attention":
            _apply_attention(entry, ops, state)
        elif entry.target_kind == "stage" and state.options.pipeline is None:  # cut_stages reads them
            raise HintError(f"hint {entry.key!r} puts modules into a pipeline stage but the mesh has no pipeline "
                            f"axis; name a mesh axis 'pp' (mesh axes: {list(state.mesh.names)}) or remove the "
                            "':stage' keys")
    for node in ops:
        if node.target is torch.ops.autoshard.constrain.default:
            _apply_constrain(node, state, sources)
    for node in graph.nodes:
        if meta.HINT in node.meta:
            _check_nested_divisibility(node, state.mesh, sources)



def _set(node, entry_key: str, axis_name: str, placement, state, sources, what: str):
    mesh = state.mesh
    axis = mesh.axis(axis_name)
    shape = tuple(node.meta["val"].shape)
    placement = check_placement_for(entry_key, what, axis_name, placement, shape, _describe(node))
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
            _set(node, entry.key, axis, placement, state, sources, node.meta[meta.KIND])


def _apply_input(entry, placeholders, state, sources):
    inputs = [n for n in placeholders if n.meta.get(meta.KIND) == "input"]
    index = int(entry.pattern)
    if index >= len(inputs):
        raise HintError(f"hint {entry.key!r}: the model takes {len(inputs)} example input"
                        f"{'' if len(inputs) == 1 else 's'}, so input indices run from 0 to {len(inputs) - 1}; "
                        "number inputs by their position in example_inputs")
    for axis, placement in entry.placements.items():
        _set(inputs[index], entry.key, axis, placement, state, sources, "input")


def module_outputs(ops, module: str) -> list:
    """Nodes inside `module` whose values are used outside it (or returned): what `<module>:output`
    hints fix.

    >>> ops = [n for n in state.gm.graph.nodes if n.op == "call_function"]
    >>> [n.name for n in module_outputs(ops, "layers.0")]
    ['add_tensor']
    """
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


def _apply_module_input(entry, ops, state, sources):
    """`<module>:input`: the placement each op inside the module needs of an activation made outside it
    (parameters and buffers excluded: their hints are parameter keys)."""
    modules = sorted(match_paths(entry.pattern, _module_paths(ops)))
    if not modules:
        raise unknown_target_error(entry, _module_paths(ops), "module")
    mesh = state.mesh
    for module in modules:
        inside = {n for n in ops if (n.meta.get(meta.PATH, "") + ".").startswith(module + ".")}
        for node in inside:
            for pos, producer in enumerate(tensor_inputs(node)):
                if producer in inside or producer.meta.get(meta.KIND) in ("param", "buffer"):
                    continue
                shape = tuple(producer.meta["val"].shape)
                for axis_name, placement in entry.placements.items():
                    axis = mesh.axis(axis_name)
                    where = f"input {pos} of {_describe(node)}"
                    placement = check_placement_for(entry.key, "input", axis_name, placement, shape, where)
                    wanted = node.meta.setdefault(meta.INPUT_HINT, {}).setdefault(axis, {})
                    if wanted.get(pos, placement) != placement:
                        raise HintError(f"hints {sources[(node, axis, pos)]!r} and {entry.key!r} contradict on {where} "
                                        f"axis {axis_name!r}: {wanted[pos]!r} vs {placement!r}; keep one of them")
                    wanted[pos] = placement
                    sources[(node, axis, pos)] = entry.key


def _apply_attention(entry, ops, state):
    """`<module>:attention`: the context-parallel strategy of every attention inside the matched modules."""
    modules = sorted(match_paths(entry.pattern, _module_paths(ops) | {""}))
    attentions = [n for n in ops if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    found = [n for n in attentions for m in modules
             if m == "" or (n.meta.get(meta.PATH, "") + ".").startswith(m + ".")]
    if not found:
        where = ", ".join(sorted({n.meta.get(meta.PATH) or "the top level" for n in attentions})) or "none"
        raise HintError(f"hint {entry.key!r} matches no attention (scaled_dot_product_attention) of the model; the "
                        f"attentions are in: {where}. An attention written out that normalize could not fuse (a dropout "
                        "between softmax and matmul, a learned bias) takes 'allgather' and 'alltoall' by placement hints "
                        "on its matmuls instead")
    for node in dict.fromkeys(found):
        for axis_name, method in entry.placements.items():
            node.meta.setdefault(meta.ATTENTION_HINT, {})[state.mesh.axis(axis_name)] = method


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
        options = []
        for pos, (producer, counts) in enumerate(zip(inputs, entry.split_counts)):
            shape = tuple(producer.meta["val"].shape)
            if len(counts) != len(shape):
                raise HintError(f"hint {entry.key!r}: input {pos} of {module!r} has {len(shape)} dims "
                                f"(shape {shape}) but in_strategy gives {len(counts)} counts; give one count per dim")
            where = f"input {pos} of {module!r} ({_describe(producer)})"
            options.append(_axis_assignments(entry, counts, shape, state.mesh, where))
        chosen = _supported_assignment(node, inputs, options, state.mesh)
        if chosen is None:
            raise HintError(f"hint {entry.key!r}: no mapping of the split counts {list(map(list, entry.split_counts))} "
                            f"onto the axes of {state.mesh!r} is a sharding that the op of module {module!r} "
                            f"({node.target}, node {node.name!r}) supports; check that dims the op combines (e.g. "
                            "a matmul's contracted dim) get equal counts")
        wanted = node.meta.setdefault(meta.INPUT_HINT, {})
        for pos, (producer, assignment) in enumerate(zip(inputs, chosen)):
            for axis, placement in assignment.items():
                wanted.setdefault(axis, {})[pos] = placement
                if producer.op == "placeholder" and producer.meta.get(meta.KIND) != "input":
                    _set(producer, entry.key, state.mesh.names[axis], placement, state, sources,
                         producer.meta[meta.KIND])


def _axis_assignments(entry, counts, shape, mesh, where: str) -> list[dict]:
    """Every way to give each count > 1 its own mesh axes whose sizes multiply to it: [{axis: Shard(dim)}],
    preferred first (fewest axes, then outer axes first)."""
    found = [({}, frozenset())]
    for dim, count in enumerate(counts):
        if count == 1:
            continue
        if shape[dim] % count:
            raise HintError(f"hint {entry.key!r}: split count {count} does not divide dim {dim} (size {shape[dim]}) "
                            f"of {where}; use a count that divides it (or 1 to leave the dim whole)")
        extended = []
        for assignment, used in found:
            free = [a for a in range(mesh.ndim) if a not in used]
            for r in range(1, len(free) + 1):
                for combo in itertools.combinations(free, r):
                    if math.prod(mesh.shape[a] for a in combo) == count:
                        extended.append(({**assignment, **{a: Shard(dim) for a in combo}}, used | set(combo)))
        if not extended:
            raise HintError(f"hint {entry.key!r}: split count {count} on dim {dim} of {where} matches no product of "
                            f"distinct mesh axes {[(n, k) for n, k in zip(mesh.names, mesh.shape)]}; use a count "
                            "that is the size of a mesh axis (or a product of several)")
        found = extended
    return [assignment for assignment, _ in found]


def _supported_assignment(node, inputs, options, mesh):
    """The first combination of per-input assignments that the op's strategy rule allows on every axis
    (inputs not split on an axis are replicated there, as in MindSpore)."""
    in_shapes = [tuple(p.meta["val"].shape) for p in inputs]
    out_shapes = output_shapes(node)
    allowed = [{c.inputs for c in candidates_for(node, in_shapes, out_shapes, k, warn=False)} for k in mesh.shape]
    for combo in itertools.product(*options):
        if all(tuple(a.get(axis, R) for a in combo) in allowed[axis] for axis in range(mesh.ndim)):
            return combo
    return None


def _apply_constrain(node, state, sources):
    spec = node.args[1]
    key = f"autoshard.constrain({spec!r}) in {node.meta.get(meta.PATH) or 'the top-level forward'}"
    for axis, placement in parse_spec(spec, key).items():
        if axis not in state.mesh.names:
            raise HintError(f"{key} names mesh axis {axis!r}, but the mesh has axes {list(state.mesh.names)}; "
                            "use one of those names (or pass axis_names=...)")
        _set(node, key, axis, placement, state, sources, "output")


def _check_nested_divisibility(node, mesh, sources):
    shape = tuple(node.meta["val"].shape)
    hint = node.meta[meta.HINT]
    for dim in range(len(shape)):
        axes = [a for a, p in hint.items() if isinstance(p, Shard) and p.dim == dim]
        total = math.prod(mesh.shape[a] for a in axes)
        if axes and shape[dim] % total:
            keys = sorted({sources[(node, a)] for a in axes})
            raise HintError(f"hints {keys} shard dim {dim} (size {shape[dim]}) of {_describe(node)} over axes "
                            f"{[mesh.names[a] for a in axes]} ({total} blocks), which does not divide it; shard "
                            f"it over fewer axes or make the size a multiple of {total}")
