"""predict: the plan's predicted step time, communication per mesh axis and memory per rank.

Reads the graph after insert_comm (collective nodes, specs, `autoshard.choice`) and `state.grad_reduce`.
Writes a CommCost (fwd_bytes, bwd_bytes, seconds) on each collective node, a NodeCost on every node with a
spec, and `state.predicted`, a Prediction (autoshard/cost/prediction.py): step_time_s, compute_s, comm_s,
comm_bytes_per_step {axis: AxisBytes(fwd, bwd, sync)}, memory_bytes_per_rank, memory (its parts,
`memory_parts`), overlapped_step_s, and recompute_s under recomputation. Bytes use the runtime's counting
convention (all_gather: gathered output; others: the rank's input), so `verify --json` can compare them.
`step_time_s` assumes communication does not overlap compute (an upper bound; the searches compare it);
`overlapped_step_s` is the step as the runtime overlaps it by default (gradient buckets during backward,
ZeRO-3's gathers prefetched and reduce-scatters started in backward): autoshard/cost/overlap.py.

The examples use Megatron's MLP on a 2-way tensor-parallel axis:

>>> import autoshard
>>> from autoshard.passes.pass_lists import state_before
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> hints = {"layers.0.weight": {"tp": "S(0)"}, "layers.0.bias": {"tp": "S(0)"}, "layers.1.weight": {"tp": "S(1)"},
...          "layers.1.bias": {"tp": "R"}}
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("tp",), hints=hints)
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from autoshard.cost.attention_cost import attention_terms
from autoshard.cost.axis_cost import compute_parts, data_parallel_bucket_bytes, held_bytes_factor, needs_grad
from autoshard.cost.collective_time import (
    collective_time,
    grad_sync_time,
)
from autoshard.cost.flops import local_bytes
from autoshard.cost.overlap import hidden_seconds
from autoshard.cost.prediction import (
    AxisBytes,
    CommCost,
    MemoryParts,
    NodeCost,
    Prediction,
)
from autoshard.cost.recompute_cost import account_recompute
from autoshard.cost.saved_tensors import kept_for_backward
from autoshard.cost.sync_buckets import bucket_correction
from autoshard.cost.zero_cost import (
    apply_zero,
    gather_bytes,
    gather_forward_seconds,
    gather_gaps,
    gather_seconds,
    gradient_scatter_seconds,
    memory_breakdown,
    reduce_scatter_groups,
    reduce_scatter_shares,
)
from autoshard.ir import meta
from autoshard.ir.collective_table import direction_bytes
from autoshard.ir.meta import COMM_COST, NODE_COST
from autoshard.passes.contract import compiler_pass
from autoshard.strategies import tensor_inputs

aten = torch.ops.aten


def collective_bytes(node, mesh, has_grad: bool = True) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends into a collective node, runtime convention; a value
    without a gradient has no backward.

    >>> comm = next(n for n in prog.state.gm.graph.nodes if n.meta.get("autoshard.kind") == "comm")
    >>> comm.meta["autoshard.comm"]["op"], collective_bytes(comm, prog.mesh)
    ('all_reduce', (1024, 0))
    """
    op = node.meta[meta.COMM]["op"]
    src = local_bytes(node, node.args[0].meta[meta.SPEC], mesh)
    dst = local_bytes(node, node.meta[meta.SPEC], mesh)
    if op == "param_all_gather":
        fwd, bwd = gather_bytes(node, dst)
        return fwd, bwd if has_grad else 0
    return direction_bytes(op, src, dst, has_grad)


@compiler_pass("predict", reads=(meta.SPEC, meta.CHOICE, meta.COMM, "state.grad_reduce"),
               writes=(meta.NODE_COST, meta.COMM_COST, "state.predicted"))
