"""What autograd keeps for backward, per node: the one home of the saved-activation formula that the ILP's
memory row (autoshard/cost/axis_cost.py) and predict (autoshard/passes/predict.py) share.

Each ATen op is probed once on meta tensors of the node's shapes under `saved_tensors_hooks`: which inputs
it saves, whether it saves its output, the bytes of buffers it saves besides (a layer norm's statistics, a
dropout's mask) and which input its output is a view of. Views share their base's storage, so a value saved
through any of its views is one storage, counted once, on the node that allocated it (its root); a value no
op saves is not kept (an add's output, a bias-less linear's output consumed by another linear's input is).
Attention is priced as the fused CPU/GPU kernels run it (q, k, v, output and the log-sum-exp rows; its
score blocks, where kept, are attention_cost's); the runtime's collectives save nothing, and a
`grad_all_reduce` forward (or a `chunk` of the outermost dim) returns a view of its input. ZeRO-3's gathered
parameters are saved as shards (autoshard/runtime/zero_gather.py): not kept here, their transient copies
are zero_cost's `gathered`. Ops the probe cannot run are assumed to keep their output (conservative).

>>> import torch
>>> from autoshard.passes.pass_lists import state_before
>>> from autoshard.cost.axis_cost import needs_grad
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> state = state_before("solve", mlp, (2,), (torch.randn(8, 4),), axis_names=("dp",))
>>> kept = kept_for_backward(state.gm.graph, needs_grad(state.gm.graph))
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

from autoshard.ir import meta

aten = torch.ops.aten
_ATTENTION = aten.scaled_dot_product_attention.default
_ALIASING_COMM = {"grad_all_reduce"}  # forward returns x.view_as(x)
_SHARD_SAVED_COMM = {"param_all_gather"}  # ZeRO-3: saved as the shard, re-gathered in backward


@dataclass(frozen=True)
class Saves:
    """What one op keeps for backward: tensor-input positions, its output, other buffers (bytes per byte of
    output) and the input position its output is a view of (None: fresh storage).

    >>> Saves(inputs=(0, 1), output=False, extra=0.0, alias=None).inputs
    (0, 1)
    """

    inputs: tuple[int, ...] = ()
    output: bool = False
    extra: float = 0.0
    alias: int | None = None


_KEEPS_OUTPUT = Saves(output=True)  # what an op the probe cannot run is assumed to save


def _tensor_args(node) -> list:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _signature(value, grad):
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return ("T", tuple(val.shape), tuple(val.stride()), val.dtype, bool(grad.get(value)))
        return ("N", repr(val))
    return value


def _fresh(value, grad):
    val = value.meta["val"]
    t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="meta")
    return t.requires_grad_(bool(grad.get(value)) and t.is_floating_point())


_PROBED: dict = {}  # (op, argument signature) -> Saves: repeated layers probe once


def _probe(target, inputs, args, kwargs) -> Saves:
    """Run `target` once on meta tensors; Saves by storage identity (meta storages are distinct objects)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = target(*args, **kwargs)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]

    def sid(t):
        return t.untyped_storage()._cdata

    in_ids = [sid(t) for t in inputs]
    out_ids = {sid(o) for o in outs}
    positions, output, extra, seen = set(), False, 0, set()
    for t in saved:
        key = sid(t)
        if key in seen:
            continue
        seen.add(key)
        if key in in_ids:
            positions.add(in_ids.index(key))
        elif key in out_ids:
            output = True
        else:
            extra += t.untyped_storage().nbytes()
    out_bytes = sum(o.numel() * o.element_size() for o in outs) or 1
    alias = next((in_ids.index(sid(o)) for o in outs if sid(o) in in_ids), None)
    return Saves(tuple(sorted(positions)), output, extra / out_bytes, alias)


def _attention_saves(node) -> Saves:
    """The fused kernel keeps q, k, v, its output and one float32 log-sum-exp per row and head."""
    out = node.meta["val"]
    distinct = len(_tensor_args(node))  # self-attention on one value, sdpa(x, x, x), saves that value once
    return Saves(tuple(range(min(3, distinct))), True, 4 / (out.shape[-1] * out.element_size()), None)


