"""The costs of solve's ILP (autoshard/passes/solve.py): what each candidate strategy, each placement conversion
and each gradient reduction adds to a step, in the ILP's form (per-candidate costs, edge matrices between
classes, shared and conjunction charges; autoshard/solver/problem.py), apart from the memory row.

The prices come from the cost model (autoshard/cost/): a node's compute from AxisCostModel, a conversion from
the collective table, so the chosen plan's objective is predict's step. What is priced where:
  - a conversion is charged once per chain insert_comm emits (one per value, wanted placement and partial axes,
    shared by its consumers): a conjunction charge, or the edge's matrix when one consumer alone can take it;
  - the duality rule's gradient all-reduce (a consumer splits its work with the value replicated) is charged once
    per value, axis and bytes; a parameter's is its gradient sync, once per step (a pipeline's micro-batch
    program pays 1/m of it);
  - where a chain's last step on such an axis is an all-gather, fuse_comm makes gather and all-reduce one
    all_gather_sum_grad: the chain pays the fused op, and that pair of candidates does not trigger the
    all-reduce (the charge becomes a conjunction over the pairs that do) -- a positive charge, which keeps the
    LP relaxation as tight as a plain shared charge (a negative refund made HiGHS stall at its time limit); a
    parameter gathered per use outside a pipeline is the one exception (`_fused_gather_refund` says why);
  - semi-auto mode (any hint) multiplies resharding a parameter and gathering a sharded value by
    PROPAGATION_PENALTY, so hinted shardings flow (GSPMD-style propagation).
Costs are scaled to microseconds (SCALE) for HiGHS's tolerances.

>>> import torch
>>> from autoshard.passes.pass_lists import state_before
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> state = state_before("solve", mlp, (2,), (torch.randn(8, 4),), axis_names=("dp",))
>>> from autoshard.cost.axis_cost import AxisCostModel, needs_grad
>>> from autoshard.cost.saved_tensors import kept_split
>>> nodes = [n for n in state.gm.graph.nodes if "autoshard.candidates" in n.meta]
>>> grad = needs_grad(state.gm.graph)
>>> models = [AxisCostModel(state.mesh, 0, state.options.profile, grad, 2.0, kept_split(state.gm.graph, grad).own)]
>>> combos = {n: [{0: c} for c in n.meta["autoshard.candidates"][0]] for n in nodes}
>>> parts = ilp_costs(nodes, (0,), combos, {n: [] for n in nodes}, state, models, semi_auto=False)
"""
from __future__ import annotations

from typing import NamedTuple

from autoshard.cost.axis_cost import partial_grad_time
from autoshard.cost.collective_time import (
    INF,
    fused_gather_change,
    fused_gather_saving,
    redistribution_time,
)
from autoshard.cost.flops import is_view, node_bytes
from autoshard.ir import meta
from autoshard.ir.graph_utils import data_parallel_axes
from autoshard.ir.mixed_precision import cast_parameter
from autoshard.ir.placement import Replicate, Shard, Spec
from autoshard.solver.layers import decision_classes
from autoshard.strategies import mutated_positions, tensor_inputs

SCALE = 1e6  # seconds -> microseconds keeps HiGHS's tolerances meaningful
PROPAGATION_PENALTY = 1e3


class IlpCosts(NamedTuple):
    """What the ILP deciding some mesh axes costs, apart from its memory row (see the module docstring):
    decision classes, the class of each node, each class's candidate count, per-candidate costs, edge matrices
    by class pair, shared charges, conjunction charges, and each node's per-candidate, per-axis breakdowns.

    >>> parts.sizes == [len(combos[members[0]]) for members in parts.classes]
    True
    """

    classes: list
    class_of: dict
    sizes: list
    costs: list
    edges: dict
    shared: list
    conjunctions: list
    breakdowns: dict


