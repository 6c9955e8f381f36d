"""fuse_comm: an all-gather whose gradient comes back partial on the same axis becomes one collective.

Reads the collective nodes insert_comm made (`autoshard.comm`). Writes: every `grad_all_reduce` on
axis a whose chain of collectives (single-user comm nodes back towards the producer) contains an
`all_gather` on a is removed, and that all_gather becomes `all_gather_sum_grad` (forward all-gather,
backward reduce-scatter). This is the duality pair of sequence parallelism (Megatron-SP's g / g-bar)
and of 2-D/3-D tensor parallelism: gathering the input of an op that splits its work must cost a
reduce-scatter in backward, not an all-reduce plus a free chunk (twice the bytes).
Why it is exact: the gradient's all-reduce on a commutes with the collectives on other axes between
the two nodes, and all-reduce followed by this rank's chunk is a reduce-scatter.
Also, with mixed precision and ZeRO-3, a parameter's `param_all_gather` followed by the policy's cast
to bfloat16 becomes one gather of the cast shard (its backward casts the gradient back to float32
before the reduce-scatter): FSDP2's param_dtype / reduce_dtype, half the gather bytes.
Invariant: the values and gradients every rank computes are unchanged; specs are unchanged.

>>> import torch
>>> from autoshard.passes.pass_lists import state_before
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 8))
>>> hints = {"1:output": {"tp": "S(0)"}, "2.weight": {"tp": "S(0)"}}  # tokens split, then column parallel
>>> state = state_before("fuse_comm", net, (2,), (torch.randn(8, 4),), axis_names=("tp",), hints=hints)
>>> def collectives(state):
...     return [n.meta["autoshard.comm"]["op"] for n in state.gm.graph.nodes if "autoshard.comm" in n.meta]
>>> collectives(state)
['chunk', 'all_gather', 'grad_all_reduce']
"""
from __future__ import annotations

from autoshard.ir import meta
from autoshard.ir.mixed_precision import downcast_dtype
from autoshard.passes.contract import compiler_pass
from autoshard.runtime.collectives import COLLECTIVES


@compiler_pass("fuse_comm", reads=(meta.COMM,), writes=(meta.COMM,))
def fuse_comm(state) -> None:
    """The pass: fuse every all_gather with the grad_all_reduce on its axis that follows it.

    >>> fuse_comm(state)  # state: see the module docstring
    >>> collectives(state)
    ['chunk', 'all_gather_sum_grad']
    """
    graph = state.gm.graph
    for node in list(graph.nodes):
        info = node.meta.get(meta.COMM)
        if not info or info["op"] != "grad_all_reduce":
            continue
        gather = _gather_on_axis(node.args[0], info["axis"])
        if gather is None:
            continue
        gather.target = COLLECTIVES["all_gather_sum_grad"]
        gather.meta[meta.COMM] = {**gather.meta[meta.COMM], "op": "all_gather_sum_grad"}
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
    for node in list(graph.nodes):
        _gather_in_compute_dtype(graph, node)
    graph.lint()
    state.gm.recompile()



def _gather_on_axis(value, axis):
    """The all_gather on `axis` in the single-user chain of collectives ending at `value`, or None."""
    while value.meta.get(meta.KIND) == "comm" and len(value.users) == 1:
        info = value.meta[meta.COMM]
        if info["axis"] == axis:
            return value if info["op"] == "all_gather" else None
        value = value.args[0]
    return None


def _gather_in_compute_dtype(graph, cast) -> None:
    """Mixed precision with ZeRO-3: a parameter's gather followed by the policy's cast gathers the cast
    shard instead (FSDP2's param_dtype: half the bytes and the gathered memory of bf16); its backward casts
    the gradient back before the reduce-scatter (reduce_dtype float32). The cast node goes."""
    dtype = downcast_dtype(cast)
    gather = cast.args[0] if dtype is not None else None
    info = getattr(gather, "meta", {}).get(meta.COMM)
    if not info or info["op"] != "param_all_gather" or len(gather.users) != 1 or len(gather.args) != 4:
        return
    gather.args = (*gather.args, dtype)
    gather.meta[meta.COMM] = {**info, "args": [*info["args"], dtype]}
    gather.meta["val"] = cast.meta["val"]
    cast.replace_all_uses_with(gather)
    graph.erase_node(cast)
