"""What a hand plan needs to know of a model, read off its traced graph: which linear layers of the repeated
blocks are column- and row-parallel (Megatron's pairs), which modules bound the sequence-parallel regions, where
the attention ops and the stacked expert weights are. Read from data flow, not from names, so that it holds for
any model (the zoo's, transformers' families, wrapped in a module or not).

A pair is found inside one parent module (an attention block, an MLP): a linear whose activation input depends,
through the parent's own ops, on another linear of the same parent is row-parallel (its weight split on the
contracted dim, its output a partial sum); the linears it depends on are column-parallel (split on their output
features). A lone linear (a router, the LM head) belongs to no pair and is left to the search.

>>> from autoshard.zoo import llama
>>> from autoshard.frontend.trace import trace
>>> model, inputs, loss_fn = llama(n_layers=2)
>>> roles = model_roles(trace(model, inputs, loss_fn).gm)
>>> roles.column["layers.*.attn.q.weight"], roles.row["layers.*.mlp.w2.weight"]
(0, 1)
>>> roles.sequence_regions, roles.attention
(['layers.*.attn_norm', 'layers.*.ffn_norm'], ['layers.*.attn'])
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autoshard.ir import meta
from autoshard.ir.mixed_precision import cast_parameter
from autoshard.solver.layers import layer_key

aten = torch.ops.aten
_TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}


@dataclass
class ModelRoles:
    """Hint globs by role: `column` / `row` map a weight glob to the dim its tensor-parallel split is on (its
    output features / its contracted features); `column_bias` the biases that follow their column weight;
    `column_modules` / `row_modules` the linears' module globs; `sequence_regions` the modules whose outputs
    feed column-parallel linears (the norms Megatron-SP splits on the sequence); `attention` the modules of
    scaled_dot_product_attention ops; `experts` stacked expert weights (dim 0 = expert).

    >>> roles.column_modules, roles.row_modules
    (['layers.*.attn.q', 'layers.*.attn.k', 'layers.*.attn.v', 'layers.*.mlp.w1', 'layers.*.mlp.w3'], ['layers.*.attn.wo', 'layers.*.mlp.w2'])
    """

    column: dict = field(default_factory=dict)
    row: dict = field(default_factory=dict)
    column_bias: list = field(default_factory=list)
    column_modules: list = field(default_factory=list)
    row_modules: list = field(default_factory=list)
    sequence_regions: list = field(default_factory=list)
    attention: list = field(default_factory=list)
    experts: list = field(default_factory=list)
    sizes: dict = field(default_factory=dict)  # weight or region glob -> its (output's) shape, for divisibility


def layer_glob(path: str) -> str:
    """The path with every list index made a wildcard (`layer_key`'s glob): one glob for a module in every layer.

    >>> layer_glob("inner.model.layers.12.self_attn.q_proj.weight")
    'inner.model.layers.*.self_attn.q_proj.weight'
    """
    return layer_key(path)[0]


def _in_repeated_layer(path: str) -> bool:
    return layer_glob(path) != path


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _matmul_weight(node):
    """(activation input, weight placeholder, dim of the weight's output features, bias placeholder or None)
    of a linear-like op whose weight is a parameter, else None."""
    def param(value):
        transposed = False
        while isinstance(value, torch.fx.Node) and value.op == "call_function":
            if value.target in _TRANSPOSES:
                value, transposed = value.args[0], not transposed
            elif cast_parameter(value) is not None:  # mixed precision's per-use cast
                value = cast_parameter(value)
            else:
                break
        if isinstance(value, torch.fx.Node) and value.op == "placeholder" and value.meta.get(meta.KIND) == "param":
            return value, transposed
        return None, False

    if node.target is aten.linear.default:
        weight, transposed = param(node.args[1])
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return (node.args[0], weight, 1 if transposed else 0, bias) if weight is not None else None
    if node.target is aten.addmm.default:
        weight, transposed = param(node.args[2])
        return (node.args[1], weight, 0 if transposed else 1, node.args[0]) if weight is not None else None
    if node.target in (aten.mm.default, aten.matmul.default):
        weight, transposed = param(node.args[1])
        if weight is not None and weight.meta["val"].dim() == 2:
            return node.args[0], weight, 0 if transposed else 1, None
    return None


def _linears_before(start, parent: str, linears: dict) -> set:
    """The linear ops of `parent` that `start` depends on through the parent's own ops."""
    found, seen, stack = set(), set(), [start]
    while stack:
        node = stack.pop()
        if not isinstance(node, torch.fx.Node) or node in seen or node.op != "call_function":
            continue
        seen.add(node)
        path = node.meta.get(meta.PATH, "")
        if path != parent and not path.startswith(parent + "."):
            continue
        if node in linears:
            found.add(node)
            continue
        stack.extend(node.all_input_nodes)
    return found


def model_roles(gm: torch.fx.GraphModule) -> ModelRoles:
    """The roles of a traced graph (see the module docstring). A plain two-layer MLP in a Sequential has no
    pair: its globbed layers are one weight glob, both column and row.

    >>> from autoshard.zoo import mlp
    >>> two, two_inputs, two_loss = mlp(n_layers=2)
    >>> model_roles(trace(two, two_inputs, two_loss).gm).row
    {}
    """
    roles = ModelRoles()
    linears = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        path = node.meta.get(meta.PATH, "")
        if node.target is aten.scaled_dot_product_attention.default and _in_repeated_layer(path):
            _add(roles.attention, layer_glob(path))
        found = _matmul_weight(node)
        if found is not None and _in_repeated_layer(found[1].meta.get(meta.PATH, "")):
            linears[node] = found
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.meta.get(meta.KIND) == "param" and node.meta["val"].dim() == 3 \
                and _in_repeated_layer(node.meta.get(meta.PATH, "")) and not _convolved(node):
            _add(roles.experts, layer_glob(node.meta[meta.PATH]))
            roles.sizes[layer_glob(node.meta[meta.PATH])] = tuple(node.meta["val"].shape)
    parents = {n: _parent(n.meta.get(meta.PATH, "")) for n in linears}
    order = {n: i for i, n in enumerate(linears)}
    for node, (activation, weight, out_dim, _) in linears.items():
        before = _linears_before(activation, parents[node], linears)
        if not before:
            continue
        _assign(roles.row, roles.row_modules, roles.sizes, weight, 1 - out_dim, node)
        for column in sorted(before, key=order.get):  # graph order: the hints come out the same every run
            col_activation, col_weight, col_out, bias = linears[column]
            _assign(roles.column, roles.column_modules, roles.sizes, col_weight, col_out, column)
            if isinstance(bias, torch.fx.Node) and bias.op == "placeholder":
                _add(roles.column_bias, layer_glob(bias.meta[meta.PATH]))
            region, made = _producer_module(col_activation, parents[column])
            if made is not None:
                roles.sizes.setdefault(layer_glob(region), tuple(made.meta["val"].shape))
            if region and region != parents[column] and not region.startswith(parents[column] + ".") \
                    and _in_repeated_layer(region):
                _add(roles.sequence_regions, layer_glob(region))
    overlap = set(roles.column) & set(roles.row)  # a linear both ways (chained inside one parent): not a pair
    for key in overlap:
        roles.column.pop(key)
        roles.row.pop(key)
    return roles


_CONVOLUTIONS = {aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
                 aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input}


def _convolved(param) -> bool:
    """Whether a parameter is a convolution's weight (a 3-D conv1d weight is not a stack of experts), through its
    casts and views."""
    seen, todo = set(), [param]
    while todo:
        value = todo.pop()
        for user in value.users:
            if user.target in _CONVOLUTIONS:
                return True
            if user not in seen and (cast_parameter(user) is not None or user.target in (
                    aten._to_copy.default, aten.view.default, aten.alias.default, aten.detach.default)):
                seen.add(user)
                todo.append(user)
    return False


def _producer_module(value, parent: str) -> tuple:
    """The module that made a linear's activation input, looking through the parent's own reshapes (a
    Conv1D flattens its input before its addmm), and the node that made it."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function":
        path = value.meta.get(meta.PATH, "")
        if path != parent and not path.startswith(parent + "."):
            return path, value
        inputs = value.all_input_nodes
        if len(inputs) != 1:
            return "", None
        value = inputs[0]
    return "", None


def _assign(table: dict, modules: list, sizes: dict, weight, dim: int, op) -> None:
    glob = layer_glob(weight.meta[meta.PATH])
    table[glob] = dim
    sizes[glob] = tuple(weight.meta["val"].shape)
    _add(modules, layer_glob(op.meta.get(meta.PATH, "")))


def _add(items: list, value: str) -> None:
    if value not in items:
        items.append(value)
