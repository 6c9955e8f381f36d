"""Real process groups: initialisation, mesh axes -> sub-groups (torch DeviceMesh), spawning ranks.

Under torchrun call `init_distributed()` then `communicator_for(mesh)`; for tests and `verify`,
`run_distributed(task, world_size, *args)` spawns the ranks itself on gloo. Every collective runs
under the process-group timeout (default 120 s, `AUTOSHARD_TIMEOUT_S`), so a dead rank turns into an
error on the others instead of a hang.
"""
from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import AutoshardError
from ..mesh import Mesh
from .communicator import DistCommunicator

_MESHES: dict = {}


def default_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("AUTOSHARD_TIMEOUT_S", "120")))


def init_distributed(backend: str | None = None, timeout: timedelta | None = None) -> None:
    """Initialise the default process group from torchrun's environment (gloo on CPU, NCCL on GPUs)."""
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, timeout=timeout or default_timeout())


def device_mesh(mesh: Mesh):
    """(torch DeviceMesh over world ranks 0..mesh.size-1, a group of all its ranks); cached, and every
    rank of the world must call it (group creation is collective)."""
    from torch.distributed.device_mesh import DeviceMesh
    key = (mesh.shape, mesh.names)
    if key not in _MESHES:
        world = dist.get_world_size()
        if mesh.size > world:
            raise AutoshardError(f"mesh {mesh!r} needs {mesh.size} ranks but the process group has {world}; "
                                 f"launch {mesh.size} processes (torchrun --nproc-per-node {mesh.size}) or use a "
                                 "smaller mesh")
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        _MESHES[key] = (DeviceMesh(device, torch.arange(mesh.size).reshape(mesh.shape), mesh_dim_names=mesh.names),
                        dist.new_group(list(range(mesh.size)), timeout=default_timeout()))
    return _MESHES[key]


def communicator_for(mesh: Mesh, exact: bool | None = None, strict_world: bool = True) -> DistCommunicator | None:
    """This rank's communicator on `mesh`, or None when the rank is not part of the mesh."""
    world = dist.get_world_size()
    if strict_world and world != mesh.size:
        raise AutoshardError(f"mesh {mesh!r} has {mesh.size} devices but the world size is {world}: the mesh must "
                             f"cover every rank (launch with --nproc-per-node {mesh.size} or change the mesh)")
    dm, mesh_group = device_mesh(mesh)
    rank = dist.get_rank()
    if rank >= mesh.size:
        return None
    groups = {name: dm.get_group(name) for name in mesh.names}
    if exact is None:
        exact = dist.get_backend() == "gloo"
    return DistCommunicator(mesh, rank, groups, mesh_group, exact=exact, timeout=default_timeout())


def check_fingerprint(comm: DistCommunicator, fingerprint: str) -> None:
    """Every rank of the mesh must have planned the same program before the first collective."""
    group = comm.mesh_group
    gathered = [None] * comm.mesh.size
    dist.all_gather_object(gathered, fingerprint, group=group)
    if len(set(gathered)) != 1:
        by_rank = ", ".join(f"rank {r}: {f}" for r, f in enumerate(gathered))
        raise AutoshardError(f"ranks planned different programs ({by_rank}); every rank must run the same code "
                             "with the same model, inputs, mesh and hints")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_bytes(value) -> bytes:
    """Results cross processes as torch.save bytes: shared-memory tensors would die with the child."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _child(rank, world, port, task, args, results, timeout_s):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        results.put((rank, "ok", _to_bytes(task(rank, world, *args))))
    except BaseException:  # noqa: BLE001  (reported to the parent with the traceback)
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(task, world_size: int, *args, timeout_s: float = 120.0) -> dict:
    """Spawn `world_size` gloo ranks running `task(rank, world, *args)`; return {rank: result}.

    `task` must be importable (a module-level function). A rank that raises or dies makes this raise
    with that rank's traceback; the other ranks' collectives fail within the timeout.
    """
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, task, args, results, timeout_s), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors = {}, {}
    deadline = time.monotonic() + timeout_s + 60
    try:
        while len(out) + len(errors) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
                if status == "ok":
                    out[rank] = _from_bytes(value)
                else:
                    errors[rank] = value
                continue
            except queue_mod.Empty:
                pass
            silent = [r for r in range(world_size) if r not in out and r not in errors]
            dead = [r for r in silent if procs[r].exitcode is not None]
            if dead and all(procs[r].exitcode is not None for r in silent):
                raise AutoshardError(f"ranks {dead} exited (codes {[procs[r].exitcode for r in dead]}) without "
                                     "reporting a result")
            if time.monotonic() > deadline:
                raise AutoshardError(f"ranks {silent} did not finish within {timeout_s + 60:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        raise AutoshardError(f"rank {rank} failed:\n{errors[rank]}")
    return out
