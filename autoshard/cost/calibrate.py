"""`python -m autoshard calibrate`: measure alpha (latency) and beta (1 / bandwidth) of every mesh axis.

Spawns prod(mesh) gloo ranks, times all_reduce of several message sizes on each axis's groups, and
fits time = 2 (k-1) alpha + 2 (k-1)/k * bytes / bandwidth (the ring model the cost model uses) by
least squares. Prints the fitted links and writes a HardwareProfile JSON usable with `--profile`.

    python -m autoshard calibrate --mesh 2,2 --axis-names dp,tp --output profile.json

>>> fit_link([(4096, 2.1e-5), (1048576, 5.3e-4)], k=2)  # doctest: +ELLIPSIS
Link(alpha=..., bandwidth=...)
"""
from __future__ import annotations

import json
import time

import numpy as np
import torch
import torch.distributed as dist

from autoshard.cost.profiles import CPU_PROFILE, HardwareProfile, Link
from autoshard.ir.mesh import Mesh
from autoshard.runtime.launch import communicator_for, run_distributed

REPEATS = 5


def _time_axis_task(rank, world, mesh_json, sizes):
    mesh = Mesh.from_json(mesh_json)
    comm = communicator_for(mesh)
    out = {}
    for axis in mesh.names:
        group = comm.groups[axis]
        for size in sizes:
            tensor = torch.ones(max(size // 4, 1), dtype=torch.float32)
            dist.all_reduce(tensor, group=group)  # warm up the connection
            dist.barrier()
            start = time.perf_counter()
            for _ in range(REPEATS):
                dist.all_reduce(tensor, group=group)
            out[(axis, size)] = (time.perf_counter() - start) / REPEATS
    return out


def fit_link(samples, k: int) -> Link:
    """Least-squares alpha, bandwidth from [(bytes, seconds)] of ring all-reduces over k ranks.

    >>> link = fit_link([(b, 2 * 1e-5 + b / 1e9) for b in (4096, 65536, 1048576)], k=2)  # 10 us, 1 GB/s
    >>> round(link.alpha * 1e6, 3), round(link.bandwidth / 1e9, 3)
    (10.0, 1.0)
    """
    a = np.array([[2 * (k - 1), 2 * (k - 1) / k * b] for b, _ in samples], dtype=np.float64)
    t = np.array([s for _, s in samples], dtype=np.float64)
    (alpha, beta), *_ = np.linalg.lstsq(a, t, rcond=None)
    return Link(max(float(alpha), 1e-7), 1.0 / max(float(beta), 1e-13))


def calibrate_command(args) -> int:
    """`python -m autoshard calibrate`: time every axis on prod(mesh) spawned gloo ranks, print the links,
    write the profile (`args` as the command line parses them). Spawning ranks takes seconds, so the
    example does not run here:

    >>> import argparse
    >>> args = argparse.Namespace(mesh=(2,), axis_names=("dp",), sizes="4096,65536", output=None)
    >>> calibrate_command(args)  # doctest: +SKIP
    axis dp (size 2): alpha 41.3 us, bandwidth 1.127 GB/s
    {...}
    0
    """
    mesh = Mesh.of(args.mesh, args.axis_names)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = run_distributed(_time_axis_task, mesh.size, mesh.to_json(), sizes)
    slowest = {key: max(r[key] for r in results.values()) for key in results[0]}
    links = []
    for axis, name in enumerate(mesh.names):
        link = fit_link([(size, slowest[(name, size)]) for size in sizes], mesh.shape[axis])
        links.append(link)
        print(f"axis {name} (size {mesh.shape[axis]}): alpha {link.alpha * 1e6:.1f} us, "
              f"bandwidth {link.bandwidth / 1e9:.3f} GB/s")
    profile = HardwareProfile(name="calibrated", peak_flops=CPU_PROFILE.peak_flops,
                              memory_bandwidth=CPU_PROFILE.memory_bandwidth, memory_bytes=CPU_PROFILE.memory_bytes,
                              axis_links=tuple(links))
    text = json.dumps(profile.to_json(), indent=1)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        print(f"wrote {args.output}")
    else:
        print(text)
    return 0
