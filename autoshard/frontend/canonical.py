"""A traced graph in canonical order, with canonical node names: the same model, inputs and options give the
same graph in every process.

Export records ops in the order Python ran them. That order can depend on the process: a model that iterates a
set of strings (transformers' Beam builds its attention masks in `for kind in set(config.layer_types)`) runs
its independent branches in an order set by the per-process string hash seed (PYTHONHASHSEED). The launcher and
the ranks would then trace different graphs and a plan made by one would not apply to the others.

`canonical_graph` rewrites the graph so that its order and names are a function of its structure alone. First a
walk: placeholders, as export lifts them (parameters and buffers in the model's order, then the inputs); then
every op in depth-first post-order from the outputs, a node's operands visited in argument order, the items of a
multi-output op right after it. What the outputs do not reach (export's `_assert_tensor_metadata` checks, an
in-place update of a buffer nothing reads later, a dead value) goes right before the next node that reads one of
its operands, or at the end; several at once in the order of their op, constant arguments and module path, then
of where their operands are (nodes alike in both are interchangeable: either order gives the same graph). Then
every module call is put back in one piece, as Python ran it (a layer whose value a later layer reads on its own,
WavLM's position bias, would otherwise be split by the walk; recomputation regions, pipeline cuts and folded
layers need each in one piece): at each level of the module tree, Kahn's algorithm over its ops and its
submodules' calls (one item each), the item the walk reached first going first.

Two kinds of order that are not data flow are kept as traced: in-place writes stay between the reads of the
value they write (before them: the reads traced before; after them: the reads traced after), and the random
ops keep their relative order (the order the single device draws in). Names are the traced ones with their
numeric suffix dropped, numbered again in the new order (`linear`, `linear_1`, ...); a graph whose traced
order was already the canonical one keeps its names. A graph with a call that is neither an ATen op, a
higher-order op nor `getitem` (a Python function that may change global state) keeps its traced order.
Cost: 20 ms for a folded Llama-3-8B trace (307 nodes), 0.2 s for all its 32 layers (2424 nodes, 4% of export).

>>> import torch
>>> from autoshard.frontend.trace import trace
>>> class TwoBranches(torch.nn.Module):
...     def __init__(self, order):
...         super().__init__()
...         self.order = order
...     def forward(self, x):
...         out = {}
...         for kind in self.order:  # as with a set of strings: the order differs between processes
...             out[kind] = x.sin() if kind == "a" else x.cos()
...         return out["a"] * out["b"]
>>> x = torch.randn(4)
>>> ab, ba = trace(TwoBranches("ab"), (x,)).gm.graph, trace(TwoBranches("ba"), (x,)).gm.graph
>>> [n.name for n in ab.nodes] == [n.name for n in ba.nodes]
True
>>> [n.name for n in ab.nodes]
['inputs_0', 'sin', 'cos', 'mul', 'mean', 'output']
>>> gm = torch.export.export(TwoBranches("ba"), (x,)).graph_module  # as traced: cos first
"""
from __future__ import annotations

import copy
import heapq
import itertools
import operator
import re

import torch
from torch import fx

from autoshard.ir import meta
from autoshard.runtime.rng import is_random

_SUFFIX = re.compile(r"_\d+$")


