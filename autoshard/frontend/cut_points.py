"""Where a pipeline is cut: the model's repeated layers, found at any depth of the module tree.

People wrap the models they train (a module returning `self.inner(input_ids=ids).logits`), so the layers a
pipeline cuts between need not be the model's children: they are `inner.model.layers.0`, `...layers.1`, ...
`find_layers` reads the module paths export recorded on the ops (`nn_module_stack`) and finds the containers
(a ModuleList, or an nn.Sequential) whose items are layers of one class that run one after another: each
uses a value of the one before it, directly or through ops outside the items (a list of experts, which all
read the same input, is not a sequence of layers). The container with the most layers wins, the shallower
one on a tie; other containers of layers of the same class outside it count too (an encoder's and a
decoder's blocks). The modules before and after the layers (embedding, final norm, head) are no layers: the
automatic cut (passes/auto_cut.py) keeps them with the first and last stage unless a stage boundary next
to them balances better.

It reads the graph, not the module tree, so it sees what ran: a folded trace (frontend/fold.py) shows three
of the layers, and the unfolded graph that cut_stages cuts shows every one of them.

>>> import torch
>>> from autoshard.frontend.trace import trace
>>> from autoshard.zoo import llama
>>> class Wrapped(torch.nn.Module):
...     def __init__(self, inner):
...         super().__init__()
...         self.inner = inner
...     def forward(self, ids):
...         return self.inner(ids)
>>> model, inputs, loss_fn = llama(n_layers=3)
>>> ops = [n for n in trace(Wrapped(model), inputs, loss_fn).gm.graph.nodes if n.op == "call_function"]
>>> layers = find_layers(ops)
>>> layers
LayerSequence('inner.layers': 3 layers)
>>> attention_op = next(n for n in ops if n.meta["autoshard.path"] == "inner.layers.0.attn")
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from autoshard.ir import meta


@dataclass(frozen=True)
class LayerSequence:
    """The containers of the model's repeated layers and the layers (module paths) in execution order.

    >>> layers.containers, layers.layers[-1]
    (('inner.layers',), 'inner.layers.2')
    """

    containers: tuple = ()
    layers: tuple = ()
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        self._index.update((path, i) for i, path in enumerate(self.layers))

    def layer_of(self, node) -> str:
        """The layer `node` runs in ('' outside the layers).

        >>> layers.layer_of(ops[0]), layers.layer_of(attention_op)
        ('', 'inner.layers.0')
        """
        for path, _ in module_entries(node):
            if path in self._index:
                return path
        return ""

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        where = ", ".join(map(repr, self.containers)) or "no repeated layers"
        return f"LayerSequence({where}: {len(self.layers)} layers)"


def module_entries(node) -> list[tuple[str, str]]:
    """(module path, class name) of the modules a node runs in, outermost first (the model itself left out).

    >>> module_entries(attention_op)[-1]
    ('inner.layers.0.attn', 'autoshard.zoo.llama.Attention')
    """
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for path, kind in stack.values():
        path = meta._strip_root(path)
        if path:
            out.append((path, kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"))
    return out


def find_layers(nodes) -> LayerSequence:
    """The repeated layers of the graph whose nodes are `nodes` (see the module docstring); empty when the
    model has none.

    >>> find_layers(ops[:3])  # the embedding alone
    LayerSequence(no repeated layers: 0 layers)
    """
    ops = [n for n in nodes if n.op == "call_function"]
    items: dict = {}  # container -> {item path: class}, items in the order they first run
    for node in ops:
        for path, kind in module_entries(node):
            parent, _, last = path.rpartition(".")
            if last.isdigit():
                items.setdefault(parent, {}).setdefault(path, kind)
    ranked = []
    for container, members in items.items():
        kind, count = Counter(members.values()).most_common(1)[0]
        if count >= 2:
            ranked.append((-count, _depth(container), len(ranked), container, kind))
    chosen, kind = [], None
    for *_, container, this_kind in sorted(ranked):
        if kind is not None and this_kind != kind:
            continue
        if any(_inside(container, c) or _inside(c, container) for c in chosen):
            continue
        layers = [path for path, k in items[container].items() if k == this_kind]
        if _chained(ops, layers):
            chosen.append(container)
            kind = this_kind
    order = [path for container in chosen for path, k in items[container].items() if k == kind]
    first = {}
    for i, node in enumerate(ops):
        for path, _ in module_entries(node):
            first.setdefault(path, i)
    return LayerSequence(tuple(chosen), tuple(sorted(order, key=first.__getitem__)))


def _depth(path: str) -> int:
    return path.count(".") + 1 if path else 0


def _inside(inner: str, outer: str) -> bool:
    """Whether container `inner` lies inside an item of container `outer` ('layers.3.experts' in 'layers')."""
    prefix = outer + "." if outer else ""
    rest = inner[len(prefix):] if inner.startswith(prefix) else None
    return rest is not None and rest != "" and rest.split(".", 1)[0].isdigit() and "." in rest


def _chained(ops, layers: list) -> bool:
    """Whether each layer uses a value of the one that ran before it (directly or through ops outside the
    layers): a sequence of layers, not parallel branches."""
    position = {path: i for i, path in enumerate(layers)}
    latest: dict = {}  # node -> the last layer its value depends on (-1: none)
    fed = [False] * len(layers)
    for node in ops:
        mine = next((position[p] for p, _ in module_entries(node) if p in position), None)
        inputs = [latest.get(a, -1) for a in node.all_input_nodes]
        if mine is None:
            latest[node] = max(inputs, default=-1)
        else:
            latest[node] = mine
            fed[mine] = fed[mine] or (mine - 1) in inputs
    return all(fed[1:])


def module_stack(node) -> list[str]:
    """Module paths of a node, outermost first (model-relative, the model itself left out).

    >>> module_stack(attention_op)[-1]
    'inner.layers.0.attn'
    """
    return [path for path, _ in module_entries(node)]