def op_saves(node, grad: dict, seen: dict | None = None) -> Saves:
    """What `node`'s op keeps for backward, given which values carry a gradient (`needs_grad`). `seen`: a dict
    kept over one walk of a graph, where the copies of a repeated layer's op (an unfolded trace's) share their
    arguments' `val` objects: found there by those objects' ids, not by their shapes.

    >>> first, second = [n for n in state.gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    >>> op_saves(second, needs_grad(state.gm.graph))  # its input (for the weight's gradient) and its weight
    Saves(inputs=(0, 1), output=False, extra=0.0, alias=None)
    >>> op_saves(first, needs_grad(state.gm.graph)).inputs  # the model's input only: it needs no gradient
    (0,)
    """
    if node.op != "call_function":
        return Saves()
    if node.target is operator.getitem:
        return Saves(alias=0)
    if node.meta.get(meta.KIND) == "comm":
        op = node.meta[meta.COMM]["op"]
        return Saves(alias=0) if op in _ALIASING_COMM or _chunk_is_view(node) else Saves()
    tensors = _tensor_args(node)
    if not any(grad.get(t) for t in tensors):
        return Saves()  # autograd records nothing
    if node.target is _ATTENTION:
        return _attention_saves(node)
    if not isinstance(node.target, torch._ops.OpOverload) or not all("val" in t.meta for t in tensors):
        return _KEEPS_OUTPUT
    if seen is not None:
        same = (node.target, _by_identity(node.args, grad), _by_identity(tuple(node.kwargs.items()), grad))
        if same in seen:
            return seen[same]
    key = (node.target, _hashable([_signature(a, grad) for a in node.args]),
           _hashable(sorted((k, _signature(v, grad)) for k, v in node.kwargs.items())))
    if key not in _PROBED:
        fresh = {t: _fresh(t, grad) for t in tensors}
        swap = functools.partial(tree_map, lambda a: fresh.get(a, a) if isinstance(a, torch.fx.Node) else a)
        try:
            _PROBED[key] = _probe(node.target, [fresh[t] for t in tensors], swap(node.args), swap(dict(node.kwargs)))
        except Exception:  # noqa: BLE001  (an op meta tensors cannot run: keep its output, as before)
            _PROBED[key] = _KEEPS_OUTPUT
    if seen is not None:
        seen[same] = _PROBED[key]
    return _PROBED[key]


def _by_identity(value, grad):
    """An argument tree as `op_saves`' `seen` keys it: a node by its value's identity and whether it carries a
    gradient (ids are stable while the graph holds the values: `seen` lives for one walk)."""
    if isinstance(value, torch.fx.Node):
        return id(value.meta.get("val")), bool(grad.get(value))
    if isinstance(value, (list, tuple)):
        return tuple(_by_identity(v, grad) for v in value)
    return _hashable(value)


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _chunk_is_view(node) -> bool:
    if node.meta[meta.COMM]["op"] != "chunk":
        return False
    dim = node.meta[meta.COMM]["args"][0] if node.meta[meta.COMM].get("args") else 0
    return chunk_is_view(node.args[0].meta["val"].shape, dim)


def chunk_is_view(shape, dim: int) -> bool:
    """Whether the runtime's `chunk` of a value of (global) `shape` along `dim` returns a view: it slices its input,
    and `.contiguous()` copies unless the dim is the outermost non-unit one.

    >>> chunk_is_view((8, 4), 0), chunk_is_view((8, 4), 1), chunk_is_view((1, 8, 4), 1)
    (True, False, True)
    """
    return all(s == 1 for s in shape[:dim])


def storage_root(node, grad: dict):
    """The node whose output storage `node`'s value lives in (itself unless its op returns a view).

    >>> graph = torch.fx.Graph()
    >>> x = graph.placeholder("x")
    >>> x.meta["val"] = torch.empty(4, 8)
    >>> view = graph.call_function(torch.ops.aten.transpose.int, (x, 0, 1))
    >>> view.meta["val"] = torch.empty(8, 4)
    >>> storage_root(view, {x: True, view: True}) is x  # a transposed value is its input's storage
    True
    """
    return _storage_root(node, lambda n: op_saves(n, grad))


def _storage_root(node, saves_of):
    while True:
        alias = saves_of(node).alias
        if alias is None:
            return node
        node = node.args[0] if node.target is operator.getitem or node.meta.get(meta.KIND) == "comm" \
            else _tensor_args(node)[alias]


