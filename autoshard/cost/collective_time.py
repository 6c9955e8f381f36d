"""Seconds of communication: alpha-beta collectives per mesh axis (ring formulas; on an axis calibrate timed, its
measured times interpolated, `Link.measured_seconds`), one emitted collective forward and backward, a placement
conversion, a redistribution over several axes. The links come from the hardware profile (cost/profiles.py).

Byte conventions (also what the runtime counts): all_reduce/reduce_scatter/all_to_all carry the
rank's input tensor, all_gather the gathered output.
"""
from __future__ import annotations

import functools
import math

from autoshard.cost.profiles import HardwareProfile, Link
from autoshard.ir.collective_table import TABLE, collective_for, direction_bytes
from autoshard.ir.placement import Partial, Placement, Shard
from autoshard.ir.redistribute import plan_redistribute
from autoshard.runtime.grad_sync import BUCKET_BYTES

# The table calibrate writes of all-gathers called back to back (`Link.measured`; `all_gather_time`'s `after_s`)
BACK_TO_BACK = "all_gather_back_to_back"
# ... and of reduce-scatters started one after another, the runtime's REDUCE_SCATTERS_IN_FLIGHT of them in flight, as
# ZeRO-3's deferred ones run in `sync_grads` (`reduce_scatter_time`'s `in_flight`)
IN_FLIGHT = "reduce_scatter_in_flight"

INF = float("inf")  # the cost of what cannot be chosen (a forbidden pair of placements)


def all_reduce_time(nbytes: float, k: int, link: Link) -> float:
    """Seconds of a ring all-reduce of `nbytes` over `k` ranks: 2(k-1)/k of the bytes plus 2(k-1) latencies.

    >>> all_reduce_time(1e6, 4, Link(1e-5, 1e9))
    0.00156
    >>> timed = Link(1e-3, 1e8, measured=(4, (("all_reduce", ((4096, 0.004), (1048576, 0.010))),)))
    >>> all_reduce_time(526336, 4, timed)  # between the sizes calibrate timed on this axis
    0.007
    """
    if k == 1:
        return 0.0
    measured = link.measured_seconds("all_reduce", nbytes, k)
    return measured if measured is not None else 2 * (k - 1) / k * nbytes / link.bandwidth + 2 * (k - 1) * link.alpha


def grad_sync_time(nbytes: float, k: int, link: Link, bucket_bytes: float = BUCKET_BYTES) -> float:
    """Seconds of one parameter's gradient all-reduce over `k` ranks in the runtime's buckets (grad_sync.py: up to
    BUCKET_BYTES a message): its bytes' share of a bucket's all-reduce (`all_reduce_time` of `bucket_bytes`, at most
    BUCKET_BYTES: the measured time where calibrate timed the axis, else the line), a parameter of a bucket's size or
    more its own all-reduce. Linear in the parameters, so the ILP and ZeRO price the sync alike. The buckets are
    full ones by default; the ILP gives the bytes a data-parallel plan syncs where those fill less than one
    (`data_parallel_bucket_bytes`), so that the sync of the plan it weighs against sharding is the runtime's one
    all-reduce (the line through calibrate's timings can miss a bucket's measured time 2x either way: on this
    VM's 2 gloo ranks the zoo GPT-2's 13 MB took 22 ms where the line said 39, and the ILP sharded half its
    parameters to avoid a sync that predict, pricing the measured bucket, called 10% faster). predict adds what
    the buckets really take beyond these shares (autoshard/cost/sync_buckets.py).

    >>> link = Link(1e-5, 1e9)
    >>> grad_sync_time(BUCKET_BYTES, 4, link) == all_reduce_time(BUCKET_BYTES, 4, link)
    True
    >>> grad_sync_time(1e3, 4, link) < all_reduce_time(1e3, 4, link)  # a small gradient shares its bucket's latency
    True
    >>> grad_sync_time(1e3, 4, link, bucket_bytes=4e3) == all_reduce_time(4e3, 4, link) / 4  # a quarter of 4 kB
    True
    """
    if k == 1:
        return 0.0
    bucket = min(bucket_bytes, BUCKET_BYTES)
    if nbytes >= bucket:
        return all_reduce_time(nbytes, k, link)
    return nbytes / bucket * all_reduce_time(bucket, k, link)


