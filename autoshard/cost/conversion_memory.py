"""The memory a conversion moves: what the ILP's memory row charges on its edges, so that the row of the chosen
plan is predict's memory (both follow autoshard/cost/saved_tensors.py).

A consumer that keeps its input for backward (KeptSplit.keepers) and is given it converted keeps the copy
insert_comm made (its last step that makes fresh storage: a `chunk` of the outermost non-unit dim is a view)
instead of the producer's storage. So:
  - the copy costs its bytes once per chain insert_comm emits (value, its placement, the wanted placement and
    the axes where the gradient comes back partial) when any consumer that keeps it takes that chain;
  - the producer's own storage (when no op saves it as its output) costs its bytes when any consumer that keeps
    it takes it unconverted;
  - a ZeRO-3 parameter's gather on the ZeRO axis is saved as its shard: no copy.
A charge one consumer alone can incur goes on its edge's matrix; one several share is a memory charge the ILP
pays once (autoshard/solver/model.py). Sizes are after the axes decided before (`choices`) and the candidate's
axes; axes decided later count as replicated.

>>> from autoshard.ir.placement import R, S, P, Spec
>>> saved_copy(Spec([S(0), R]), Spec([R, R]), (8, 4))  # an all_gather: a fresh, whole copy
[R, R]
>>> saved_copy(Spec([R, R]), Spec([S(0), R]), (8, 4)) is OWN  # a chunk of dim 0 views the producer's storage
True
>>> saved_copy(Spec([S(0), R]), Spec([R, R]), (8, 4), shard_saved_axis=0) is None  # ZeRO-3's gather
True
"""
from __future__ import annotations

import functools
import math

from autoshard.cost.flops import node_bytes
from autoshard.cost.saved_tensors import chunk_is_view
from autoshard.ir.errors import PlanError
from autoshard.ir.placement import Shard, Spec
from autoshard.ir.redistribute import plan_redistribute
from autoshard.strategies import tensor_inputs

OWN = "own"  # saved_copy: the consumer gets (a view of) the producer's own storage


def saved_copy(have: Spec, want: Spec, shape, shard_saved_axis: int | None = None):
    """What a consumer that keeps its input holds after converting `have` into `want`: OWN (the producer's
    storage, or a view of it), the spec of the fresh copy it keeps, or None (a ZeRO-3 gather on
    `shard_saved_axis`, saved as the shard).

    >>> saved_copy(Spec([S(1)]), Spec([R]), (8, 4))  # gathered: the consumer keeps the whole copy
    [R]
    """
    key = (have, want, shape, shard_saved_axis)
    if key not in _SAVED_COPY:
        _SAVED_COPY[key] = _saved_copy(have, want, shape, shard_saved_axis)
    return _SAVED_COPY[key]


_SAVED_COPY: dict = {}  # repeated layers and candidates ask for the same conversions


def _saved_copy(have, want, shape, shard_saved_axis):
    try:
        steps = plan_redistribute(have, want)
    except PlanError:  # no conversion makes a partial sum: the ILP forbids the pair
        return None
    kept = OWN
    spec = have
    for step in steps:
        spec = step.apply(spec)
        if step.op == "chunk" and chunk_is_view(shape, step.dim):
            continue
        kept = None if step.op == "all_gather" and step.axis == shard_saved_axis else spec
    return kept


def local_bytes(node, placements, mesh_shape) -> float:
    """Bytes of `node`'s block under `placements` (one per mesh axis decided so far).

    >>> import torch
    >>> from autoshard.ir.placement import R, S
    >>> graph = torch.fx.Graph()
    >>> x = graph.placeholder("x")
    >>> x.meta["val"] = torch.empty(8, 4)
    >>> local_bytes(x, (S(0), R), (2, 4))
    64.0
    """
    return _split_bytes(node_bytes(node), placements, mesh_shape)


