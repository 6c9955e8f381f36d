"""Benchmark 19, where a step's time goes on each rank: the phases each gloo rank measures (forward, backward,
gradient sync, optimizer), the least any rank paid for each, and what is left of the step: the ranks waiting for
each other, which the cost model does not price (section 18's predictions leave it out).

A step's collectives make the ranks wait for the slowest to arrive; on ranks that share this VM's 2 cores they arrive
apart and leave apart, and each waits in its turn: in data parallelism one rank waits in the gradient sync for the
other's backward, the other at the loss's all-reduce in the next forward. The least any rank paid for a phase is
what that phase costs with no one waiting (the last rank to reach a collective does not wait at it); the step less
their sum is the waiting. For each plan the predicted step (under the profile `calibrate` measured just before,
with as many ranks running; section 18's method) is compared with both: the step, and the step without the waiting.
For data parallelism the gradient buckets' all-reduce is also timed alone (a barrier, then the same bytes through the
same communicator): the figure the cost model prices.

    python -m benchmarks --only rank_waits
"""
from __future__ import annotations

import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from autoshard.cost.calibrate import calibrated_profile
from autoshard.ir.mesh import Mesh
from autoshard.report.accuracy import PHASES, StepClock
from autoshard.runtime.launch import run_distributed

from .prediction_accuracy import DTYPES, MODELS, plan_case, plans_for, prepared_step
from .report import table, write_section

WORLDS = (2, 4)
CASES = {"llama (zoo)": ("data parallel", "Megatron TP", "pipeline"), "gpt2 (zoo)": ("data parallel",)}
WARMUP, STEPS, ALONE = 3, 15, 8


def _rank_task(rank, world, jobs):
    """Per job, this rank's median phases over STEPS steps run back to back, and (data parallelism) the median of
    ALONE all-reduces of its gradient bytes after a barrier."""
    torch.manual_seed(0)
    out = []
    for job in jobs:
        make_step, comm = prepared_step(job, rank)
        clock = StepClock(warmup=WARMUP)
        step = make_step(clock)
        dist.barrier()
        for _ in range(WARMUP + STEPS):
            step()
        clock.mark("forward")
        alone = None
        if job["plan"] == "data parallel":
            bucket, times = torch.ones(job["grad_elements"]), []  # float32, as the plans train
            for _ in range(ALONE):
                dist.barrier()
                started = time.perf_counter()
                comm.all_reduce(bucket, job["axes"][0])
                times.append(time.perf_counter() - started)
            alone = statistics.median(times)
        dist.barrier()
        out.append({"phases": clock.phases("median"), "alone_s": alone})
    return out


def measure(quick: bool = False) -> list[dict]:
    """One row per (model, ranks, plan): the predicted phases and each rank's measured ones (`quick`: the zoo
    Llama's data parallelism on 2 ranks)."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for world in WORLDS[:1] if quick else WORLDS:
            profile = calibrated_profile(Mesh((world,), ("dp",)), dtypes=DTYPES, quiet=True)
            jobs = []
            cases = {"llama (zoo)": ("data parallel",)} if quick else CASES
            for name, wanted in cases.items():
                for plan_name, (axes, options) in plans_for(name, world).items():
                    if not plan_name.startswith(wanted):
                        continue
                    job = plan_case(name, world, plan_name, axes, options, profile, folder)
                    job["grad_elements"] = sum(p.numel() for p in MODELS[name]()[0].parameters())
                    jobs.append(job)
            measured = run_distributed(_rank_task, world, jobs, total_s=1800)
            for i, job in enumerate(jobs):
                rows.append(dict(job, ranks=[measured[r][i] for r in sorted(measured)]))
    return rows


def decomposed(row) -> dict:
    """The step (the slowest rank's), each phase's least over the ranks, their sum, and the waiting (step - sum).

    >>> ranks = [{"phases": {"forward_s": 5.0, "backward_s": 4.0, "sync_s": 1.0, "optimizer_s": 0.0, "step_s": 10.0}},
    ...          {"phases": {"forward_s": 3.0, "backward_s": 4.0, "sync_s": 3.0, "optimizer_s": 0.0, "step_s": 10.0}}]
    >>> decomposed({"ranks": ranks})["waiting_s"]
    2.0
    """
    least = {key: min(r["phases"][key] for r in row["ranks"]) for key in PHASES}
    step = max(r["phases"]["step_s"] for r in row["ranks"])
    busy = sum(least.values())
    return {"step_s": step, "least": least, "busy_s": busy, "waiting_s": max(step - busy, 0.0)}


def report(rows) -> str:
    headers = ["model", "ranks", "plan", "predicted step ms", "measured step ms", "predicted/measured",
               "phases' least sum ms", "predicted/that", "waiting ms", "per rank fwd / bwd / sync / optimizer ms",
               "all-reduce alone ms (predicted sync ms)"]
    out = []
    for row in rows:
        parts = decomposed(row)
        predicted = row["predicted"]["step_s"]
        per_rank = "; ".join(" / ".join(f"{r['phases'][k] * 1e3:.0f}" for k in PHASES) for r in row["ranks"])
        alone = [r["alone_s"] for r in row["ranks"] if r["alone_s"] is not None]
        out.append([row["model"], row["world"], row["plan"], f"{predicted * 1e3:.1f}", f"{parts['step_s'] * 1e3:.1f}",
                    f"{predicted / parts['step_s']:.2f}", f"{parts['busy_s'] * 1e3:.1f}",
                    f"{predicted / parts['busy_s']:.2f}", f"{parts['waiting_s'] * 1e3:.1f}", per_rank,
                    f"{max(alone) * 1e3:.1f} ({row['predicted']['sync_s'] * 1e3:.1f})" if alone else "-"])
    return ("Each plan trained on gloo ranks (SGD, sync after backward, float32; " + f"{STEPS} steps back to back after "
            f"{WARMUP}, each phase's median per rank); predicted under the profile calibrated just before with as many "
            "ranks. 'phases' least sum': each phase's least over the ranks, summed (the step with no rank waiting); "
            "'waiting': the step less that sum. A pipeline's forward column holds its whole schedule.\n\n"
            + table(headers, out)
            + "\n\nReproduce: `python -m benchmarks --only rank_waits` (about 4 minutes on 2 cores).\n")


def main(quick: bool = False) -> None:
    write_section("rank_waits", "19. Where a step's time goes on each rank: phases, and ranks waiting for each other",
                  report(measure(quick)))
