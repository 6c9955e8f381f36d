"""normalize: rewrite ops into forms whose sharding is local and exact.

Reads the traced graph; writes a graph where
- a bias is added after linear/conv/addmm (so a partial matmul never adds its bias k times);
- `mean` is `sum / count` with the global count (a mean over a shard is not a partial mean);
- cross-entropy is `log_softmax` + `nll_loss(sum) / number of counted targets`;
- training batch norm is explicit sums over (batch, spatial) dims plus in-place running-stat updates;
- `unflatten` is a `view` to its output shape; `x.T` (numpy_T) is a `permute`;
- `x @ W.T` (matmul of a transposed 2-D W) is `linear(x, W)`; addmm/baddbmm's alpha and beta are muls;
- in-place ops whose operand nothing else aliases (not a placeholder, not a view) are out-of-place
  (`x.div_(y)` -> `div(x, y)`), so they shard like any op;
- higher-order `wrap_with_set_grad_enabled` regions are inlined (outputs detached when grad was off), and
  `torch.autocast` regions (`wrap_with_autocast`) with their casts spelled out as `_to_copy` ops;
- an unfused attention (matmul, softmax, matmul) is `scaled_dot_product_attention` (autoshard/passes/attention_fusion.py);
- random ops (dropout, attention with dropout, rand_like, ...) are numbered in graph order, the single
  device's order of draws (`autoshard.rng_index`; autoshard/passes/random_ops.py).
Rewrites run in graph order and may read nodes earlier rewrites made (their `val`s are filled in first).
Invariant: the graph computes the same values; every node has a FakeTensor `val`.
"""
from __future__ import annotations

import math
import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from autoshard.cost.axis_cost import needs_grad
from autoshard.ir import meta
from autoshard.ir.graph_utils import copy_node, new_node, refresh_vals, val_of
from autoshard.passes.attention_fusion import fuse_attention
from autoshard.passes.contract import NORMALIZED, compiler_pass
from autoshard.passes.random_ops import number_random_ops

aten = torch.ops.aten


@compiler_pass("normalize", reads=("val", meta.KIND), writes=(NORMALIZED, meta.RNG_INDEX, meta.GRAD))
def normalize(state) -> None:
    """The pass: rewrite `state.gm` in place (see the module docstring). A linear's bias becomes an add
    and the default loss's mean a sum divided by the global count:

    >>> import torch
    >>> from autoshard.passes.pass_lists import state_before
    >>> state = state_before("normalize", torch.nn.Linear(4, 2), (2,), (torch.randn(8, 4),), axis_names=("dp",))
    >>> normalize(state)
    >>> [str(n.target) for n in state.gm.graph.nodes if n.op == "call_function"]
    ['aten.linear.default', 'aten.add.Tensor', 'aten.sum.dim_IntList', 'aten.div.Tensor']
    """
    gm = state.gm
    changed = _inline_grad_regions(gm)
    mode = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder" and "val" in n.meta])
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        rewrite = _REWRITES.get(node.target) or (_out_of_place if _in_place(node.target) else None)
        if rewrite is None:
            continue
        _fill_input_vals(node, mode)  # an earlier rewrite may have made this node's inputs
        if rewrite(gm.graph, node):
            changed = True
    if changed:
        gm.graph.lint()
        refresh_vals(gm)
    if fuse_attention(gm, needs_grad(gm.graph)):  # unfused attentions become the fused op
        gm.graph.lint()
        refresh_vals(gm)
    number_random_ops(gm.graph, state.options.rng)
    needs_grad(gm.graph)  # every node's gradient flag, stored for the passes after



def _fill_input_vals(node: fx.Node, mode) -> None:
    """FakeTensor `val`s for inputs made by earlier rewrites (rewrites read their inputs' shapes)."""
    for arg in node.all_input_nodes:
        if "val" in arg.meta or arg.op != "call_function":
            continue
        _fill_input_vals(arg, mode)
        args, kwargs = fx.node.map_arg((arg.args, arg.kwargs), lambda n: n.meta["val"])
        with mode:
            arg.meta["val"] = arg.target(*args, **kwargs)


def _replace(node: fx.Node, new: fx.Node) -> bool:
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)
    return True


