"""Invariant checks run between passes in tests and debug mode; errors name node, placement and axis.

>>> import torch
>>> from autoshard.passes.pipelines import state_before
>>> from autoshard.ir.placement import Spec, S
>>> state = state_before("codegen", torch.nn.Linear(4, 2), (2,), (torch.randn(8, 4),), axis_names=("dp",))
>>> verify_state(state, after="predict")  # a state the passes left: nothing to report
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


def verify_state(state, after: str) -> None:
    """Raise VerifierError naming the node, placement and axis where the graph breaks an invariant after
    pass `after`: a node without a FakeTensor value or candidates, a partial placeholder, a shard of a
    dim the tensor lacks, an edge whose producer's spec is not what its consumer needs.

    >>> verify_state(state, after="codegen")  # the module docstring's state: fine
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
        if after in ("insert_comm", "predict", "codegen") and node.op == "call_function" and meta.IN_SPECS in node.meta:
            for pos, producer in enumerate(tensor_inputs(node)):
                want = node.meta[meta.IN_SPECS][pos]
                have = producer.meta.get(meta.SPEC)
                if have != want:
                    raise VerifierError(f"after {after}: node {node.name!r} input {pos} ({producer.name!r}) is "
                                        f"{have!r} but the op's strategy needs {want!r}")
