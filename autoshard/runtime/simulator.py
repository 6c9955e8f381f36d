"""The single-process simulator: every rank of the mesh as a thread with its own module.

Collectives meet in a ThreadHub; they are built from the same all-gather primitive and fixed-order
sums as the exact gloo path, so results agree bit for bit with a real multi-process run.
"""
from __future__ import annotations

import threading

import torch

from .communicator import CollectiveTimeout, ThreadCommunicator, ThreadHub


def run_ranks(program, fn, timeout_s: float = 60.0) -> dict:
    """Call `fn(rank_module)` on every rank in its own thread; return {rank: result}."""
    hub = ThreadHub(program.mesh, timeout_s)
    modules = {r: program.module(r, ThreadCommunicator(hub, r)) for r in range(program.mesh.size)}
    results, errors = {}, {}

    def worker(rank):
        try:
            results[rank] = fn(modules[rank])
        except BaseException as exc:  # noqa: BLE001  (re-raised below, the first real one)
            errors[rank] = exc
            hub.abort()

    threads = [threading.Thread(target=worker, args=(r,), name=f"autoshard-rank{r}") for r in modules]
    # One intra-op thread, as each real rank uses: reductions then sum in the same order (bitwise equal).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(previous)
    if errors:
        real = {r: e for r, e in errors.items() if not isinstance(e, CollectiveTimeout)}
        rank, exc = sorted((real or errors).items())[0]
        raise RuntimeError(f"simulated rank {rank} failed: {type(exc).__name__}: {exc}") from exc
    return results