def _alias_source(node, saves: Saves):
    """The input whose storage `node`'s output views (None: a fresh storage)."""
    if saves.alias is None:
        return None
    if node.target is operator.getitem or node.meta.get(meta.KIND) == "comm":
        return node.args[0]
    return _tensor_args(node)[saves.alias]


@dataclass(frozen=True)
class KeptSplit:
    """`kept_for_backward` split for the ILP, whose edges can replace a value by a converted copy:
    `own` {node: bytes kept per byte of output whatever its consumers are given} (buffers its op saves, its
    storage when its own op saves its output), `keepers` {node: consumers that keep its value alive} (they
    save it, or view it and that view is kept) and `roots`: the nodes whose storage is kept only when some
    keeper gets it unconverted (a keeper given a fresh copy keeps the copy instead).

    >>> split = kept_split(state.gm.graph, needs_grad(state.gm.graph))
    >>> relu = next(n for n in state.gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    >>> split.own.get(relu, 0.0), [n.target.__name__ for n in split.keepers[relu]]  # relu saves its output
    (1.0, ['linear.default'])
    >>> relu in split.roots  # kept whatever its consumer is given
    False
    """

    own: dict
    keepers: dict
    roots: frozenset


def kept_split(graph, grad: dict) -> KeptSplit:
    """`own`, `keepers` and `roots` of the graph (see KeptSplit); with every keeper given its value
    unconverted, `own` plus one storage per root is `kept_for_backward`:

    >>> split = kept_split(state.gm.graph, needs_grad(state.gm.graph))
    >>> whole = dict(split.own)
    >>> whole.update({root: whole.get(root, 0.0) + 1.0 for root in split.roots})
    >>> whole == kept_for_backward(state.gm.graph, needs_grad(state.gm.graph))
    True
    """
    seen: dict = {}
    saves = {n: op_saves(n, grad, seen) for n in graph.nodes}
    through: dict = {}  # node -> its value (or a view of it) is saved
    keepers: dict = {}
    for node in reversed(graph.nodes):
        users = []
        for user in node.users:
            mine = saves[user]
            args = _tensor_args(user) if mine.inputs else []
            if any(args[p] is node for p in mine.inputs) or (through.get(user) and _alias_source(user, mine) is node):
                users.append(user)
        through[node] = saves[node].output or bool(users)
        if users:
            keepers[node] = users
    own, roots = {}, set()
    for node in graph.nodes:
        counted = saves[node].alias is None and not _not_counted(node)
        value = saves[node].extra + (1.0 if counted and saves[node].output else 0.0)
        if value:
            own[node] = value
        if counted and not saves[node].output and node in keepers:
            roots.add(node)
    return KeptSplit(own, keepers, frozenset(roots))


def _not_counted(root) -> bool:
    """Parameters and inputs are counted as such, ZeRO-3's gathered parameters as shards."""
    return root.op == "placeholder" or (root.meta.get(meta.KIND) == "comm" and
                                        root.meta[meta.COMM]["op"] in _SHARD_SAVED_COMM)


def kept_for_backward(graph, grad: dict) -> dict:
    """{node: bytes it keeps for backward per byte of its (local) output}: 1 for a storage some op saves (through
    any view of it) plus the buffers its own op saves besides. Placeholders keep nothing here (parameters and
    inputs are counted as such), nor ZeRO-3's parameter gathers (saved as shards).

    >>> {n.name: f for n, f in kept.items()}  # the second linear's input; the first's is the model's input
    {'relu': 1.0}
    """
    kept = {}
    roots = set()
    seen: dict = {}
    all_saves = {n: op_saves(n, grad, seen) for n in graph.nodes}  # once per node: storage_root walks view chains
    for node in graph.nodes:
        saves = all_saves[node]
        if saves.extra:
            kept[node] = saves.extra
        tensors = _tensor_args(node) if saves.inputs else []
        for value in [tensors[p] for p in saves.inputs] + ([node] if saves.output else []):
            roots.add(_storage_root(value, all_saves.__getitem__))
    for root in roots:
        if _not_counted(root):
            continue
        kept[root] = kept.get(root, 0.0) + 1.0
    return kept