def _split_bias(bias_index: int, bias_view_dims=0):
    """op(x, w, b, ...) -> op(x, w, None, ...) + b (viewed to broadcast over trailing spatial dims)."""
    def rewrite(graph, node):
        args = list(node.args)
        if len(args) <= bias_index or args[bias_index] is None:
            return False
        bias = args[bias_index]
        args[bias_index] = None
        if node.target is aten.linear.default:
            args = args[:2]
        with graph.inserting_before(node):
            core = new_node(graph, node.target, args, node.kwargs, like=node)
            if bias_view_dims:
                ndim = len(val_of(node).shape)
                bias = new_node(graph, aten.view.default, [bias, [-1] + [1] * (ndim - 2)], like=node)
            out = new_node(graph, aten.add.Tensor, [core, bias], like=node)
        return _replace(node, out)
    return rewrite


def _addmm(graph, node):
    """beta * bias + alpha * (a @ b) with the scalings as muls (beta = 0 ignores the bias, as torch does)."""
    bias, a, b = node.args[:3]
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    mm = aten.mm.default if node.target is aten.addmm.default else aten.bmm.default
    with graph.inserting_before(node):
        out = new_node(graph, mm, [a, b], like=node)
        if alpha != 1:
            out = new_node(graph, aten.mul.Tensor, [out, alpha], like=node)
        if beta != 0:
            if beta != 1:
                bias = new_node(graph, aten.mul.Tensor, [bias, beta], like=node)
            out = new_node(graph, aten.add.Tensor, [out, bias], like=node)
    return _replace(node, out)


def _numpy_t(graph, node):
    """x.T reverses the dims: a permute, which has a rule."""
    ndim = len(val_of(node.args[0]).shape)
    with graph.inserting_before(node):
        out = new_node(graph, aten.permute.default, [node.args[0], list(reversed(range(ndim)))], like=node)
    return _replace(node, out)


def _transposed_2d(node) -> fx.Node | None:
    """W when `node` is W.T of a 2-D W (t, a [1, 0] permute or a transpose of its two dims)."""
    if not isinstance(node, fx.Node) or node.target not in (aten.t.default, aten.permute.default, aten.transpose.int):
        return None
    if not isinstance(val_of(node.args[0]), torch.Tensor) or val_of(node.args[0]).dim() != 2:
        return None
    if node.target is aten.t.default:
        return node.args[0]
    if node.target is aten.permute.default and [d % 2 for d in node.args[1]] == [1, 0]:
        return node.args[0]
    if node.target is aten.transpose.int and node.args[1] % 2 != node.args[2] % 2:
        return node.args[0]
    return None


def _matmul(graph, node):
    """x @ W.T (Falcon's and others' own linear layers) is linear(x, W): the weight's S(0) is then column
    parallel like nn.Linear's, and its S(1) row parallel."""
    x, w_t = node.args[:2]
    weight = _transposed_2d(w_t)
    if weight is None or len(val_of(x).shape) < 1:
        return False
    with graph.inserting_before(node):
        out = new_node(graph, aten.linear.default, [x, weight], like=node)
    _replace(node, out)
    if not w_t.users:
        graph.erase_node(w_t)
    return True


def _out_of_place(graph, node):
    """An in-place op on a value nothing else sees (not a graph input, not a view, no view of it, every other
    use before this one) is its functional twin: later uses already read this node (export's form)."""
    target = node.target
    functional = getattr(getattr(aten, target.overloadpacket.__name__[:-1], None), target._overloadname, None)
    operand = node.args[0] if node.args else None
    if functional is None or not isinstance(operand, fx.Node) or operand.op != "call_function":
        return False
    if _aliases(operand) or any(_aliases(user) for user in operand.users if user is not node):
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    if any(order.get(user, len(order)) > order[node] for user in operand.users):
        return False
    with graph.inserting_before(node):
        out = new_node(graph, functional, list(node.args), node.kwargs, like=node)
    return _replace(node, out)


def _aliases(node: fx.Node) -> bool:
    """Whether the node's value may share storage with an input (a view, an in-place result, a view's piece)."""
    if node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return node.op == "call_function" and (schema is None or any(r.alias_info is not None for r in schema.returns))


