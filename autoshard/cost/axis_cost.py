"""Costs of one node's candidate strategy on one mesh axis, broken down for the ILP and for `explain`.
An attention's ring messages count as its communication, its score blocks as its memory
(autoshard/cost/attention_cost.py).

Sizes are local after the axes solved before this one. Compute is FLOPs (matmul-like) or bytes moved
(everything else) over the profile's peak, times 3 for forward + backward, divided by the axis size
when the strategy splits the work. Communication follows the duality rule: a replicated input of an
op that splits its work gets a partial gradient, all-reduced in backward (`comm_bwd` for activations,
`sync` for parameters, reduced after backward). Memory is what the node keeps on a device: a
parameter with its gradient and optimizer state, an input, or what autograd saves for backward of its
output's storage (autoshard/cost/saved_tensors.py, the formula predict shares).

>>> from autoshard.cost.profiles import HardwareProfile
>>> from autoshard.passes.pass_lists import state_before
>>> from autoshard.ir.placement import R, S
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> state = state_before("solve", mlp, (2,), (torch.randn(8, 4),), axis_names=("dp",))
>>> graph = state.gm.graph
>>> linear = next(n for n in graph.nodes if n.target is torch.ops.aten.linear.default)
>>> model = AxisCostModel(state.mesh, 0, HardwareProfile(), needs_grad(graph))
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from autoshard.cost.attention_cost import attention_terms
from autoshard.cost.collective_time import (
    INF,
    all_reduce_time,
    conversion_time,
    grad_sync_time,
)
from autoshard.cost.flops import (
    is_matmul_like,
    is_view,
    node_bytes,
    node_flops,
    returns_input,
)
from autoshard.cost.saved_tensors import kept_for_backward
from autoshard.ir import meta
from autoshard.ir.mixed_precision import cast_parameter
from autoshard.ir.placement import Shard
from autoshard.runtime.grad_sync import BUCKET_BYTES
from autoshard.strategies import tensor_inputs

aten = torch.ops.aten


@dataclass(frozen=True)
class CostBreakdown:
    """Seconds (compute, backward all-reduces, gradient sync) and bytes kept per device.

    >>> CostBreakdown(compute=1e-6, memory=128).to_json()
    {'compute_s': 1e-06, 'comm_bwd_s': 0.0, 'sync_s': 0.0, 'memory_bytes': 128}
    """

    compute: float = 0.0
    comm_bwd: float = 0.0
    sync: float = 0.0
    memory: float = 0.0
    in_op_comm: float = 0.0  # messages inside the op (an attention ring's exposed seconds): per node, like compute

    def to_json(self):
        """The breakdown as JSON (what `explain` shows).

        >>> CostBreakdown(sync=2e-6).to_json()["sync_s"]
        2e-06
        """
        out = {"compute_s": self.compute, "comm_bwd_s": self.comm_bwd, "sync_s": self.sync, "memory_bytes": self.memory}
        if self.in_op_comm:
            out["in_op_comm_s"] = self.in_op_comm
        return out


def compute_parts(node, split: int, profile, has_grad: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of one op whose work is divided `split` ways: its forward's work (FLOPs over
    the matmul rate of its dtype, attention's rate for attention, for matmul-like ops; output bytes over the
    memory bandwidth for the rest) plus the profile's fixed cost of the op (`HardwareProfile.fixed_costs`), and of
    autograd recording it when its output has a gradient (`has_grad`); backward then twice the work plus the fixed
    cost of its backward, else nothing. A view moves no data: it costs the profile's fixed costs of a view; an item
    of a multi-output op (`operator.getitem`, Python indexing in the rank program) costs nothing.

    >>> compute_parts(linear, 1, HardwareProfile()) == (2 * 8 * 4 * 8 / 3e14, 2 * 2 * 8 * 4 * 8 / 3e14)
    True
    """
    if node.target is operator.getitem:
        return 0.0, 0.0
    if returns_input(node):  # torch hands back the input itself: a dispatch, and no autograd node
        return profile.view_overhead_s, 0.0
    if is_view(node):  # a view moves no data: its dispatch, forward and (a view of the gradient) backward
        return profile.view_overhead_s, profile.view_grad_overhead_s if has_grad else 0.0
    # dropout that drops nothing (p = 0, as models built for inference and tests set it) draws no mask: a copy
    target = aten.clone.default if node.target is aten.dropout.default and not _dropout_p(node) else node.target
    fixed, recorded, backward = profile.fixed_costs(target)
    if node.target is aten.scaled_dot_product_attention.default and profile.attention_flops:
        work = node_flops(node) / profile.attention_flops
    elif is_matmul_like(node):
        val = node.meta.get("val")
        work = node_flops(node) / (profile.matmul_flops(val.dtype) if isinstance(val, torch.Tensor)
                                   else profile.peak_flops)
    else:
        work = node_bytes(node) / profile.memory_bandwidth
    if not has_grad:
        return work / split + fixed, 0.0
    return work / split + fixed + recorded, 2 * work / split + backward