def canonical_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with its graph replaced by the canonical one (see the module docstring); returns `gm`. Node metadata
    is kept; placeholders keep their names and order.

    >>> [n.name for n in gm.graph.nodes]
    ['x', 'cos', 'sin', 'mul', 'output']
    >>> [n.name for n in canonical_graph(copy.deepcopy(gm)).graph.nodes]
    ['x', 'sin', 'cos', 'mul', 'output']
    """
    graph = gm.graph
    if not all(_reorderable(node) for node in graph.nodes):
        return gm
    order = canonical_order(graph)
    if order == list(graph.nodes):  # its names were numbered in this order already
        return gm
    new = fx.Graph(owning_module=gm, tracer_cls=graph._tracer_cls, tracer_extras=graph._tracer_extras)
    new._codegen = copy.deepcopy(graph._codegen)
    env: dict = {}
    for node in order:
        name = node.name if node.op in ("placeholder", "output", "get_attr") else _SUFFIX.sub("", node.name)
        copied = new.create_node(node.op, node.target, fx.map_arg(node.args, env.__getitem__),
                                 fx.map_arg(node.kwargs, env.__getitem__), name=name, type_expr=node.type)
        copied.meta = copy.copy(node.meta)
        env[node] = copied
    gm.graph = new
    return gm


def canonical_order(graph: fx.Graph) -> list:
    """The graph's nodes in canonical order (see the module docstring): a topological order that depends on the
    graph's structure, not on the order its ops were traced in.

    >>> [n.name for n in canonical_order(gm.graph)]
    ['x', 'sin', 'cos', 'mul', 'output']
    """
    nodes = list(graph.nodes)
    before = _order_constraints(nodes)

    def operands(node) -> list:
        return [*before.get(node, ()), *node.all_input_nodes]

    return _modules_together(_depth_first(nodes, operands), operands)


def _depth_first(nodes: list, operands) -> list:
    """The order of the depth-first walk from the outputs (see the module docstring)."""
    output = nodes[-1]
    reached = _reached(output, operands)
    after: dict = {}  # operand -> the unreached nodes that wait for it
    waiting: dict = {}
    for node in nodes:
        if node not in reached and node is not output:
            waiting[node] = set(operands(node))
            for operand in waiting[node]:
                after.setdefault(operand, []).append(node)
    order: list = []
    place: dict = {}
    ready_at: dict = {}  # operand -> unreached nodes whose operands are all placed, to go before its next reader

    def emit(node) -> None:
        # An unreached node (a check, a dead value) goes right before the next node that reads one of its operands
        # (where export traced it: `_assert_tensor_metadata(w)` before `w.to(...)`); several at once in the order
        # of what they are and where their operands are (alike in both: interchangeable).
        due = {u for operand in node.all_input_nodes for u in ready_at.pop(operand, ()) if u not in place}
        for user in sorted(due - {node}, key=lambda u: (_local_key(u), [place[o] for o in operands(u)])):
            if user not in place:
                emit(user)
        place[node] = len(order)
        order.append(node)
        items = [u for u in node.users if u.target is operator.getitem and u not in place]
        for item in sorted(items, key=lambda u: u.args[1]):  # a multi-output op's items right after it
            emit(item)
        for user in after.get(node, ()):
            waiting[user].discard(node)
            if not waiting[user] and user not in place:
                for operand in set(operands(user)):
                    ready_at.setdefault(operand, []).append(user)

    for node in nodes:
        if node.op == "placeholder":
            emit(node)
    done: set = set()  # entered by the depth-first walk

    def visit(root) -> None:  # iterative: a deep model's chain of layers would overflow Python's stack
        done.add(root)
        stack = [(root, iter(operands(root)))]
        while stack:
            node, todo = stack[-1]
            for operand in todo:
                if operand not in done and operand not in place:
                    done.add(operand)
                    stack.append((operand, iter(operands(operand))))
                    break
            else:
                stack.pop()
                if node not in place:
                    emit(node)

    for root in operands(output):
        if root not in done and root not in place:
            visit(root)
    while True:  # what no later node reads: at the end
        left = [n for n in waiting if not waiting[n] and n not in place]
        if not left:
            break
        emit(min(left, key=lambda u: (_local_key(u), [place[o] for o in operands(u)])))
    order.append(output)
    return order


def _modules_together(order: list, operands) -> list:
    """`order` with every module call's nodes next to each other, as Python ran them (recomputation regions,
    pipeline cuts and folded layers need each layer in one piece): at each level of the module tree, its ops and
    the calls of its submodules (each as one item) in the order of Kahn's algorithm, the item first in `order`
    first. A level whose items depend on each other both ways (an op export gave no module) keeps `order`."""
    place = {n: i for i, n in enumerate(order)}
    chains = {}
    for node in order:
        stack = node.meta.get("nn_module_stack") or {}
        chains[node] = tuple(stack)
    for node in order:  # a multi-output op's items belong where the op does
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            chains[node] = chains[node.args[0]]
    out: list = []

    def expand(members: list, depth: int) -> None:
        items: dict = {}  # item key -> its nodes, in `order`
        for node in members:
            chain = chains[node]
            key = chain[depth] if len(chain) > depth else node  # a submodule call's key, or the op itself
            items.setdefault(key, []).append(node)
        if len(items) == 1 and next(iter(items)) not in place:  # one submodule call: go down
            expand(members, depth + 1)
            return
        item_of = {n: key for key, group in items.items() for n in group}
        needs: dict = {key: set() for key in items}
        for key, group in items.items():
            for node in group:
                needs[key].update(item_of[o] for o in operands(node) if o in item_of and item_of[o] != key)
        users: dict = {}
        for key, needed in needs.items():
            for other in needed:
                users.setdefault(other, []).append(key)
        first = {key: place[group[0]] for key, group in items.items()}  # distinct: no two items tie
        waiting = {key: len(needed) for key, needed in needs.items()}
        ready = [(first[key], key) for key in items if not waiting[key]]
        heapq.heapify(ready)
        ordered = []
        while ready:
            _, key = heapq.heappop(ready)
            ordered.append(key)
            for user in users.get(key, ()):
                waiting[user] -= 1
                if not waiting[user]:
                    heapq.heappush(ready, (first[user], user))
        if len(ordered) < len(items):  # contracting the calls made a cycle: keep the walk's order here
            out.extend(members)
            return
        for key in ordered:
            if key in place:
                out.append(key)
            else:
                expand(items[key], depth + 1)

    expand(order, 0)
    return out


def _reached(output, operands) -> set:
    """The nodes the output depends on (through `operands`)."""
    seen, todo = set(), [output]
    while todo:
        for operand in operands(todo.pop()):
            if operand not in seen:
                seen.add(operand)
                todo.append(operand)
    return seen


def _local_key(node) -> str:
    """What a node is, its operands aside: op, target, constant arguments, module path."""
    def text(value) -> str:
        if isinstance(value, fx.Node):
            return "%"
        if isinstance(value, (tuple, list)):
            return "(" + ",".join(text(v) for v in value) + ")"
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}:{text(v)}" for k, v in value.items()) + "}"
        return repr(value)

    return f"{node.op}|{node.target}|{text(node.args)}|{text(node.kwargs)}|{meta.module_path(node)}"


def _order_constraints(nodes) -> dict:
    """{node: nodes that must come before it besides its operands}: the traced order of the random ops, and of
    in-place writes relative to the reads of the value they write (and of its views)."""
    before: dict = {}
    position = {n: i for i, n in enumerate(nodes)}
    draws = [n for n in nodes if n.op == "call_function" and is_random(n.target, n.args, n.kwargs)]
    for previous, node in itertools.pairwise(draws):
        before.setdefault(node, []).append(previous)
    for node in nodes:
        for written in _written_operands(node):
            base = written
            while _is_view(base):
                base = base.args[0]
            for reader in _readers(base):
                if reader is node:
                    continue
                if position[reader] < position[node]:
                    before.setdefault(node, []).append(reader)
                else:
                    before.setdefault(reader, []).append(node)
    return before


def _written_operands(node) -> list:
    """The operands an op writes in place (its schema's `Tensor(a!)` arguments)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    written = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, fx.Node):
                written.append(value)
    return written


def _is_view(node) -> bool:
    """Whether the op returns a view of its first operand (a non-writing alias annotation on both)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None or not schema.returns or not schema.arguments or not node.args:
        return False
    out, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return out is not None and not out.is_write and first is not None and isinstance(node.args[0], fx.Node)


def _readers(base) -> list:
    """Every user of `base` and of the views taken of it, transitively."""
    readers, family = [], [base]
    while family:
        value = family.pop()
        for user in value.users:
            readers.append(user)
            if _is_view(user) and user.args[0] is value:
                family.append(user)
    return readers


def _reorderable(node) -> bool:
    """Whether the node's place in the graph is fixed by its operands alone (an ATen op, a higher-order op, an
    item of a multi-output op), as opposed to a Python call that may act on global state."""
    if node.op != "call_function":
        return node.op in ("placeholder", "output", "get_attr")
    return node.target is operator.getitem or isinstance(node.target, (torch._ops.OpOverload,
                                                                       torch._ops.HigherOrderOperator))