def all_gather_time(out_bytes: float, k: int, link: Link, after_s: float | None = None, gap_s: float = 0.0) -> float:
    """Seconds of a ring all-gather producing `out_bytes` per rank (also a reduce-scatter of that input).

    `after_s`: the compute seconds since this rank's previous collective, where known. Calibrate times its
    collectives after `gap_s` of compute (`HardwareProfile.collective_gap_s`), as training meets most of them, and
    back to back too (`BACK_TO_BACK`, the smallest message): one called sooner after the last costs less, the
    difference shrinking linearly to nothing at `gap_s` (on gloo the peers' threads are still awake and their
    compute has not drifted apart: ZeRO-3's per-parameter gathers of a small model; measured on this 2-core VM,
    a 4 KiB all-gather on 4 ranks 3.5 ms back to back, 3.8 ms after 0.3 ms of compute, 4.7 ms after 1 ms).

    >>> all_gather_time(1e6, 4, Link(1e-5, 1e9))
    0.00078
    >>> timed = Link(1e-5, 1e9, measured=(2, (("all_gather", ((4096, 9e-4),)), (BACK_TO_BACK, ((4096, 5e-4),)))))
    >>> [round(all_gather_time(4096, 2, timed, after, gap_s=1e-3) * 1e3, 3) for after in (None, 0.0, 5e-4, 2e-3)]
    [0.9, 0.5, 0.7, 0.9]
    """
    link = link.of("all_gather")
    if k == 1:
        return 0.0
    measured = link.measured_seconds("all_gather", out_bytes, k)
    if measured is None:
        return (k - 1) / k * out_bytes / link.bandwidth + (k - 1) * link.alpha
    back_to_back = link.measured_seconds(BACK_TO_BACK, 0, k)
    if after_s is None or back_to_back is None or gap_s <= 0.0 or after_s >= gap_s:
        return measured
    saved = max(link.measured_seconds("all_gather", 0, k) - back_to_back, 0.0)  # the smallest message's latency
    return measured - saved * (1.0 - after_s / gap_s)


def reduce_scatter_time(in_bytes: float, k: int, link: Link, latency_share: float = 1.0,
                        in_flight: bool = False) -> float:
    """Seconds of a ring reduce-scatter of `in_bytes` per rank under the link's reduce-scatter figures (calibrated:
    on gloo the exact path's gather and sum); `latency_share`: the part of its latencies this tensor pays where
    several travel as one collective (ZeRO-3's per-layer reduce-scatters, cost/zero_cost.py); `in_flight`: started
    right after another, with the runtime's usual number in flight (ZeRO-3's deferred ones in `sync_grads`), its
    latency the one calibrate timed so where it did (`IN_FLIGHT`; measured on 4 ranks of this 2-core VM: 5.4 ms
    after compute, 2.8 ms two in flight).

    >>> reduce_scatter_time(1e6, 4, Link(1e-5, 1e9)) == all_gather_time(1e6, 4, Link(1e-5, 1e9))
    True
    >>> reduce_scatter_time(1e6, 4, Link(1e-5, 1e9, (1e-5, 1e9), (1e-5, 2.5e8)))  # four times the bytes' time
    0.00303
    >>> timed = Link(1e-5, 1e9, measured=(2, (("reduce_scatter", ((4096, 9e-4), (65536, 1e-3))),
    ...                                       (IN_FLIGHT, ((4096, 5e-4),)))))
    >>> [round(reduce_scatter_time(65536, 2, timed, in_flight=f) * 1e3, 3) for f in (False, True)]  # 0.4 ms less
    [1.0, 0.6]
    """
    link = link.of("reduce_scatter")
    if k == 1:
        return 0.0
    measured = link.measured_seconds("reduce_scatter", in_bytes, k)
    if measured is not None:  # its latency (the smallest message's time) paid in part where others share it
        latency = link.measured_seconds("reduce_scatter", 0, k)
        quicker = link.measured_seconds(IN_FLIGHT, 0, k) if in_flight else None
        return measured - latency + latency_share * (latency if quicker is None else min(quicker, latency))
    return (k - 1) / k * in_bytes / link.bandwidth + (k - 1) * link.alpha * latency_share


def all_to_all_time(local_bytes: float, k: int, link: Link) -> float:
    """Seconds of an all-to-all of `local_bytes` per rank over `k` ranks.

    >>> all_to_all_time(1e6, 4, Link(1e-5, 1e9))
    0.00078
    """
    link = link.of("all_to_all")
    if k == 1:
        return 0.0
    measured = link.measured_seconds("all_to_all", local_bytes, k)
    return measured if measured is not None else (k - 1) / k * local_bytes / link.bandwidth + (k - 1) * link.alpha


# Each emitted collective (autoshard.comm's "op") as the ring collectives its forward and backward run
# (ir/collective_table.py); the ILP, predict and the stage table all price
# communication through `collective_time`.
COLLECTIVES = {name: (row.forward, row.backward) for name, row in TABLE.items()}
_RING = {"all_reduce": all_reduce_time, "all_gather": all_gather_time, "reduce_scatter": reduce_scatter_time,
         "all_to_all": all_to_all_time}


def collective_time(op: str, fwd_bytes: float, bwd_bytes: float, k: int, link: Link) -> float:
    """Seconds of one emitted collective, forward and backward: a direction that moves no bytes (a chunk's
    forward is a local slice; a value without a gradient has no backward) costs nothing.

    >>> link = Link(1e-5, 1e9)
    >>> collective_time("reduce_scatter", 1e6, 1e6, 4, link) == reduce_scatter_time(1e6, 4, link) + all_gather_time(1e6, 4, link)
    True
    >>> collective_time("chunk", 0, 0, 4, link)   # forward slice, no gradient: free
    0.0
    """
    total = 0.0
    for ring, nbytes in zip(COLLECTIVES[op], (fwd_bytes, bwd_bytes)):
        if ring is not None and nbytes > 0:
            total += _RING[ring](nbytes, k, link)
    return total


