"""A decision on a node: which strategies it may still take on a mesh axis, and writing the chosen ones.

solve, zero (ZeRO-3's parameter shards) and apply_plan decide; `record_choice` is the one place a
decision becomes meta: the node's choice per axis, its output spec, its input specs and the mesh axes where
each input's gradient comes back partial (the duality rule: a replicated input of an op that splits its
work there).

>>> import torch
>>> from autoshard.cost.axis_cost import needs_grad
>>> from autoshard.passes.pass_lists import state_before
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> megatron = {"0.weight": {"tp": "S(0)"}, "2.weight": {"tp": "S(1)"}}
>>> solved = state_before("insert_comm", mlp, (2,), (torch.randn(8, 4),), axis_names=("tp",), hints=megatron)
>>> linear = next(n for n in solved.gm.graph.nodes if n.target is torch.ops.aten.linear.default)
>>> two = state_before("solve", torch.nn.Linear(4, 2), (2, 2), (torch.randn(8, 4),), axis_names=("a", "b"),
...                    hints={"weight": {"b": "S(0)"}})  # a weight of 2 rows: S(0) on one axis only
>>> weight = next(n for n in two.gm.graph.nodes if n.meta.get("autoshard.path") == "weight")
"""
from __future__ import annotations

from autoshard.ir import meta
from autoshard.ir.errors import HintError
from autoshard.ir.placement import Shard, Spec
from autoshard.strategies import tensor_inputs
from autoshard.strategies.attention import method_of, why_not
from autoshard.strategies.base import REGISTRY, RuleContext, feasible, output_shapes


def record_choice(node, chosen, grad) -> None:
    """Write a node's chosen strategies (one per axis) and what follows from them (also used by apply_plan).

    >>> record_choice(linear, linear.meta["autoshard.choice"], needs_grad(solved.gm.graph))
    >>> linear.meta["autoshard.choice"], linear.meta["autoshard.spec"], linear.meta["autoshard.in_specs"]
    ([(R, S(0)) -> S(1)], [S(1)], [[R], [S(0)]])
    """
    node.meta[meta.CHOICE] = chosen
    node.meta[meta.SPEC] = Spec(c.output for c in chosen)
    n_in = len(chosen[0].inputs) if chosen else 0
    node.meta[meta.IN_SPECS] = [Spec(c.inputs[i] for c in chosen) for i in range(n_in)]
    inputs = tensor_inputs(node) if node.op == "call_function" else []
    node.meta[meta.GRAD_PARTIAL] = [
        tuple(a for a, c in enumerate(chosen) if c.partial_grad(i))
        if grad.get(inputs[i], False) else () for i in range(n_in)]


def _local(shape, placements, mesh, upto_axis):
    """Shape after the placements chosen on axes before `upto_axis`."""
    shape = list(shape)
    for axis, p in enumerate(placements[:upto_axis]):
        if isinstance(p, Shard) and p.dim < len(shape):
            shape[p.dim] //= mesh.shape[axis]
    return tuple(shape)


