"""Repeated-layer detection: copies of one node across `layers.0`, `layers.1`, ... share a decision.

Two nodes are copies when their module paths agree once the index of a repeated container is
replaced by `*`, and they have the same op, the same position among such nodes in their layer, the
same shapes and the same candidate strategies. The solver then decides once per class, so the ILP
does not grow with depth.

Only instances holding at least two matmul-like ops are tied: inside such a block (a transformer
layer) the column/row alternation of tensor parallelism is free to form, whereas tying one-linear
"layers" would forbid alternating across them (Alpa's MLP optimum does exactly that).

>>> layer_key("layers.3.attn.q")
('layers.*.attn.q', 'layers.3')
"""
from __future__ import annotations

import re

from autoshard.cost.flops import is_matmul_like
from autoshard.ir import meta

_INDEX = re.compile(r"(^|\.)(\d+)(?=\.|$)")


def layer_key(path: str) -> tuple[str, str]:
    """('layers.*.attn.q', 'layers.3') for 'layers.3.attn.q'; (path, '') outside repeated containers.

    >>> layer_key("blocks.0.mlp.fc"), layer_key("lm_head")
    (('blocks.*.mlp.fc', 'blocks.0'), ('lm_head', ''))
    """
    match = _INDEX.search(path)
    if match is None:
        return path, ""
    instance = path[: match.end(2)]
    return _INDEX.sub(lambda m: m.group(1) + "*", path), instance


def decision_classes(nodes, signature) -> tuple[list[list], dict]:
    """Group `nodes` (graph order) into classes of copies; `signature(node)` adds shape/candidate keys.

    Returns (classes as lists of nodes in graph order, node -> class index).

    In a two-layer GPT-2 the query projection of layer 1 joins the class of its copy in layer 0:

    >>> from autoshard.frontend.trace import trace
    >>> from autoshard.zoo import gpt2
    >>> model, inputs, loss_fn = gpt2(n_layers=2)
    >>> nodes = list(trace(model, inputs, loss_fn).gm.graph.nodes)
    >>> classes, index = decision_classes(nodes, signature=lambda node: ())
    >>> q0, q1 = [n for n in nodes if n.op == "call_function" and n.meta["autoshard.path"].endswith("attn.q")][:2]
    >>> q0.meta["autoshard.path"], q1.meta["autoshard.path"], index[q0] == index[q1]
    ('layers.0.attn.q', 'layers.1.attn.q', True)
    """
    classes: list[list] = []
    index: dict = {}
    by_key: dict = {}
    ordinal: dict = {}
    matmuls: dict = {}
    for node in nodes:
        instance = layer_key(node.meta.get(meta.PATH, ""))[1]
        if instance and node.op == "call_function" and is_matmul_like(node):
            matmuls[instance] = matmuls.get(instance, 0) + 1
    for node in nodes:
        pattern, instance = layer_key(node.meta.get(meta.PATH, ""))
        if not instance or matmuls.get(instance, 0) < 2:
            index[node] = len(classes)
            classes.append([node])
            continue
        base = (pattern, str(node.target) if node.op == "call_function" else node.op)
        count = ordinal.get((instance, base), 0)
        ordinal[(instance, base)] = count + 1
        key = (base, count, signature(node))
        if key in by_key:
            index[node] = by_key[key]
            classes[by_key[key]].append(node)
        else:
            by_key[key] = index[node] = len(classes)
            classes.append([node])
    return classes, index
