"""The step's peak memory per rank, phase by phase: what the footprint (`plan.predicted.memory`, every term held at
once) leaves out and what it over-counts.

The footprint is what the planner budgets; a rank's allocator peaks elsewhere. Walking one training step:

- forward's end: the activations autograd saved (and ZeRO-3's gathered copies);
- backward, node by node in reverse: each op frees what it saved once its backward ran, and each parameter's
  gradient appears at its last use in forward; so activations and gradients are rarely all alive at once;
- the gradient sync: the runtime's buckets (autoshard/runtime/grad_sync.py, the same layout) are flattened copies
  of the gradients. With `overlap` (from the second step on) a bucket starts when backward completes its
  gradients and stays in flight until `sync_grads`. Gloo's exact reduction (`exact=True`) all-gathers every
  rank's bucket (k copies) and sums them in a fixed order into one new tensor (one more bucket size,
  `communicator._ordered_sum`); NCCL's all-reduce (`exact=False`) reduces the flat bucket in place;
- the optimizer: torch.optim.Adam's temporaries (the single-tensor path torch takes on a CPU: the square root
  and the quotient of one parameter; the foreach path on GPUs: the square roots of all parameters at once);
  SGD's updates are in place;
- recomputation (autoshard/cost/recompute_cost.py): forward's end keeps only what the regions do not drop; a
  region's dropped activations are alive again from its recomputation, when backward reaches its last op;
- ZeRO-1/2 (autoshard/runtime/zero.py): ZeRO-2 reduce-scatters the gradients of replicated parameters in buckets
  laid out and started like the all-reduce's (the exact path gathers every rank's rows too), then keeps this
  rank's chunk; the optimizer steps the master chunks (Adam's temporaries are a chunk's), then all-gathers the
  updated parameters bucket by bucket: this rank's chunks, every rank's (k parts) and their concatenation;
- ZeRO-3 (autoshard/runtime/zero_gather.py, zero_overlap.py): forward's end keeps no gathered copy (each is saved
  as its shard); backward re-gathers a saved parameter at its last use and frees the copy at its gather's backward,
  where its full gradient (in the master's dtype) appears. A layer's gradients wait for the layer's end and then
  travel as one reduce-scatter (`cost/zero_cost.reduce_scatter_groups`): their rows (a copy of the gradients)
  and, on the exact path, every rank's rows gathered; with `overlap` a group starts when backward leaves its
  layer and the oldest beyond REDUCE_SCATTERS_IN_FLIGHT is waited for, its sum made (one group size more) and
  only this rank's shard kept; without, every group waits with its full gradients until `sync_grads` starts
  them. The optimizer steps the shards (sharded parameters are their own masters). A parameter with another use
  than its gathers is reduce-scattered at once in backward, alone;
- a pipeline (each pp rank; by default the peak is the fullest's): its schedule holds the rank's gradients and its
  micro-batches' activations in flight (`cost/pipeline_schedule.rank_memory`, both counted whole: a bound), then
  the optimizer its gradients and Adam's temporaries over the rank's parameters.

The peak is the state held through the step (parameters, optimizer state and ZeRO's masters, inputs) plus the
most of these at once. Not modelled (`predicted_peak` returns None and says why): a pipeline whose stages also
sync gradients (their buckets). Approximated: ZeRO-3's prefetched gathers (the coalesced buffers of the next
layer's shards, small beside its reduce-scatters' buffers) are not counted.

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}})
>>> peak = predicted_peak(prog, exact=True)
>>> peak["phase"], peak["bytes"] > prog.plan.predicted.memory_bytes_per_rank  # gloo's gathered buckets
('gradient sync', True)
"""
from __future__ import annotations

import math

from autoshard.cost.axis_cost import needs_grad
from autoshard.cost.flops import local_bytes
from autoshard.cost.pipeline_schedule import rank_memory, rank_nodes, stage_nodes
from autoshard.cost.recompute_cost import region_savings
from autoshard.cost.sync_buckets import bucket_layout
from autoshard.cost.zero_cost import gather_parts, reduce_scatter_groups
from autoshard.ir import meta
from autoshard.ir.placement import Shard
from autoshard.runtime.grad_sync import SizedTensor, buckets
from autoshard.runtime.zero import master_dtype
from autoshard.runtime.zero_overlap import REDUCE_SCATTERS_IN_FLIGHT