def _in_place(target) -> bool:
    """An ATen op that writes its first argument (`div_`, `index_put_`, ...)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments or not target.overloadpacket.__name__.endswith("_"):
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def _mean(graph, node):
    x = node.args[0]
    shape = val_of(x).shape
    if node.target is aten.mean.default:
        dims, keepdim = list(range(len(shape))), False
    else:
        dims = node.args[1] if len(node.args) > 1 and node.args[1] not in (None, []) else list(range(len(shape)))
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims = [dims] if isinstance(dims, int) else dims
    count = math.prod(shape[d] for d in dims)
    dtype = node.kwargs.get("dtype")
    with graph.inserting_before(node):
        total = new_node(graph, aten.sum.dim_IntList, [x, list(dims), keepdim], {"dtype": dtype} if dtype else {},
                         like=node)
        out = new_node(graph, aten.div.Tensor, [total, float(count)], like=node)
    return _replace(node, out)


def _cross_entropy(graph, node):
    x, target = node.args[:2]
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    if smoothing or val_of(target).dtype not in (torch.int64, torch.int32):
        return False
    dtype = val_of(node).dtype
    with graph.inserting_before(node):
        logp = new_node(graph, aten.log_softmax.int, [x, 1], like=node)
        nll = new_node(graph, aten.nll_loss_nd.default, [logp, target, weight, reduction, ignore], like=node)
    _replace(node, nll)
    _nll_mean(graph, nll, dtype)
    return True


def _nll_mean(graph, node, dtype=None):
    """nll_loss(mean) -> nll_loss(sum) / count of targets not ignored (the global count)."""
    args = list(node.args) + [None] * (5 - len(node.args))
    x, target, weight, reduction, ignore = args[:5]
    reduction = node.kwargs.get("reduction", 1) if reduction is None else reduction
    ignore = node.kwargs.get("ignore_index", -100) if ignore is None else ignore
    if reduction != 1 or weight is not None or node.kwargs.get("weight") is not None:
        return False
    dtype = dtype or val_of(node).dtype
    with graph.inserting_before(node):
        total = new_node(graph, node.target, [x, target, None, 2, ignore], like=node)
        counted = new_node(graph, aten.ne.Scalar, [target, ignore], like=node)
        count = new_node(graph, aten.sum.default, [counted], {"dtype": dtype}, like=node)
        out = new_node(graph, aten.div.Tensor, [total, count], like=node)
    return _replace(node, out)


def _batch_norm(graph, node):
    """Training batch norm as explicit sums over (batch, spatial) dims: sharding the batch then gives
    SyncBatchNorm (the sums become partial and are all-reduced), and the running statistics are
    updated in place from the global statistics."""
    x, weight, bias, running_mean, running_var, training, momentum, eps = node.args[:8]
    if not training or momentum is None:
        return False
    shape = val_of(x).shape
    dims = [0] + list(range(2, len(shape)))
    count = math.prod(shape[d] for d in dims)
    param_shape = [1, shape[1]] + [1] * (len(shape) - 2)

    def call(target, *args, **kwargs):
        return new_node(graph, target, list(args), kwargs, like=node)

    with graph.inserting_before(node):
        mean = call(aten.div.Tensor, call(aten.sum.dim_IntList, x, dims, True), float(count))
        centered = call(aten.sub.Tensor, x, mean)
        var = call(aten.div.Tensor, call(aten.sum.dim_IntList, call(aten.mul.Tensor, centered, centered), dims, True),
                   float(count))
        out = call(aten.mul.Tensor, centered, call(aten.rsqrt.default, call(aten.add.Tensor, var, eps)))
        if weight is not None:
            out = call(aten.mul.Tensor, out, call(aten.view.default, weight, param_shape))
        if bias is not None:
            out = call(aten.add.Tensor, out, call(aten.view.default, bias, param_shape))
        for buffer, stat, scale in ((running_mean, mean, 1.0), (running_var, var, count / max(count - 1, 1))):
            if buffer is None:
                continue
            stat = call(aten.view.default, call(aten.detach.default, stat), [shape[1]])
            updated = call(aten.add.Tensor, call(aten.mul.Tensor, buffer, 1.0 - momentum),
                           call(aten.mul.Tensor, stat, momentum * scale))
            call(aten.copy_.default, buffer, updated)
    return _replace(node, out)


def _unflatten(graph, node):
    """unflatten's size list is global; a view with the output shape gets localized like any view."""
    with graph.inserting_before(node):
        out = new_node(graph, aten.view.default, [node.args[0], list(val_of(node).shape)], like=node)
    return _replace(node, out)


