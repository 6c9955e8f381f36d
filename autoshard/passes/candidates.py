"""strategies, the pass: list every node's feasible sharding candidates on each mesh axis.

Reads: node vals, `autoshard.kind`, the compile mode (auto / semi-auto). Writes
`autoshard.candidates` = [per axis: [AxisStrategy]] on every placeholder and op node.
Invariant: every list holds at least the all-replicated candidate (always correct). An op without a rule
is replicated, with one warning per op and parallelize call.
Placeholders choose an output placement only: R or S(d) (never P). In semi-auto mode (any hint
given) a parameter or buffer without a hint on an axis stays replicated there, as in MindSpore.
"""
from __future__ import annotations

import warnings

from autoshard.ir import meta
from autoshard.ir.graph_utils import data_parallel_axes
from autoshard.ir.placement import R, Shard
from autoshard.ir.warn_once import warn_once
from autoshard.passes.contract import NORMALIZED, compiler_pass
from autoshard.strategies import AxisStrategy, candidates_for, tensor_inputs
from autoshard.strategies.base import is_tensor_value, output_shapes


@compiler_pass("strategies", reads=(NORMALIZED, meta.KIND, meta.HINT), writes=(meta.CANDIDATES,))
def strategies(state) -> None:
    """The pass: write `autoshard.candidates` (per mesh axis, the feasible AxisStrategy list) on every
    placeholder and op. A linear on an axis of size 2 may shard the batch (S(0)), the output features
    (S(1)), or the contracted features (partial output P):

    >>> import torch
    >>> from autoshard.passes.pass_lists import state_before
    >>> state = state_before("strategies", torch.nn.Linear(4, 2), (2,), (torch.randn(8, 4),), axis_names=("dp",))
    >>> strategies(state)
    >>> linear = next(n for n in state.gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    >>> linear.meta["autoshard.candidates"][0]
    [(R, R) -> R, (S(0), R) -> S(0), (S(1), S(1)) -> P, (R, S(0)) -> S(1), (P, R) -> P, (R, P) -> P]
    """
    mesh = state.mesh
    semi_auto = state.semi_auto
    batch_axes = data_parallel_axes(state.gm.graph.nodes)
    unknown: dict[str, list[str]] = {}
    for node in state.gm.graph.nodes:
        if node.op == "placeholder":
            node.meta[meta.CANDIDATES] = [_placeholder_candidates(node, axis, k, semi_auto, axis in batch_axes)
                                          for axis, k in enumerate(mesh.shape)]
        elif node.op == "call_function" and is_tensor_value(node):
            in_shapes = [_first_shape(n) for n in tensor_inputs(node)]
            outs = output_shapes(node)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                node.meta[meta.CANDIDATES] = [_on_axis(candidates_for(node, in_shapes, outs, k), k, node, axis)
                                              for axis, k in enumerate(mesh.shape)]
            if caught:
                unknown.setdefault(str(node.target), []).append(node.name)
    for op, names in unknown.items():  # once per op and parallelize call (its candidates and layers say it once)
        warn_once(f"autoshard: no sharding rule for {op} (nodes {', '.join(names[:5])}"
                  f"{' ...' if len(names) > 5 else ''}); they run replicated on every rank. Register a rule "
                  "in autoshard/strategies to shard them.", key=op)


def _on_axis(candidates: list[AxisStrategy], axis_size: int, node, axis: int) -> list[AxisStrategy]:
    """A size-1 axis (e.g. the intra-op mesh of a pure pipeline) has nothing to split: replicated, or
    what a hint asks for (the same thing on one device)."""
    if axis_size > 1:
        return candidates
    hint = node.meta.get(meta.HINT, {}).get(axis)
    keep = [c for c in candidates if not c.splits_work][:1]
    return keep + [c for c in candidates if hint is not None and c.output == hint and c not in keep] or candidates


def _first_shape(node):
    shapes = output_shapes(node)
    return shapes[0] if shapes else ()


def _placeholder_candidates(node, axis: int, axis_size: int, semi_auto: bool,
                            batch_axis: bool = False) -> list[AxisStrategy]:
    found = [AxisStrategy((), R)]
    hinted = node.meta.get(meta.HINT, {}).get(axis)
    if axis_size == 1:  # nothing to split; a hint's placement is the same thing on one device
        return found + ([AxisStrategy((), hinted)] if hinted is not None and hinted != R else [])
    if semi_auto and (node.meta.get(meta.KIND) != "param" or batch_axis):
        # Unhinted inputs and buffers stay replicated, and so do parameters on the user's data-parallel
        # axes (the user chose data parallelism there).
        return found + ([AxisStrategy((), hinted)] if hinted is not None and hinted != R else [])
    # Elsewhere an unhinted parameter may be stored sharded in semi-auto mode too: a bias then follows
    # its weight's sharding (GSPMD's propagation) instead of being chunked, or the activation moved.
    shape = _first_shape(node)
    found += [AxisStrategy((), Shard(d)) for d, size in enumerate(shape) if size % axis_size == 0 and size >= axis_size]
    return found