ADAM_STATE_FACTOR = 2  # optimizer_state_factor of Adam (two moments): the optimizer with temporaries


def predicted_peak(prog, exact: bool, overlap: bool = True, foreach: bool = False,
                   pp_rank: int | None = None) -> dict | None:
    """{"bytes": the predicted peak per rank, "phase": where it is, "phases": {phase: bytes}} of one training step
    of `prog` (see the module docstring); `exact`: gloo's exact reductions (the runtime's default on gloo),
    `overlap`: buckets started in backward, `foreach`: Adam's foreach path; of a pipeline, pp rank `pp_rank`'s
    (None: the fullest pp rank's). None for what is not modelled.

    >>> predicted_peak(prog, exact=False)["phases"]["gradient sync"] < peak["phases"]["gradient sync"]
    True
    """
    state = prog.state
    if not_modelled(prog) is not None:
        return None
    if getattr(prog.plan, "pipeline", None):
        return _pipeline_peak(state, prog.config, foreach, pp_rank)
    if state.zero is not None and state.zero.stage == 3:
        return _zero3_peak(state, exact, overlap, foreach)
    parts = state.predicted.memory
    held = parts.params + parts.optimizer + parts.inputs
    graph = state.gm.graph
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    grad = needs_grad(graph)
    trained = [n for n in nodes if n.op == "placeholder" and n.meta.get(meta.KIND) == "param" and grad.get(n)]
    size = {p: local_bytes(p, p.meta[meta.SPEC], state.mesh) for p in trained}
    uses = {p: [order[u] for u in p.users] or [len(nodes)] for p in trained}
    appears = {}  # reverse walk position -> gradients allocated there (a parameter's last use in forward)
    for p in trained:
        appears.setdefault(max(uses[p]), []).append(p)
    layout = _bucket_layout(state) + _scatter_layout(state, trained, size)
    complete = {}  # position -> buckets whose gradients are all complete there (the earliest first use in forward)
    for bucket in layout:
        complete.setdefault(min(min(uses[p]) for p in bucket["params"]), []).append(bucket)
    gradients = sum(size.values())
    recomputed, largest = _recomputed(state, order)  # last op's position -> bytes alive again from there
    activations = parts.activations - largest + parts.gathered
    phases = {"forward's end": activations}
    alive, most = activations, activations
    in_flight = []
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        alive += sum(size[p] for p in appears.get(i, ())) + recomputed.get(i, 0)
        most = max(most, alive)
        if overlap:
            for bucket in complete.get(i, ()):
                alive += _started_bytes(bucket, exact)
                in_flight.append(bucket)
                most = max(most, alive)
        if node.op == "call_function" and meta.NODE_COST in node.meta:
            alive -= node.meta[meta.NODE_COST].memory_bytes
    phases["backward"] = most
    phases["gradient sync"] = _sync_peak(layout, gradients + sum(_started_bytes(b, exact) for b in in_flight),
                                         exact, overlap)
    synced = gradients - sum(b["bytes"] - b["kept"] for b in layout if b["scatter"])  # ZeRO-2 keeps its chunks
    phases["optimizer"] = synced + _optimizer_peak(state, trained, size, foreach)
    return _peak_of(held, phases)


def _peak_of(held: int, phases: dict) -> dict:
    phase = max(phases, key=phases.get)
    return {"bytes": int(held + phases[phase]), "phase": phase, "phases": {k: int(held + v) for k, v in phases.items()}}


def not_modelled(prog) -> str | None:
    """Why `predicted_peak` has no figure for `prog`, or None when it has one.

    >>> not_modelled(prog) is None
    True
    """
    state = prog.state
    if getattr(prog.plan, "pipeline", None) and any(state.grad_reduce.values()):
        return "a pipeline's stage gradient sync (its buckets beside the micro-batches in flight) is not modelled"
    return None