def _inline_grad_regions(gm: fx.GraphModule) -> bool:
    """Inline `wrap_with_set_grad_enabled(flag, submod, *args)` (detach results made without grad, unless a result is
    an input unchanged: `_unchanged_input`) and
    `wrap_with_autocast(device, dtype, enabled, cache, submod, *args)` (`torch.autocast` in forward): the
    autocast region is traced again under autocast, which spells its casts out as `_to_copy` ops."""
    grad_hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    autocast_hop = getattr(torch.ops.higher_order, "wrap_with_autocast", None)
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (grad_hop, autocast_hop) or node.target is None:
            continue
        if node.target is grad_hop:
            enabled, sub_node, *args = node.args
            sub = getattr(gm, sub_node.target)
        else:
            device, dtype, cast, cache, sub_node, *args = node.args
            with torch.autocast(device, dtype=dtype, enabled=cast, cache_enabled=cache):
                sub = make_fx(getattr(gm, sub_node.target), pre_dispatch=False)(*[a.meta["val"] for a in args])
            enabled = True
        env = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], args))
        results = None
        with gm.graph.inserting_before(node):
            for inner in sub.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    results = fx.node.map_arg(inner.args[0], lambda n, env=env: env[n])
                    continue
                copied = copy_node(gm.graph, inner, lambda n, env=env: env[n])
                copied.meta[meta.KIND] = "op"
                copied.meta[meta.PATH] = node.meta.get(meta.PATH, meta.module_path(inner))
                env[inner] = copied
            if not enabled:
                results = [_unchanged_input(r, args) or new_node(gm.graph, aten.detach.default, [r], like=node)
                           for r in results]
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(results[user.args[1]])
                gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        gm.graph.erase_node(sub_node)
        delattr(gm, sub_node.target)
        changed = True
    return changed


# Ops that return their input itself where they change nothing (`Tensor.to` to the dtype and device it has,
# `contiguous` of a contiguous tensor): under no_grad too, so the result keeps the input's requires_grad.
_RETURNS_INPUT = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.contiguous.default)


def _unchanged_input(result, inputs) -> fx.Node | None:
    """The region input `result` is in eager (a chain of no-op `_RETURNS_INPUT` ops from it), else None. A no_grad
    region's results are detached, but eager hands such a result back as the very tensor that went in, still
    requiring grad, and export reads the value's later uses from it (Dots3's sparse-attention indexer casts the
    hidden states to its weight's dtype under no_grad; detached, the gate projection that reads them after the
    indexer sent no gradient back: layer 0's gradients 12% off)."""
    node = result
    while isinstance(node, fx.Node) and node not in inputs and node.target in _RETURNS_INPUT:
        source = node.args[0]
        if _copies(node) or not _same_tensor_kind(val_of(node), val_of(source)):
            return None
        node = source
    return node if isinstance(node, fx.Node) and node in inputs else None


def _copies(node: fx.Node) -> bool:
    """Whether `node` (a `Tensor.to` overload) was asked to copy (its `copy` argument, by position or keyword)."""
    for i, argument in enumerate(node.target._schema.arguments):
        if argument.name == "copy":
            return bool(node.args[i] if i < len(node.args) else node.kwargs.get("copy", False))
    return False


def _same_tensor_kind(out, source) -> bool:
    """Whether a `_RETURNS_INPUT` op made `out` from `source` without a copy (same dtype, device, layout, strides)."""
    return (isinstance(out, torch.Tensor) and isinstance(source, torch.Tensor) and out.dtype == source.dtype
            and out.device == source.device and out.layout == source.layout and out.stride() == source.stride())


_REWRITES = {
    aten.linear.default: _split_bias(2),
    aten.conv1d.default: _split_bias(2, bias_view_dims=1),
    aten.conv2d.default: _split_bias(2, bias_view_dims=1),
    aten.conv3d.default: _split_bias(2, bias_view_dims=1),
    aten.addmm.default: _addmm,
    aten.baddbmm.default: _addmm,
    aten.mean.dim: _mean,
    aten.mean.default: _mean,
    aten.cross_entropy_loss.default: _cross_entropy,
    aten.nll_loss_nd.default: _nll_mean,
    aten.nll_loss.default: _nll_mean,
    aten.unflatten.int: _unflatten,
    aten.numpy_T.default: _numpy_t,
    aten.matmul.default: _matmul,
    aten.batch_norm.default: _batch_norm,
}
