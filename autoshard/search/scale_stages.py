"""One candidate's pipeline stages at real scale: ZeRO over the data-parallel axis, which layers to recompute
and how, the memory of a device and the stage rows of the 1F1B formula (`pipeline_search.estimate_step`).

ZeRO over dp (stage z; gradient bytes g of each parameter, in its dtype, on dp ranks over the dp link):

  z = 0  parameters replicated: all-reduce of g once per step
  z = 1  optimizer state sharded: reduce-scatter of g and all-gather of the updated parameters once per step
  z = 2  gradients sharded too: reduce-scatter of g every micro-batch, all-gather once per step
  z = 3  parameters sharded (FSDP): all-gather forward, again backward, reduce-scatter of g, every micro-batch

Memory: a parameter with gradient and optimizer state costs `cost/zero_cost.memory_scale` x its bytes without
ZeRO; ZeRO-3 adds two units' gathered parameters (FSDP gathers one while the next is prefetched). No
communication overlaps compute, as everywhere in the cost model; the per-micro-batch collectives count as
latency (they do not grow with the micro-batch).

Recomputation, per layer: none, selective (`scale_units.selective_savings`) or full. "auto" takes the steps
none -> selective -> full that save the most bytes per second of recompute first, only while the stage does not
fit; a layer whose selective step saves fewer bytes per second than its full step skips it.

>>> from autoshard.cost.profiles import Link
>>> replica = Replica(dp=4, zero=3, link=Link(0.0, 1e9), factor=6.0)
>>> replica.static_bytes(param_bytes=8e9, grads=[1e9]) / 1e9   # 16 bytes per 2-byte parameter over 4 ranks
2.0
"""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost.collective_time import (
    all_gather_time,
    all_reduce_time,
    reduce_scatter_time,
)
from autoshard.cost.profiles import Link
from autoshard.cost.zero_cost import memory_scale

ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_POLICIES = ("auto", "selective", "full")


@dataclass(frozen=True)
class Replica:
    """How a candidate holds its parameters across data parallelism: dp ranks, the ZeRO stage over them, the
    dp link and the optimizer state factor (bytes of optimizer state per parameter byte).

    >>> Replica(dp=8, zero=0, link=Link(0.0, 1e9), factor=6.0).sync([1e9])   # all-reduce once per step
    (1.75, 0.0)
    """

    dp: int
    zero: int
    link: Link
    factor: float

    def sync(self, grads) -> tuple[float, float]:
        """(seconds once per step, seconds every micro-batch) of the dp collectives of parameters with these
        gradient bytes.

        >>> Replica(dp=8, zero=3, link=Link(0.0, 1e9), factor=6.0).sync([1e9])  # 2 gathers + 1 reduce-scatter
        (0.0, 2.625)
        """
        step = micro = 0.0
        k, link = self.dp, self.link
        for g in grads:
            gather, scatter = all_gather_time(g, k, link), reduce_scatter_time(g, k, link)
            if self.zero == 0:
                step += all_reduce_time(g, k, link)
            elif self.zero == 1:
                step += scatter + gather
            elif self.zero == 2:
                step, micro = step + gather, micro + scatter
            else:
                micro += 2 * gather + scatter
        return step, micro

    def static_bytes(self, param_bytes: float, grads) -> float:
        """Bytes a unit's parameters hold on a device (with gradients and optimizer state) under this ZeRO
        stage; `param_bytes` is what they hold without ZeRO, `grads` the trained parameters' bytes.

        >>> Replica(dp=4, zero=1, link=Link(0.0, 1e9), factor=6.0).static_bytes(8e9, [1e9]) / 1e9  # 2 + 7/4 bytes
        3.75
        """
        if self.zero == 0 or self.dp == 1:
            return param_bytes
        trained = (2 + self.factor) * sum(grads)
        return param_bytes - trained + trained * memory_scale(self.zero, self.dp, self.factor, False)


def _levels(unit) -> list:
    """The recompute steps of one layer as (saves, seconds, flops, level), in order."""
    full = (unit.checkpoint_saves, unit.recompute_s, unit.flops, 2)
    sel = (unit.selective_saves, unit.selective_s, unit.selective_flops, 1)
    if sel[0] <= 0 or sel[0] * (full[1] - sel[1]) <= (full[0] - sel[0]) * sel[1]:
        return [full]  # the selective step is not the better buy first
    return [sel, tuple(f - s for f, s in zip(full[:3], sel[:3])) + (2,)]


def _live(unit, level) -> float:
    return (0.0, unit.selective_saves, unit.checkpoint_saves)[level]