def _zero3_peak(state, exact: bool, overlap: bool, foreach: bool) -> dict:
    """The ZeRO-3 step's peak (see the module docstring): backward walked node by node in reverse with its
    re-gathered copies and the reduce-scatter groups' buffers, then `sync_grads`, then the optimizer."""
    parts, mesh = state.predicted.memory, state.mesh
    held = parts.params + parts.optimizer + parts.inputs
    graph = state.gm.graph
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    groups = reduce_scatter_groups(graph, mesh)
    group_of = {node: g for g, members in enumerate(groups) for node, _ in members}
    gathers = [n for n in nodes if n.meta.get(meta.COMM, {}).get("op") == "param_all_gather"]
    copy = {g: local_bytes(g, g.meta[meta.SPEC], mesh) for g in gathers}  # one gathered parameter
    parts_of = {g: gather_parts(g, copy[g]) for g in gathers}  # (gathered, re-gathered, reduce-scattered) bytes
    saved = {g for g in gathers if parts_of[g][1]}
    grad_bytes = {g: parts_of[g][2] for g in gathers if parts_of[g][2]}  # its full gradient, in the master's dtype
    appears = {}  # reverse walk position -> bytes allocated there: re-gathered copies, other parameters' gradients
    for g in saved:
        position = max(order[u] for u in g.users)
        appears[position] = appears.get(position, 0) + copy[g]
    grad = needs_grad(graph)
    trained = [n for n in nodes if n.op == "placeholder" and n.meta.get(meta.KIND) == "param" and grad.get(n)]
    for p in trained:  # a parameter no gather serves: its gradient appears at its last use, as without ZeRO
        if not any(u in copy for u in p.users) and p.users:
            position = max(order[u] for u in p.users)
            appears[position] = appears.get(position, 0) + local_bytes(p, p.meta[meta.SPEC], mesh)
    recomputed, largest = _recomputed(state, order)
    walk = _ScatterWalk(mesh.shape[mesh.axis(state.zero.axis)], exact, overlap)
    alive = parts.activations - largest
    phases = {"forward's end": alive + parts.gathered}
    current = None  # the group backward is in
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        alive += appears.get(i, 0) + recomputed.get(i, 0)
        walk.see(alive)
        if node in grad_bytes and node in group_of:
            if group_of[node] != current:
                walk.start(alive)  # backward left the last group's layer
                current = group_of[node]
            walk.wait(grad_bytes[node])
        elif node in grad_bytes:  # reduce-scattered at once, alone
            walk.alone(alive, grad_bytes[node])
        if node in saved:
            alive -= copy[node]  # every consumer's backward has run: the re-gathered copy goes
        elif node.op == "call_function" and node not in copy and meta.NODE_COST in node.meta:
            alive -= node.meta[meta.NODE_COST].memory_bytes
        walk.see(alive)
    walk.start(alive)  # the end of backward closes the last group
    phases["backward"] = walk.most
    phases["gradient sync"] = walk.finish()
    stepped = {p: local_bytes(p, p.meta[meta.SPEC], mesh) for p in trained}
    phases["optimizer"] = parts.grads + _adam_temporaries(state, stepped, foreach)
    return _peak_of(held, phases)


