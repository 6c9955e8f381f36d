"""Interleaved timing on gloo ranks: every contender runs once per repetition, in a rotating order, so
the noise of a shared machine hits all of them alike; figures are medians of per-repetition ratios.

Both wall time and this process's CPU time are kept: on a machine shared with other jobs the wall
time of a rank includes the time it was descheduled, the CPU time (all threads, gloo's included) does
not, so CPU-time ratios show per-op overhead with far less noise."""
from __future__ import annotations

import statistics
import time

import torch.distributed as dist


def interleaved_times(steps: dict, repetitions: int, steps_per_sample: int = 1, group=None) -> tuple[dict, dict]:
    """({name: [wall seconds per step, one per repetition]}, the same in CPU seconds) on this rank. The
    order rotates each repetition and is the same on every rank (the contenders run collectives); a
    barrier starts every sample together."""
    names = list(steps)
    wall: dict = {n: [] for n in names}
    cpu: dict = {n: [] for n in names}
    for rep in range(repetitions):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            dist.barrier(group=group)
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(steps_per_sample):
                steps[name]()
            wall[name].append((time.perf_counter() - start) / steps_per_sample)
            cpu[name].append((time.process_time() - start_cpu) / steps_per_sample)
    return wall, cpu


def slowest_rank(per_rank: list[dict]) -> dict:
    """{name: [per repetition, the slowest rank's time]}: a step is done when every rank is done."""
    return {name: [max(ts) for ts in zip(*(r[name] for r in per_rank))] for name in per_rank[0]}


def median_ratio(numerator: list, denominator: list) -> float:
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def timed_on_ranks(rank_task, worlds, configs, timeout_s: float) -> list[dict]:
    """`rank_task(rank, world, configs)` -> {config: {"times", "cpu", ...}} on each number of gloo ranks in
    `worlds`: per world and config {"world", "config", "load" (when the world started), "ranks" (each rank's
    result), "times", "cpu" (the slowest rank per repetition)}."""
    import os

    from autoshard.runtime.launch import run_distributed
    out = []
    for world in worlds:
        load = os.getloadavg()
        per_rank = run_distributed(rank_task, world, configs, timeout_s=timeout_s)
        for config in configs:
            ranks = [per_rank[r][config] for r in sorted(per_rank)]
            out.append({"world": world, "config": config, "load": load, "ranks": ranks,
                        "times": slowest_rank([r["times"] for r in ranks]),
                        "cpu": slowest_rank([r["cpu"] for r in ranks])})
    return out


CSV_HEADERS = ["ranks", "hidden", "contender", "clock", "median_ms", "samples_ms"]


def csv_samples(rows) -> list:
    """CSV rows (CSV_HEADERS) of every contender's wall and CPU samples, per row's ranks and hidden size."""
    return [[r["world"], r["hidden"], n, "wall" if key == "times" else "cpu", f"{statistics.median(v) * 1e3:.4f}",
             " ".join(f"{x * 1e3:.3f}" for x in v)]
            for r in rows for key in ("times", "cpu") for n, v in r[key].items()]
