"""A pool of gloo ranks started once and reused: for test suites and repeated `verify` runs.

Starting 8 ranks on a 2-core machine takes ~15 s, so tests share one pool per session. Every task
runs on every worker (`task(rank, world, *args)`, a module-level function); meshes smaller than the
pool use world ranks 0..n-1 and the other workers only take part in creating the groups.

Starting processes takes seconds, so the examples here do not run (tests/conftest.py's session pool
runs every multi-rank test through one); `task` is any importable function `task(rank, world, *args)`:

>>> from autoshard.ir.mesh import Mesh
>>> from autoshard.cost.link_timing import time_axis_task  # times all_reduce on each mesh axis
"""
from __future__ import annotations

import os
import queue as queue_mod
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from autoshard.ir.errors import AutoshardError
from autoshard.runtime.launch import free_port, from_bytes, to_bytes


def _worker(rank, world, port, inbox, outbox, timeout_s):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    outbox.put((rank, "ready", None))
    while True:
        job = inbox.get()
        if job is None:
            break
        job_id, task, args = job
        try:
            outbox.put((rank, job_id, ("ok", to_bytes(task(rank, world, *args)))))
        except BaseException:  # noqa: BLE001  (reported to the parent)
            outbox.put((rank, job_id, ("error", traceback.format_exc())))
    # The parent has every result: end at once. An orderly teardown of the group and of an interpreter
    # holding torch took ~0.7 s per worker (5.9 s for 8 on 2 cores), all of it waiting.
    os._exit(0)


class WorkerPool:
    """`pool.run(task, *args) -> {rank: result}` on `world_size` persistent gloo ranks.

    >>> with WorkerPool(world_size=2) as pool:  # doctest: +SKIP
    ...     first = pool.run(time_axis_task, Mesh((2,), ("dp",)).to_json(), [4096])
    ...     second = pool.run(time_axis_task, Mesh((2,), ("dp",)).to_json(), [65536])  # the same 2 processes
    """

    def __init__(self, world_size: int = 8, timeout_s: float = 120.0):
        ctx = torch.multiprocessing.get_context("spawn")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.inboxes[r], self.outbox, timeout_s),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()
        self._next_job = 0
        ready = set()
        deadline = time.monotonic() + timeout_s + 120
        while len(ready) < world_size:
            try:
                rank, _, _ = self.outbox.get(timeout=1.0)
                ready.add(rank)
            except queue_mod.Empty:
                self._check_alive("starting the pool", deadline)

    def _check_alive(self, what, deadline):
        dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
        if dead:
            raise AutoshardError(f"pool ranks {dead} died while {what}")
        if time.monotonic() > deadline:
            raise AutoshardError(f"pool timed out after {self.timeout_s:.0f} s while {what}")

    def run(self, task, *args) -> dict:
        """Run `task(rank, world, *args)` on every worker; {rank: result}, or AutoshardError naming the rank
        that failed first with its traceback.

        >>> pool.run(time_axis_task, Mesh((2,), ("dp",)).to_json(), [4096])  # doctest: +SKIP
        {0: {('dp', 4096): 0.0028}, 1: {('dp', 4096): 0.0024}}
        """
        job_id = self._next_job
        self._next_job += 1
        for inbox in self.inboxes:
            inbox.put((job_id, task, args))
        out, errors = {}, {}
        deadline = time.monotonic() + self.timeout_s + 60
        while len(out) + len(errors) < self.world_size:
            try:
                rank, got_id, (status, value) = self.outbox.get(timeout=1.0)
            except queue_mod.Empty:
                if errors and time.monotonic() > deadline:  # the rest wait on the failed ranks: report those
                    break
                self._check_alive(f"running {getattr(task, '__name__', task)}", deadline)
                continue
            if got_id != job_id:
                continue  # a late answer of an earlier failed job
            if status == "ok":
                out[rank] = from_bytes(value)
            else:
                errors[rank] = value
        if errors:
            rank = min(errors, key=lambda r: ("CollectiveTimeout" in errors[r] or "closed by peer" in errors[r], r))
            waiting = sorted(set(range(self.world_size)) - set(out) - set(errors))
            also = f" (ranks {waiting} were still waiting on it)" if waiting else ""
            raise AutoshardError(f"rank {rank} failed{also}:\n{errors[rank]}")
        return out

    def close(self):
        """Stop the workers (the `with` block calls it).

        >>> pool.close()  # doctest: +SKIP
        """
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
