"""The step's peak memory per rank, phase by phase: what the footprint (`plan.predicted.memory`, every term held at
once) leaves out and what it over-counts.

The footprint is what the planner budgets; a rank's allocator peaks elsewhere. Walking one training step:

- forward's end: the activations autograd saved (and ZeRO-3's gathered copies);
- backward, node by node in reverse: each op frees what it saved once its backward ran, and each parameter's
  gradient appears at its last use in forward; so activations and gradients are rarely all alive at once;
- the gradient sync: the runtime's buckets (autoshard/runtime/grad_sync.py, the same layout) are flattened copies
  of the gradients. With `overlap` (from the second step on) a bucket starts when backward completes its
  gradients and stays in flight until `sync_grads`. Gloo's exact reduction (`exact=True`) all-gathers every
  rank's bucket (k copies) and sums them in a fixed order (a clone, then one addition at a time: two more bucket
  sizes at once); NCCL's all-reduce (`exact=False`) reduces the flat bucket in place;
- the optimizer: torch.optim.Adam's temporaries (the single-tensor path torch takes on a CPU: the square root
  and the quotient of one parameter; the foreach path on GPUs: the square roots of all parameters at once);
  SGD's updates are in place.

The peak is the state held through the step (parameters, optimizer state, inputs) plus the most of these at
once. Not modelled (`predicted_peak` returns None and says why): ZeRO (its reduce-scatter buckets and master
copies), pipelines (the runtime counts a pp rank's in-flight micro-batches itself), recomputation.

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

from autoshard.cost.axis_cost import needs_grad
from autoshard.cost.flops import local_bytes
from autoshard.cost.sync_buckets import bucket_layout
from autoshard.ir import meta

ADAM_STATE_FACTOR = 2  # optimizer_state_factor of Adam (two moments): the optimizer with temporaries


def predicted_peak(prog, exact: bool, overlap: bool = True, foreach: bool = False) -> dict | None:
    """{"bytes": the predicted peak per rank, "phase": where it is, "phases": {phase: bytes}} of one training step
    of `prog` (see the module docstring); `exact`: gloo's exact reductions (the runtime's default on gloo),
    `overlap`: buckets started in backward, `foreach`: Adam's foreach path. None for what is not modelled.

    >>> predicted_peak(prog, exact=False)["phases"]["gradient sync"] < peak["phases"]["gradient sync"]
    True
    """
    state = prog.state
    if not_modelled(prog) is not None:
        return None
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
    layout = _bucket_layout(state)
    complete = {}  # position -> buckets whose gradients are all complete there (the earliest first use in forward)
    for bucket in layout:
        complete.setdefault(min(min(uses[p]) for p in bucket["params"]), []).append(bucket)
    gradients = sum(size.values())
    activations = parts.activations + parts.gathered
    phases = {"forward's end": activations}
    alive, most = activations, activations
    in_flight = []
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        alive += sum(size[p] for p in appears.get(i, ()))
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
    phases["optimizer"] = gradients + _optimizer_temporaries(state, size, foreach)
    phase = max(phases, key=phases.get)
    return {"bytes": int(held + phases[phase]), "phase": phase, "phases": {k: int(held + v) for k, v in phases.items()}}


def not_modelled(prog) -> str | None:
    """Why `predicted_peak` has no figure for `prog`, or None when it has one.

    >>> not_modelled(prog) is None
    True
    """
    state = prog.state
    if getattr(prog.plan, "pipeline", None):
        return "a pipeline's peak (its micro-batches in flight) is counted by the runtime, not modelled here"
    if state.zero is not None:
        return "ZeRO's buckets and master copies are not modelled"
    if any(meta.RECOMPUTE in n.meta for n in state.gm.graph.nodes):
        return "recomputation's regions live again in backward: not modelled"
    return None


def _bucket_layout(state) -> list[dict]:
    """The runtime's gradient buckets (cost/sync_buckets.bucket_layout), each {"params", "bytes", "k": ranks of its
    first axis}."""
    mesh = state.mesh
    return [{"params": [g.node for g in bucket], "bytes": sum(g.nbytes for g in bucket),
             "k": mesh.shape[mesh.axis(axes[0])]} for axes, bucket in bucket_layout(state)]


def _started_bytes(bucket: dict, exact: bool) -> int:
    """A started bucket's buffers: its flat copy, and on the exact path every rank's copy gathered."""
    return bucket["bytes"] * (1 + bucket["k"]) if exact else bucket["bytes"]


def _sync_peak(layout: list, alive: int, exact: bool, overlap: bool) -> int:
    """The most bytes alive while `sync_grads` reduces the buckets in order (`alive`: gradients and the buckets in
    flight when it begins). Exact: a bucket's sum holds two more bucket sizes; once written, its gradients are
    views of the sum and its flat copy and gathered parts are freed."""
    most = alive
    for bucket in layout:
        started = 0 if overlap else _started_bytes(bucket, exact)
        most = max(most, alive + started + (2 * bucket["bytes"] if exact else 0))
        if overlap:
            alive -= _started_bytes(bucket, exact)
    return most


def _optimizer_temporaries(state, size: dict, foreach: bool) -> int:
    """Adam's temporaries (see the module docstring); none for SGD."""
    if state.options.optimizer_state_factor != ADAM_STATE_FACTOR or not size:
        return 0
    return sum(size.values()) if foreach else 2 * max(size.values())