def written_through_views(graph) -> set:
    """Values written in place through a view (`shifted[:, 1:] = labels[:, :-1]` in transformers'
    shift_tokens_right), with the views between: none of them may be resharded, or the write would land
    on a rank's fresh copy and later reads of the base would miss it.

    >>> graph = torch.fx.Graph()
    >>> base, src = graph.placeholder("base"), graph.placeholder("src")
    >>> base.meta["val"] = src.meta["val"] = torch.zeros(2, 4)
    >>> view = graph.call_function(torch.ops.aten.slice.Tensor, (base, 1, 1))
    >>> view.meta["val"] = torch.zeros(2, 3)
    >>> write = graph.call_function(torch.ops.aten.copy_.default, (view, src))
    >>> sorted(n.name for n in written_through_views(graph))
    ['base', 'slice_tensor']
    """
    frozen = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for pos in mutated_positions(node):
            value, chain = tensor_inputs(node)[pos], []
            while is_view(value):
                chain.append(value)
                value = value.args[0]
            if chain:
                frozen.update([*chain, value])
    return frozen


def _edge_cost(u, cu, have, want, mutated, axes, models, others, semi_auto, mesh, profile, nbytes) -> float:
    """Scaled cost of turning placements `have` into `want` on `axes` (one tuple entry per axis); `nbytes`
    is node_bytes(u). On several axes it depends on `u` only through `_value_kind(u, ...)` and `nbytes`."""
    if mutated:
        return INF
    if len(axes) == 1:
        cost = models[axes[0]].edge(u, have[0], want[0], others(u, cu, axes[0]))
    elif isinstance(u.meta.get("val"), (tuple, list)):
        cost = INF  # multi-output values are never resharded: their getitem follows them
    else:  # several axes at once: price the exact collectives insert_comm will emit
        cost = redistribution_time(Spec(have), Spec(want), nbytes, mesh.shape, profile,
                                   models[0].grad.get(u, False))
    is_param = u.op == "placeholder" and u.meta.get(meta.KIND) != "input"
    gathers = any(isinstance(h, Shard) and isinstance(w, Replicate) for h, w in zip(have, want))
    if semi_auto and (is_param or gathers):
        cost *= PROPAGATION_PENALTY
    return cost * SCALE


def _value_kind(u, models) -> tuple:
    """What _edge_cost and _fused_gather_refund read of a value besides its bytes, on several axes:
    values alike in these (the copies in repeated layers, most of all) share one priced conversion."""
    return (u.op == "placeholder", u.meta.get(meta.KIND) != "input", isinstance(u.meta.get("val"), (tuple, list)),
            bool(models[0].grad.get(u, False)), cast_parameter(u) is not None)


def _partial_gradient_charges(nodes, axes, combos, class_of, models, others, free_sync, fused, edges,
                              sync_share=1.0, copies=lambda node: 1) -> tuple[list, list]:
    """The duality rule's backward all-reduce, charged once per value and axis however many split ops
    use it replicated (insert_comm emits one grad_all_reduce per value; a parameter is synced once).
    A parameter's charge is its gradient sync, paid once per step: a pipeline's micro-batch program
    pays `sync_share` = 1/micro-batches of it (its other costs recur every micro-batch). `copies(u)`: how many
    values of the whole model u stands for (a folded trace, autoshard/frontend/fold.py).

    One charge per (value, axis, bytes after the other axes: as the consumer takes it, or for a parameter its own
    block); a consumer candidate that takes the value replicated on that axis while splitting its work triggers
    it -- unless its chain from the value's candidate fuses the all-reduce into a gather (`fused`: (u, v, pos,
    consumer candidate, axis) -> the value's candidates whose chain does), or the parameter's candidate has another
    block size. A charge every pair triggers is a shared charge over consumer candidates; else a conjunction over
    the candidate pairs that do. Returns (shared charges, conjunction charges).
    """
    charges: dict = {}
    for v in nodes:
        if v.op != "call_function":
            continue
        for pos, u in enumerate(tensor_inputs(v)):
            if u not in combos or not models[0].grad.get(u, False):
                continue
            # A parameter's per-use cast (mixed precision) is synced as its float32 master after backward.
            master = cast_parameter(u)
            synced = u.op == "placeholder" or master is not None
            for axis in axes:
                if axis in free_sync and synced:
                    continue
                model = models[axis]
                # A parameter's sync after backward reduces its own block (after the backward of any gather on
                # other axes): its bytes follow the parameter's candidate, one charge per size.
                own = _sizes(model.local_bytes(u, others(u, cu, axis)) for cu in combos[u]) if synced else None
                for t, cv in enumerate(combos[v]):
                    if not cv[axis].partial_grad(pos):
                        continue
                    fused_here = fused.get((u, v, pos, t, axis), set())
                    sizes = own if own is not None else {model.input_bytes(u, pos, others(v, cv, axis)): set()}
                    for nbytes, others_sized in sizes.items():
                        if master is not None:
                            nbytes = nbytes * master.meta["val"].element_size() // u.meta["val"].element_size()
                        excluded = fused_here | others_sized  # pairs that do not trigger this charge
                        triggers = charges.setdefault((u, axis, nbytes), {}).setdefault(v, {})
                        triggers[t] = triggers[t] & excluded if t in triggers else set(excluded)
    merged: dict = {}
    for (u, axis, nbytes), consumers in charges.items():
        cost = partial_grad_time(u, nbytes, models[axis].k, models[axis].link, models[axis].bucket_bytes) * SCALE
        cost *= sync_share if u.op == "placeholder" or cast_parameter(u) is not None else 1.0
        # Copies of u in repeated layers are tied: their identical charges merge into one, paid per copy.
        merged_key = (class_of[u], axis, nbytes, _triggers(u, consumers, combos, class_of, edges))
        merged[merged_key] = merged.get(merged_key, 0.0) + cost * copies(u)
    shared, conjunctions = [], []
    for (_, _, _, (form, terms)), cost in merged.items():
        if form == "shared":
            shared.append((cost, [list(group) for group in terms]))
        elif terms:
            conjunctions.append((cost, [(c, d, list(pairs)) for c, d, pairs in terms]))
    return shared, conjunctions


