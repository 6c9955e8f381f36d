"""The gradient sync's latencies as the runtime pays them: one per bucket and axis (autoshard/runtime/grad_sync.py
cuts the synced gradients into buckets of up to BUCKET_BYTES), where the ILP's linear price (`grad_sync_time`) gives
each parameter its bytes' share of a full bucket's latency. A model whose gradients fill less than a bucket waits
one whole latency; the linear price charged it that fraction of one. predict adds the difference (`bucket_shortfall`)
to each synced parameter's row, in proportion to its bytes, and to the step.

The examples use a data-parallel MLP, whose gradients are one bucket:

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}})
"""
from __future__ import annotations

import math

from autoshard.cost.collective_time import all_reduce_time, grad_sync_time
from autoshard.cost.flops import local_bytes
from autoshard.cost.profiles import Link
from autoshard.ir import meta
from autoshard.runtime.grad_sync import SizedTensor, buckets


class _Gradient(SizedTensor):
    """A synced gradient as `buckets` sees it (its bytes and dtype), with its parameter's node."""

    def __init__(self, node, nbytes: int):
        super().__init__(nbytes, node.meta["val"].dtype)
        self.node = node


def bucket_shortfall(state, within=None) -> dict:
    """{parameter node: seconds} the runtime's buckets add to each synced parameter's linear sync price: per bucket
    and axis it reduces on, one latency (2 (k - 1) alpha, `all_reduce_time`'s) less the shares its parameters were
    charged, spread over them by bytes. An axis where ZeRO-2/3 reduce-scatters the gradients is not bucketed.
    `within`: only these parameters, bucketed on their own (a pipeline stage's, which its module syncs).

    >>> from autoshard.runtime.grad_sync import BUCKET_BYTES
    >>> shortfall = bucket_shortfall(prog.state)
    >>> link = prog.state.options.profile.link((2,), 0)
    >>> synced = prog.plan.predicted.comm_bytes_per_step["dp"].sync  # under one bucket: one latency in all
    >>> abs(sum(shortfall.values()) - 2 * link.alpha * (1 - synced / BUCKET_BYTES)) < 1e-12
    True
    """
    mesh, profile = state.mesh, state.options.profile
    out: dict = {}
    for axes, bucket in bucket_layout(state, within):
        total = sum(g.nbytes for g in bucket)
        for name in axes:
            axis = mesh.axis(name)
            k, latency = mesh.shape[axis], Link(profile.link(mesh.shape, axis).alpha, math.inf)  # no bytes' time
            missing = all_reduce_time(0.0, k, latency) - sum(grad_sync_time(g.nbytes, k, latency) for g in bucket)
            if total <= 0 or missing <= 0:
                continue
            for g in bucket:
                out[g.node] = out.get(g.node, 0.0) + missing * g.nbytes / total
    return out


def bucket_layout(state, within=None) -> list[tuple[tuple, list]]:
    """The runtime's gradient buckets as the plan predicts them (autoshard/runtime/grad_sync.py: gradients grouped by
    the axes they are reduced on, in backward's order, cut by `buckets`): [(axes, [gradient])], each gradient with
    its parameter's `node` and local `nbytes`. An axis where ZeRO-2/3 reduce-scatters the gradients is not
    bucketed; `within`: only these parameters.

    >>> [(axes, [g.node.meta["autoshard.path"] for g in bucket]) for axes, bucket in bucket_layout(prog.state)]
    [(('dp',), ['layers.1.bias', 'layers.1.weight', 'layers.0.bias', 'layers.0.weight'])]
    """
    mesh, zero = state.mesh, state.zero
    scattered = zero.axis if zero is not None and zero.stage >= 2 else None
    groups: dict = {}  # the axes a gradient is reduced on -> its gradients, in graph order
    for node in state.gm.graph.nodes:
        if node.op != "placeholder" or meta.SPEC not in node.meta or (within is not None and node not in within):
            continue
        axes = tuple(a for a in state.grad_reduce.get(node.meta.get(meta.PATH), ()) if a != scattered)
        if axes:
            groups.setdefault(axes, []).append(_Gradient(node, local_bytes(node, node.meta[meta.SPEC], mesh)))
    # backward's order, as the runtime's layout
    return [(axes, bucket) for axes, gradients in groups.items() for bucket in buckets(reversed(gradients), lambda g: g)]
