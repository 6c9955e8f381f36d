"""The single-process simulator: every rank of the mesh as a thread with its own module.

Collectives meet in a ThreadHub; they are built from the same all-gather primitive and fixed-order
sums as the exact gloo path, so results agree bit for bit with a real multi-process run.

>>> import torch
>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}})
"""
from __future__ import annotations

import threading

import torch

from autoshard.runtime.collectives import use_communicator
from autoshard.runtime.communicator import CollectiveTimeout
from autoshard.runtime.thread_communicator import ThreadCommunicator, ThreadHub


def run_ranks(program, fn, timeout_s: float = 60.0, **module_options) -> dict:
    """Call `fn(rank_module)` on every rank in its own thread; return {rank: result}. `module_options`
    (e.g. weights="init") go to `program.module(rank, comm, ...)`.

    >>> def train_step(module):  # what each rank runs: forward, backward, gradient sync
    ...     loss, _ = module(*module.local_inputs(*inputs))
    ...     loss.backward()
    ...     module.sync_grads()
    ...     return dict(module.named_local_parameters())["layers.0.weight"].grad
    >>> grads = run_ranks(prog, train_step)
    >>> loss_fn(model(*inputs), *inputs).backward()
    >>> torch.allclose(grads[0], model.layers[0].weight.grad) and torch.equal(grads[0], grads[1])
    True
    """
    hub = ThreadHub(program.mesh, timeout_s)
    modules = {r: program.module(r, ThreadCommunicator(hub, r), **module_options) for r in range(program.mesh.size)}
    return _run_threads(hub, lambda rank: fn(modules[rank]))


def run_on_mesh(mesh, fn, timeout_s: float = 60.0) -> dict:
    """Call `fn(comm)` on every rank of `mesh` in its own thread, with that rank's ThreadCommunicator
    current, so the collectives of autoshard.runtime.collectives work as on real ranks; {rank: result}.

    >>> from autoshard.ir.mesh import Mesh
    >>> from autoshard.runtime.collectives import all_reduce
    >>> run_on_mesh(Mesh((2,), ("dp",)), lambda comm: all_reduce(torch.tensor([comm.rank + 1.0]), "dp"))
    {0: tensor([3.]), 1: tensor([3.])}
    """
    hub = ThreadHub(mesh, timeout_s)

    def call(rank):
        comm = ThreadCommunicator(hub, rank)
        with use_communicator(comm):
            return fn(comm)

    return _run_threads(hub, call)


def _run_threads(hub: ThreadHub, call) -> dict:
    """`call(rank)` for every rank of `hub.mesh`, one thread each; the first real failure is re-raised."""
    results, errors = {}, {}

    def worker(rank):
        try:
            results[rank] = call(rank)
        except BaseException as exc:  # noqa: BLE001  (re-raised below, the first real one)
            errors[rank] = exc
            hub.abort()

    threads = [threading.Thread(target=worker, args=(r,), name=f"autoshard-rank{r}") for r in range(hub.mesh.size)]
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
        rank, exc = min((real or errors).items())
        raise RuntimeError(f"simulated rank {rank} failed: {type(exc).__name__}: {exc}") from exc
    return dict(sorted(results.items()))