class _ScatterWalk:
    """ZeRO-3's gradient reduce-scatter buffers through backward and `sync_grads` (see the module docstring):
    `most` is the most bytes alive at once, the walk's other memory (`alive`) included where it is given."""

    def __init__(self, k: int, exact: bool, overlap: bool):
        self.k, self.exact, self.overlap = k, exact, overlap
        self.waiting = 0  # the full gradients of the group backward is in
        self.pending: list = []  # groups closed, not started (without overlap): their full gradients
        self.in_flight: list = []  # groups started, not waited for
        self.shards = 0  # this rank's shards kept
        self.alive = 0  # alive outside the walk, as last seen
        self.most = 0

    def _buffers(self, nbytes: int) -> int:
        """A started group's buffers: its rows and, exact, every rank's rows (gloo); else the output shard."""
        return nbytes * (1 + self.k) if self.exact else nbytes + nbytes // self.k

    def held(self) -> int:
        """Bytes the walk holds now: waiting and pending gradients, started groups' buffers, the shards kept."""
        return (self.waiting + sum(self.pending) + sum(self._buffers(g) for g in self.in_flight) + self.shards)

    def see(self, alive: int, extra: int = 0) -> None:
        self.alive = alive
        self.most = max(self.most, alive + self.held() + extra)

    def wait(self, nbytes: int) -> None:
        self.waiting += nbytes
        self.see(self.alive)

    def alone(self, alive: int, nbytes: int) -> None:
        """A gradient reduce-scattered at once: its buffers and its sum, then its shard."""
        self.see(alive, nbytes + self._buffers(nbytes) + self._sum(nbytes))
        self.shards += nbytes // self.k

    def _sum(self, nbytes: int) -> int:
        return nbytes if self.exact else 0  # the exact path's ordered sum: one new tensor

    def start(self, alive: int) -> None:
        """Close the waiting group: started now with overlap (the rows copied while the gradients live), else kept."""
        group, self.waiting = self.waiting, 0
        if not group:
            return
        if not self.overlap:
            self.pending.append(group)
            return
        self.see(alive, group + self._buffers(group))
        self.in_flight.append(group)
        while len(self.in_flight) > REDUCE_SCATTERS_IN_FLIGHT:
            self._settle(alive)

    def _settle(self, alive: int, extra: int = 0) -> None:
        """Wait for the oldest group in flight: its sum made, then only this rank's shard kept (`extra`: other
        bytes alive meanwhile)."""
        group = self.in_flight.pop(0)
        self.see(alive, extra + self._buffers(group) + self._sum(group))
        self.shards += group // self.k
        self.see(alive, extra)

    def finish(self) -> int:
        """`sync_grads`: the pending groups started in order (every one's full gradients alive until all are
        started), then the groups still in flight waited for; the most alive meanwhile (backward's activations
        gone)."""
        self.most = 0
        self.see(0)
        pending, total = self.pending, sum(self.pending)
        self.pending = []
        for group in pending:
            self.see(0, total + self._buffers(group))
            self.in_flight.append(group)
            while len(self.in_flight) > REDUCE_SCATTERS_IN_FLIGHT:
                self._settle(0, total)
        while self.in_flight:
            self._settle(0)
        return self.most


def _bucket_layout(state) -> list[dict]:
    """The runtime's gradient buckets (cost/sync_buckets.bucket_layout), each {"params", "bytes", "k": ranks of its
    first axis}."""
    mesh = state.mesh
    return [{"params": [g.node for g in bucket], "bytes": sum(g.nbytes for g in bucket),
             "k": mesh.shape[mesh.axis(axes[0])], "scatter": False} for axes, bucket in bucket_layout(state)]


def _pipeline_peak(state, config, foreach: bool, pp_rank: int | None) -> dict:
    """pp rank `pp_rank`'s peak, or the fullest pp rank's (see the module docstring)."""
    grad = needs_grad(state.gm.graph)
    per_stage = stage_nodes(state, config.num_stages)
    peaks = []
    for nodes, parts in zip(rank_nodes(config, per_stage), rank_memory(state, config)):
        trained = [n for n in nodes if n.op == "placeholder" and n.meta.get(meta.KIND) == "param" and grad.get(n)]
        size = {p: local_bytes(p, p.meta[meta.SPEC], state.mesh) for p in trained}
        held = parts["params"] + parts["optimizer"] + parts["inputs"]
        phases = {"schedule": parts["grads"] + parts["activations"],
                  "optimizer": parts["grads"] + _adam_temporaries(state, size, foreach)}
        phase = max(phases, key=phases.get)
        peaks.append({"bytes": int(held + phases[phase]), "phase": phase,
                      "phases": {k: int(held + v) for k, v in phases.items()}})
    return max(peaks, key=lambda peak: peak["bytes"]) if pp_rank is None else peaks[pp_rank]


def _adam_temporaries(state, stepped: dict, foreach: bool) -> int:
    """Adam's temporaries over the tensors it steps (bytes each; see the module docstring); none for SGD."""
    if state.options.optimizer_state_factor != ADAM_STATE_FACTOR or not stepped:
        return 0
    return sum(stepped.values()) if foreach else 2 * max(stepped.values())


def _zero_axis(state) -> tuple[int, int] | None:
    """(index, size) of the ZeRO axis, or None without ZeRO."""
    zero = state.zero
    if zero is None:
        return None
    axis = state.mesh.axis(zero.axis)
    return axis, state.mesh.shape[axis]


def _flat(p, zero_axis: int) -> bool:
    """A parameter ZeRO flattens and cuts in chunks (replicated on the ZeRO axis), not one it stores sharded."""
    return not isinstance(p.meta[meta.SPEC][zero_axis], Shard)


