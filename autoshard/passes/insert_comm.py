"""insert_comm: put the collectives on every edge whose producer and consumer placements differ.

Reads `autoshard.spec`, `autoshard.in_specs`, `autoshard.grad_partial` (from solve). Writes
collective nodes calling `autoshard.runtime.collectives.*` (meta `autoshard.kind` = "comm",
`autoshard.comm` = {"op", "axis", ...}, `autoshard.spec` = the spec after the step) and
`state.grad_reduce` (parameter FQN -> mesh axis names its gradient is reduced on after backward).

Duality rule: a replicated input of an op that splits its work on an axis gets a partial gradient
there. For activations a `grad_all_reduce` node (identity forward, all-reduce backward) restores
the replicated gradient; one node per (producer, spec) serves every consumer, so q/k/v projections of
one input cost one backward all-reduce. A parameter partial on an axis in every use, and converted by
none of them on that axis, is instead reduced after backward by the bucketed grad sync. A ZeRO-3
parameter (stored S(d) on the ZeRO axis) is gathered by its own `param_all_gather` right before each use, which also reduce-scatters
its gradient. Invariant: every edge's producer spec equals its consumer's required spec, and every
gradient arrives in its dual placement.

>>> import torch
>>> from autoshard.passes.pass_lists import state_before
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> megatron = {"0.weight": {"tp": "S(0)"}, "2.weight": {"tp": "S(1)"}}
>>> state = state_before("insert_comm", mlp, (2,), (torch.randn(8, 4),), axis_names=("tp",), hints=megatron)
"""
from __future__ import annotations

import torch
from torch import fx

from autoshard.ir import meta
from autoshard.ir.mixed_precision import cast_parameter
from autoshard.ir.placement import Shard, Spec
from autoshard.ir.redistribute import plan_redistribute
from autoshard.passes.contract import compiler_pass
from autoshard.runtime.collectives import COLLECTIVES
from autoshard.strategies import tensor_inputs
from autoshard.strategies.base import is_tensor_value


@compiler_pass("insert_comm", reads=(meta.SPEC, meta.IN_SPECS, meta.GRAD_PARTIAL, "state.zero"),
               writes=(meta.COMM, "state.grad_reduce"),
               ensures=("edges_match",))
def insert_comm(state) -> None:
    """The pass: a chain of collectives on every edge whose placements differ (see the module docstring).
    The row-parallel output is partial; its bias is replicated (added once), so it is all-reduced:

    >>> insert_comm(state)
    >>> [(n.meta["autoshard.comm"]["op"], n.meta["autoshard.comm"]["axis"]) for n in state.gm.graph.nodes
    ...  if "autoshard.comm" in n.meta]
    [('all_reduce', 'tp')]
    """
    graph = state.gm.graph
    names = state.mesh.names
    uses: dict = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or meta.IN_SPECS not in node.meta:
            continue
        for pos, producer in enumerate(tensor_inputs(node)):
            want = node.meta[meta.IN_SPECS][pos]
            partial = node.meta[meta.GRAD_PARTIAL][pos]
            uses.setdefault(producer, []).append((node, pos, want, partial))
    cache: dict = {}
    state.grad_reduce = {}
    param_of = {p: cast_parameter(p) or p for p in uses}  # before the chains below re-wire the casts' inputs
    deferred_of = _deferred_by_parameter(uses, param_of)
    for producer, producer_uses in uses.items():
        src = producer.meta[meta.SPEC]
        param = param_of[producer]
        deferred = deferred_of.get(param, ())
        # A ZeRO-3 parameter's gradient on its ZeRO axis is reduce-scattered by its own gather's backward
        # (float32, before its cast), not synced after backward.
        owned_axis = _zero_gather_axis(state, param, param.meta[meta.SPEC])
        synced = tuple(a for a in deferred if a != owned_axis)
        if synced:
            state.grad_reduce[param.meta[meta.PATH]] = tuple(names[a] for a in synced)
        zero_axis = _zero_gather_axis(state, producer, src)
        for node, pos, want, partial in producer_uses:
            if zero_axis is not None and zero_axis in deferred and param_of.get(node) is producer:
                partial = tuple(sorted({*partial, zero_axis}))  # its cast's uses were partial there
            in_graph_partial = tuple(a for a in partial if a not in deferred or a == zero_axis)
            key = (producer, want, in_graph_partial) + ((node,) if zero_axis is not None else ())
            if key not in cache:
                cache[key] = _build_chain(graph, producer, src, want, in_graph_partial, names, node, zero_axis)
            new_input = cache[key]
            if new_input is not producer:
                _replace_input(node, pos, producer, new_input)



