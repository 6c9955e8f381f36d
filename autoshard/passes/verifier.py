"""Invariant checks run between passes in tests and debug mode; errors name node, placement and axis.

>>> import torch
>>> from autoshard.passes.pass_lists import state_before
>>> from autoshard.ir.placement import Spec, S
>>> state = state_before("codegen", torch.nn.Linear(4, 2), (2,), (torch.randn(8, 4),), axis_names=("dp",))
>>> verify_state(state, after="predict", invariants=("edges_match",))  # as the passes left it: fine
"""
from __future__ import annotations

import torch

from autoshard.ir import meta
from autoshard.ir.placement import Partial, Shard
from autoshard.strategies import tensor_inputs


class VerifierError(AssertionError):
    """A pass left the graph in a state that breaks an invariant (an autoshard bug).

    >>> weight = next(n for n in state.gm.graph.nodes if n.op == "placeholder")
    >>> kept, weight.meta["autoshard.spec"] = weight.meta["autoshard.spec"], Spec([S(2)])  # a 2-d weight
    >>> try:
    ...     verify_state(state, after="a broken pass")
    ... except VerifierError as exc:
    ...     print(exc)
    ... finally:
    ...     weight.meta["autoshard.spec"] = kept
    after a broken pass: node 'p_model_weight' placement S(2) on axis 'dp' names a dim of a 2-d tensor
    """


def verify_state(state, after: str, invariants=()) -> None:
    """Raise VerifierError naming the node, placement and axis where the graph breaks an invariant after
    pass `after`: always that every node has a FakeTensor value and candidates, no placeholder is partial
    and no shard names a dim the tensor lacks; then each named one of INVARIANTS (those the passes so far
    ensure, declared in their contracts).

    >>> verify_state(state, after="codegen", invariants=("edges_match",))  # the module docstring's state: fine
    """
    graph = state.gm.graph
    graph.lint()
    names = state.mesh.names
    for node in graph.nodes:
        if node.op in ("placeholder", "call_function") and "val" not in node.meta:
            raise VerifierError(f"after {after}: node {node.name!r} has no FakeTensor 'val'")
        cands = node.meta.get(meta.CANDIDATES)
        if cands is not None:
            for axis, found in enumerate(cands):
                if not found:
                    raise VerifierError(f"after {after}: node {node.name!r} has no candidate on axis {names[axis]!r}")
        spec = node.meta.get(meta.SPEC)
        if spec is None:
            continue
        if node.op == "placeholder" and any(isinstance(p, Partial) for p in spec):
            raise VerifierError(f"after {after}: placeholder {node.name!r} is partial ({spec!r})")
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for axis, p in enumerate(spec):
                if isinstance(p, Shard) and not 0 <= p.dim < val.dim():
                    raise VerifierError(f"after {after}: node {node.name!r} placement {p!r} on axis "
                                        f"{names[axis]!r} names a dim of a {val.dim()}-d tensor")
    for name in invariants:
        INVARIANTS[name](state, after)


def edges_match(state, after: str) -> None:
    """Every edge's producer spec is what its consumer's strategy needs (insert_comm establishes it).

    >>> edges_match(state, after="insert_comm")
    """
    for node in state.gm.graph.nodes:
        if node.op == "call_function" and meta.IN_SPECS in node.meta:
            for pos, producer in enumerate(tensor_inputs(node)):
                want = node.meta[meta.IN_SPECS][pos]
                have = producer.meta.get(meta.SPEC)
                if have != want:
                    raise VerifierError(f"after {after}: node {node.name!r} input {pos} ({producer.name!r}) is "
                                        f"{have!r} but the op's strategy needs {want!r}")


INVARIANTS = {"edges_match": edges_match}  # by the name a pass's contract `ensures`
