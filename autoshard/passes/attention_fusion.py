"""normalize's last rewrite: an unfused attention becomes `scaled_dot_product_attention`, so that it gets the
context-parallel strategies (autoshard/strategies/attention.py; the ring exists only for the fused op).

The form matched (transformers' "eager" attention, hand-written attentions):

    scores = matmul(q, k^T) [* scale | / d]  [+ mask | masked_fill(cond, -inf)]
    weights = softmax(scores, -1) [-> to(dtype)] [-> dropout(p = 0 or not training)]
    out = matmul(weights, v)

with k^T a transpose of the last two dims of a [..., S, E] k, and nothing else using the scores or the weights.
It becomes `scaled_dot_product_attention(q, k, v, attn_mask, scale=scale)` (a `masked_fill` mask as its
logical not). Left unfused: a real dropout between softmax and matmul (the mask draws must stay the model's
own), a mask or scores that need a gradient (learned position biases: T5's), softcapping or anything else
between the matmuls. The fused op computes the same values (torch's math kernel: the same products, the scale
split between q and k, so float rounding differs).

>>> import torch
>>> from autoshard.passes.pass_lists import state_before
>>> class Eager(torch.nn.Module):
...     def forward(self, q, k, v):
...         scores = q @ k.transpose(-2, -1) / 2.0
...         return torch.softmax(scores, dim=-1) @ v
>>> qkv = [torch.randn(2, 4, 8, 4) for _ in range(3)]
>>> state = state_before("normalize", Eager(), (2,), qkv, axis_names=("cp",))
"""
from __future__ import annotations

import math

import torch
from torch import fx

from autoshard.ir.graph_utils import new_node

aten = torch.ops.aten
_PASS_THROUGH = (aten.to.dtype, aten._to_copy.default, aten.clone.default)
_IGNORED_USERS = (aten._assert_tensor_metadata.default,)


def fuse_attention(gm: fx.GraphModule, needs_grad: dict) -> bool:
    """Rewrite every matched attention in `gm` (module docstring); `needs_grad`: which nodes carry a gradient
    (their mask is then a learned bias, left alone). Returns whether the graph changed.

    >>> from autoshard.passes.normalize import normalize
    >>> normalize(state)
    >>> [str(n.target) for n in state.gm.graph.nodes if n.op == "call_function"][:1]
    ['aten.scaled_dot_product_attention.default']
    """
    changed = False
    for softmax in [n for n in gm.graph.nodes if n.target in (aten.softmax.int, aten._softmax.default)]:
        match = _match(softmax, needs_grad)
        if match is None:
            continue
        q, k, v, mask, scale, out, forward, backward = match
        with gm.graph.inserting_before(out):
            if isinstance(mask, tuple):  # masked_fill(cond, -inf): attend where cond is False
                mask = new_node(gm.graph, aten.logical_not.default, [mask[1]], like=out)
            fused = new_node(gm.graph, aten.scaled_dot_product_attention.default, [q, k, v],
                             {"attn_mask": mask, "scale": scale}, like=out)
        fused.meta["val"] = out.meta["val"]
        out.replace_all_uses_with(fused)
        for node in [out, *reversed(forward), *backward]:  # consumers before their producers
            for user in list(node.users):
                if user.target in _IGNORED_USERS:
                    gm.graph.erase_node(user)
            if not node.users:
                gm.graph.erase_node(node)
        changed = True
    return changed


def _single_user(node):
    users = [u for u in node.users if u.target not in _IGNORED_USERS]
    return users[0] if len(users) == 1 else None


def _match(softmax: fx.Node, needs_grad: dict):
    """(q, k, v, mask, scale, final matmul, the nodes after the softmax, the nodes before) or None."""
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    scores = softmax.args[0]
    if dim not in (-1, scores.meta["val"].dim() - 1):
        return None
    # forward: softmax -> [casts] -> [dropout that draws nothing] -> matmul(weights, v)
    forward, node = [softmax], _single_user(softmax)
    while node is not None and (node.target in _PASS_THROUGH or _inert_dropout(node)):
        forward.append(node)
        node = _single_user(node)
    if node is None or node.target is not aten.matmul.default or node.args[0] is not forward[-1]:
        return None
    out, v = node, node.args[1]
    # backward: [+ mask | masked_fill(cond, -inf)] [* scale | / d] matmul(q, transpose(k))
    mask, scale, backward, node = None, 1.0, [], scores
    if node.target is aten.add.Tensor and _single_user(node) is softmax:
        node, mask = node.args[0], node.args[1]
        if not isinstance(mask, fx.Node) or needs_grad.get(mask, False):
            return None  # a learned bias: its gradient is the attention's to give
        backward.append(scores)
    elif node.target is aten.masked_fill.Scalar and _single_user(node) is softmax and node.args[2] == float("-inf"):
        mask = ("fill", node.args[1])
        backward.append(node)
        node = node.args[0]
    if node.target in (aten.mul.Tensor, aten.div.Tensor) and isinstance(node.args[1], (int, float)):
        if not node.args[1] or _single_user(node) is None:
            return None
        scale = float(node.args[1]) if node.target is aten.mul.Tensor else 1.0 / float(node.args[1])
        backward.append(node)
        node = node.args[0]
    if node.target is not aten.matmul.default or _single_user(node) is None or not math.isfinite(scale):
        return None
    q, kt = node.args
    if not _is_key_transpose(kt):
        return None
    backward.append(node)
    k = kt.args[0]
    shapes = [x.meta["val"].shape for x in (q, k, v)]
    if len(shapes[0]) < 2 or shapes[0][-1] != shapes[1][-1] or shapes[1][-2] != shapes[2][-2]:
        return None
    if len({x.meta["val"].dtype for x in (q, k, v, out)}) != 1:  # the fused op computes in one dtype
        return None
    if _single_user(kt) is not None:
        backward.append(kt)
    return q, k, v, mask, scale, out, forward, backward


def _is_key_transpose(node) -> bool:
    if not isinstance(node, fx.Node) or node.target is not aten.transpose.int:
        return False
    ndim = node.args[0].meta["val"].dim()
    return {d % ndim for d in node.args[1:3]} == {ndim - 2, ndim - 1}


def _inert_dropout(node) -> bool:
    """A dropout that draws nothing: p = 0, or not training."""
    if node.target is not aten.dropout.default:
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return p == 0 or train is False