def _dropout_p(node) -> float:
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    return p if isinstance(p, (int, float)) else 1.0  # a traced p: assume it draws


def compute_time(node, split: int, profile, has_grad: bool = True) -> float:
    """Seconds of forward + backward of one op (`compute_parts`: 3x the forward's work with a gradient, plus the
    profile's fixed costs per op; the ILP and predict).

    >>> compute_time(linear, 1, HardwareProfile()) == 3 * 2 * 8 * 4 * 8 / 3e14  # graph: see the module docstring
    True
    """
    return sum(compute_parts(node, split, profile, has_grad))


def partial_grad_time(producer, nbytes: float, k: int, link, bucket_bytes: float = BUCKET_BYTES) -> float:
    """Seconds of reducing a gradient partial over `k` ranks at `producer`'s output: a parameter's (or its per-use
    cast's, reduced on the master) in the runtime's buckets of `bucket_bytes` (`grad_sync_time`), an activation's by
    its own all-reduce (the ILP's charges and the breakdown `explain` shows use this one rule).

    >>> link = HardwareProfile().intra_node
    >>> partial_grad_time(linear.args[1], 1e3, 4, link) < partial_grad_time(linear, 1e3, 4, link)  # a bucket's share
    True
    """
    if producer.op == "placeholder" or cast_parameter(producer) is not None:
        return grad_sync_time(nbytes, k, link, bucket_bytes)
    return all_reduce_time(nbytes, k, link)


def data_parallel_bucket_bytes(grad: dict, copies=lambda node: 1) -> float:
    """The bytes of the gradient buckets a data-parallel plan of this graph syncs: every trained parameter's (each
    repeated layer a folded trace stands for: `copies`), at most one bucket (BUCKET_BYTES). The ILP prices each
    parameter's sync as its share of such a bucket (`grad_sync_time`).

    >>> data_parallel_bucket_bytes(needs_grad(graph))  # the MLP's weights and biases: (4 x 8 + 8 + 8 x 2 + 2) x 4
    232.0
    """
    total = sum(float(node_bytes(n)) * copies(n) for n, trained in grad.items()
                if trained and n.op == "placeholder" and n.meta.get(meta.KIND) == "param")
    return min(total, float(BUCKET_BYTES)) if total > 0 else float(BUCKET_BYTES)


def held_bytes_factor(node, grad: dict, optimizer_state_factor: float) -> float:
    """How many copies of a placeholder's block a device keeps: a trained parameter its value, gradient and
    optimizer state; an input or buffer itself.

    >>> held_bytes_factor(linear.args[1], needs_grad(graph), 2.0), held_bytes_factor(linear.args[0], {}, 2.0)
    (4.0, 1.0)
    """
    trained = node.meta.get(meta.KIND) == "param" and grad.get(node, False)
    return 2.0 + optimizer_state_factor if trained else 1.0


def needs_grad(graph) -> dict:
    """Which values carry a gradient: parameters and everything float computed from them. Each node's flag is
    stored in its meta (`autoshard.grad`, written for every node by normalize) and derived here, by the same
    rule, only for nodes added since (collectives, copies): the graph is walked, not re-analysed.

    >>> sorted(n.name for n, g in needs_grad(graph).items() if g)[:4]  # graph: see the module docstring
    ['add_tensor', 'add_tensor_1', 'div_tensor', 'linear_default']
    """
    out = {}
    for node in graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        flag = node.meta.get(meta.GRAD)
        if flag is None:
            flag = node.meta[meta.GRAD] = _derived_grad(node, out)
        out[node] = flag
    return out