def _sizes(per_candidate) -> dict:
    """{bytes: the candidates of other sizes} from each candidate's bytes."""
    per_candidate = list(per_candidate)
    return {nbytes: {a for a, other in enumerate(per_candidate) if other != nbytes} for nbytes in per_candidate}


def _triggers(u, consumers, combos, class_of, edges) -> tuple:
    """What triggers a gradient charge of `u` (consumers: v -> {candidate: u's candidates that do not trigger it}):
    ("shared", groups of (class, candidate)) when every pair does, else ("conjunction", terms (class of u,
    class of v, the allowed candidate pairs that trigger it))."""
    if not any(excluded for per in consumers.values() for excluded in per.values()):
        return "shared", tuple(sorted(tuple(sorted((class_of[v], t) for t in per)) for v, per in consumers.items()))
    terms = []
    for v, per in consumers.items():
        key = (class_of[u], class_of[v])
        matrix = edges[key]
        pairs = tuple(sorted((a, t) for t, excluded in per.items() for a in range(len(combos[u]))
                             if a not in excluded and matrix[a][t] != INF))
        if pairs:
            terms.append((*key, pairs))
    return "conjunction", tuple(sorted(terms))


def _fused_gather_refund(u, v, pos, cv, have, want, axes, models, others, partial_axes, nbytes,
                         sync_share: float = 1.0) -> tuple:
    """The chain `have` -> `want` of `u` into `v` where its last step on an axis where `v` splits its work with that
    input replicated is an all-gather: fuse_comm makes it and the gradient all-reduce one all_gather_sum_grad (a
    reduce-scatter backward). Returns (scaled seconds the gather is priced over the fused op -- negative, the
    chain pays the fused op --, the axes fused: their all-reduce is not charged for this pair).
    A parameter (or its per-use cast) gathered per use in a program that syncs once per step (`sync_share` 1) is
    left priced as gather + all-reduce, deliberately: the fused op costs as much as data parallelism's all-reduce,
    and the tie-break (fewest bytes kept) would pick it, but the gather blocks the forward where data parallelism's
    sync overlaps the backward (cost/overlap.py) -- such a plan's objective exceeds predict's step by the gather's
    price. In a pipeline's micro-batch program (`sync_share` 1/m) it is priced exactly: the fused op runs in every
    micro-batch, the sync it replaces once per step.
    When `axes` are the whole mesh, the chain insert_comm emits is known step by step and the saving is
    exact (cost.fused_gather_saving); one axis of several is priced on that axis alone."""
    if not models[0].grad.get(u, False):
        return 0.0, ()
    if sync_share == 1.0 and (u.op == "placeholder" or cast_parameter(u) is not None):
        return 0.0, ()
    mesh = models[0].mesh
    if len(axes) == mesh.ndim and len(axes) > 1:
        parts = fused_gather_saving(Spec(have), Spec(want), partial_axes, nbytes, mesh.shape, models[0].profile)
    else:
        parts = {}
        for i, axis in enumerate(axes):
            if isinstance(have[i], Shard) and isinstance(want[i], Replicate) and cv[axis].partial_grad(pos):
                model = models[axis]
                parts[axis] = fused_gather_change(model.input_bytes(u, pos, others(v, cv, axis)), model.k, model.link)
    return sum(parts.values()) * SCALE, tuple(parts)


