"""Real process groups: initialisation, mesh axes -> sub-groups (torch DeviceMesh), spawning ranks.

Under torchrun call `init_distributed()` then `communicator_for(mesh)`; for tests and `verify`,
`run_distributed(task, world_size, *args)` spawns the ranks itself on gloo. Every collective runs
under the process-group timeout (default 120 s, `AUTOSHARD_TIMEOUT_S`; also set on DeviceMesh's
sub-groups), so a dead or stuck rank turns into a CollectiveTimeout on the others naming the rank,
collective, axis and group instead of a hang; `check_fingerprint` stops ranks that planned different
programs before their first collective; `run_distributed` raises RanksFailed naming the first cause.

The examples start a one-rank gloo process group in this process (torchrun's environment variables,
set by hand) and end it at the end of each example:

>>> import os
>>> from unittest import mock
>>> def torchrun_env():  # what torchrun sets for rank 0 of a world of one
...     return mock.patch.dict(os.environ, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
...                                         "RANK": "0", "WORLD_SIZE": "1"})
"""
from __future__ import annotations

import atexit
import builtins
import contextlib
import io
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from autoshard.ir.errors import AutoshardError
from autoshard.ir.mesh import Mesh
from autoshard.runtime.communicator import CollectiveTimeout, DistCommunicator

if dist.is_available() and not dist.is_initialized():
    # torch.distributed.nn's functions take `group=group.WORLD` as a default argument: imported while a default
    # group is up (torch.export and torch.compile import it), they hold that group for ever, its gloo threads
    # outlive destroy_process_group, and one releasing its last collective while the interpreter finalises
    # aborts the process ("terminate called without an active exception"). Imported now, they hold None.
    import torch.distributed.nn

# (DeviceMesh, group of all its ranks) by mesh, made under the current default process group (entries made before
# it was destroyed are dropped: their groups are dead, and holding them keeps the backend's threads alive).
_MESHES: dict = {}
STARTUP_TIMEOUT_S = 60.0  # rendezvous of spawned ranks (many ranks on few cores start slowly)


def default_timeout() -> timedelta:
    """The timeout of every collective and process group: `AUTOSHARD_TIMEOUT_S` seconds, default 120.

    >>> with mock.patch.dict(os.environ, {"AUTOSHARD_TIMEOUT_S": "30"}):
    ...     default_timeout()
    datetime.timedelta(seconds=30)
    """
    return timedelta(seconds=float(os.environ.get("AUTOSHARD_TIMEOUT_S", "120")))


def init_distributed(backend: str | None = None, timeout: timedelta | None = None) -> None:
    """Initialise the default process group from torchrun's environment (gloo on CPU, NCCL on GPUs).

    >>> with torchrun_env():
    ...     init_distributed("gloo")
    >>> dist.get_world_size(), dist.get_backend()
    (1, 'gloo')
    >>> dist.destroy_process_group()
    """
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, timeout=timeout or default_timeout())
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    """Tear down the process group `init_distributed` made when the script did not: left to the interpreter's
    finalisation, its gloo threads (6 per rank in the tutorial's torchrun script) are still alive there, and one
    releasing a collective then aborts a run that succeeded ("terminate called without an active exception": 1 of
    30 runs of that script on this 2-core VM under load). Not after an uncaught exception: the peers may be gone and
    tearing down could block (run_distributed's ranks skip it too)."""
    _MESHES.clear()
    if dist.is_initialized() and getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()


def device_mesh(mesh: Mesh):
    """(torch DeviceMesh over world ranks 0..mesh.size-1, a group of all its ranks); cached, and every
    rank of the world must call it (group creation is collective).

    >>> with torchrun_env():
    ...     init_distributed("gloo")
    >>> dm, everyone = device_mesh(Mesh((1,), ("device_mesh_example",)))
    >>> dm.mesh_dim_names, dist.get_world_size(everyone)
    (('device_mesh_example',), 1)
    >>> dist.destroy_process_group()
    """
    from torch.distributed.device_mesh import DeviceMesh
    key = (mesh.shape, mesh.names)
    if key in _MESHES and not _alive(_MESHES[key][1]):  # made before the default group was destroyed
        _MESHES.clear()
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


def _alive(group) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except KeyError:  # torch forgets every group when the default one is destroyed
        return False
    return True