def choose_recompute(layers, policy: str, need: float, inflight: int) -> dict:
    """{index in `layers`: level (1 selective, 2 full)}: every layer at the policy's level ("selective",
    "full"), or ("auto") the cheapest steps first until the bytes saved per sequence, times the micro-batches
    in flight, less the largest layer live again while recomputed, cover `need` (bytes per sequence over the
    budget).

    >>> from autoshard.search.scale_units import Unit
    >>> layer = Unit("layers.1", checkpoint_saves=10.0, recompute_s=2.0, selective_saves=8.0, selective_s=1.0)
    >>> choose_recompute([layer, layer], "auto", need=8.0, inflight=2)  # one selective step: 2 x 8 - 8 >= 8
    {0: 1}
    >>> choose_recompute([layer, layer], "full", need=0.0, inflight=1)
    {0: 2, 1: 2}
    """
    if policy != "auto":
        return dict.fromkeys(range(len(layers)), RECOMPUTE_POLICIES.index(policy))
    steps = sorted(((-saves / max(seconds, 1e-12), n, i, saves, level)
                    for i, u in enumerate(layers) for n, (saves, seconds, _, level) in enumerate(_levels(u))))
    chosen, saved, live = {}, 0.0, 0.0
    for *_, i, saves, level in steps:
        if inflight * saved - live >= need:
            break
        chosen[i] = level
        saved += saves
        live = max(live, _live(layers[i], level))
    return chosen


def stage_rows(units, shared, bounds, transfer, replica: Replica, b: int, m: int, budget: float, policy: str):
    """Stage rows for estimate_step (at one sequence per micro-batch), the fullest device's bytes, per stage the
    layers recomputed fully and selectively, and the recomputed forward FLOPs per sequence.

    >>> from autoshard.search.scale_units import Unit
    >>> layer = Unit("layers.1", seconds=1.0, activation_bytes=10.0, checkpoint_saves=9.0, recompute_s=0.3,
    ...              param_bytes=16.0, grad_bytes=[2.0], is_layer=True)
    >>> rows, peak, full, sel, flops = stage_rows([layer] * 4, [], [(0, 4)], [0.0] * 4, replica, b=1, m=1,
    ...                                           budget=100.0, policy="auto")
    >>> peak, full   # ZeRO-3 over 4: 4 x 4 bytes of parameters, 2 x 2 gathered, 4 x 10 of activations
    (60.0, (0,))
    """
    rows, peak, full, selective, redone = [], 0.0, [], [], 0.0
    gathered = 2 * max(sum(u.grad_bytes) for u in units) if replica.zero == 3 and replica.dp > 1 else 0.0
    for s, (a, z) in enumerate(bounds):
        members = units[a:z]
        inflight = min(len(bounds) - s, m)
        mine = [entry for entry in shared if any(a <= i < z for i in entry[3])]
        static = gathered + sum(replica.static_bytes(u.param_bytes, u.grad_bytes) for u in members)
        static += sum(replica.static_bytes(nbytes, grads) for nbytes, _, grads, _ in mine)
        kept = b * sum(u.activation_bytes for u in members)
        layers = [u for u in members if u.is_layer]
        chosen = choose_recompute(layers, policy, (static + inflight * kept - budget) / b, inflight)
        kept -= b * sum(_live(layers[i], level) for i, level in chosen.items())
        live = max((_live(layers[i], level) for i, level in chosen.items()), default=0.0)
        peak = max(peak, static + inflight * kept + b * live)
        full.append(sum(level == 2 for level in chosen.values()))
        selective.append(sum(level == 1 for level in chosen.values()))
        redone += sum(layers[i].flops if level == 2 else layers[i].selective_flops for i, level in chosen.items())
        syncs = [replica.sync(u.grad_bytes) for u in members] + [replica.sync(entry[2]) for entry in mine]
        micro = sum(t for _, t in syncs)
        seconds = sum(u.seconds for u in members) + micro
        seconds += sum(layers[i].recompute_s if level == 2 else layers[i].selective_s for i, level in chosen.items())
        seconds += (transfer[a] if a > 0 else 0.0) + (transfer[z] if z < len(units) else 0.0)
        rows.append({"seconds": seconds, "latency_s": sum(u.fixed_s for u in members) + micro,
                     "sync_s": sum(u.sync_s for u in members) + sum(entry[1] for entry in mine)
                     + sum(t for t, _ in syncs)})
    return rows, peak, tuple(full), tuple(selective), redone