def _derived_grad(node, flags: dict) -> bool:
    """The rule: a float parameter, or a float op (not a detach) with an input that carries a gradient."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    is_float = any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)
    if node.op == "placeholder":
        return node.meta.get(meta.KIND) == "param" and is_float
    return bool(is_float and node.target is not aten.detach.default
                and any(flags.get(i, False) for i in node.all_input_nodes))


class AxisCostModel:
    """Cost terms on mesh axis `axis`. `other` arguments give the node's strategies on the other
    axes already fixed ({axis: AxisStrategy}); sizes are divided by the shards they imply.

    >>> model.k, model.link.bandwidth  # model: see the module docstring
    (2, 200000000000.0)
    """

    def __init__(self, mesh, axis, profile, grad, optimizer_state_factor: float = 2.0, kept: dict | None = None,
                 copies=lambda node: 1):
        self.mesh, self.axis, self.profile = mesh, axis, profile
        self.k = mesh.shape[axis]
        self.link = profile.link(mesh.shape, axis)
        self.grad = grad
        self.optimizer_state_factor = optimizer_state_factor
        # bytes saved for backward per byte of output (kept_for_backward of the graph `grad` covers)
        self.kept = kept if kept is not None else kept_for_backward(next(iter(grad)).graph, grad) if grad else {}
        self._bytes: dict = {}  # node -> node_bytes: the ILP's build asks for each edge and candidate pair
        # a parameter's sync is its share of the buckets a data-parallel plan syncs (`grad_sync_time`)
        self.bucket_bytes = data_parallel_bucket_bytes(grad, copies)

    def _node_bytes(self, node) -> float:
        nbytes = self._bytes.get(node)
        if nbytes is None:
            nbytes = self._bytes[node] = float(node_bytes(node))
        return nbytes

    def _shrink(self, nbytes, placements) -> float:
        for b, p in placements.items():
            if isinstance(p, Shard):
                nbytes /= self.mesh.shape[b]
        return nbytes

    def local_bytes(self, node, other: dict) -> float:
        """Bytes of the node's output after the other axes' placements (whole on this axis).

        >>> model.local_bytes(linear, {})  # the [8, 8] float32 output of the first linear
        256.0
        """
        return self._shrink(self._node_bytes(node), {b: c.output for b, c in other.items()})

    def input_bytes(self, producer, pos, other: dict) -> float:
        """Bytes of `producer` as the consumer takes it at input `pos` (placements of the other axes).

        >>> model.input_bytes(linear.args[1], 1, {})  # the [8, 4] weight
        128.0
        """
        return self._shrink(self._node_bytes(producer), {b: c.inputs[pos] for b, c in other.items()})

    def node(self, node, cand, other: dict) -> CostBreakdown:
        """The breakdown of one candidate: data parallel halves the work and syncs the weight's gradient.

        >>> replicated, batch_split = linear.meta["autoshard.candidates"][0][:2]
        >>> model.node(linear, replicated, {}).memory  # no op saves the first linear's output (the ReLU its own)
        0.0
        >>> relu = next(n for n in graph.nodes if n.target is torch.ops.aten.relu.default)
        >>> [model.node(relu, c, {}).memory for c in relu.meta["autoshard.candidates"][0][:2]]
        [256.0, 128.0]
        >>> model.node(linear, batch_split, {}).sync > 0
        True
        """
        kept = self.local_bytes(node, other) / (self.k if isinstance(cand.output, Shard) else 1)
        if node.op == "placeholder":
            return CostBreakdown(memory=kept * held_bytes_factor(node, self.grad, self.optimizer_state_factor))
        split = math.prod(self.mesh.shape[b] for b, c in other.items() if c.divides_compute)
        split *= self.k if cand.divides_compute else 1
        compute = compute_time(node, split, self.profile, self.grad.get(node, False))
        comm_bwd = sync = extra_memory = in_op = 0.0
        if node.target is aten.scaled_dot_product_attention.default:  # a ring's messages; the score blocks
            strategies = {**other, self.axis: cand}
            in_bytes = [self.input_bytes(p, pos, other) / (self.k if isinstance(cand.inputs[pos], Shard) else 1)
                        for pos, p in enumerate(tensor_inputs(node))]
            terms = attention_terms(node, strategies, self.mesh, self.profile, compute, in_bytes, kept,
                                    self.grad.get(node, False))
            compute, in_op, extra_memory = terms.compute_s, terms.comm_s, terms.memory_bytes
        if cand.splits_work:
            for pos, producer in enumerate(tensor_inputs(node)):
                if cand.partial_grad(pos) and self.grad.get(producer, False):
                    t = partial_grad_time(producer, self.input_bytes(producer, pos, other), self.k, self.link,
                                          self.bucket_bytes)
                    if producer.op == "placeholder":
                        sync += t
                    else:
                        comm_bwd += t
        saved = kept * self.kept.get(node, 0.0)
        return CostBreakdown(compute, comm_bwd, sync, saved + extra_memory, in_op)

    def edge(self, producer, produced, wanted, producer_other: dict) -> float:
        """Seconds (forward + backward) to turn the producer's placement into the consumer's.

        >>> model.edge(linear, S(0), R, {})  # all-gather 256 bytes over 2 ranks: latency + 128 B / bandwidth
        5.00064e-06
        """
        if produced == wanted:
            return 0.0
        if isinstance(producer.meta.get("val"), (tuple, list)):
            return INF  # multi-output values are never resharded: their getitem follows them
        nbytes = self.local_bytes(producer, producer_other)
        return conversion_time(produced, wanted, nbytes, self.k, self.link, self.grad.get(producer, False))
