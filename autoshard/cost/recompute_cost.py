"""What recomputation costs and saves: predict's figures adjusted for the checkpoint regions (the regions
themselves are chosen by the recompute pass, autoshard/passes/recompute.py). Reads predict's NODE_COST and
COMM_COST and the regions' `autoshard.recompute` marks.

>>> import autoshard
>>> from autoshard.ir.meta import RECOMPUTE
>>> from autoshard.zoo import gpt2
>>> model, inputs, loss_fn = gpt2(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}}, checkpoint=["layers.*"])
>>> region = [n for n in prog.state.gm.graph.nodes if n.meta.get(RECOMPUTE) == "layers.0"]
"""
from __future__ import annotations

from autoshard.cost.prediction import node_cost
from autoshard.ir import meta
from autoshard.ir.meta import COMM_COST, RECOMPUTE


def recompute_seconds(state, node) -> tuple[float, dict]:
    """Seconds of recomputing one node in backward, and the forward bytes per axis a collective resends.

    >>> seconds, resent = recompute_seconds(prog.state, region[0])
    >>> seconds > 0, resent
    (True, {})
    """
    # NODE_COST counts forward + backward (a collective's forward part as predict split it); ops without a tensor
    # output (checks) have none
    forward = node_cost(node).forward_seconds()
    if node.meta.get(meta.KIND) != "comm":
        return forward, {}
    return forward, {node.meta[meta.COMM]["axis"]: node.meta[COMM_COST].fwd_bytes}


def op_seconds(state, node) -> float:
    """A node's predicted seconds per step (forward and backward) with, inside a checkpoint region, its recompute
    in backward: what a pipeline stage's time is made of (cut_stages sums it per stage).

    >>> op_seconds(prog.state, region[0]) == node_cost(region[0]).seconds + recompute_seconds(prog.state, region[0])[0]
    True
    """
    seconds = node_cost(node).seconds
    return seconds + recompute_seconds(state, node)[0] if node.meta.get(RECOMPUTE) else seconds


def dropped_activations(nodes) -> list:
    """The nodes of a checkpoint region whose outputs are no longer kept for backward: those only the
    region's own ops use (the region's outputs are the next region's saved inputs).

    >>> dropped = dropped_activations(region)
    >>> 0 < len(dropped) < len(region), region[-1] in dropped  # the layer's last op feeds the next layer
    (True, False)
    """
    members = set(nodes)
    return [n for n in nodes if all(u in members for u in n.users)]


def region_savings(state, nodes) -> tuple[float, float]:
    """(activation bytes per rank no longer kept, seconds of recompute) of checkpointing `nodes`.

    >>> saved, seconds = region_savings(prog.state, region)
    >>> saved > 0 and seconds > 0
    True
    """
    saved = sum(node_cost(n).memory_bytes for n in dropped_activations(nodes))
    return saved, sum(recompute_seconds(state, n)[0] for n in nodes)


def account_recompute(state) -> None:
    """Adjust `state.predicted` (written by predict) for the checkpoint regions: forward compute and
    forward collectives run twice; a region keeps only its outputs, and while one region is recomputed
    its activations are live again (the largest region counts once).

    >>> prog.plan.predicted.recompute_s > 0  # predict called it
    True
    """
    regions = state.recompute_regions
    if not regions:
        return
    predicted = state.predicted
    by_region: dict = {}
    for node in state.gm.graph.nodes:
        if RECOMPUTE in node.meta:
            by_region.setdefault(node.meta[RECOMPUTE], []).append(node)
    largest = 0.0
    for nodes in by_region.values():
        saved, _ = region_savings(state, nodes)
        predicted.memory_bytes_per_rank -= int(saved)
        largest = max(largest, saved)
        for node in nodes:
            seconds, resent = recompute_seconds(state, node)
            if resent:
                predicted.add_comm(seconds)
            else:
                predicted.add_compute(seconds)
            for axis, nbytes in resent.items():
                predicted.comm_bytes_per_step[axis].fwd += nbytes
    predicted.memory_bytes_per_rank += int(largest)
    predicted.recompute_s = sum(recompute_seconds(state, n)[0] for nodes in by_region.values() for n in nodes)