def collective_latency(op: str, fwd_bytes: float, bwd_bytes: float, k: int, link: Link) -> float:
    """The part of `collective_time` that does not shrink with the bytes (per-message latencies).

    >>> round(collective_latency("all_gather_sum_grad", 1e6, 1e6, 4, Link(1e-5, 1e9)), 9)  # 2 x 3 steps of 10 us
    6e-05
    """
    return collective_time(op, fwd_bytes, bwd_bytes, k, link.latency_only())


@functools.lru_cache(maxsize=65536)  # the ILP prices the same conversion of the same bytes many times over
def conversion_time(src: Placement, dst: Placement, nbytes: float, k: int, link: Link,
                    with_backward: bool = True) -> float:
    """Forward (+ backward, for values with a gradient) time of turning `src` into `dst` on one axis;
    `nbytes`: the tensor's bytes, whole on this axis.

    >>> from autoshard.ir.placement import P, R, S
    >>> conversion_time(S(0), R, 1e6, 4, Link(1e-5, 1e9))   # all-gather forward, nothing backward
    0.00078
    >>> conversion_time(P, R, 1e6, 4, Link(1e-5, 1e9))      # all-reduce
    0.00156
    """
    if src == dst:
        return 0.0
    if isinstance(dst, Partial):
        return INF  # making a partial sum out of a full tensor is never needed (even on a size-1 axis)
    if k == 1:
        return 0.0
    name = collective_for(src, dst)
    src_bytes, dst_bytes = (nbytes / k if isinstance(p, Shard) else nbytes for p in (src, dst))
    return collective_time(name, *direction_bytes(name, src_bytes, dst_bytes, with_backward), k, link)


@functools.lru_cache(maxsize=65536)
def fused_gather_saving(src, dst, partial_axes, global_bytes: float, mesh_shape,
                        profile: HardwareProfile) -> dict[int, float]:
    """What fuse_comm changes on the chain `plan_redistribute(src, dst)` followed by a gradient all-reduce on each
    of `partial_axes`: where the last step on such an axis is an all-gather, the two become one
    all_gather_sum_grad (its backward a reduce-scatter of the gathered block), and the chain's all-reduce on that
    axis is gone. Per such axis: the gather's seconds less the fused op's (negative: the chain pays the fused op).

    >>> from autoshard.ir.placement import R, S, Spec
    >>> link = HardwareProfile().link((2, 2), 1)
    >>> (change,) = fused_gather_saving(Spec([S(0), S(0)]), Spec([S(0), R]), (1,), 1e6, (2, 2),
    ...                                 HardwareProfile()).values()
    >>> math.isclose(change, -reduce_scatter_time(5e5, 2, link))
    True
    """
    steps, spec, blocks = plan_redistribute(src, dst), src, []
    for step in steps:
        spec = step.apply(spec)
        blocks.append(global_bytes / math.prod(mesh_shape[a] for a, p in enumerate(spec) if isinstance(p, Shard)))
    saving = {}
    for axis in partial_axes:
        last = next((i for i in reversed(range(len(steps))) if steps[i].axis == axis), None)
        if last is None or steps[last].op != "all_gather":
            continue
        saving[axis] = fused_gather_change(blocks[last], mesh_shape[axis], profile.link(mesh_shape, axis))
    return saving


def fused_gather_change(gathered_bytes: float, k: int, link: Link) -> float:
    """An all-gather's seconds less those of the all_gather_sum_grad fuse_comm makes of it and the gradient
    all-reduce after it (negative: the fused op adds the reduce-scatter of the gathered block in backward).

    >>> link = Link(1e-5, 1e9)
    >>> math.isclose(fused_gather_change(1e6, 4, link), -reduce_scatter_time(1e6, 4, link))
    True
    """
    return (collective_time("all_gather", gathered_bytes, 0, k, link)
            - collective_time("all_gather_sum_grad", gathered_bytes, gathered_bytes, k, link))


@functools.lru_cache(maxsize=65536)
def redistribution_time(src, dst, global_bytes: float, mesh_shape, profile: HardwareProfile,
                        with_backward: bool = True) -> float:
    """Forward (+ backward) seconds of the exact collectives `plan_redistribute(src, dst)` emits.

    >>> from autoshard.ir.placement import R, S, Spec
    >>> redistribution_time(Spec([S(0), R]), Spec([R, R]), 1e6, (2, 2), HardwareProfile())
    7.500000000000001e-06
    """
    try:
        steps = plan_redistribute(src, dst)
    except Exception:  # noqa: BLE001  (an impossible conversion, e.g. to a partial sum)
        return INF
    total, spec = 0.0, src
    for step in steps:
        local = global_bytes / math.prod(mesh_shape[a] for a, p in enumerate(spec) if isinstance(p, Shard))
        k, link = mesh_shape[step.axis], profile.link(mesh_shape, step.axis)
        after = step.apply(spec)
        out = global_bytes / math.prod(mesh_shape[a] for a, p in enumerate(after) if isinstance(p, Shard))
        total += collective_time(step.op, *direction_bytes(step.op, local, out, with_backward), k, link)
        spec = after
    return total
