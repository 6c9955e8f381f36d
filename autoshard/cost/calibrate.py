"""`python -m autoshard calibrate`: measure what the cost model uses on this machine, on prod(mesh) ranks at once.

Spawns prod(mesh) gloo ranks. Each times all_reduce of several message sizes on each axis's groups (between
compute, as training calls them), and time = 2 (k-1) alpha + 2 (k-1)/k * bytes / bandwidth (the ring model the
cost model uses) gives alpha (latency: the smallest message) and bandwidth (the slope over the larger ones) per
axis (`link_timing.fit_link`), and likewise for all-gathers, reduce-scatters and all-to-alls (each as the runtime runs it);
then how much of an asynchronous collective compute hides meanwhile (`comm_overlap_share`).
Then the ranks time matmuls per dtype, attention and a memory-bound op, forward and backward
(autoshard/cost/compute_rates.py), all at once on GPUs; CPU ranks as many at once as the host has cores, and the
rates kept are those times the slowdown of all ranks computing at once (`compute_slowdown`: the contention training
on this machine meets; a pipeline's idle ranks leave their cores to the busy ones, `HardwareProfile.host_cores`);
the slowest rank's figures are kept. Prints the fitted figures and writes a HardwareProfile JSON usable with
`--profile` / `profile=`.

    python -m autoshard calibrate --mesh 2,2 --axis-names dp,tp --output profile.json

>>> DTYPES  # the matmul dtypes timed unless `--dtypes` says
('float32', 'float64', 'bfloat16')
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from autoshard.cost.collective_time import BACK_TO_BACK, IN_FLIGHT
from autoshard.cost.compute_rates import ComputeRates, measure_compute
from autoshard.cost.link_timing import fit_link, layer_compute, time_axis_task
from autoshard.cost.profiles import CPU_PROFILE, HardwareProfile
from autoshard.ir.errors import UserInputError
from autoshard.ir.mesh import Mesh
from autoshard.runtime.launch import communicator_for, run_distributed
from autoshard.runtime.zero_overlap import REDUCE_SCATTERS_IN_FLIGHT

# Message sizes timed per axis: latency-bound to bandwidth-bound, past a full gradient bucket (grad_sync.py's
# BUCKET_BYTES, 25 MiB), so that every bucket's all-reduce is priced between two timed sizes (`Link.measured_seconds`).
# The time per byte is not smooth: on 2 gloo ranks of this VM 12 MiB took 16 ms, 16 MiB 31 ms, 24 MiB 57 ms; so 12 and
# 24 MiB are timed too (with 8 and 16 alone, the zoo GPT-2's 13 MB bucket read 34 ms where it takes 20: its
# data-parallel step 1.10x the measured, 0.99 with them).
CALIBRATION_SIZES = (4096, 65536, 262144, 1048576, 4194304, 8388608, 12582912, 16777216, 25165824, 33554432)
DTYPES = ("float32", "float64", "bfloat16")  # the matmul rates measured (what training and `verify` run in)


def _calibrate_task(rank, world, mesh_json, sizes, dtypes=DTYPES):
    """This rank's link timings (`time_axis_task`), the pipeline runtime's costs, the overlap of an asynchronous
    collective with compute, then its compute rates (as JSON) on the device it trains on: its GPU where the host has
    them (CUDA events time the kernels, every rank at once), else the CPU (as many ranks at once as there are cores),
    and how much slower all ranks compute together than that (`compute_slowdown`; 1 where none wait their turn)."""
    links = time_axis_task(rank, world, mesh_json, sizes)
    action = pipeline_runtime_seconds(rank, world) if world > 1 else (0.0, 0.0)
    overlap = comm_overlap_share(Mesh.from_json(mesh_json)) if world > 1 else 1.0
    device = f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    memory = torch.cuda.get_device_properties(device).total_memory if device != "cpu" else None
    # CPU ranks measure no more at once than the host has cores (`calibrated_profile` adds the contention of all):
    # four ranks of 2 cores timed together read each other's descheduling, 1.3-1.8x the steps they predicted
    at_once = world if device != "cpu" else min(world, host_cores())
    rates = None
    for turn in range(-(-world // at_once)):
        dist.barrier()
        if rank // at_once == turn:
            rates = measure_compute(device, dtypes).to_json()
    dist.barrier()
    slowdown = compute_slowdown(rank, world, at_once) if at_once < world else 1.0
    return links, rates, memory, action, overlap, slowdown


def compute_slowdown(rank: int, world: int, at_once: int, seconds: float = 0.3) -> float:
    """How much longer a layer's compute (`layer_compute`) takes on this rank with all `world` ranks computing at once
    than with `at_once` (the host's cores): the host's cores shared by its ranks, and what sharing them costs besides
    (the scheduler's slices: the ranks do not progress evenly). Every rank calls it.

    >>> compute_slowdown(dist.get_rank(), 4, 2)  # doctest: +SKIP
    2.3
    """
    def timed(active: bool) -> float:
        dist.barrier()
        if not active:
            return 0.0
        started, calls = time.perf_counter(), 0
        while calls < 5 or time.perf_counter() - started < seconds:
            layer_compute()
            calls += 1
        return (time.perf_counter() - started) / calls

    layer_compute()
    alone = [timed(rank // at_once == turn) for turn in range(-(-world // at_once))]
    together = timed(True)
    dist.barrier()
    return together / max(alone)


OVERLAP_BYTES = 4 * 2**20  # a gradient bucket's order (grad_sync.py's buckets, ZeRO-3's layer gathers)


def comm_overlap_share(mesh: Mesh, repeats: int = 5) -> float:
    """The share of an asynchronous all-reduce's time that compute running meanwhile hides, as the runtime overlaps
    gradient buckets and ZeRO-3's gathers (the communicator's `start_all_reduce` on the mesh's first axis): with
    `m` the collective alone, `c` a matmul chain of about as long alone and `b` both (started, computed, waited),
    (c + m - b) / min(c, m), between 0 (nothing hidden: the plain sum) and 1 (hidden whole). Every rank calls it.

    >>> comm_overlap_share(Mesh((2,), ("dp",)))  # doctest: +SKIP
    0.4
    """
    comm = communicator_for(mesh)
    axis = mesh.names[0]
    message = torch.ones(OVERLAP_BYTES // 4)

    def collective():
        return comm.start_all_reduce(message.clone(), axis).wait()

    def chain(n):
        return layer_compute(n, width=256)

    def timed(run) -> float:
        run()
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)

    m = timed(collective)
    n = max(1, round(m / max(timed(lambda: chain(8)) / 8, 1e-9)))
    n = _world_max(n)
    c = timed(lambda: chain(n))

    def both():
        pending = comm.start_all_reduce(message.clone(), axis)
        chain(n)
        pending.wait()

    b = timed(both)
    return min(max((c + m - b) / min(c, m), 0.0), 1.0)


def _world_max(value: int) -> int:
    """The largest `value` over the ranks (every rank must run the same chain: the collective pairs them)."""
    box = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item())


PIPELINE_COUNTS = (1, 4)  # micro-batches of the two timed steps, per stage (1F1B needs at least one per stage)
FANOUT = 6  # tensors a stage sends in the second timed pipeline (transformers' stages send 3-7: masks, rotary tables)


class _Fanout(torch.nn.Module):
    """A pipeline stage of one small Linear that takes and sends `k` tensors (one when k is 1)."""

    def __init__(self, k: int):
        super().__init__()
        self.k, self.linear = k, torch.nn.Linear(16, 16)

    def forward(self, *xs):
        y = self.linear(xs[0] if len(xs) == 1 else sum(xs))
        return y if self.k == 1 else tuple(y * (i + 1) for i in range(self.k))


def pipeline_runtime_seconds(rank: int, world: int, repeats: int = 9) -> tuple[float, float]:
    """(per schedule action, per tensor a stage sends beyond its first): the seconds torch.distributed.pipelining
    spends besides compute and transfer, on this rank of a `world`-stage 1F1B pipeline of one small Linear per
    stage. An action's: the step's growth per micro-batch (a forward, a backward and their two messages on the
    critical path) less a message's round trip, halved. A tensor's: the same growth with the stages sending FANOUT
    tensors each way (each is its own message), less the one-tensor growth, per extra tensor and direction.
    Measured on 2 ranks of this 2-core machine: 0.3-0.55 ms an action (a small Linear's forward and backward take
    0.02), about 0.1 ms a tensor. Every rank of the default process group calls it (calibrate's ranks do):

    >>> pipeline_runtime_seconds(dist.get_rank(), dist.get_world_size())  # doctest: +SKIP
    (0.00044, 0.0001)
    """
    from torch.distributed.pipelining import (  # the runtime's; not at import: heavy
        PipelineStage,
        Schedule1F1B,
    )

    def loss(out, target):
        return out.sum() if isinstance(out, torch.Tensor) else sum(o.sum() for o in out)

    counts = [world * count for count in PIPELINE_COUNTS]
    growth = {}
    for k in (1, FANOUT):
        steps = {}
        for m in counts:
            stage = PipelineStage(_Fanout(k), rank, world, torch.device("cpu"))
            schedule = Schedule1F1B(stage, m, loss_fn=loss)
            x = torch.ones(4 * m, 16)
            times = []
            for _ in range(repeats + 2):
                dist.barrier()
                started = time.perf_counter()
                if rank == 0:
                    schedule.step(x)
                elif rank == world - 1:
                    schedule.step(target=x)
                else:
                    schedule.step()
                times.append(time.perf_counter() - started)
            steps[m] = statistics.median(times[2:])
        low, high = counts
        growth[k] = (steps[high] - steps[low]) / (high - low)
    message, trips = torch.ones(64), []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        if rank == 0:
            dist.send(message, 1)
            dist.recv(message, 1)
        elif rank == 1:
            dist.recv(message, 0)
            dist.send(message, 0)
        trips.append(time.perf_counter() - started)
    action = max(growth[1] - statistics.median(trips), 0.0) / 2
    return action, max(growth[FANOUT] - growth[1], 0.0) / (2 * (FANOUT - 1))


def slowest_rates(per_rank: list) -> ComputeRates:
    """The slowest figure of each rate over the ranks' `ComputeRates.to_json()`: ranks that share a host contend
    for it, and every collective waits for the slowest rank (measured: the median rank's rates predicted steps on 4
    ranks of 2 cores at 0.3-0.7 of the measured ones, the slowest's closer).

    >>> fast = ComputeRates({"float32": 4e10}, 2e10, 8e9, 1e-5, 2e-5, optimizer_updates=((0.0, 1e-6, 4e10),)).to_json()
    >>> slow = ComputeRates({"float32": 2e10}, 3e10, 6e9, 3e-5, 1e-5, optimizer_updates=((0.0, 2e-6, 3e10),)).to_json()
    >>> slowest_rates([fast, slow])
    ComputeRates(matmul_flops={'float32': 20000000000.0}, attention_flops=20000000000.0, memory_bandwidth=6000000000.0, op_overhead_s=3e-05, grad_op_overhead_s=2e-05, recorded_op_overhead_s=0.0, view_overhead_s=0.0, view_grad_overhead_s=0.0, op_overheads=(), split_backward_factor=1.0, optimizer_updates=((0.0, 2e-06, 30000000000.0),))
    """
    names = [name for name, _ in per_rank[0]["dtype_flops"]]
    slowest = {key: max(r[key] for r in per_rank) for key in ("op_overhead_s", "grad_op_overhead_s",
                                                               "recorded_op_overhead_s", "view_overhead_s",
                                                               "view_grad_overhead_s")}
    tables = [{name: costs for name, *costs in r["op_overheads"]} for r in per_rank]
    ops = sorted(set.intersection(*(set(table) for table in tables)))  # an op timed on every rank
    slowest["op_overheads"] = tuple((op, *(max(table[op][i] for table in tables) for i in range(3))) for op in ops)
    slowest["split_backward_factor"] = max(r["split_backward_factor"] for r in per_rank)
    updates = [{row[0]: row[1:] for row in r.get("optimizer_updates", ())} for r in per_rank]
    slowest["optimizer_updates"] = tuple((f, max(u[f][0] for u in updates), min(u[f][1] for u in updates))
                                         for f in sorted(set.intersection(*(set(u) for u in updates))))
    return ComputeRates({name: min(dict(r["dtype_flops"])[name] for r in per_rank) for name in names},
                        min(r["attention_flops"] for r in per_rank), min(r["memory_bandwidth"] for r in per_rank),
                        **slowest)


def calibrate_command(args) -> int:
    """`python -m autoshard calibrate`: time every axis and the compute rates on prod(mesh) spawned gloo ranks,
    print them, write the profile (`args` as the command line parses them). Spawning ranks takes seconds, so the
    example does not run here:

    >>> import argparse
    >>> args = argparse.Namespace(mesh=(2,), axis_names=("dp",), sizes="4096,65536", dtypes=("float32",), output=None)
    >>> calibrate_command(args)  # doctest: +SKIP
    axis dp (size 2): all-reduces: alpha 41.3 us, bandwidth 1.127 GB/s; all-gathers: ...
    matmul float32 61.2 GFLOP/s, ...
    {...}
    0
    """
    mesh = Mesh.of(args.mesh, args.axis_names)
    sizes = [int(s) for s in args.sizes.split(",")]
    dtypes = tuple(getattr(args, "dtypes", None) or DTYPES)
    unknown = [name for name in dtypes if not isinstance(getattr(torch, name, None), torch.dtype)]
    if unknown:
        raise UserInputError(f"--dtypes {','.join(unknown)}: not torch dtypes; give names such as float32,bfloat16")
    profile = calibrated_profile(mesh, sizes, dtypes)
    text = json.dumps(profile.to_json(), indent=1)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        print(f"wrote {args.output}")
    else:
        print(text)
    return 0


def calibrated_profile(mesh: Mesh, sizes=CALIBRATION_SIZES, dtypes=DTYPES, quiet: bool = False,
                       runner=run_distributed) -> HardwareProfile:
    """The HardwareProfile of this machine measured on `mesh.size` ranks (`runner(task, world, *args)`: spawned
    gloo ranks by default, or a worker pool's run); prints each figure unless `quiet`.

    >>> calibrated_profile(Mesh((2,), ("dp",)), quiet=True)  # doctest: +SKIP
    HardwareProfile(name='calibrated', ...)
    """
    results = runner(_calibrate_task, mesh.size, mesh.to_json(), list(sizes), tuple(dtypes))
    slowest = {key: max(r[0][key] for r in results.values()) for key in results[0][0]}
    links = []
    for axis, name in enumerate(mesh.names):
        timed = {collective: [(size, slowest[(collective, name, size)]) for size in sizes]
                 for collective in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
        small = min(sizes)
        link = fit_link(timed["all_reduce"], mesh.shape[axis], timed["all_gather"], timed["reduce_scatter"],
                        timed["all_to_all"], [(small, slowest[(BACK_TO_BACK, name, small)])],
                        [(small, slowest[(IN_FLIGHT, name, small)])])
        links.append(link)
        if not quiet:
            figures = "; ".join(f"{label}: alpha {link.of(c).alpha * 1e6:.1f} us, bandwidth "
                                f"{link.of(c).bandwidth / 1e9:.3f} GB/s"
                                for c, label in (("all_reduce", "all-reduces"), ("all_gather", "all-gathers"),
                                                 ("reduce_scatter", "reduce-scatters"), ("all_to_all", "all-to-alls")))
            print(f"axis {name} (size {mesh.shape[axis]}): {figures}; a {small} B all-gather "
                  f"{timed['all_gather'][0][1] * 1e3:.3f} ms after compute, "
                  f"{slowest[(BACK_TO_BACK, name, small)] * 1e3:.3f} ms back to back; a {small} B reduce-scatter "
                  f"{timed['reduce_scatter'][0][1] * 1e3:.3f} ms after compute, "
                  f"{slowest[(IN_FLIGHT, name, small)] * 1e3:.3f} ms in a run of them "
                  f"({REDUCE_SCATTERS_IN_FLIGHT} in flight)")
    memories = [r[2] for r in results.values() if r[2]]  # a GPU's memory; a CPU rank keeps CPU_PROFILE's figure
    # CPU ranks share the host's cores: the rates of all mesh.size ranks computing at once, from those measured with
    # as many at once as there are cores (the cores shared evenly: HardwareProfile.contention)
    cores = 0 if memories else host_cores()
    share = max(max(r[5] for r in results.values()), 1.0)  # a collective waits for the slowest rank
    rates = slowest_rates([r[1] for r in results.values()]).scaled(share, share).work_scaled(share)
    if not quiet:
        print(", ".join(f"matmul {name} {rate / 1e9:.1f} GFLOP/s" for name, rate in rates.matmul_flops.items())
              + f", attention {rates.attention_flops / 1e9:.1f} GFLOP/s, memory-bound ops "
              f"{rates.memory_bandwidth / 1e9:.2f} GB/s, {rates.op_overhead_s * 1e6:.1f} us per op forward (+ "
              f"{rates.recorded_op_overhead_s * 1e6:.1f} us when autograd records it) and "
              f"{rates.grad_op_overhead_s * 1e6:.1f} us backward, {rates.view_overhead_s * 1e6:.1f} us per view "
              f"forward and {rates.view_grad_overhead_s * 1e6:.1f} us backward, optimizer updates "
              + " and ".join(f"{rate / 1e9:.1f} GB/s + {per_tensor * 1e6:.1f} us per tensor (state factor {f:g})"
                             for f, per_tensor, rate in rates.optimizer_updates)
              + (f" ({mesh.size} ranks on {cores} cores: timed {cores} at a time, then scaled by the {share:.2f}x "
                 "they compute slower all together)" if share > 1 else ""))
    action = max(r[3][0] for r in results.values())
    tensor = max(r[3][1] for r in results.values())
    overlap = min(r[4] for r in results.values())
    gap = slowest[("compute_before", None, 0)] if mesh.size > 1 else 0.0
    if not quiet and mesh.size > 1:
        print(f"collectives timed after {gap * 1e3:.3f} ms of compute each (an all-gather sooner after the last costs "
              "less: ZeRO-3's gathers)")
        print(f"pipeline runtime: {action * 1e3:.3f} ms per schedule action and {tensor * 1e3:.3f} ms per tensor a "
              "stage sends beyond its first, a backward split in two (zero bubble) "
              f"{rates.split_backward_factor:.2f} x the fused one; compute hides {overlap:.0%} of an asynchronous "
              "collective")
    return HardwareProfile(name="calibrated", peak_flops=rates.matmul_flops.get("float32", CPU_PROFILE.peak_flops),
                           memory_bandwidth=rates.memory_bandwidth,
                           memory_bytes=float(min(memories)) if memories else CPU_PROFILE.memory_bytes,
                           devices_per_node=max(mesh.size, 1), axis_links=tuple(links),
                           dtype_flops=tuple(sorted(rates.matmul_flops.items())),
                           attention_flops=rates.attention_flops, op_overhead_s=rates.op_overhead_s,
                           grad_op_overhead_s=rates.grad_op_overhead_s,
                           recorded_op_overhead_s=rates.recorded_op_overhead_s,
                           view_overhead_s=rates.view_overhead_s, view_grad_overhead_s=rates.view_grad_overhead_s,
                           op_overheads=rates.op_overheads, pipeline_action_s=action, pipeline_tensor_s=tensor,
                           split_backward_factor=rates.split_backward_factor, comm_overlap=overlap,
                           host_cores=cores, rates_ranks=mesh.size,
                           collective_gap_s=gap, optimizer_updates=rates.optimizer_updates)


def host_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else the machine's count).

    >>> host_cores() >= 1
    True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1
