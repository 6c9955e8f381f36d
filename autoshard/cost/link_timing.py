"""Timing each mesh axis's collectives as training meets them, and fitting the link figures the cost model reads
(autoshard/cost/collective_time.py) to those timings: `time_axis_task` runs on every rank of `calibrate`
(autoshard/cost/calibrate.py), `fit_link` turns its timings into a Link.

>>> fit_link([(4096, 2.1e-5), (1048576, 5.3e-4)], k=2)  # doctest: +ELLIPSIS
Link(alpha=..., bandwidth=...)
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from autoshard.cost.collective_time import BACK_TO_BACK, IN_FLIGHT
from autoshard.cost.profiles import Link
from autoshard.ir.mesh import Mesh
from autoshard.runtime.launch import communicator_for
from autoshard.runtime.zero_overlap import REDUCE_SCATTERS_IN_FLIGHT

REPEATS = 5
SMALL_REPEATS = 400  # the latency-bound calls: a heavy tail (a peer thread waking late) that training pays too


def time_axis_task(rank, world, mesh_json, sizes):
    """Seconds of one all-reduce, reduce-scatter and all-to-all of each size (the rank's input) on each axis, and of
    one all-gather of that output size, as the runtime runs them, between compute (`between_compute_seconds`): the
    communicator's (on gloo the reductions gathered in a fixed order and summed, bitwise reproducible: an all-reduce
    moves (k-1) x the bytes where a ring moves 2(k-1)/k, a reduce-scatter (k-1) x where a ring moves (k-1)/k, so the
    fitted bandwidths are what the runtime's collectives get, and an all-gather pays the whole latency an all-reduce
    pays; an all-to-all is the backend's own on gloo and NCCL alike; NCCL's rings elsewhere). Keys (collective,
    axis, bytes). On ranks of a process group (autoshard/runtime/pool.py's example runs it on two):

    >>> run_distributed(time_axis_task, 2, Mesh((2,), ("dp",)).to_json(), [4096])[0][("all_reduce", "dp", 4096)] > 0
    ... # doctest: +SKIP
    True
    """
    mesh = Mesh.from_json(mesh_json)
    comm = communicator_for(mesh)
    out = {}
    for axis in mesh.names:
        k = mesh.shape[mesh.axis(axis)]
        for size in sizes:
            reduced = torch.ones(max(size // 4 // k, 1) * k, dtype=torch.float32)  # splits evenly over the axis
            gathered = torch.ones(max(size // 4 // k, 1), dtype=torch.float32)
            runs = {"all_reduce": lambda x=reduced, a=axis: comm.all_reduce(x, a),
                    "all_gather": lambda x=gathered, a=axis: comm.all_gather(x, a, 0),
                    "reduce_scatter": lambda x=reduced, a=axis: comm.reduce_scatter(x, a, 0),
                    "all_to_all": lambda x=reduced, a=axis: comm.all_to_all(x, a, 0, 0)}
            repeats = max(REPEATS, min(SMALL_REPEATS, 2**24 // size))  # small messages: cheap, and noisier
            for name, run in runs.items():
                run()  # warm up the connection
                out[(name, axis, size)] = between_compute_seconds(run, repeats)
            if size == min(sizes):  # and called back to back, what the compute before them adds to their latency
                out[(BACK_TO_BACK, axis, size)] = between_compute_seconds(runs["all_gather"], repeats, _no_compute)
                out[(IN_FLIGHT, axis, size)] = in_flight_seconds(comm, reduced, axis, max(REPEATS, repeats // 8))
    out[("compute_before", None, 0)] = _compute_seconds(REPEATS)
    return out


def _no_compute():
    return None


def in_flight_seconds(comm, tensor, axis: str, repeats: int, run: int = 8) -> float:
    """Seconds per reduce-scatter of `tensor` on `axis` where `run` of them start one right after another, at most
    REDUCE_SCATTERS_IN_FLIGHT in flight, as ZeRO-3's deferred ones run in `sync_grads` (autoshard/runtime/
    zero_overlap.py): the mean over `repeats` runs, each after a barrier. On gloo two in flight overlap (4 ranks of
    this 2-core VM: 2.8 ms each, 5.4 ms after compute).

    >>> from autoshard.runtime.simulator import run_on_mesh  # simulated ranks: the collectives complete as started
    >>> run_on_mesh(Mesh((2,), ("dp",)), lambda comm: in_flight_seconds(comm, torch.ones(4), "dp", 2) > 0.0)
    {0: True, 1: True}
    """
    spent = 0.0
    for _ in range(repeats):
        if dist.is_initialized():  # every rank starts the run together
            dist.barrier()
        started, flight = time.perf_counter(), []
        for _ in range(run):
            flight.append(comm.start_reduce_scatter(tensor, axis, 0))
            if len(flight) > REDUCE_SCATTERS_IN_FLIGHT:
                flight.pop(0).wait()
        for pending in flight:
            pending.wait()
        spent += (time.perf_counter() - started) / run
    return spent / repeats


def _compute_seconds(repeats: int) -> float:
    """Mean wall seconds of `layer_compute` with every rank running it (the compute `between_compute_seconds` puts
    before each collective it times, on this machine with its contention)."""
    dist.barrier()
    started = time.perf_counter()
    for _ in range(repeats):
        layer_compute()
    return (time.perf_counter() - started) / repeats


def layer_compute(n: int = 16, width: int = 128):
    """`n` matmuls of `width` squared and a tanh each; the defaults about half a millisecond (on this machine): what
    a layer computes between two of training's collectives.

    >>> tuple(layer_compute(n=2, width=8).shape)
    (8, 8)
    """
    chain = torch.full((width, width), 0.01)
    y = chain
    for _ in range(n):
        y = torch.tanh(y @ chain)
    return y


def between_compute_seconds(run, repeats: int, compute=layer_compute) -> float:
    """Seconds of one `run()` (a collective) as training meets it: after some compute, not back to back; the mean
    over `repeats` calls, each timed on its own (a rank waits there for peers whose compute ends later, as in
    training). On gloo a small message then costs about twice what back-to-back calls take (measured on 2 ranks
    of this 2-core machine: 4 KiB all-gathers 480 us back to back, 920-1280 us between matmuls: the peers' threads
    sleep between calls and their compute ends at different times). The calls alone are timed, not the loop less
    the compute timed apart, whose own variation entered the difference (two runs put one all-gather's latency at
    0.85 and 1.25 ms); the mean, not the median: training pays the slow calls too (the median was 0.35 ms where
    ZeRO-3's gathers took 0.84 ms each). Every rank of the collective's group calls it.

    >>> between_compute_seconds(lambda: None, 3) >= 0.0  # doctest: +SKIP
    True
    """
    dist.barrier()
    spent = 0.0
    for _ in range(repeats):
        compute()
        start = time.perf_counter()
        run()
        spent += time.perf_counter() - start
    return spent / repeats


def fit_link(samples, k: int, gathers=None, reduce_scatters=None, all_to_alls=None, back_to_back=None,
             in_flight=None) -> Link:
    """Alpha and bandwidth of the ring model from [(bytes, seconds)] of all-reduces over k ranks (and, from
    `gathers`, all-gathers' [(output bytes, seconds)], `reduce_scatters` and `all_to_alls` [(input bytes,
    seconds)], the link's figures for those; `back_to_back`, all-gathers called one right after another, and
    `in_flight`, reduce-scatters in a run of them (`in_flight_seconds`), are kept as timed: `all_gather_time`'s
    `after_s`, `reduce_scatter_time`'s `in_flight`): the bandwidth from the least-squares slope over the sizes but the
    smallest, alpha from the smallest message's time less its bytes' share. (An intercept fitted under 16 MiB
    messages is their noise: a run put gloo's alpha at 0.1 us, and ZeRO-3's per-parameter gathers at a tenth of
    their measured time.)

    >>> link = fit_link([(b, 2 * 1e-5 + b / 1e9) for b in (4096, 65536, 1048576)], k=2)  # 10 us, 1 GB/s
    >>> round(link.alpha * 1e6, 3), round(link.bandwidth / 1e9, 3)
    (10.0, 1.0)
    >>> fit_link([(4096, 1e-6), (65536, 2e-6)], k=1)
    Link(alpha=1e-07, bandwidth=10000000000000.0, gather=None, reduce_scatter=None, all_to_all=None)
    >>> round(link.measured_seconds("all_reduce", 65536, 2) * 1e6, 3)  # the timings too (interpolated between)
    85.536
    >>> gather = fit_link([(b, 2e-5 + b / 1e9) for b in (4096, 65536)], 2,
    ...                   [(b, 4e-5 + b / 2e9) for b in (4096, 65536)]).gather  # one 40 us step, half the bytes
    >>> round(gather[0] * 1e6, 3), round(gather[1] / 1e9, 3)
    (40.0, 1.0)
    """
    if k < 2:  # nothing crosses an axis of one rank
        return Link(1e-7, 1e13)
    link = Link(*_fit_ring(samples, 2 * (k - 1), 2 * (k - 1) / k))
    ring = [None if timed is None else _fit_ring(timed, k - 1, (k - 1) / k)
            for timed in (gathers, reduce_scatters, all_to_alls)]
    # the timings themselves too: the collective times interpolate them (Link.measured_seconds)
    timed = (("all_reduce", samples), ("all_gather", gathers), ("reduce_scatter", reduce_scatters),
             ("all_to_all", all_to_alls), (BACK_TO_BACK, back_to_back), (IN_FLIGHT, in_flight))
    measured = (k, tuple((name, tuple(sorted(points))) for name, points in timed if points))
    return Link(link.alpha, link.bandwidth, *ring, measured=measured)


def _fit_ring(samples, steps: int, share: float) -> tuple[float, float]:
    """(alpha, bandwidth) of time = steps x alpha + share x bytes / bandwidth (see fit_link)."""
    samples = sorted(samples)
    large = samples[1:] if len(samples) > 2 else samples
    a = np.array([[1.0, share * b] for b, _ in large], dtype=np.float64)
    t = np.array([s for _, s in large], dtype=np.float64)
    (_, beta), *_ = np.linalg.lstsq(a, t, rcond=None)
    beta = max(float(beta), 1e-13)
    smallest, seconds = samples[0]
    return max((seconds - share * smallest * beta) / steps, 1e-7), 1.0 / beta