def _partial_axes(u, pos, strategies, models) -> tuple:
    """Axes where a consumer with these strategies (axis -> AxisStrategy) gets `u`'s gradient back
    partial: it splits its work with the input replicated. insert_comm builds one chain per (value,
    wanted placement, these axes)."""
    if not models[0].grad.get(u, False):
        return ()
    return tuple(sorted(a for a, s in strategies.items() if s.partial_grad(pos)))


def _conversion_charges(conversions, edges) -> list:
    """Conjunction charges (autoshard/solver/model.py) for the conversions: insert_comm emits one chain per value,
    wanted placement and partial axes, shared by every consumer that asks for it, so its cost is paid
    once when any consumer pair chooses it. Copies of a value in repeated layers whose charges span the
    same class pairs merge into one charge that costs their sum. A chain only one input of one consumer
    can use goes on that edge's matrix instead: there, at most one of its pairs is chosen, so the edge
    already pays it once, and the ILP stays as small as Alpa's (most values have one consumer)."""
    merged: dict = {}
    for (_, _, _, _, _, cost), (terms, uses) in conversions.items():
        if cost == 0.0:
            continue
        if len(uses) == 1:
            (key, pairs), = terms.items()
            for a, b in pairs:
                if edges[key][a][b] != INF:
                    edges[key][a][b] += cost
            continue
        if any(edges[key][a][b] == INF for key, pairs in terms.items() for a, b in pairs):
            terms = {key: {(a, b) for a, b in pairs if edges[key][a][b] != INF} for key, pairs in terms.items()}
        signature = (cost > 0, tuple(sorted((key, tuple(sorted(pairs))) for key, pairs in terms.items() if pairs)))
        if signature[1]:
            merged[signature] = merged.get(signature, 0.0) + cost
    return [(cost, [(c, d, list(pairs)) for (c, d), pairs in signature[1]]) for signature, cost in merged.items()]




