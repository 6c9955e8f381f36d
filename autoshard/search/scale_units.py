"""The units of the scale search (embedding; each layer; final norm, head and loss): what one intra-op plan
predicts for each per micro-batch of one sequence, and the traced layers repeated to the real depth.

A layer can be recomputed two ways: all of it (`cost/recompute_cost.region_savings`: only its inputs kept,
its forward run again) or selectively, as torchtitan's "selective op" activation checkpointing does: the
outputs of the matmul-like ops (attention included) are kept except every second linear of the layer, and of
the reduce-scatters, everything else (norms, activations, rotary embeddings, gathers, every second linear) is
recomputed in backward.

The examples use a two-way tensor-parallel LLaMA of 3 layers:

>>> import autoshard
>>> from autoshard.zoo import llama
>>> model, inputs, loss_fn = llama(n_layers=3)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("tp",))
>>> units, shared = units_of(prog.state, prog.state.options.profile)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autoshard.cost.axis_cost import needs_grad
from autoshard.cost.collective_time import collective_latency
from autoshard.cost.flops import is_matmul_like, local_bytes, node_flops
from autoshard.cost.prediction import node_cost
from autoshard.cost.recompute_cost import recompute_seconds, region_savings
from autoshard.frontend.cut_points import LayerSequence, find_layers
from autoshard.ir import meta
from autoshard.ir.errors import UserInputError
from autoshard.ir.meta import NODE_COST
from autoshard.passes.cut_stages import boundary_bytes
from autoshard.passes.predict import collective_bytes

aten = torch.ops.aten
# torchtitan's selective-op policy (parallelize_llama.py, _save_list): matmuls (every second one recomputed),
# attention, reduce-scatters.
_LINEARS = (aten.linear.default, aten.mm.default, aten.matmul.default)
_SAVED_COLLECTIVES = ("reduce_scatter",)


@dataclass
class Unit:
    """Predicted figures of one unit (embedding, a layer, or the head) per micro-batch of one sequence:
    seconds forward + backward and their part that does not grow with the micro-batch, activation
    bytes kept, bytes and seconds of checkpointing it (all of it, or selectively), forward matmul FLOPs (all,
    and those a selective checkpoint recomputes), and, of the parameters no other unit uses: bytes with
    gradients and optimizer state, gradient bytes (one entry per parameter), tp gradient-sync seconds; bytes
    sent (forward and backward) when a stage starts at this unit.

    >>> Unit("layers.1", seconds=2.0, is_layer=True).seconds
    2.0
    """

    name: str
    seconds: float = 0.0
    fixed_s: float = 0.0
    activation_bytes: float = 0.0
    checkpoint_saves: float = 0.0
    recompute_s: float = 0.0
    selective_saves: float = 0.0
    selective_s: float = 0.0
    flops: float = 0.0
    selective_flops: float = 0.0
    param_bytes: float = 0.0
    grad_bytes: list = field(default_factory=list)
    sync_s: float = 0.0
    in_bytes: float = 0.0
    is_layer: bool = False


def layer_instance(node, layers: LayerSequence | None = None) -> str:
    """The repeated layer an op belongs to ('layers.1', at any depth: 'inner.model.layers.1' in a wrapped
    model), or '' outside the layers; `layers` is its graph's `find_layers` (found again when not given).

    >>> layers = find_layers(prog.state.gm.graph.nodes)
    >>> sorted({layer_instance(n, layers) for n in prog.state.gm.graph.nodes})
    ['', 'layers.0', 'layers.1', 'layers.2']
    """
    return (layers if layers is not None else find_layers(node.graph.nodes)).layer_of(node)


def selective_savings(state, nodes) -> tuple[float, float, float]:
    """(activation bytes no longer kept, seconds of recompute, forward matmul FLOPs recomputed) of checkpointing
    the layer `nodes` selectively (torchtitan's "selective op" policy; see the module docstring).

    >>> layers = find_layers(prog.state.gm.graph.nodes)
    >>> layer = [n for n in prog.state.gm.graph.nodes if layer_instance(n, layers) == "layers.1"]
    >>> saved, seconds, flops = selective_savings(prog.state, layer)
    >>> 0 < saved < region_savings(prog.state, layer)[0] and 0 < flops < sum(map(node_flops, filter(is_matmul_like, layer)))
    True
    """
    members, linears = set(nodes), 0
    saved = seconds = flops = 0.0
    for node in nodes:
        if node.op != "call_function":
            continue
        comm = node.meta.get(meta.COMM)
        if node.target in _LINEARS:
            linears += 1
            if linears % 2:
                continue
        elif is_matmul_like(node) or (comm and comm["op"] in _SAVED_COLLECTIVES):
            continue
        seconds += recompute_seconds(state, node)[0]
        flops += node_flops(node) if is_matmul_like(node) else 0.0
        if all(u in members for u in node.users):
            saved += node_cost(node).memory_bytes
    return saved, seconds, flops


def units_of(state, profile) -> tuple[list[Unit], list]:
    """Units of the planned graph in order (embedding, each traced layer, head) and the parameters shared by
    several units as (bytes, tp sync seconds, gradient bytes, unit indices).

    >>> [u.name for u in units], [round(u.selective_saves / u.checkpoint_saves, 2) for u in units[1:-1]]
    (['embedding', 'layers.0', 'layers.1', 'layers.2', 'head'], [0.81, 0.81, 0.81])
    """
    graph, mesh = state.gm.graph, state.mesh
    ops = [n for n in graph.nodes if n.op == "call_function"]
    layers = find_layers(ops)
    instances = [i for i in dict.fromkeys(map(layers.layer_of, ops)) if i]
    if len(instances) < 2:
        raise UserInputError("the scale search needs a model with repeated layers (a ModuleList such as "
                             f"'layers.0', 'layers.1', ...); found {instances}")
    units = [Unit("embedding")] + [Unit(i, is_layer=True) for i in instances] + [Unit("head")]
    where = {i: k + 1 for k, i in enumerate(instances)}
    seen_layer, of, members = False, {}, {}
    for node in ops:
        instance = layers.layer_of(node)
        seen_layer = seen_layer or bool(instance)
        of[node] = where[instance] if instance else (len(units) - 1 if seen_layer else 0)
        members.setdefault(of[node], []).append(node)
    grad = needs_grad(graph)
    fwd, bwd, _ = boundary_bytes(state, ops)
    for k, node in enumerate(ops):
        unit = units[of[node]]
        if k == 0 or of[ops[k - 1]] != of[node]:
            unit.in_bytes = fwd[k] + bwd[k]
        cost = node_cost(node)
        unit.seconds += cost.seconds
        unit.activation_bytes += cost.memory_bytes
        comm = node.meta.get(meta.COMM)
        if comm and node.args[0].op == "placeholder":  # a weight's collective: as long whatever the micro-batch
            unit.fixed_s += cost.seconds
        elif comm:
            axis = mesh.axis(comm["axis"])
            unit.fixed_s += collective_latency(comm["op"], *collective_bytes(node, mesh), mesh.shape[axis],
                                               profile.link(mesh.shape, axis))
        elif is_matmul_like(node):
            unit.flops += node_flops(node)
    for index, nodes in members.items():
        unit = units[index]
        if unit.is_layer:
            unit.checkpoint_saves, unit.recompute_s = region_savings(state, nodes)
            unit.selective_saves, unit.selective_s, unit.selective_flops = selective_savings(state, nodes)
    shared = []
    for node in graph.nodes:
        if node.op != "placeholder" or NODE_COST not in node.meta:
            continue
        used = sorted({of[u] for u in node.users if u in of})
        cost = node.meta[NODE_COST]
        grads = [local_bytes(node, node.meta[meta.SPEC], mesh)] if grad.get(node) else []
        if len(used) == 1:
            units[used[0]].param_bytes += cost.memory_bytes
            units[used[0]].grad_bytes += grads
            units[used[0]].sync_s += cost.sync_s
        elif used:
            shared.append((cost.memory_bytes, cost.sync_s, grads, tuple(used)))
    return units, shared


def scaled(units: list[Unit], shared: list, n_layers: int) -> tuple[list[Unit], list]:
    """The traced units at the real depth: first layer, n_layers - 2 copies of the second, last layer.

    >>> [u.name for u in scaled(units, shared, 5)[0]]
    ['embedding', 'layers.0', 'layers.1', 'layers.1', 'layers.1', 'layers.2', 'head']
    """
    layers = units[1:-1]
    if n_layers == len(layers):
        return units, shared
    if len(layers) < 3:
        raise UserInputError(f"the model was traced with {len(layers)} layers; trace at least 3 (first, middle, "
                             f"last) to plan a depth of {n_layers}")
    out = [units[0], layers[0], *[layers[1]] * (n_layers - 2), layers[-1], units[-1]]
    last = len(units) - 1

    def moved(i):
        if 1 < i < last - 1:
            raise UserInputError("a parameter shared by a middle layer and another unit cannot be scaled to a "
                                 "different depth; trace the model at its real depth")
        return {0: 0, 1: 1, last - 1: n_layers, last: n_layers + 1}[i]

    return out, [(nbytes, sync, grads, tuple(moved(i) for i in where)) for nbytes, sync, grads, where in shared]