def predict(state) -> None:
    """The pass: write `state.predicted` and each node's `autoshard.node_cost` (collectives also
    `autoshard.comm_cost`), per step and rank.

    >>> state = state_before("predict", model, (2,), inputs, loss_fn=loss_fn, axis_names=("tp",), hints=hints)
    >>> predict(state)
    >>> list(state.predicted), state.predicted.comm_bytes_per_step["tp"]
    (['step_time_s', 'compute_s', 'comm_s', 'comm_bytes_per_step', 'memory_bytes_per_rank', 'memory', 'overlapped_step_s'], AxisBytes(fwd=1024, bwd=0, sync=0))
    """
    mesh = state.mesh
    profile = state.options.profile
    opt_factor = state.options.optimizer_state_factor
    grad = needs_grad(state.gm.graph)
    bucket = data_parallel_bucket_bytes(grad)  # a parameter's sync: its share of such a bucket, as the ILP's
    saved_per_byte = kept_for_backward(state.gm.graph, grad)  # the ILP's memory row's formula
    per_axis = {name: AxisBytes() for name in mesh.names}
    # The reduce-scatters a flat program's runtime defers to the gradient sync (the accuracy report's phases): one
    # group after another there, each after the first started right after the one before (`in_flight`).
    groups = reduce_scatter_groups(state.gm.graph, mesh) if state.zero is not None else []
    scatter_shares = reduce_scatter_shares(state.gm.graph, mesh, groups)
    deferred = {g for group in groups for g, _ in group}
    in_flight = {g for group in groups[1:] for g, _ in group} if state.options.pipeline is None else set()
    compute = comm = memory = 0.0
    gathers = []  # ZeRO-3's parameter gathers: (node, fwd bytes, bwd bytes, k, link, bytes saved)
    for node in state.gm.graph.nodes:
        spec = node.meta.get(meta.SPEC)
        if spec is None:
            continue
        if node.meta.get(meta.KIND) == "comm":
            info = node.meta[meta.COMM]
            axis = mesh.axis(info["axis"])
            fwd, bwd = collective_bytes(node, mesh, grad.get(node, False))
            k, link = mesh.shape[axis], profile.link(mesh.shape, axis)
            per_axis[info["axis"]].fwd += fwd
            per_axis[info["axis"]].bwd += bwd
            saved = int(local_bytes(node, node.meta[meta.SPEC], mesh) * saved_per_byte.get(node, 0.0))
            memory += saved  # a copy an op saves for backward (a gathered parameter or activation)
            if info["op"] == "param_all_gather":  # priced below, once the compute before each is known
                gathers.append((node, fwd, bwd, k, link, saved))
                continue
            seconds = collective_time(info["op"], fwd, bwd, k, link)
            node.meta[COMM_COST] = CommCost(fwd, bwd, seconds)
            comm += seconds
            node.meta[NODE_COST] = NodeCost(seconds, saved, forward_s=collective_time(info["op"], fwd, 0, k, link))
            continue
        kept = local_bytes(node, spec, mesh)
        if node.op == "placeholder":
            held = kept * held_bytes_factor(node, grad, opt_factor)
            memory += held
            sync = 0.0
            for axis_name in state.grad_reduce.get(node.meta.get(meta.PATH), ()):
                axis = mesh.axis(axis_name)
                per_axis[axis_name].sync += kept
                sync += grad_sync_time(kept, mesh.shape[axis], profile.link(mesh.shape, axis), bucket)
            comm += sync
            node.meta[NODE_COST] = NodeCost(0.0, held, sync)
            continue
        choice = node.meta.get(meta.CHOICE, [])
        split = math.prod(mesh.shape[a] for a, c in enumerate(choice) if c.divides_compute)
        forward, backward = compute_parts(node, split, profile, bool(grad.get(node)))
        seconds = forward + backward
        saved = int(kept * saved_per_byte.get(node, 0.0))
        if node.target is aten.scaled_dot_product_attention.default and choice:
            in_bytes = [local_bytes(p, s, mesh) for p, s in zip(tensor_inputs(node), node.meta[meta.IN_SPECS])]
            terms = attention_terms(node, dict(enumerate(choice)), mesh, profile, seconds, in_bytes, kept,
                                    bool(grad.get(node)))
            seconds, saved = terms.compute_s, saved + int(terms.memory_bytes)
            if terms.ring is not None:  # the ring's messages: its axis's bytes, exposed time in the node's
                name = mesh.names[terms.ring_axis]
                per_axis[name].fwd += terms.ring.fwd_bytes
                per_axis[name].bwd += terms.ring.bwd_bytes
                comm += terms.comm_s
            compute += terms.compute_s
            seconds += terms.comm_s
            forward = None  # attention's own split (its ring's messages in both directions)
        else:
            compute += seconds
        memory += saved
        node.meta[NODE_COST] = NodeCost(seconds, saved, forward_s=forward)
    gaps = gather_gaps(state.gm.graph) if gathers else {}
    for node, fwd, bwd, k, link, saved in gathers:  # a layer's reduce-scatters travel as one
        seconds = gather_seconds(node, fwd, k, link, scatter_shares.get(node, 1.0), grad.get(node, False),
                                 gaps[node], profile.collective_gap_s, node in in_flight)
        in_sync = gradient_scatter_seconds(node, fwd, k, link, scatter_shares.get(node, 1.0), node in in_flight) \
            if node in deferred and grad.get(node, False) else 0.0
        node.meta[COMM_COST] = CommCost(fwd, bwd, seconds, sync_s=in_sync)
        comm += seconds
        forward = gather_forward_seconds(node, fwd, k, link, gaps[node][0], profile.collective_gap_s)
        node.meta[NODE_COST] = NodeCost(seconds, saved, forward_s=forward)
    state.predicted = Prediction(step_time_s=compute + comm, compute_s=compute, comm_s=comm,
                                 comm_bytes_per_step=per_axis, memory_bytes_per_rank=int(memory))
    apply_zero(state, bucket)  # ZeRO: the optimizer's reduce-scatter/all-gather and the sharded memory
    if state.options.pipeline is None:  # a pipeline's stages bucket their own gradients (cut_stages adds theirs)
        for node, seconds in bucket_correction(state, bucket_bytes=bucket).items():  # each bucket as the runtime pays it
            node.meta[NODE_COST] = replace(node.meta[NODE_COST], sync_s=node.meta[NODE_COST].sync_s + seconds)
            state.predicted.add_comm(seconds)
    settle_prediction(state)


