"""codegen: the last pass: every rank's module can be built (each local shape divides its mesh axes).

Reads the graph after insert_comm (`autoshard.spec` everywhere, collectives as call nodes). Writes nothing:
the per-rank GraphModules are built on demand by `autoshard.lowering.rank_module.build_rank_module`
(`prog.graph(rank)`), after compiling, from the graph this pass checked.

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("tp",),
...                              hints={"layers.0.weight": {"tp": "S(0)"}, "layers.0.bias": {"tp": "S(0)"},
...                                     "layers.1.weight": {"tp": "S(1)"}, "layers.1.bias": {"tp": "R"}})
"""
from __future__ import annotations

import torch

from autoshard.ir import meta
from autoshard.ir.errors import PlanError
from autoshard.ir.placement import local_shape
from autoshard.passes.contract import compiler_pass


@compiler_pass("codegen", reads=(meta.SPEC, meta.COMM, "state.grad_reduce"), writes=())
def codegen(state) -> None:
    """The pass: checks that every rank's module can be built (local shapes divide); modules are built
    lazily by `build_rank_module` (`prog.graph(rank)`).

    >>> codegen(prog.state)  # nothing to report: every local shape divides
    """
    for node in state.gm.graph.nodes:
        if meta.SPEC in node.meta and isinstance(node.meta.get("val"), torch.Tensor):
            try:
                local_shape(node.meta["val"].shape, node.meta[meta.SPEC], state.mesh.shape)
            except ValueError as exc:
                raise PlanError(f"node {node.name!r} ({node.meta.get(meta.PATH)}): {exc}") from None
