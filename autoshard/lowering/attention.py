"""How codegen writes a context-parallel attention into a rank's graph (autoshard/strategies/attention.py):

- "allgather" with `is_causal`: the rank holds query rows from its block's first row on, so the attention runs
  shifted by that row: `causal_rows_attention` (the fused kernel on the keys before the rows and on the rows' own
  block), or with attention dropout (a random op, drawn by the rank's stream) an explicit shifted causal mask
  (`causal_rows_mask`); without `is_causal` the op runs as it is.
- "ring": the op becomes `ring_attention(..., axis=<the axis>)`, which passes the key/value blocks around.

>>> import autoshard
>>> from autoshard.zoo import gpt2
>>> model, inputs, loss_fn = gpt2(batch=2, seq=8, n_layers=1)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("cp",),
...                              hints={"input:0": {"cp": "S(1)"}, "*:attention": {"cp": "ring"}})
>>> [n.target.__name__ for n in prog.graph(0).graph.nodes if "attention" in str(n.target)]
['ring_attention']
"""
from __future__ import annotations

import torch
from torch import fx

from autoshard.ir import meta
from autoshard.ir.op_schema import argument, arguments
from autoshard.ir.placement import shard_index
from autoshard.runtime.context_parallel import (
    causal_rows_attention,
    causal_rows_mask,
    ring_attention,
)

aten = torch.ops.aten


def lower_attention(new: fx.Node, node: fx.Node, mesh, coord) -> None:
    """Rewrite `new` (the rank graph's copy of `node`) when `node`'s chosen strategy splits the sequence.

    >>> prog.graph(1).code.count("ring_attention(")  # one attention, one ring
    1
    """
    if node.target is not aten.scaled_dot_product_attention.default:
        return
    methods = [(axis, c.method) for axis, c in enumerate(node.meta.get(meta.CHOICE, ())) if c.method]
    if not methods:
        return
    axis, method = methods[0]
    args = arguments(new)  # by name, defaults filled in: what ring_attention and causal_rows_attention take
    query, key = args.pop("query"), args.pop("key")
    value = args.pop("value")
    if method == "ring":
        new.target = ring_attention
        new.args, new.kwargs = (query, key, value), {**args, "axis": mesh.names[axis]}
        return
    if args["is_causal"]:  # allgather: this rank's rows start at its block's first row
        q_spec = node.meta[meta.IN_SPECS][0]
        q = argument(node, "query").meta["val"]  # the whole query, as planned
        rows = q.dim() - 2
        index, count = shard_index(q_spec, rows, coord, mesh.shape)
        offset = index * (q.shape[rows] // count)
        if not args["dropout_p"]:  # the fused kernel on the rows' two key ranges: no rows x keys mask
            new.target = causal_rows_attention
            new.args, new.kwargs = (query, key, value), {**args, "row_offset": offset}
            return
        with new.graph.inserting_before(new):
            mask = new.graph.call_function(causal_rows_mask, (query, key, offset))
        # the mask belongs where its attention does (a recomputed region, a pipeline stage)
        mask.meta.update({k: node.meta[k] for k in (meta.RECOMPUTE, meta.STAGE, "nn_module_stack") if k in node.meta})
        new.args, new.kwargs = (query, key, value), {**args, "attn_mask": mask, "is_causal": False}