def ilp_costs(nodes, axes, combos, choices, state, models, semi_auto) -> IlpCosts:
    """What the ILP deciding `axes` costs, apart from its memory row (IlpCosts; the module docstring says what is
    priced where). `combos`: each node's candidate strategies on `axes` (axis -> AxisStrategy); `choices`: each
    node's strategies on the axes decided before; `models`: an AxisCostModel per mesh axis.

    Data parallelism's weight syncs are shared charges, paid when a consumer candidate that splits the batch with
    the weight replicated is chosen:

    >>> linear = parts.class_of[next(n for n in nodes if n.op == "call_function")]
    >>> any(linear in {c for c, _ in group} for _, groups in parts.shared for group in groups)
    True
    """
    mesh = state.mesh
    free_sync = data_parallel_axes(nodes) if semi_auto else set()  # gradient sync there is the user's choice
    profile = models[0].profile

    decided = {n: dict(enumerate(choices[n])) for n in nodes}  # the earlier axes' strategies, made once per node

    def others(node, combo, axis):
        if len(combo) == 1:  # one axis decided: every candidate sees the earlier decisions alone
            return decided[node]
        return {**decided[node], **{b: c for b, c in combo.items() if b != axis}}

    breakdowns = {n: [[models[a].node(n, combo[a], others(n, combo, a)) for a in axes] for combo in combos[n]]
                  for n in nodes}
    classes, class_of = decision_classes(
        nodes, lambda n: (tuple(tuple(sorted(c.items())) for c in combos[n]), node_bytes(n),
                          tuple(c.output for c in choices[n])))
    sizes = [len(combos[members[0]]) for members in classes]
    costs = [[0.0] * size for size in sizes]
    copies = state.fold.copies if state.fold is not None else lambda node: 1  # a folded trace's middle layer
    for n in nodes:
        c = class_of[n]
        for s, per_axis in enumerate(breakdowns[n]):
            # compute (with a ring's messages inside the op) is per node, not per axis
            costs[c][s] += copies(n) * (per_axis[0].compute + per_axis[0].in_op_comm) * SCALE
    edges: dict = {}
    conversions: dict = {}  # one charge per chain insert_comm emits (see _conversion_charges)
    fused: dict = {}  # (value, consumer, position, consumer candidate, axis) -> value candidates whose chain fuses
    pipeline = state.options.pipeline
    sync_share = 1.0 / pipeline.microbatches if pipeline is not None else 1.0
    outs = {u: [tuple(cu[a].output for a in axes) for cu in combos[u]] for u in nodes}
    interned: dict = {}  # placement tuple -> small int: the pair loop below compares and hashes ints, not specs
    out_ids = {u: [interned.setdefault(have, len(interned)) for have in outs[u]] for u in nodes}
    frozen = written_through_views(state.gm.graph)
    size = {u: node_bytes(u) for u in nodes}
    # A conversion's price depends on the value itself on one axis, but only on its kind and bytes on several:
    # there the values of repeated layers share one price per build (and one refund, where it is exact).
    several, whole_mesh = len(axes) > 1, len(axes) > 1 and len(axes) == mesh.ndim
    priced_as = {u: (size[u], _value_kind(u, models)) if several else u for u in nodes}
    prices: dict = {}
    refunds: dict = {}
    for v in nodes:
        if v.op != "call_function":
            continue
        mutated = set(mutated_positions(v)) | {pos for pos, u in enumerate(tensor_inputs(v)) if u in frozen}
        for pos, u in enumerate(tensor_inputs(v)):
            if u not in combos:
                continue
            key = (class_of[u], class_of[v])
            matrix = edges.get(key)
            if matrix is None:  # made once per class pair (a default argument would be built for every use)
                matrix = edges[key] = [[0.0] * sizes[key[1]] for _ in range(sizes[key[0]])]
            wants = [tuple(cv[a].inputs[pos] for a in axes) for cv in combos[v]]
            partials = [_partial_axes(u, pos, {**dict(enumerate(choices[v])), **cv}, models) for cv in combos[v]]
            # A conversion into an input placement the user asked for (`<module>:input`) is not penalized.
            penalize = semi_auto and not any(pos in wanted for wanted in v.meta.get(meta.INPUT_HINT, {}).values())
            want_ids = [interned.setdefault(want, len(interned)) for want in wants]
            for a, have in enumerate(outs[u]):
                have_id, row = out_ids[u][a], matrix[a]
                for b, want in enumerate(wants):
                    want_id = want_ids[b]
                    if have_id == want_id or row[b] == INF:
                        continue
                    price_key = (priced_as[u], have_id, want_id, pos in mutated, penalize)
                    cost = prices.get(price_key)
                    if cost is None:
                        cost = prices[price_key] = _edge_cost(u, combos[u][a], have, want, pos in mutated, axes,
                                                              models, others, penalize, mesh, profile, size[u])
                    if cost == INF:
                        row[b] = INF
                        continue
                    refund_key = (priced_as[u], have_id, want_id, partials[b]) if whole_mesh else (v, pos, a, b)
                    found = refunds.get(refund_key)
                    if found is None:
                        found = refunds[refund_key] = _fused_gather_refund(u, v, pos, combos[v][b], have, want, axes,
                                                                           models, others, partials[b], size[u],
                                                                           sync_share)
                    refund, fused_axes = found
                    for axis in fused_axes:  # this pair's chain pays the fused op, not the value's all-reduce
                        fused.setdefault((u, v, pos, b, axis), set()).add(a)
                    cost = (cost - refund) * copies(u)  # one chain per value, in every layer it stands for
                    terms, uses = conversions.setdefault((u, have_id, want_id, partials[b], penalize, cost),
                                                         ({}, set()))
                    terms.setdefault(key, set()).add((a, b))
                    uses.add((v, pos))
    shared, gradient_terms = _partial_gradient_charges(nodes, axes, combos, class_of, models, others, free_sync, fused,
                                                       edges, sync_share, copies)
    conjunctions = _conversion_charges(conversions, edges) + gradient_terms
    return IlpCosts(classes, class_of, sizes, costs, edges, shared, conjunctions, breakdowns)