_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)  # export's dtype checks: no values flow out


def _deferred_by_parameter(uses, param_of) -> dict:
    """Parameter -> axes its gradient is reduced on after backward: the axes every use of it defers, its
    per-use casts' uses included (a cast passes a partial gradient through to the float32 master)."""
    found: dict = {}
    for producer, producer_uses in uses.items():
        param = param_of[producer]
        if param is not producer and all(u is producer or param_of.get(u) is param or u.target in _CHECKS
                                         for u in param.users):
            axes = set(_deferred_axes(producer, producer.meta[meta.SPEC], producer_uses, through_cast=True))
        elif param is not producer:
            axes = set()  # the parameter has other uses: its cast's gradient is reduced in the graph
        else:
            axes = None if all(param_of.get(u) is param or u.target in _CHECKS for u, *_ in producer_uses) else \
                set(_deferred_axes(producer, producer.meta[meta.SPEC], producer_uses))
        if axes is not None:
            found[param] = axes if param not in found else found[param] & axes
    return {param: tuple(sorted(axes)) for param, axes in found.items()}


def _deferred_axes(producer, src, producer_uses, through_cast: bool = False) -> tuple[int, ...]:
    """Axes where a parameter's gradient is reduced after backward: partial there in every use, and no
    use converts the parameter on that axis. A use that gathers it on other axes (2-D/2.5-D/3-D weights)
    still defers: the reduction commutes with the gathers' backward, and after it the gradient has the
    parameter's own (smaller) shape -- Tesseract's depth all-reduce of the weight block, not of the panel."""
    if not through_cast and (producer.op != "placeholder" or producer.meta.get(meta.KIND) != "param"):
        return ()
    axes = set(producer_uses[0][3])
    for _, _, want, partial in producer_uses:
        axes &= set(partial)
        axes -= {step.axis for step in plan_redistribute(src, want)}
    return tuple(sorted(axes))


def _zero_gather_axis(state, producer, src: Spec):
    """The ZeRO-3 axis when `producer` is a parameter stored sharded there (gathered per use), else None."""
    zero = state.zero
    if zero is None or zero.stage != 3 or producer.op != "placeholder" or producer.meta.get(meta.KIND) != "param":
        return None
    axis = state.mesh.axis(zero.axis)
    return axis if isinstance(src[axis], Shard) else None


def _build_chain(graph, producer, src: Spec, want: Spec, partial_axes, names, consumer, zero_axis=None):
    value, spec = producer, src
    anchor = consumer
    for step in plan_redistribute(src, want):
        spec = step.apply(spec)
        args = [value, names[step.axis]]
        if step.op == "all_gather" and step.axis == zero_axis:
            # ZeRO-3: gathered right before this use, re-gathered in backward; a partial gradient is
            # reduce-scattered by the same node (all_gather + grad_all_reduce fused, the duality pair).
            args += [step.dim, zero_axis in partial_axes]
            partial_axes = tuple(a for a in partial_axes if a != zero_axis)
            value = _comm_node(graph, anchor, "param_all_gather", args, spec, producer, consumer)
            continue
        if step.op == "all_to_all":
            args += [step.dim, step.to_dim]
        elif step.dim is not None:
            args.append(step.dim)
        value = _comm_node(graph, anchor, step.op, args, spec, producer, consumer)
    for axis in partial_axes:
        value = _comm_node(graph, anchor, "grad_all_reduce", [value, names[axis]], spec, producer, consumer)
    return value


def _comm_node(graph, anchor, op, args, spec, producer, consumer):
    with graph.inserting_before(anchor):
        node = graph.call_function(COLLECTIVES[op], tuple(args))
    node.meta["val"] = producer.meta["val"]
    node.meta[meta.KIND] = "comm"
    node.meta[meta.SPEC] = spec
    node.meta[meta.PATH] = consumer.meta.get(meta.PATH, "")
    node.meta[meta.COMM] = {"op": op, "axis": args[1], "args": list(args[2:])}
    if "nn_module_stack" in consumer.meta:
        node.meta["nn_module_stack"] = consumer.meta["nn_module_stack"]
    return node


def _replace_input(node, pos, producer, new_input):
    """Swap the `pos`-th tensor input (counting repeats, as `tensor_inputs` does) from `producer`."""
    seen = [0]

    def swap(arg):
        if not is_tensor_value(arg):
            return arg
        index = seen[0]
        seen[0] += 1
        return new_input if index == pos and arg is producer else arg
    node.args = fx.node.map_arg(node.args, swap)
    node.kwargs = fx.node.map_arg(node.kwargs, swap)
