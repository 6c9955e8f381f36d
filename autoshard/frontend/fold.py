"""Depth folding: a model with many identical repeated layers is traced with three of them.

Export's time grows with depth (about 0.1 s per transformer layer on this machine), and so does every pass
before the sharding decision; but repeated layers share one decision (autoshard/solver/layers.py), so their
copies add nothing to decide. `fold_model` finds the longest `nn.ModuleList` of at least FOLD_MIN_LAYERS
interchangeable layers and returns a shallow copy of the model whose list holds only the first, the second
and the last layer, under their real indices (`layers.0`, `layers.1`, `layers.31`), so their module
paths and parameter names are the real ones. The trace of that copy (`check_folded_trace`) stands for the
whole model: the second layer's nodes stand for n_layers - 2 real layers each (`Fold.copies`), which solve
weighs their costs and memory by (the objective is the whole model's); the
`unfold` pass (autoshard/passes/unfold.py) then writes those copies out, so every later pass, the plan and
the rank programs see the whole model.

Layers are interchangeable when they have the same class, the same parameter and buffer names, shapes,
dtypes and requires_grad at every depth, the same plain attributes (a layer's own index, an int named like
`layer_idx` or `layer_number`, may differ; an attribute such as HF Gemma2's `is_sliding` may not), no
hooks, and no parameter shared with another layer or module. Hints that name one layer by index (not
`layers.*`) turn folding off, as does `parallelize(fold_layers=False)`.

Nothing outside the layers may use a layer's values but the last layer's, with one exception: a running value
the model carries through its layers at the top level, as mixture-of-experts models sum their load-balancing
losses (`aux = aux + layer(x)[1]`). In the folded trace that is one op taking the first layer's value and the
middle one's and the same op taking its result and the last layer's (`mark_carried`); the first op counts as the
middle layer's (it stands for n_layers - 2 of them), the second as the last layer's.

>>> from autoshard.zoo import llama
>>> model, inputs, loss_fn = llama(n_layers=8, device="meta")
>>> fold = fold_model(model)
>>> fold
Fold('layers': 8 layers traced as layers.0, layers.1, layers.7)
>>> [name for name, _ in fold.model.named_children()] == [name for name, _ in model.named_children()]
True
>>> from autoshard.frontend.trace import trace
>>> traced = trace(fold.model, inputs, loss_fn)  # three layers' worth of export
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import re
import weakref
from dataclasses import dataclass

import torch
from torch import fx

from autoshard.ir import meta

FOLD_MIN_LAYERS = 8  # below this the three traced layers save too little to be worth it
_INDEX_ATTR = re.compile(r"(^|_)(idx|index|id|number|num)$")
# While `reuse_folds()` is active (one planning call): model -> its Fold, so that the copies the search traces are one
# model and their exports are reused. Not kept across calls: a model changed in place between them is folded anew.
_FOLDS: contextvars.ContextVar = contextvars.ContextVar("autoshard_folds", default=None)


@contextlib.contextmanager
def reuse_folds():
    """Within the block, folding one model again returns the same folded copy (nested blocks share it).

    >>> with reuse_folds():
    ...     fold_model(model) is fold_model(model)
    True
    >>> fold_model(model) is fold_model(model)  # outside a block: a fresh copy each time
    False
    """
    token = _FOLDS.set(_FOLDS.get() if _FOLDS.get() is not None else weakref.WeakKeyDictionary())
    try:
        yield
    finally:
        _FOLDS.reset(token)


@dataclass(frozen=True)
class Fold:
    """A model folded to three of its `n_layers` repeated layers at `container` (module path of the list).

    >>> fold.n_layers, fold.container
    (8, 'layers')
    """

    container: str
    n_layers: int
    model: torch.nn.Module

    def instance(self, index: int) -> str:
        """The module path of layer `index`.

        >>> fold.instance(3)
        'layers.3'
        """
        return f"{self.container}.{index}"

    @functools.cached_property
    def middle(self) -> str:
        """The traced layer that stands for layers 1 .. n_layers - 2.

        >>> fold.middle
        'layers.1'
        """
        return self.instance(1)

    @property
    def last(self) -> str:
        """The traced last layer.

        >>> fold.last
        'layers.7'
        """
        return self.instance(self.n_layers - 1)

    def copies(self, node) -> int:
        """How many nodes of the whole model `node` of the folded graph stands for (by its module path, which
        the passes keep on the nodes they rewrite).

        >>> [fold.copies(n) for n in traced.gm.graph.nodes if n.meta.get("autoshard.path") == "layers.1.attn.q"]
        [6]
        """
        if node.op not in ("placeholder", "call_function"):
            return 1
        carried = node.meta.get(meta.FOLD_CARRIED)
        if carried is not None:
            return self.n_layers - 2 if carried[0] == self.middle else 1
        path, middle = node.meta.get(meta.PATH, ""), self.middle  # instance_of's test, inlined: the ILP asks often
        return self.n_layers - 2 if path.startswith(middle) and path[len(middle):len(middle) + 1] in ("", ".") else 1

    def __repr__(self) -> str:
        return (f"Fold({self.container!r}: {self.n_layers} layers traced as {self.instance(0)}, {self.middle}, "
                f"{self.last})")


def fold_model(model, hints=None) -> Fold | None:
    """The folded copy of `model` (one per model inside `reuse_folds`), or None when no repeated layers can be folded.

    >>> fold_model(llama(n_layers=4, device="meta")[0]) is None  # too shallow to be worth it
    True
    """
    if not isinstance(model, torch.nn.Module) or isinstance(model, fx.GraphModule):
        return None
    folds = _FOLDS.get()
    # within one planning call the model does not change: its fold (or that it has none) is looked for once (the
    # search compiles it dozens of times, and comparing its layers costs more than a pass)
    fold = folds.get(model, False) if folds is not None else False
    if fold is False:
        fold = _new_fold(model)
        if folds is not None:
            folds[model] = fold
    if fold is None or _hints_name_one_layer(hints, fold.container):
        return None
    return fold


def _new_fold(model) -> Fold | None:
    found = _container(model)
    if found is None:
        return None
    path, layers = found
    n = len(layers)
    kept = {"0": layers[0], "1": layers[1], str(n - 1): layers[n - 1]}
    return Fold(path, n, _with_replaced(model, path.split("."), kept))


def mark_carried(fold: Fold, gm: fx.GraphModule) -> int:
    """Mark the running values the model carries through its layers at the top level (the module docstring): an op
    `c = op(a, m)` outside the layers, `a` a value of the first layer and `m` its twin in the middle one (the same
    position in its layer), used only by `op(c, l)`, `l` the twin in the last layer, the running value at the same
    argument position. `c` is marked as the middle layer's and `op(c, l)` as the last layer's (meta FOLD_CARRIED:
    (layer, position of the running value)). Returns how many were marked.

    >>> mark_carried(fold, traced.gm)  # the zoo's llama carries nothing
    0
    """
    groups = layer_nodes(fold, gm.graph)
    groups = [groups.get(fold.instance(0), []), groups.get(fold.middle, []), groups.get(fold.last, [])]
    inside = {n for group in groups for n in group}
    first, middle, last = (layer_ops(group) for group in groups)
    if not first or not (len(first) == len(middle) == len(last)):
        return 0
    marked = 0
    for index, m in enumerate(middle):
        outside = [u for u in m.users if u not in inside]
        if len(outside) != 1 or m.op != "call_function":
            continue
        carry, a, tail = outside[0], first[index], last[index]
        if carry.op != "call_function" or len(carry.users) != 1 or carry.kwargs or len(carry.args) != 2:
            continue
        end = next(iter(carry.users))
        if {u for u in a.users if u not in inside} != {carry} or end.op != "call_function" \
                or end.target != carry.target or end.kwargs or {u for u in tail.users if u not in inside} != {end}:
            continue
        position = next((i for i, arg in enumerate(carry.args) if arg is a), None)
        if position is None or carry.args[1 - position] is not m or end.args != \
                tuple(carry if i == position else tail for i in range(2)):
            continue
        carry.meta[meta.FOLD_CARRIED] = (fold.middle, position)
        end.meta[meta.FOLD_CARRIED] = (fold.last, position)
        marked += 1
    return marked


def check_folded_trace(fold: Fold, gm: fx.GraphModule) -> bool:
    """Whether the folded trace stands for the whole model: the three layers have the same nodes in the same
    order, each takes the one before it as the other takes its own predecessor, nothing outside them uses a
    layer's values except the last layer's and the running values `mark_carried` marked, and the middle layer's
    runs of nodes (its parameters; its casts, under mixed precision; its ops) can be written out once per layer in
    place (unfold: each run's copies only need earlier runs and the copy before).

    >>> check_folded_trace(fold, traced.gm)
    True
    """
    groups = layer_nodes(fold, gm.graph)
    first, middle, last = (groups.get(fold.instance(0), []), groups.get(fold.middle, []), groups.get(fold.last, []))
    # the layers' own ops (the carried ops, in the middle and last layers only, were checked when marked)
    own = [layer_ops(group) for group in (first, middle, last)]
    carried = [sum(meta.FOLD_CARRIED in n.meta for n in group) for group in (first, middle, last)]
    if carried[0] or carried[1] != carried[2]:
        return False
    signature = [[_role(fold, n) for n in group] for group in own]
    if not first or signature[0] != signature[1] or signature[1] != signature[2]:
        return False
    if _edges(own[0], own[1]) != _edges(own[1], own[2]) or _edges(own[0], own[2]):
        return False
    run_of, run, previous = {}, -1, None
    for node in gm.graph.nodes:
        if node in run_of or instance_of(fold, node) != fold.middle:
            previous = None
            continue
        run += previous is None
        run_of[node] = previous = run
    twin = dict(zip(own[0], own[1]))
    if any(run_of[twin[a]] > run_of[v] for v in middle for a in v.all_input_nodes if a in twin):
        return False  # a layer would need its predecessor's value before that run is written out
    inside = set(first) | set(middle) | set(last)
    # e.g. every layer's hidden states returned: the whole model has n of them
    return not any(u not in inside for n in (*first, *middle) for u in n.users)


# export's dtype checks (`x.to(dtype)` traces one): no value flows out of them, and where the canonical order puts
# one depends on where its operand is read next (a rotary table every layer casts), so layers are compared without
_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)


def layer_ops(group: list) -> list:
    """A layer's nodes that layers must have alike, twin by twin: its own ops, not export's checks nor the carried
    ops (`layer_nodes` gives the group).

    >>> groups = layer_nodes(fold, traced.gm.graph)
    >>> len(layer_ops(groups["layers.0"])) == len(layer_ops(groups["layers.1"]))
    True
    """
    return [n for n in group if n.target not in _CHECKS and meta.FOLD_CARRIED not in n.meta]


def layer_nodes(fold: Fold, graph: fx.Graph) -> dict:
    """{layer instance path: its placeholders and ops in graph order} for the folded layers.

    >>> {k: len(v) for k, v in layer_nodes(fold, traced.gm.graph).items()}
    {'layers.0': 61, 'layers.1': 61, 'layers.7': 61}
    """
    out: dict = {}
    for node in graph.nodes:
        instance = instance_of(fold, node)
        if instance:
            out.setdefault(instance, []).append(node)
    return out


def instance_of(fold: Fold, node) -> str:
    """The folded layer a node belongs to ('' outside them): by its module path, or its parameter's name.

    >>> instance_of(fold, next(n for n in traced.gm.graph.nodes if n.meta.get("autoshard.path") == "layers.7.attn.q"))
    'layers.7'
    """
    if node.op not in ("placeholder", "call_function"):
        return ""
    carried = node.meta.get(meta.FOLD_CARRIED)
    if carried is not None:
        return carried[0]
    path = node.meta.get(meta.PATH, "")
    if not path.startswith(fold.container + "."):
        return ""
    index = path[len(fold.container) + 1:].split(".", 1)[0]
    return f"{fold.container}.{index}" if index.isdigit() else ""


def _role(fold: Fold, node) -> tuple:
    """What a node does in its layer: its op, or, for a parameter, its name inside the layer."""
    if node.op == "placeholder":
        return (node.op, node.meta[meta.PATH].split(".", len(fold.container.split(".")) + 1)[-1])
    return (node.op, node.target)


def _edges(src: list, dst: list) -> set:
    """(producer's position in its layer, consumer's position in its layer, argument index) of src -> dst."""
    where = {n: i for i, n in enumerate(src)}
    return {(where[a], j, k) for j, n in enumerate(dst) for k, a in enumerate(n.all_input_nodes) if a in where}


def _container(model):
    """(module path, list) of the longest foldable ModuleList outside any other list, or None."""
    best = None
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < FOLD_MIN_LAYERS:
            continue
        if any(part.isdigit() for part in path.split(".")) or (best and len(best[1]) >= len(module)):
            continue
        if _interchangeable(list(module), model):
            best = (path, module)
    return best


def _interchangeable(layers, model) -> bool:
    first = _describe(layers[0])
    if first is None or any(type(layer) is not type(layers[0]) or _describe(layer) != first for layer in layers[1:]):
        return False
    owned = {id(p) for layer in layers for _, p in layer.named_parameters(remove_duplicate=False)}
    if len(owned) != sum(1 for layer in layers for _ in layer.named_parameters(remove_duplicate=False)):
        return False  # a parameter shared between layers
    inside = {id(m) for layer in layers for m in layer.modules()}
    return not any(id(p) in owned for m in model.modules() if id(m) not in inside
                   for p in m.parameters(recurse=False))


def _describe(layer):
    """What must agree between interchangeable layers; None when the layer has hooks."""
    out = []
    for name, module in layer.named_modules():
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
            return None
        tensors = [(k, tuple(t.shape), t.dtype, getattr(t, "requires_grad", False))
                   for k, t in (*module._parameters.items(), *module._buffers.items()) if t is not None]
        plain = []
        for key, value in sorted(vars(module).items()):
            if key.startswith("_") or key == "training" or isinstance(value, (torch.Tensor, torch.nn.Module)):
                continue
            if isinstance(value, int) and not isinstance(value, bool) and _INDEX_ATTR.search(key):
                continue  # the layer's own index (HF's layer_idx, Megatron's layer_number)
            plain.append((key, _comparable(value)))
        out.append((name, type(module), tuple(tensors), tuple(plain)))
    return out


def _comparable(value):
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)  # lists, dicts, configs: compared by what they print


def _hints_name_one_layer(hints, container: str) -> bool:
    """Whether a hint key names one layer of the container by index (folding would hide it)."""
    if hints is None:
        return False
    keys = hints.to_json() if hasattr(hints, "to_json") else hints if isinstance(hints, dict) else {}
    pattern = re.compile(rf"(^|\.){re.escape(container)}\.\d")
    return any(pattern.search(key) for key in keys)


def _with_replaced(module, path: list[str], kept: dict):
    """A shallow copy of `module` down `path` whose list at the end holds only `kept` (index -> layer)."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    head, rest = path[0], path[1:]
    if rest:
        clone._modules[head] = _with_replaced(module._modules[head], rest, kept)
    else:
        short = copy.copy(module._modules[head])
        short._modules = dict(kept)
        if type(short) is torch.nn.ModuleList:
            short.__class__ = FoldedList
            short.n_layers = len(module._modules[head])
        clone._modules[head] = short
    return clone


class FoldedList(torch.nn.ModuleList):
    """The folded ModuleList: it holds the first, second and last layers under their real indices. Iterating it
    gives those three; a model that indexes its layers one by one (`layers[i] for i in range(n)`, e.g. MarkupLM's
    per-depth xpath embeddings) gets the middle layer for an index it does not hold, so its folded trace calls
    that layer many times, differs from the whole model's and is discarded by `check_folded_trace`, instead of
    failing with a KeyError.

    >>> folded = _with_replaced(torch.nn.Sequential(torch.nn.ModuleList(torch.nn.Linear(1, 1) for _ in range(8))),
    ...                         ["0"], {"0": torch.nn.Linear(1, 1), "1": torch.nn.Linear(1, 1), "7": torch.nn.Linear(1, 1)})
    >>> layers = folded[0]
    >>> len(layers), layers[5] is layers[1], layers[-1] is layers[7]
    (3, True, True)
    """

    def __getitem__(self, idx):
        if isinstance(idx, int) and not isinstance(idx, bool):
            n = getattr(self, "n_layers", len(self))
            key = str(idx + n if idx < 0 else idx)
            return self._modules.get(key, self._modules.get("1"))
        return super().__getitem__(idx)
