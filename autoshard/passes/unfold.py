"""unfold: write out the repeated layers a folded trace left out (autoshard/frontend/fold.py).

Reads `state.fold` (None: nothing to do) and the folded graph, whose middle layer stands for layers
1 .. n - 2 (`Fold.copies`). Writes `state.gm` and `state.traced` for the whole model: the middle
layer's placeholders and ops copied once per layer they stand for, in layer order, each copy named and
pathed after its layer (`layers.5.attn.q`, parameter `layers.5.attn.q.weight`, the real model's tensor)
and carrying every decision made on the folded graph (candidates, choices, specs); copy k takes copy
k - 1's outputs where the middle layer took the first layer's, and the last layer takes the last copy's.
Random ops are numbered again in the new order (each layer draws its own masks).
Invariant: the graph equals the whole model's trace up to node names, with the folded graph's decisions.

In the plan pipeline it runs after solve and zero, so the ILP sees three layers (weighted by their copies);
when a saved plan is applied it runs right after normalize, so the plan's rows meet the whole graph.

>>> import autoshard
>>> from autoshard.zoo import llama
>>> model, inputs, loss_fn = llama(n_layers=8, device="meta")
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("tp",))
>>> sorted({n.meta["autoshard.path"].split(".")[1] for n in prog.state.gm.graph.nodes
...         if n.meta.get("autoshard.path", "").startswith("layers.")}, key=int)
['0', '1', '2', '3', '4', '5', '6', '7']
"""
from __future__ import annotations

import dataclasses

from torch import fx

from autoshard.frontend.fold import layer_nodes, layer_ops
from autoshard.ir import meta
from autoshard.ir.graph_utils import copy_node, lazy_graph_module
from autoshard.passes.contract import compiler_pass
from autoshard.passes.random_ops import number_random_ops


@compiler_pass("unfold", reads=("state.fold",), writes=("state.gm", "state.traced", meta.RNG_INDEX))
def unfold(state) -> None:
    """The pass (see the module docstring); the parameters of every layer are the real model's:

    >>> [k for k in prog.state.traced.params if k.startswith("layers.4.")][:2]
    ['layers.4.attn_norm.weight', 'layers.4.attn.q.weight']
    """
    fold = state.fold
    if fold is None:
        return
    old = state.gm.graph
    groups = layer_nodes(fold, old)
    first, middle = groups[fold.instance(0)], groups[fold.middle]
    previous = dict(zip(layer_ops(first), layer_ops(middle)))  # a first-layer value -> its twin in the middle
    in_middle, in_first, in_last = set(middle), set(first), set(groups[fold.last])
    copies: list[dict] = [{} for _ in range(fold.n_layers - 1)]  # copies[k]: middle node -> its copy in layer k
    graph, env = fx.Graph(), {}
    stacks: dict = {}  # (layer, a module stack's entries) -> renamed: a layer's ops share a few stacks

    def copy_run(run):
        for k in range(1, fold.n_layers - 1):
            for node in run:
                copies[k][node] = _copy(graph, node, fold, k, lambda a, k=k, node=node: lookup(a, k, node), stacks)

    def lookup(value, k, consumer):
        carried = consumer.meta.get(meta.FOLD_CARRIED)
        if carried is not None and k > 1 and value is consumer.args[carried[1]]:
            return copies[k - 1][consumer]  # the running value as the layer before left it
        if value in in_middle:
            return copies[k][value]
        if value in in_first and k > 1:
            return copies[k - 1][previous[value]]
        return env[value]

    starts = {run[0]: run for run in _runs(old, in_middle)}  # each run's copies go where the run began
    for node in old.nodes:
        if node in in_middle:
            if node in starts:
                copy_run(starts[node])
            continue
        into_last = node in in_last
        env[node] = copy_node(graph, node, lambda a, into_last=into_last: copies[-1][a] if into_last and a in in_middle
                                    else env[a])
    for node in graph.nodes:  # the whole model's graph: its carried ops are top-level ops again
        node.meta.pop(meta.FOLD_CARRIED, None)
    gm = lazy_graph_module(state.gm, graph)
    gm.graph.lint()
    state.gm = gm
    state.traced = _traced(state, gm)
    number_random_ops(gm.graph, state.options.rng)


def _runs(graph, members) -> list[list]:
    """Consecutive runs of `members` in graph order (a layer's parameters, and its ops, each form one)."""
    runs, current = [], []
    for node in graph.nodes:
        if node in members:
            current.append(node)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _copy(graph, node, fold, k, arg_transform, stacks: dict):
    """The copy of a middle-layer node in layer k: renamed, re-pathed, its decisions kept; `stacks` caches the
    renamed module stacks."""
    if k == 1:
        new = copy_node(graph, node, arg_transform)
    else:
        old_key, new_key = fold.middle.replace(".", "_"), fold.instance(k).replace(".", "_")
        name = node.name.replace(old_key, new_key, 1) if node.op == "placeholder" else node.name
        if node.op == "placeholder":
            new = graph.placeholder(name)
            new.meta = dict(node.meta)
        else:
            new = copy_node(graph, node, arg_transform)
        if meta.FOLD_CARRIED in node.meta:  # a top-level op: its path and module stack stay
            return new
        path = node.meta.get(meta.PATH, "")
        new.meta[meta.PATH] = fold.instance(k) + path[len(fold.middle):]
        if "nn_module_stack" in node.meta:  # module paths as export wrote them (cut_stages reads them)
            entries = (k, tuple(node.meta["nn_module_stack"].items()))
            renamed = stacks.get(entries)
            if renamed is None:
                old_path, new_path = f"model.{fold.middle}", f"model.{fold.instance(k)}"
                renamed = stacks[entries] = {_renamed(key, old_path, new_path): (_renamed(p, old_path, new_path), kind)
                                             for key, (p, kind) in node.meta["nn_module_stack"].items()}
            new.meta["nn_module_stack"] = dict(renamed)
    return new


def _renamed(text: str, old: str, new: str) -> str:
    """`text` with the module path `old` (a whole path or a dotted prefix, anywhere) replaced by `new`."""
    if text.endswith(old):
        return text[: len(text) - len(old)] + new
    return text.replace(old + ".", new + ".", 1)


def _traced(state, gm):
    """The Traced of the whole model: every placeholder's tensor (the real model's for the copies)."""
    traced = state.traced
    named = dict(state.model.named_parameters(remove_duplicate=False))
    named_buffers = dict(state.model.named_buffers(remove_duplicate=False))
    params, buffers, non_persistent = {}, {}, set(traced.non_persistent)
    middle = state.fold.middle + "."
    for node in gm.graph.nodes:
        kind, fqn = node.meta.get(meta.KIND), node.meta.get(meta.PATH, "")
        if node.op != "placeholder" or kind not in ("param", "buffer"):
            continue
        if kind == "param":
            params[fqn] = traced.params[fqn] if fqn in traced.params else named[fqn]
        elif fqn in traced.buffers:
            buffers[fqn] = traced.buffers[fqn]
        else:  # a copy's buffer: the real model's, or (a lifted constant) the middle layer's
            twin = middle + fqn.split(".", len(state.fold.container.split(".")) + 1)[-1]
            buffers[fqn] = named_buffers.get(fqn, traced.buffers[twin])
            if twin in traced.non_persistent:
                non_persistent.add(fqn)
    return dataclasses.replace(traced, gm=gm, params=params, buffers=buffers, non_persistent=frozenset(non_persistent))