def settle_prediction(state) -> None:
    """What of `state.predicted` follows from the rest and the recompute regions: the recomputation's time and the
    activations it does not keep (none before the recompute pass, which runs after predict and settles the
    prediction again for the regions it chose), the memory's parts and the overlapped step.

    >>> predicted = prog.state.predicted  # no recompute regions
    >>> predicted.recompute_s is None and predicted.memory.total() == predicted.memory_bytes_per_rank
    True
    """
    account_recompute(state)  # activation checkpointing: recompute time, activations not kept
    state.predicted.memory = memory_parts(state)
    state.predicted.overlapped_step_s = state.predicted.step_time_s - hidden_seconds(state)


def memory_parts(state) -> MemoryParts:
    """What `state.predicted.memory_bytes_per_rank` is made of: parameters, gradients, optimizer state,
    ZeRO-3's gathered copies, inputs, activations (saved for backward, after recomputation); they sum to
    the total. (The budget is an option, not part of the plan: the same plan serves any budget it fits.)

    >>> parts = prog.plan.predicted.memory
    >>> parts.total() == prog.plan.predicted.memory_bytes_per_rank, sum(parts.values()) == parts.total()
    (True, True)
    """
    parts = MemoryParts(**memory_breakdown(state))  # the trained parameters, ZeRO or not
    grad = needs_grad(state.gm.graph)
    for node in state.gm.graph.nodes:
        if node.op != "placeholder" or meta.SPEC not in node.meta:
            continue
        kept = local_bytes(node, node.meta[meta.SPEC], state.mesh)
        if node.meta.get(meta.KIND) == "input":
            parts.inputs += kept
        elif not grad.get(node):
            parts.params += kept  # frozen parameters and buffers: no gradient, no optimizer state
    parts.activations = max(0, state.predicted.memory_bytes_per_rank - parts.total())
    return parts