def conversion_memory(problem_nodes, axes, combos, choices, class_of, split, grad, mesh_shape, copies, dropped,
                      shard_saved_axis) -> tuple[dict, dict, list]:
    """(node memory {node: [bytes per candidate]} kept whatever the edges choose, edge memory {(class, class):
    [[bytes]]} and memory charges [(bytes, [(class, class, pairs)])]) of the values some consumer keeps (see
    the module docstring). `split` is saved_tensors.kept_split's; `shard_saved_axis(u)` the ZeRO-3 axis a
    parameter is gathered on per use (None otherwise); `dropped` the ops whose activations are recomputed.

    >>> import torch
    >>> from autoshard.passes.pass_lists import state_before
    >>> from autoshard.cost.axis_cost import needs_grad
    >>> from autoshard.cost.saved_tensors import kept_split
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> state = state_before("solve", mlp, (2,), (torch.randn(8, 4),), axis_names=("dp",))
    >>> nodes = [n for n in state.gm.graph.nodes if "autoshard.candidates" in n.meta]
    >>> combos = {n: [{0: c} for c in n.meta["autoshard.candidates"][0]] for n in nodes}
    >>> class_of = {n: i for i, n in enumerate(nodes)}
    >>> grad = needs_grad(state.gm.graph)
    >>> fixed, edges, charges = conversion_memory(nodes, (0,), combos, {n: [] for n in nodes}, class_of,
    ...     kept_split(state.gm.graph, grad), grad, (2,), lambda n: 1, set(), lambda n: None)
    >>> weight = next(n for n in nodes if n.meta.get("autoshard.path") == "2.weight")
    >>> second = weight.users.copy().popitem()[0]  # the linear, which saves its weight
    >>> max(max(row) for row in edges[(class_of[weight], class_of[second])])  # the [2, 8] weight gathered: 64 B
    64.0
    """
    in_problem = set(problem_nodes)
    fixed: dict = {}
    edges: dict = {}
    shared: dict = {}  # charge key -> [bytes, {(class, class): pairs}, uses]
    for u in problem_nodes:
        users = [v for v in split.keepers.get(u, ()) if v in in_problem]
        if not users or isinstance(u.meta.get("val"), (tuple, list)) or u in dropped:
            continue
        shape = tuple(u.meta["val"].shape)
        owns = u in split.roots  # its storage is charged here (not a view's root's, not a parameter's)
        zero_axis = shard_saved_axis(u)
        nbytes = node_bytes(u) * copies(u)
        haves = [tuple(c.output for c in choices[u]) + tuple(cu[a].output for a in axes) for cu in combos[u]]
        uses = [(v, pos) for v in users for pos, w in enumerate(tensor_inputs(v)) if w is u]
        kept_own: dict = {}  # candidate of u -> {(class, class): pairs that keep u's storage}, per use
        always = [False] * len(haves)
        converted: dict = {}  # (have, want) -> what the consumer keeps
        for v, pos in uses:
            key = (class_of[u], class_of[v])
            wants = [tuple(c.inputs[pos] for c in choices[v]) + tuple(cv[a].inputs[pos] for a in axes)
                     for cv in combos[v]]
            partials = [_partial_axes(choices[v], cv, pos) if grad.get(u) else () for cv in combos[v]]
            for a, have in enumerate(haves):
                own_pairs = []
                for b, want in enumerate(wants):
                    if have == want:
                        own_pairs.append((a, b))
                        continue
                    kept = converted.get((have, want), False)
                    if kept is False:
                        kept = converted[(have, want)] = saved_copy(Spec(have), Spec(want), shape, zero_axis)
                    if kept is OWN:
                        own_pairs.append((a, b))
                    elif kept is not None and v not in dropped:
                        charge_key = (u, have, want, partials[b])
                        charge = shared.get(charge_key)
                        if charge is None:
                            charge = shared[charge_key] = [_split_bytes(nbytes, kept, mesh_shape), {}, set()]
                        charge[1].setdefault(key, set()).add((a, b))
                        charge[2].add((v, pos))
                if owns and len(own_pairs) == len(wants):
                    always[a] = True
                elif owns and own_pairs:
                    kept_own.setdefault(a, []).append((key, own_pairs))
        if not owns:
            continue
        sizes = [_split_bytes(nbytes, have, mesh_shape) for have in haves]
        fixed[u] = [sizes[a] if always[a] else 0.0 for a in range(len(haves))]
        for a, terms in kept_own.items():
            if always[a]:
                continue
            if len(terms) == 1 and len(uses) == 1:
                _add_to_edge(edges, combos, class_of, u, users[0], terms[0][0], terms[0][1], sizes[a])
            else:
                charge = shared.setdefault((u, "own", a), [sizes[a], {}, set(uses)])
                for key, pairs in terms:
                    charge[1].setdefault(key, set()).update(pairs)
    charges: dict = {}
    for (u, *_), (nbytes, terms, users) in shared.items():
        if len(users) == 1 and len(terms) == 1:
            (key, pairs), = terms.items()
            (v, _), = users
            _add_to_edge(edges, combos, class_of, u, v, key, pairs, nbytes)
            continue
        # copies of a value in repeated layers span the same class pairs: one charge, their bytes summed
        signature = tuple(sorted((key, tuple(sorted(pairs))) for key, pairs in terms.items()))
        charges[signature] = charges.get(signature, 0.0) + nbytes
    return fixed, edges, [(nbytes, [(c, d, list(pairs)) for (c, d), pairs in signature])
                          for signature, nbytes in charges.items()]


def _split_bytes(nbytes, placements, mesh_shape) -> float:
    return nbytes / _ways(tuple(placements), tuple(mesh_shape))


@functools.lru_cache(maxsize=4096)  # a few placements over one mesh, asked for once per candidate pair
def _ways(placements, mesh_shape) -> int:
    return math.prod(mesh_shape[a] for a, p in enumerate(placements) if isinstance(p, Shard))


def _partial_axes(prior, combo, pos) -> tuple:
    """Axes where a consumer with these strategies gets the gradient of input `pos` back partial: with the
    wanted placement, what tells insert_comm's chains apart."""
    return tuple(sorted(a for a, c in [*enumerate(prior), *combo.items()] if c.partial_grad(pos)))


def _add_to_edge(edges, combos, class_of, u, v, key, pairs, nbytes) -> None:
    matrix = edges.get(key)
    if matrix is None:
        matrix = edges[key] = [[0.0] * len(combos[v]) for _ in combos[u]]
    for a, b in pairs:
        matrix[a][b] += nbytes
