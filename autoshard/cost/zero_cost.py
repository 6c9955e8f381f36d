"""What ZeRO costs and saves per rank: memory of parameters, gradients and optimizer state, and the
collectives the ZeroOptimizer and `param_all_gather` run (runtime byte convention, autoshard/cost/profiles.py).

Per parameter (bytes `kept` on this rank under its spec, optimizer state `f` x parameter):
  no ZeRO                         params kept, grads kept, optimizer f * kept
  replicated on the ZeRO axis     params kept, grads kept (stage 1) or one chunk (stage >= 2),
                                  optimizer f * chunk + the master chunk; chunk = ceil(numel / k)
  sharded there (ZeRO-3)          params kept, grads kept, optimizer f * kept (the parameter is its master)
plus, for ZeRO-3, the gathered copies alive at once: the largest set one op gathers.
Used by predict (memory and communication of the plan) and by solve (the memory row of the ILP).

The examples use a ZeRO-3 data-parallel MLP (2 ranks):

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}}, zero=3)
>>> gathers = [n for n in prog.state.gm.graph.nodes if n.meta.get("autoshard.comm", {}).get("op") == "param_all_gather"]
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from autoshard.cost.axis_cost import needs_grad
from autoshard.cost.collective_time import (
    all_gather_time,
    grad_sync_time,
    reduce_scatter_time,
)
from autoshard.cost.profiles import DEFAULT_PROFILE
from autoshard.ir import meta
from autoshard.ir.meta import NODE_COST
from autoshard.ir.placement import Shard
from autoshard.runtime.zero_overlap import layer_of

aten = torch.ops.aten
# (op, input position) whose value autograd does not save for backward: a gathered parameter there is
# not re-gathered in backward (probed with saved_tensors_hooks; anything else is assumed saved).
_NOT_SAVED = {(aten.embedding.default, 0), (aten.linear.default, 2), (aten.addmm.default, 0)}
_NEVER_SAVED_OPS = {aten.add.Tensor, aten.sub.Tensor}


def memory_scale(stage: int, k: int, f: float, sharded_on_axis: bool) -> float:
    """Bytes a parameter costs under ZeRO over what it costs without ((2 + f) x its bytes on this rank),
    for the solver's memory row; a parameter already sharded on the axis costs the same.

    >>> memory_scale(stage=3, k=4, f=2.0, sharded_on_axis=False)  # everything split four ways
    0.25
    >>> memory_scale(stage=1, k=4, f=2.0, sharded_on_axis=False)  # 2 + (2 + 1) / 4 of 4
    0.6875
    """
    if sharded_on_axis:
        return 1.0
    held = {1: 2 + (f + 1) / k, 2: 1 + (f + 2) / k, 3: (2 + f) / k}[stage]
    return held / (2 + f)


def param_memory(kept: int, numel: int, itemsize: int, stage: int, k: int, f: float, owned: bool) -> dict:
    """{"params", "grads", "optimizer"} bytes of one parameter on this rank under ZeRO `stage`.

    >>> param_memory(kept=4000, numel=1000, itemsize=4, stage=2, k=4, f=2.0, owned=False)
    {'params': 4000, 'grads': 1000, 'optimizer': 3000.0}
    """
    if owned:
        return {"params": kept, "grads": kept, "optimizer": f * kept}
    chunk = math.ceil(numel / k) * itemsize
    return {"params": kept, "grads": kept if stage == 1 else chunk, "optimizer": (f + 1) * chunk}


def _local_numel(node, spec, mesh) -> int:
    split = math.prod(mesh.shape[a] for a, p in enumerate(spec) if isinstance(p, Shard))
    return node.meta["val"].numel() // split


def regathered(gather) -> bool:
    """Whether backward re-gathers a `param_all_gather`'s output (some consumer saves it).

    >>> [(g.args[0].meta["autoshard.path"], regathered(g)) for g in gathers][:2]  # a linear saves its weight
    [('layers.0.weight', True), ('layers.0.bias', False)]
    """
    for user in gather.users:
        positions = [i for i, a in enumerate(user.args) if a is gather]
        if user.target in _NEVER_SAVED_OPS or all((user.target, i) in _NOT_SAVED for i in positions):
            continue
        return True
    return False


def _trained_param_shards(state):
    """(node, spec, local numel, itemsize, local bytes) of every parameter with a gradient, in graph order."""
    grad = needs_grad(state.gm.graph)
    for node in state.gm.graph.nodes:
        if node.op != "placeholder" or node.meta.get(meta.KIND) != "param" or not grad.get(node):
            continue
        spec = node.meta[meta.SPEC]
        numel, itemsize = _local_numel(node, spec, state.mesh), node.meta["val"].element_size()
        yield node, spec, numel, itemsize, numel * itemsize


def memory_breakdown(state, within: set | None = None) -> dict:
    """Predicted bytes per rank: {"params", "grads", "optimizer", "gathered"} (ZeRO or not); `within`: only
    these nodes' (a pipeline rank's stages).

    >>> memory_breakdown(prog.state)
    {'params': 16704, 'grads': 16704, 'optimizer': 33408, 'gathered': 16384}
    """
    return memory_breakdowns(state, [within])[0]


def memory_breakdowns(state, groups: list) -> list[dict]:
    """`memory_breakdown` of each node set in `groups` (None: the whole graph), the parameters walked once (a
    pipeline's pp ranks: one walk, not one per rank).

    >>> memory_breakdowns(prog.state, [None, set()])[1]
    {'params': 0, 'grads': 0, 'optimizer': 0, 'gathered': 0}
    """
    mesh, zero = state.mesh, state.zero
    f = state.options.optimizer_state_factor
    axis = mesh.axis(zero.axis) if zero is not None else None
    per_param = []  # in graph order: each group sums its parameters' parts in that order
    for node, spec, numel, itemsize, kept in _trained_param_shards(state):
        if zero is None:
            parts = {"params": kept, "grads": kept, "optimizer": f * kept}
        else:
            owned = zero.stage == 3 and isinstance(spec[axis], Shard)
            parts = param_memory(kept, numel, itemsize, zero.stage, mesh.shape[axis], f, owned)
        per_param.append((node, parts))
    outs = []
    for within in groups:
        out = {"params": 0, "grads": 0, "optimizer": 0, "gathered": 0}
        for node, parts in per_param:
            if within is None or node in within:
                for key, value in parts.items():
                    out[key] += value
        for node in state.gm.graph.nodes if within is None else within:
            gathered = [a for a in node.all_input_nodes if meta.COMM in a.meta and a.meta[meta.COMM]["op"] ==
                        "param_all_gather"]
            out["gathered"] = max(out["gathered"], sum(_local_numel(a, a.meta[meta.SPEC], mesh) *
                                                       a.meta["val"].element_size() for a in gathered))
        outs.append({key: int(value) for key, value in out.items()})
    return outs


def optimizer_step_time(state, within: set | None = None) -> float:
    """Seconds of the optimizer's update on this rank per step: every trained parameter's updated part (its ZeRO
    chunk, else its local block) is read as gradient and parameter and the parameter written back, its optimizer
    state (`optimizer_state_factor` x as many bytes: Adam's two moments, none for SGD) read and written: (3 + 2 f)
    x its bytes at the update's rate, plus a cost per tensor (torch's per-parameter updates): both as calibrate timed
    torch's optimizers (`HardwareProfile.optimizer_update`). `within`: only these nodes' parameters (a pp rank's).
    The planner's step (`predicted.step_time_s`) leaves it out; the accuracy report adds it to compare with a
    measured step.

    >>> optimizer_step_time(prog.state) > optimizer_step_time(prog.state, within=set()) == 0.0
    True
    """
    mesh, zero, profile = state.mesh, state.zero, state.options.profile
    f = state.options.optimizer_state_factor
    axis = mesh.axis(zero.axis) if zero is not None else None
    moved, tensors = 0.0, 0
    for node, spec, numel, itemsize, kept in _trained_param_shards(state):
        if within is not None and node not in within:
            continue
        sharded = zero is not None and not (zero.stage == 3 and isinstance(spec[axis], Shard))
        updated = math.ceil(numel / mesh.shape[axis]) * itemsize if sharded else kept
        moved += (3 + 2 * f) * updated
        tensors += 1
    per_tensor, bandwidth = profile.optimizer_update(f)
    return moved / bandwidth + tensors * per_tensor


def gather_parts(node, dst_bytes: int) -> tuple[int, int, int]:
    """(gathered forward, re-gathered in backward, reduce-scattered in backward) bytes of a `param_all_gather`
    whose gathered parameter is `dst_bytes` on this rank.

    >>> gather_parts(gathers[0], dst_bytes=16384)  # a weight: saved by its consumer, its gradient partial
    (16384, 16384, 16384)
    """
    reduce_grad = node.meta[meta.COMM]["args"][1]
    # mixed precision gathers the cast shard but reduce-scatters the gradient in the master's dtype
    master = dst_bytes * node.args[0].meta["val"].element_size() // node.meta["val"].element_size()
    return dst_bytes, dst_bytes * int(regathered(node)), master * int(bool(reduce_grad))


def gather_bytes(node, dst_bytes: int) -> tuple[int, int]:
    """(forward, backward) bytes of a `param_all_gather`: the gathered parameter forward; backward its
    reduce-scattered gradient (when partial; in the master's dtype) and its re-gather (when a consumer
    saved it).

    >>> gather_bytes(gathers[0], dst_bytes=16384)  # a weight: reduce-scatter and re-gather in backward
    (16384, 32768)
    """
    fwd, regather, scatter = gather_parts(node, dst_bytes)
    return fwd, regather + scatter


def gather_seconds(node, dst_bytes: int, k: int, link, latency_share: float = 1.0, has_grad: bool = True,
                   after: tuple = (None, None), gap_s: float = 0.0, in_flight: bool = False) -> float:
    """Seconds of a `param_all_gather` (forward and backward): the all-gather; in backward the re-gather (an
    all-gather) and the reduce-scatter of the gradient, which pays `latency_share` of a collective's latencies
    (`reduce_scatter_shares`). `after`: the compute seconds before the gather and before the re-gather since the
    rank's previous collective (`gather_gaps`), which make a gather that soon after another cheaper than `gap_s`
    later (`all_gather_time`); `in_flight`: its reduce-scatter starts right after another's (`sync_grads`'s).

    >>> from autoshard.cost.profiles import Link
    >>> link = Link(1e-3, 1e9)
    >>> round(gather_seconds(gathers[0], 16384, 2, link) * 1e3, 3)  # three collectives of 1 ms latency each
    3.025
    >>> round(gather_seconds(gathers[0], 16384, 2, link, latency_share=0.5) * 1e3, 3)  # half the reduce-scatter's
    2.525
    """
    fwd, regather, scatter = gather_parts(node, dst_bytes)
    seconds = gather_forward_seconds(node, dst_bytes, k, link, after[0], gap_s)
    if has_grad:
        seconds += all_gather_time(regather, k, link, after[1], gap_s) if regather else 0.0
        seconds += gradient_scatter_seconds(node, dst_bytes, k, link, latency_share, in_flight)
    return seconds


def gradient_scatter_seconds(node, dst_bytes: int, k: int, link, latency_share: float = 1.0,
                             in_flight: bool = False) -> float:
    """The part of `gather_seconds` that reduce-scatters the gradient (none when it is not partial): the runtime runs
    it in the gradient sync where it defers it (`reduce_scatter_groups`), else in backward; `in_flight`: right after
    another (`collective_time.reduce_scatter_time`).

    >>> from autoshard.cost.profiles import Link
    >>> round(gradient_scatter_seconds(gathers[0], 16384, 2, Link(1e-3, 1e9)) * 1e3, 3)  # the third collective
    1.008
    """
    scatter = gather_parts(node, dst_bytes)[2]
    return reduce_scatter_time(scatter, k, link, latency_share, in_flight) if scatter else 0.0


def gather_forward_seconds(node, dst_bytes: int, k: int, link, after_s: float | None = None,
                           gap_s: float = 0.0) -> float:
    """The forward part of `gather_seconds`: the all-gather of the parameter before its use, `after_s` seconds of
    compute since the rank's last collective.

    >>> from autoshard.cost.profiles import Link
    >>> round(gather_forward_seconds(gathers[0], 16384, 2, Link(1e-3, 1e9)) * 1e3, 3)  # one of the three
    1.008
    """
    return all_gather_time(gather_parts(node, dst_bytes)[0], k, link, after_s, gap_s)


def gather_gaps(graph) -> dict:
    """{`param_all_gather` node: (the compute seconds before its gather since the rank's previous collective, before
    its re-gather in backward since the previous one there)}, from each op's `autoshard.node_cost`: forward runs the
    graph's order, backward the reverse (a re-gather runs right before its consumer's backward); None where no
    collective came before in that pass (the figure calibrate measured after compute applies).

    >>> gaps = gather_gaps(prog.state.gm.graph)
    >>> [None if before is None else before > 0.0 for before, _ in map(gaps.get, gathers)]  # the first follows none
    [None, True, True, True]
    >>> gaps[gathers[-1]][1] is None  # backward re-gathers the last first
    True
    """
    gathers: dict = {}
    for direction, nodes in (("forward", list(graph.nodes)), ("backward", list(reversed(graph.nodes)))):
        since = None
        for node in nodes:
            if node.op != "call_function":
                continue
            if node.meta.get(meta.KIND) == "comm":
                if node.meta[meta.COMM]["op"] == "param_all_gather":
                    gathers.setdefault(node, []).append(since)
                since = 0.0
                continue
            cost = node.meta.get(NODE_COST)
            if since is not None and cost is not None:
                forward = cost.forward_seconds()
                since += forward if direction == "forward" else cost.seconds - forward
    return {node: tuple(gaps) for node, gaps in gathers.items()}


def reduce_scatter_groups(graph, mesh) -> list[list[tuple]]:
    """ZeRO-3's gradient reduce-scatters as the runtime starts them (autoshard/runtime/zero_overlap.py): those of
    parameters used by nothing but their gathers are deferred and started a group at a time, in backward's order
    (taken as the reverse of the gathers': each runs right before its use), a group closed where the layer, axis or
    dtype changes; the gradients splitting evenly over the axis travel as one collective, any other alone. Each
    group: [(`param_all_gather` node, travels with the others: evenly split)]. The others' reduce-scatters (a
    parameter with another use) run at once in backward and are not listed.

    >>> [[(g.args[0].meta["autoshard.path"], even) for g, even in group] for group in reduce_scatter_groups(
    ...     prog.state.gm.graph, prog.mesh)]
    [[('layers.1.bias', True), ('layers.1.weight', True)], [('layers.0.bias', True), ('layers.0.weight', True)]]
    """
    groups, key_now = [], None
    for node in reversed(graph.nodes):
        info = node.meta.get(meta.COMM)
        if node.op != "call_function" or not info or info["op"] != "param_all_gather" or not info["args"][1]:
            continue
        param = node.args[0]
        if param.op != "placeholder" or not all(u.meta.get(meta.COMM, {}).get("op") == "param_all_gather"
                                                for u in param.users):
            continue  # another use: its gradient reaches it through autograd, reduce-scattered on its own
        key = (layer_of(param.meta.get(meta.PATH, "")), info["axis"], param.meta["val"].dtype)
        if key != key_now:
            groups.append([])
            key_now = key
        k, dim = mesh.shape[mesh.axis(info["axis"])], info["args"][0]
        spec = node.meta[meta.SPEC]
        length = node.meta["val"].shape[dim] // math.prod(mesh.shape[a] for a, p in enumerate(spec) if p == Shard(dim))
        groups[-1].append((node, length % k == 0))
    return groups


def reduce_scatter_shares(graph, mesh, groups: list | None = None) -> dict:
    """{`param_all_gather` node: the share of a collective's latencies its gradient's reduce-scatter pays}: the
    evenly split gradients of a group (`reduce_scatter_groups`, or `groups` where the caller has them) travel as one
    collective, each paying its bytes' share of its latencies; any other pays them whole (absent here).

    >>> shares = reduce_scatter_shares(prog.state.gm.graph, prog.mesh)
    >>> sorted(round(share, 3) for share in shares.values())  # each layer's weight and bias share one collective
    [0.008, 0.03, 0.97, 0.992]
    """
    shares = {}
    for group in reduce_scatter_groups(graph, mesh) if groups is None else groups:
        members = [(node, _local_numel(node, node.meta[meta.SPEC], mesh)) for node, even in group if even]
        total = sum(numel for _, numel in members)
        for node, numel in members:
            shares[node] = numel / total if total else 1.0 / len(members)
    return shares


def apply_zero(state, bucket_bytes: float) -> None:
    """Correct predict's figures (made as if without ZeRO) for the ZeroOptimizer's work: the gradient
    sync of replicated parameters (which predict priced as shares of a bucket of `bucket_bytes`,
    `grad_sync_time`) becomes a reduce-scatter of padded chunks (stage >= 2), their chunks
    are all-gathered after the step, and memory follows `memory_breakdown`. Each parameter's own row
    (`autoshard.node_cost`) gets its ZeRO memory; in a pipeline's micro-batch program also its ZeRO sync
    seconds, which the stage table sums per stage (cut_stages) and the pipeline's step runs after the last
    micro-batch. A flat program's rows keep the all-reduce's seconds: its overlap model hides them under
    backward, while the chunks' all-gather after the step is exposed (in `step_time_s` only).

    >>> plain = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
    ...                               hints={"input:0": {"dp": "S(0)"}})
    >>> prog.plan.predicted.memory_bytes_per_rank < plain.plan.predicted.memory_bytes_per_rank
    True
    """
    zero = state.zero
    if zero is None:
        return
    mesh, profile, predicted = state.mesh, state.options.profile, state.predicted
    profile = profile or DEFAULT_PROFILE
    axis = mesh.axis(zero.axis)
    k, link = mesh.shape[axis], profile.link(mesh.shape, axis)
    f = state.options.optimizer_state_factor
    sent = predicted.comm_bytes_per_step[zero.axis]
    seconds = 0.0
    memory = 0
    pipelined = state.options.pipeline is not None
    for node, spec, numel, itemsize, kept in _trained_param_shards(state):
        memory -= int(kept * (2 + f))
        if zero.stage == 3 and isinstance(spec[axis], Shard):
            memory += int(kept * (2 + f))
            continue
        padded = math.ceil(numel / k) * k * itemsize
        held = int(sum(param_memory(kept, numel, itemsize, zero.stage, k, f, False).values()))
        memory += held
        sent.sync += padded  # the all-gather of the updated chunks
        extra = all_gather_time(padded, k, link)
        if zero.stage >= 2 and zero.axis in state.grad_reduce.get(node.meta[meta.PATH], ()):
            sent.sync += padded - kept  # a reduce-scatter of the padded gradient, not an all-reduce
            extra += reduce_scatter_time(padded, k, link) - grad_sync_time(kept, k, link, bucket_bytes)
        seconds += extra
        cost = node.meta.get(NODE_COST)
        if cost is not None:
            node.meta[NODE_COST] = replace(cost, memory_bytes=held, sync_s=cost.sync_s + (extra if pipelined else 0.0))
    memory += memory_breakdown(state)["gathered"]
    predicted.memory_bytes_per_rank = max(0, predicted.memory_bytes_per_rank + memory)
    predicted.add_comm(seconds)