def axis_candidates(node, axis, mesh, choices):
    """`node`'s candidates on mesh `axis` still feasible given the shapes its choices on earlier axes
    (`choices[node]`) leave, with hints applied; a hint no candidate meets is an error.

    >>> found = [str(c) for c in axis_candidates(linear, 0, solved.mesh, {linear: []})]
    >>> found[:2], "(R, S(0)) -> S(1)" in found  # replicated, data parallel, ..., column parallel
    (['(R, R) -> R', '(S(0), R) -> S(0)'], True)
    """
    prior = choices[node]
    inputs = tensor_inputs(node) if node.op == "call_function" else []
    in_shapes = []
    for i, producer in enumerate(inputs):
        shapes = output_shapes(producer)
        in_shapes.append(_local(shapes[0] if shapes else (), [c.inputs[i] for c in prior], mesh, axis))
    out_shapes = [_local(s, [c.output for c in prior], mesh, axis) for s in output_shapes(node)]
    ctx = RuleContext(node, in_shapes, out_shapes, mesh.shape[axis])
    found = [c for c in node.meta[meta.CANDIDATES][axis] if feasible(c, ctx)]
    rule = REGISTRY.lookup(node.target) if node.op == "call_function" else None
    if rule is not None and rule.combine is not None:
        found = [c for c in found if rule.combine(node, [*prior, c])]
    wanted_method = node.meta.get(meta.ATTENTION_HINT, {}).get(axis)
    if wanted_method is not None:
        found = [c for c in found if method_of(node, c) == wanted_method]
    hint = node.meta.get(meta.HINT, {}).get(axis)
    if hint is not None:
        found = [c for c in found if c.output == hint]
    for pos, placement in node.meta.get(meta.INPUT_HINT, {}).get(axis, {}).items():
        found = [c for c in found if c.inputs[pos] == placement]
    reason = why_not(node, wanted_method, mesh.shape[axis]) if not found and wanted_method is not None else ""
    if reason:
        raise HintError(f"context-parallel strategy {wanted_method!r} on mesh axis {mesh.names[axis]!r} cannot be used "
                        f"at {node.meta.get(meta.PATH) or 'the top level'} (node {node.name!r}): {reason}")
    if not found:
        what = (f"hint {hint!r}" if hint is not None else f"context-parallel strategy {wanted_method!r}"
                if wanted_method is not None else "the split counts given for it")
        raise HintError(f"{what} on mesh axis {mesh.names[axis]!r} cannot be met at {node.meta.get(meta.PATH) or ''} "
                        f"(node {node.name!r}, op {node.target}): after the earlier axes' choices no sharding of "
                        "this op produces it; relax the hint or shard a dim that divides evenly")
    return found


def sequential_candidates(node, axis, mesh, choices) -> list:
    """`axis_candidates` less those after which a hint of the node on a later axis cannot be met (solving the
    axes one after another, an expert weight hinted S(0) on the inner axis must not take that dim on the
    outer one first); all of them when none keeps it (the later axis then raises the hint's error).

    >>> [str(c) for c in axis_candidates(weight, 0, two.mesh, {weight: []})]
    ['() -> R', '() -> S(0)', '() -> S(1)']
    >>> [str(c) for c in sequential_candidates(weight, 0, two.mesh, {weight: []})]
    ['() -> R', '() -> S(1)']
    """
    found = axis_candidates(node, axis, mesh, choices)
    later = [b for b in range(axis + 1, mesh.ndim) if any(b in node.meta.get(key, {})
                                                          for key in (meta.HINT, meta.INPUT_HINT, meta.ATTENTION_HINT))]
    if not later:
        return found

    def keeps(cand) -> bool:
        try:
            return all(axis_candidates(node, b, mesh, {node: [*choices[node], cand]}) for b in later)
        except HintError:
            return False
    return [c for c in found if keeps(c)] or found


def joint_candidates(node, mesh) -> list[list]:
    """Every feasible combination of `node`'s candidates over all mesh axes (one list per combination, in
    axis order), hints applied; a combination whose earlier axes leave a later axis's hint unmet is dropped,
    and only when every one is does the hint's error stand.

    >>> [[str(c) for c in combo] for combo in joint_candidates(weight, two.mesh)]  # S(0) goes to b alone
    [['() -> R', '() -> S(0)'], ['() -> S(1)', '() -> S(0)']]
    """
    found = [[]]
    for axis in range(mesh.ndim):
        extended, unmet = [], None
        for prior in found:
            try:
                extended += [prior + [c] for c in axis_candidates(node, axis, mesh, {node: prior})]
            except HintError as error:  # this prior leaves the hint unmet; another may not
                unmet = unmet or error
        if not extended:
            raise unmet
        found = extended
    return found