@atexit.register
def _release_meshes() -> None:
    """Drop the cached groups before the interpreter finalises: their destructors join the backend's worker threads
    while those can still take the GIL (a gloo thread releasing its last collective's tensors during finalisation
    aborts the process: "terminate called without an active exception")."""
    _MESHES.clear()


def communicator_for(mesh: Mesh, exact: bool | None = None, strict_world: bool = True) -> DistCommunicator | None:
    """This rank's communicator on `mesh`, or None when the rank is not part of the mesh.

    >>> with torchrun_env():
    ...     init_distributed("gloo")
    >>> comm = communicator_for(Mesh((1,), ("communicator_example",)))
    >>> type(comm).__name__, comm.exact, comm.all_reduce(torch.ones(2), "communicator_example")
    ('DistCommunicator', True, tensor([1., 1.]))
    >>> communicator_for(Mesh((2,), ("dp",)))
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.AutoshardError: mesh Mesh(dp=2) has 2 devices but the world size is 1: the mesh must cover ...
    >>> dist.destroy_process_group()
    """
    world = dist.get_world_size()
    if strict_world and world != mesh.size:
        raise AutoshardError(f"mesh {mesh!r} has {mesh.size} devices but the world size is {world}: the mesh must "
                             f"cover every rank (launch with --nproc-per-node {mesh.size} or change the mesh)")
    dm, mesh_group = device_mesh(mesh)
    rank = dist.get_rank()
    if rank >= mesh.size:
        return None
    groups = {name: dm.get_group(name) for name in mesh.names}
    for group in groups.values():
        _set_timeout(group, default_timeout())
    if exact is None:
        exact = dist.get_backend() == "gloo"
    return DistCommunicator(mesh, rank, groups, mesh_group, exact=exact, timeout=default_timeout())