def _chunk_bytes(p, size: dict, k: int) -> int:
    """One rank's chunk of a flattened parameter: its local bytes padded to a multiple of k, over k."""
    element = p.meta["val"].element_size()
    return math.ceil(size[p] // element / k) * element


def _scatter_layout(state, trained: list, size: dict) -> list[dict]:
    """ZeRO-2's reduce-scatter buckets (`ZeroOptimizer.scatter_buckets`: the replicated parameters whose gradient is
    partial on the ZeRO axis, last first): each bucket's padded rows ("bytes") and the chunks this rank keeps."""
    found = _zero_axis(state)
    if found is None or state.zero.stage != 2:
        return []
    axis, k = found
    name = state.zero.axis
    reduced = [p for p in trained if _flat(p, axis) and name in state.grad_reduce.get(p.meta.get(meta.PATH), ())]
    rows = {p: k * _chunk_bytes(p, size, k) for p in reduced}
    return [{"params": bucket, "bytes": sum(rows[p] for p in bucket), "k": k, "scatter": True,
             "kept": sum(rows[p] for p in bucket) // k}
            for bucket in buckets(reversed(reduced), lambda p: SizedTensor(rows[p], p.meta["val"].dtype))]


def _recomputed(state, order: dict) -> tuple[dict, int]:
    """({position of a recomputed region's last op: the activations its recomputation makes alive again}, the
    largest of them: what `plan.predicted` adds to the activations kept at forward's end)."""
    regions: dict = {}
    for node in state.gm.graph.nodes:
        if meta.RECOMPUTE in node.meta:
            regions.setdefault(node.meta[meta.RECOMPUTE], []).append(node)
    again = {}
    for members in regions.values():
        last = max(order[m] for m in members)
        again[last] = again.get(last, 0) + int(region_savings(state, members)[0])
    return again, max(again.values(), default=0)


def _started_bytes(bucket: dict, exact: bool) -> int:
    """A started bucket's buffers: its flat copy, and on the exact path every rank's copy gathered."""
    return bucket["bytes"] * (1 + bucket["k"]) if exact else bucket["bytes"]


def _sync_peak(layout: list, alive: int, exact: bool, overlap: bool) -> int:
    """The most bytes alive while `sync_grads` reduces the buckets in order (`alive`: gradients and the buckets in
    flight when it begins). Exact: a bucket's sum holds one more bucket size; once written, its gradients are
    views of the sum and its flat copy and gathered parts are freed."""
    most = alive
    for bucket in layout:
        started = 0 if overlap else _started_bytes(bucket, exact)
        most = max(most, alive + started + (bucket["bytes"] if exact else 0))
        if overlap:
            alive -= _started_bytes(bucket, exact)
        if bucket["scatter"]:  # the full gradients go, this rank's chunks stay
            alive -= bucket["bytes"] - bucket["kept"]
    return most


def _optimizer_peak(state, trained: list, size: dict, foreach: bool) -> int:
    """The optimizer's most at once beyond the gradients: Adam's temporaries (see the module docstring; none for
    SGD) over the tensors it steps, then under ZeRO the all-gathers of the updated parameters."""
    found = _zero_axis(state)
    if found is None:
        return _adam_temporaries(state, size, foreach)
    axis, k = found
    # ZeRO steps float32 masters of low-precision parameters: chunks of the flattened ones, the sharded ones whole
    widen = {p: master_dtype(p.meta["val"].dtype).itemsize // p.meta["val"].element_size() for p in trained}
    stepped = {p: widen[p] * (_chunk_bytes(p, size, k) if _flat(p, axis) else size[p]) for p in trained}
    temporaries = _adam_temporaries(state, stepped, foreach)
    # `ZeroOptimizer.step`: per bucket of flattened parameters, this rank's chunks (one copy), all k ranks' and
    # their concatenation
    flat = [p for p in trained if _flat(p, axis)]
    gathers = [sum(stepped[p] // widen[p] for p in bucket) * (1 + 2 * k)
               for bucket in buckets(flat, lambda p: SizedTensor(size[p], p.meta["val"].dtype))]
    return max(temporaries, max(gathers, default=0))
