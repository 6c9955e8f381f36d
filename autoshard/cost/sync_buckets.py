"""The gradient sync as the runtime pays it: one all-reduce per bucket and axis (autoshard/runtime/grad_sync.py cuts
the synced gradients into buckets of up to BUCKET_BYTES), where the linear price (`grad_sync_time`) gives each
parameter its bytes' share of a full bucket's all-reduce (the ILP: of the bucket a data-parallel plan syncs). predict
adds the difference (`bucket_correction`) to each synced parameter's row, in proportion to its bytes, and to the step:
a model whose gradients fill less than a bucket waits one whole latency where a full bucket's share charged it a
fraction of one; where calibrate timed the axis's all-reduces, each bucket costs the time measured at its size
(interpolated: `Link.measured_seconds`), which is not proportional to the bytes (on this VM's 2 gloo ranks 12 MiB
took 16 ms, 24 MiB 57).

The examples use a data-parallel MLP, whose gradients are one bucket:

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}})
"""
from __future__ import annotations

import math

from autoshard.cost.axis_cost import data_parallel_bucket_bytes, needs_grad
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


def bucket_correction(state, within=None, bucket_bytes: float | None = None) -> dict:
    """{parameter node: seconds} the runtime's buckets add to (or take from) each synced parameter's linear sync
    price (`grad_sync_time`, a share of a bucket of `bucket_bytes`: by default the ILP's,
    `data_parallel_bucket_bytes`): per bucket and axis it reduces on, the bucket's all-reduce (`all_reduce_time` of
    its bytes: the measured time where there is one, else the line) less what its parameters were charged, spread
    over them by bytes. An axis where ZeRO-2/3 reduce-scatters the gradients is not bucketed. `within`: only these
    parameters, bucketed on their own (a pipeline stage's, which its module syncs).

    Without timings the bytes' time is the same line both ways, so what is added is one latency (2 (k - 1) alpha)
    less the shares charged (nothing where the gradients are all the plan syncs: the ILP's bucket is theirs):

    >>> from autoshard.runtime.grad_sync import BUCKET_BYTES
    >>> correction = bucket_correction(prog.state)
    >>> link = prog.state.options.profile.link((2,), 0)
    >>> synced = prog.plan.predicted.comm_bytes_per_step["dp"].sync  # under one bucket: one latency in all
    >>> abs(sum(correction.values())) < 1e-12
    True
    >>> full = bucket_correction(prog.state, bucket_bytes=BUCKET_BYTES)  # shares of a full bucket
    >>> abs(sum(full.values()) - 2 * link.alpha * (1 - synced / BUCKET_BYTES)) < 1e-12
    True

    With timings (a calibrated profile), the sync costs each bucket's measured time:

    >>> from autoshard.cost.profiles import HardwareProfile
    >>> timed = Link(1e-3, 1e9, measured=(2, (("all_reduce", ((4096, 0.004), (1 << 24, 0.008))),)))
    >>> on_timed = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
    ...                                  hints={"input:0": {"dp": "S(0)"}}, profile=HardwareProfile(axis_links=(timed,)))
    >>> paid = sum(n.meta[meta.NODE_COST].sync_s for n in on_timed.state.gm.graph.nodes if meta.NODE_COST in n.meta)
    >>> round(paid, 12) == round(all_reduce_time(synced, 2, timed), 12)
    True
    """
    mesh, profile = state.mesh, state.options.profile
    if bucket_bytes is None:
        bucket_bytes = data_parallel_bucket_bytes(needs_grad(state.gm.graph))
    out: dict = {}
    for axes, bucket in bucket_layout(state, within):
        total = sum(g.nbytes for g in bucket)
        for name in axes:
            axis = mesh.axis(name)
            k, link = mesh.shape[axis], profile.link(mesh.shape, axis)
            if link.measured_seconds("all_reduce", total, k) is None:  # the line: only the latencies differ
                link = Link(link.alpha, math.inf)
            missing = all_reduce_time(total, k, link) - sum(grad_sync_time(g.nbytes, k, link, bucket_bytes)
                                                            for g in bucket)
            if total <= 0 or missing == 0.0:
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


def tied_sync_seconds(state, config) -> dict:
    """{stage: seconds} of the all-reduces over the pipeline axis that sum the gradients of parameters used on
    several pp ranks (a tied embedding and head: `PipelineRankModule.sync_tied_grads`, one all-reduce per parameter on
    every pp rank, with zeros where a rank holds none of it), put on each pp rank's first stage; {} when no
    parameter spans two pp ranks. `config`: the pipeline's PipelineConfig (its `link` is the pp axis's).

    >>> from autoshard.zoo import gpt2
    >>> model, inputs, loss_fn = gpt2(n_layers=2)
    >>> pipe = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("pp",),
    ...                              pipeline={"microbatches": 2})
    >>> tied = tied_sync_seconds(pipe.state, pipe.config)
    >>> sorted(tied), tied[0] == all_reduce_time(64 * 32 * 4, 2, pipe.config.link)  # wte: vocab x dim, float32
    ([0, 1], True)
    """
    if config.pp_size < 2:
        return {}
    seconds = 0.0
    for node in state.gm.graph.nodes:
        if node.op != "placeholder" or node.meta.get(meta.KIND) != "param":
            continue
        ranks = {config.stage_rank(u.meta[meta.STAGE]) for u in node.users if meta.STAGE in u.meta}
        if len(ranks) > 1:
            seconds += all_reduce_time(local_bytes(node, node.meta[meta.SPEC], state.mesh), config.pp_size,
                                       config.link)
    if not seconds:
        return {}
    first = {}
    for stage in range(config.num_stages):
        first.setdefault(config.stage_rank(stage), stage)
    return {stage: seconds for stage in first.values()}