def _set_timeout(group, timeout: timedelta) -> None:
    """DeviceMesh creates its sub-groups with torch's default timeout (30 min on gloo); ours bounds every
    collective, so a dead or stuck rank becomes an error on the others within AUTOSHARD_TIMEOUT_S."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is not None:
        set_timeout(timeout, group)


class FingerprintMismatch(AutoshardError):
    """The ranks of a mesh planned different programs (checked before the first collective); the message
    lists each fingerprint with its ranks and says how to make them agree.

    >>> issubclass(FingerprintMismatch, AutoshardError)
    True
    """


def check_fingerprint(comm: DistCommunicator, fingerprint: str) -> None:
    """Every rank of the mesh must have planned the same program before the first collective (one
    all_gather_object on the mesh's group; FingerprintMismatch when they differ).

    >>> with torchrun_env():
    ...     init_distributed("gloo")
    >>> check_fingerprint(communicator_for(Mesh((1,), ("fingerprint_example",))), "4b8a188a956f1ad9")
    >>> dist.destroy_process_group()
    """
    group = comm.mesh_group
    gathered = [None] * comm.mesh.size
    start = time.monotonic()
    try:
        dist.all_gather_object(gathered, fingerprint, group=group)
    except RuntimeError as exc:
        raise CollectiveTimeout(comm.failure("the plan fingerprint check (all_gather_object)", None, exc,
                                             time.monotonic() - start)) from exc
    if len(set(gathered)) != 1:
        by_fingerprint: dict = {}
        for r, f in enumerate(gathered):
            by_fingerprint.setdefault(f, []).append(r)
        listing = "; ".join(f"{f} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                            for f, rs in sorted(by_fingerprint.items(), key=lambda item: -len(item[1])))
        raise FingerprintMismatch(
            f"rank {comm.rank}: the ranks planned different programs (plan fingerprints: {listing}). Every rank "
            "must call parallelize with the same model, example input shapes, mesh, hints and options (and the same "
            "autoshard and torch versions); compare prog.plan.dumps() between ranks, or save the plan on one rank "
            "(prog.plan.save(path)) and pass plan=path to parallelize on every rank")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous).

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_bytes(value) -> bytes:
    """`value` as torch.save bytes: results cross processes that way (shared-memory tensors would die
    with the child).

    >>> from_bytes(to_bytes({"loss": torch.tensor(1.5)}))
    {'loss': tensor(1.5000)}
    """
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes):
    """What `to_bytes` wrote (weights_only: nothing but tensors and plain values is loaded).

    >>> from_bytes(to_bytes([1, 2]))
    [1, 2]
    """
    return torch.load(io.BytesIO(data), weights_only=True)


def _child(rank, world, port, task, args, results, timeout_s):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["AUTOSHARD_TIMEOUT_S"] = repr(timeout_s)  # collectives run under the launch timeout too
    torch.set_num_threads(1)
    ok = False
    try:
        # Rendezvous gets at least STARTUP_TIMEOUT_S; the parent still stops everything soon after a rank dies.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)))
        _set_timeout(dist.group.WORLD, timedelta(seconds=timeout_s))
        with warnings.catch_warnings(record=True) as caught:  # the parent shows each once for all ranks
            warnings.simplefilter("default")
            value = task(rank, world, *args)
        shown = list(dict.fromkeys((w.category.__name__, str(w.message)) for w in caught))
        results.put((rank, "ok", to_bytes(value), shown))
        ok = True
    except BaseException as exc:  # noqa: BLE001  (reported to the parent with the traceback)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        results.put((rank, "error", (type(exc).__name__, first, traceback.format_exc()), []))
    finally:
        if ok and dist.is_initialized():  # after a failure the peers may be gone: tearing down could block
            dist.destroy_process_group()


# After the first rank fails, the others get the collective timeout plus this long to report their errors.
FAILURE_GRACE_S = 10.0


class RanksFailed(AutoshardError):
    """`run_distributed`: ranks raised, died or hung. `errors` {rank: (exception type, first line, traceback)},
    `exit_codes` {rank: code} of ranks that died without reporting, `hung` [ranks stopped after the grace].

    >>> failed = RanksFailed("1 of 2 ranks failed; ...", {1: ("ValueError", "bad", "Traceback ...")}, {}, [])
    >>> failed.errors[1][0], failed.hung
    ('ValueError', [])
    """

    def __init__(self, message: str, errors: dict, exit_codes: dict, hung: list):
        super().__init__(message)
        self.errors, self.exit_codes, self.hung = errors, exit_codes, hung


def run_distributed(task, world_size: int, *args, timeout_s: float | None = None,
                    total_s: float | None = None) -> dict:
    """Spawn `world_size` gloo ranks running `task(rank, world, *args)`; return {rank: result}.

    `task` must be importable (a module-level function). `timeout_s` (default AUTOSHARD_TIMEOUT_S, else
    120) bounds every collective and the process-group setup; `total_s` (default `timeout_s` + 60) the whole task, for
    a task that is long by design (a benchmark training many plans) while each collective stays bounded.
    A rank that raises, dies or hangs makes this raise RanksFailed promptly: the other ranks' collectives fail within
    the timeout, and ranks still silent `FAILURE_GRACE_S` after that are stopped. The message names the rank that
    failed first and how.
    Starting processes takes seconds, so this example does not run here (tests/multirank does):

    >>> from autoshard.cost.link_timing import time_axis_task  # any importable task(rank, world, *args)
    >>> run_distributed(time_axis_task, 2, Mesh((2,), ("dp",)).to_json(), [4096])  # doctest: +SKIP
    {0: {('dp', 4096): 0.0028}, 1: {('dp', 4096): 0.0024}}
    """
    timeout_s = default_timeout().total_seconds() if timeout_s is None else float(timeout_s)
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, task, args, results, timeout_s), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors, exit_codes, hung, warned = {}, {}, {}, [], {}
    total_s = timeout_s + 60 if total_s is None else float(total_s)
    deadline = time.monotonic() + total_s
    failed_at = None

    def take(item):
        rank, status, value, shown = item
        for warning in shown:
            warned.setdefault(warning, []).append(rank)
        if status == "ok":
            out[rank] = from_bytes(value)
        else:
            errors[rank] = value

    try:
        while len(out) + len(errors) + len(exit_codes) < world_size:
            try:
                take(results.get(timeout=0.2))
                continue
            except queue_mod.Empty:
                pass
            silent = [r for r in range(world_size) if r not in out and r not in errors and r not in exit_codes]
            exited = [r for r in silent if procs[r].exitcode is not None]
            if exited:  # a result written just before exiting is in the pipe by now
                while True:
                    try:
                        take(results.get_nowait())
                    except queue_mod.Empty:
                        break
                exit_codes.update({r: procs[r].exitcode for r in exited if r not in out and r not in errors})
            now = time.monotonic()
            if failed_at is None and (errors or exit_codes):
                failed_at = now
            waited_out = failed_at is not None and now > failed_at + timeout_s + FAILURE_GRACE_S
            if waited_out or now > deadline:
                hung = [r for r in range(world_size) if r not in out and r not in errors and r not in exit_codes]
                break
    finally:
        failed = bool(errors or exit_codes or hung)
        for p in procs:
            p.join(timeout=2 if failed else 30)
            if p.is_alive():
                p.kill()
    show_rank_warnings(warned, world_size)
    if errors or exit_codes or hung:
        raise RanksFailed(_failure_report(errors, exit_codes, hung, world_size, timeout_s, total_s, failed_at is None),
                          errors, exit_codes, hung)
    return out


def show_rank_warnings(warned: dict, world_size: int) -> None:
    """Show each warning the ranks raised once, with how many ranks raised it, unless this process has
    already shown the same message (the launcher usually planned the same model first).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     show_rank_warnings({("UserWarning", "autoshard: no sharding rule for aten.foo"): [0, 1, 2, 3]}, 4)
    >>> [str(w.message) for w in caught]
    ['autoshard: no sharding rule for aten.foo (on 4 of 4 ranks)']
    """
    for (category, message), ranks in warned.items():
        if message in _SHOWN:
            continue
        _SHOWN.add(message)
        kind = getattr(builtins, category, None)
        kind = kind if isinstance(kind, type) and issubclass(kind, Warning) else UserWarning
        warnings.warn(f"{message} (on {len(set(ranks))} of {world_size} ranks)", kind, stacklevel=3)


_SHOWN: set = set()  # messages this process showed (its own, via remember_warnings, or the ranks')


@contextlib.contextmanager
def remember_warnings():
    """Within the block, warnings are shown as usual and remembered, so that `show_rank_warnings` does not
    repeat them for the ranks (verify plans in the launcher, then every rank plans the same model).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     with remember_warnings():
    ...         warnings.warn("autoshard: example once")
    ...     show_rank_warnings({("UserWarning", "autoshard: example once"): [0, 1]}, 2)
    >>> len(caught)
    1
    """
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            yield
    finally:  # also when the block fails: its warnings may say why
        for w in caught:
            _SHOWN.add(str(w.message))
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _peer_closed(first_line: str) -> bool:
    """A gloo send/recv outside our collectives (e.g. a pipeline schedule's) that failed because its peer
    went away: a consequence, not a cause."""
    return "Connection closed by peer" in first_line or "Connection reset by peer" in first_line


def _failure_report(errors, exit_codes, hung, world_size, timeout_s, total_s, nothing_failed) -> str:
    """Root causes first (ranks that died, raised something other than a collective failure, or hung), then
    the collective failures they caused on the other ranks, then the first cause's traceback."""
    lines = [(f"rank {r} died ({f'killed by signal {-code}' if code < 0 else f'exit code {code}'}) without "
              "reporting a result: it crashed, was killed (e.g. out of memory) or exited")
             for r, code in sorted(exit_codes.items())]
    own = {r: e for r, e in errors.items() if e[0] != "CollectiveTimeout" and not _peer_closed(e[1])}
    lines += [f"rank {r} raised {kind}: {first.removeprefix(f'rank {r}: ')}"
              for r, (kind, first, _) in sorted(own.items())]
    if nothing_failed:
        lines += [(f"ranks {hung} did not finish within {total_s:g} s (no rank failed; they are stuck or too "
                  "slow: raise AUTOSHARD_TIMEOUT_S / timeout_s, or run_distributed's total_s, if the task is just long)")]
    elif hung:
        lines += [f"rank {r} reported nothing {timeout_s + FAILURE_GRACE_S:g} s after the first failure and was "
                  "stopped: it hangs outside a collective" for r in hung]
    lines += [first if first.startswith(f"rank {r}:") else f"rank {r}: {kind}: {first}"
              for r, (kind, first, _) in sorted(errors.items()) if r not in own]
    head = f"{len(exit_codes) + len(errors) + len(hung)} of {world_size} ranks failed; " + lines[0]
    text = "\n  ".join([head, *lines[1:]])
    first_cause = min(own) if own else (min(errors) if errors else None)
    if first_cause is not None:
        text += f"\n\nrank {first_cause}'s traceback:\n{errors[first_cause][2]}"
    return text
