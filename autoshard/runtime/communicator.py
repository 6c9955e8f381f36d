"""Communicators: how the ranks of one mesh axis exchange tensors.

Every collective is built from one primitive, `all_gather_list` (each rank's tensor, in axis order; or
`start_all_gather_list`, the same started now and waited for later), plus local arithmetic in a fixed
order, in both the in-process simulator and the exact gloo path.
So the simulator and a real run agree bit for bit in float64. On GPUs (`exact=False`) the native
NCCL collectives run instead. An all-to-all only moves data: a real rank runs the backend's own on gloo too
(`DistCommunicator.all_to_all`, bitwise the gathered one's). Each call is recorded (kind, axis, bytes,
forward/backward) so `verify --json` can count collectives per mesh axis.

The examples run two ranks as threads (`run_on_mesh`, autoshard/runtime/simulator.py):

>>> import torch
>>> from autoshard.ir.mesh import Mesh
>>> from autoshard.runtime.simulator import run_on_mesh
>>> mesh = Mesh((2, 2), ("dp", "tp"))

and a DistCommunicator without process groups (its collectives on size-1 axes are identities):

>>> solo = DistCommunicator(Mesh((1, 2), ("pp", "dp")), 1, groups={}, mesh_group=None)
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from autoshard.ir.errors import AutoshardError
from autoshard.ir.mesh import Mesh


class CollectiveTimeout(AutoshardError):
    """A collective did not complete: another rank died, raised, or runs a different plan.

    >>> def only_rank_0_gathers(comm):
    ...     return comm.all_gather_list(torch.ones(1), "dp", "all_gather") if comm.rank == 0 else None
    >>> run_on_mesh(Mesh((2,), ("dp",)), only_rank_0_gathers, timeout_s=0.2)
    Traceback (most recent call last):
    ...
    RuntimeError: simulated rank 0 failed: CollectiveTimeout: rank 0: all_gather on mesh axis 'dp' (group [0, 1]) ...
    """


_PHASES = {"fwd": "forward", "bwd": "backward", "sync": "gradient sync"}


def backend_reason(exc: BaseException) -> str:
    """The gist of a gloo/NCCL error: its first line without the source location and the boilerplate.

    >>> backend_reason(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1234"))
    'Connection closed by peer [10.0.0.2]:1234'
    """
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    return re.split(r"\. This (is typically|may indicate)", text)[0].rstrip(". ")


@dataclass
class CommLog:
    """Counts and bytes per (axis, kind, phase).

    >>> log = CommLog()
    >>> log.record("tp", "all_reduce", 1024, "fwd")
    >>> log.record("tp", "all_reduce", 1024, "bwd")
    >>> log.summary()
    {'tp': {'all_reduce': {'fwd': 1, 'bwd': 1, 'sync': 0, 'bytes': 2048}}}
    """

    counts: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))
    dtypes: dict = field(default_factory=lambda: defaultdict(int))  # (phase, dtype) -> count, where given

    def record(self, axis: str, kind: str, nbytes: int, phase: str, dtype=None):
        """Count one collective of `kind` on `axis` moving `nbytes` in `phase` ("fwd", "bwd" or "sync"), and
        its element `dtype` where the caller gives it (the gradient reductions do).

        >>> log = CommLog()
        >>> log.record("dp", "all_gather", 64, "sync", torch.float32)
        >>> dict(log.bytes), dict(log.dtypes)
        ({('dp', 'all_gather', 'sync'): 64}, {('sync', 'float32'): 1})
        """
        self.counts[(axis, kind, phase)] += 1
        self.bytes[(axis, kind, phase)] += int(nbytes)
        if dtype is not None:
            self.dtypes[(phase, str(dtype).removeprefix("torch."))] += 1

    def clear(self):
        """Forget everything recorded (e.g. after a warm-up step).

        >>> log = CommLog()
        >>> log.record("dp", "all_gather", 64, "sync")
        >>> log.clear()
        >>> log.summary()
        {}
        """
        self.counts.clear()
        self.bytes.clear()
        self.dtypes.clear()

    def summary(self) -> dict:
        """{axis: {kind: {"fwd": n, "bwd": n, "sync": n, "bytes": b}}}: counts per phase, bytes in total.

        >>> log = CommLog()
        >>> log.record("dp", "all_reduce", 8, "sync")
        >>> log.summary()["dp"]["all_reduce"]
        {'fwd': 0, 'bwd': 0, 'sync': 1, 'bytes': 8}
        """
        out: dict = {}
        for (axis, kind, phase), n in sorted(self.counts.items()):
            entry = out.setdefault(axis, {}).setdefault(kind, {"fwd": 0, "bwd": 0, "sync": 0, "bytes": 0})
            entry[phase] += n
            entry["bytes"] += self.bytes[(axis, kind, phase)]
        return out


class Communicator:
    """One rank's view of the mesh: its coordinate and a way to talk along each axis. Subclasses give
    `all_gather_list`; the other collectives are fixed-order arithmetic on it.

    >>> run_on_mesh(mesh, lambda comm: (comm.coord, comm.axis_rank("tp")))
    {0: ((0, 0), 0), 1: ((0, 1), 1), 2: ((1, 0), 0), 3: ((1, 1), 1)}
    """

    def __init__(self, mesh: Mesh, rank: int):
        self.mesh = mesh
        self.rank = rank
        self.coord = mesh.coord(rank)
        self.log = CommLog()
        self.phase = "fwd"

    def axis_rank(self, axis: str) -> int:
        """This rank's index along mesh axis `axis`.

        >>> run_on_mesh(mesh, lambda comm: comm.axis_rank("dp"))
        {0: 0, 1: 0, 2: 1, 3: 1}
        """
        return self.coord[self.mesh.axis(axis)]

    def axis_size(self, axis: str) -> int:
        """How many ranks mesh axis `axis` has.

        >>> run_on_mesh(mesh, lambda comm: comm.axis_size("tp"))[0]
        2
        """
        return self.mesh.shape[self.mesh.axis(axis)]

    def all_gather_list(self, tensor: torch.Tensor, axis: str, what: str) -> list[torch.Tensor]:
        """Every rank's `tensor` along `axis`, in axis order (`what` names the collective in errors).

        >>> run_on_mesh(mesh, lambda comm: comm.all_gather_list(torch.tensor([comm.rank]), "dp", "example"))[1]
        [tensor([1]), tensor([3])]
        """
        raise NotImplementedError

    # Derived collectives: fixed-order arithmetic on the gathered list (bitwise reproducible).
    def all_reduce(self, tensor, axis):
        """The sum over `axis` of every rank's `tensor` (in axis order, so bitwise reproducible).

        >>> run_on_mesh(mesh, lambda comm: comm.all_reduce(torch.tensor([comm.rank]), "tp"))
        {0: tensor([1]), 1: tensor([1]), 2: tensor([5]), 3: tensor([5])}
        """
        parts = self.all_gather_list(tensor, axis, "all_reduce")
        return _ordered_sum(parts)

    def all_gather(self, tensor, axis, dim):
        """Every rank's `tensor` along `axis`, concatenated on `dim`.

        >>> run_on_mesh(mesh, lambda comm: comm.all_gather(torch.tensor([comm.rank]), "tp", 0))[2]
        tensor([2, 3])
        """
        return torch.cat(self.all_gather_list(tensor, axis, "all_gather"), dim)

    def reduce_scatter(self, tensor, axis, dim):
        """This rank's chunk (on `dim`) of the sum over `axis`.

        >>> run_on_mesh(mesh, lambda comm: comm.reduce_scatter(torch.tensor([1, 10]) * comm.rank, "tp", 0))
        {0: tensor([1]), 1: tensor([10]), 2: tensor([5]), 3: tensor([50])}
        """
        parts = self.all_gather_list(tensor, axis, "reduce_scatter")
        return _ordered_sum(parts).chunk(self.axis_size(axis), dim)[self.axis_rank(axis)].contiguous()

    def all_to_all(self, tensor, axis, gather_dim, scatter_dim):
        """Cut `tensor` in chunks on `scatter_dim`, send chunk i to rank i of `axis`, concatenate what
        arrives on `gather_dim`: S(gather_dim) -> S(scatter_dim).

        >>> out = run_on_mesh(mesh, lambda comm: comm.all_to_all(torch.arange(4).view(1, 4) + 4 * comm.rank,
        ...                                                      "tp", gather_dim=0, scatter_dim=1))
        >>> out[0], out[1]
        (tensor([[0, 1],
                [4, 5]]), tensor([[2, 3],
                [6, 7]]))
        """
        parts = self.all_gather_list(tensor, axis, "all_to_all")
        mine = self.axis_rank(axis)
        k = self.axis_size(axis)
        return torch.cat([p.chunk(k, scatter_dim)[mine] for p in parts], gather_dim).contiguous()

    def exchange(self, outgoing: dict, incoming: dict, axis: str, what: str) -> dict:
        """Point to point along `axis`: send `outgoing[j]` to the rank at index j of the axis and receive, from
        every index i in `incoming`, a tensor shaped like `incoming[i]`; returns {i: tensor}. A rank's message
        to itself stays local. Every rank of the axis calls it (a ring's shift, a zigzag reordering).

        >>> def shift(comm):  # each rank sends its number to the next rank of the axis
        ...     k, i = comm.axis_size("tp"), comm.axis_rank("tp")
        ...     got = comm.exchange({(i + 1) % k: torch.tensor([comm.rank])}, {(i - 1) % k: torch.zeros(1, dtype=torch.long)},
        ...                         "tp", "example")
        ...     return got[(i - 1) % k]
        >>> run_on_mesh(mesh, shift)
        {0: tensor([1]), 1: tensor([0]), 2: tensor([3]), 3: tensor([2])}
        """
        return self.start_exchange(outgoing, incoming, axis, what).wait()

    def start_exchange(self, outgoing: dict, incoming: dict, axis: str, what: str) -> Pending:
        """`exchange`, started (a ring overlaps its next shift with the block it computes).

        >>> run_on_mesh(mesh, lambda comm: comm.start_exchange({comm.axis_rank("dp"): torch.ones(1)}, {comm.axis_rank("dp"):
        ...                                                    torch.zeros(1)}, "dp", "example").wait())[0]
        {0: tensor([1.])}
        """
        raise NotImplementedError

    # Started collectives (`Pending`): the same results, completed later on a DistCommunicator.
    def start_all_gather_list(self, tensor, axis, what) -> Pending:
        """`all_gather_list`, started: here it completes at once (the simulator's threads meet now).

        >>> run_on_mesh(mesh, lambda comm: comm.start_all_gather_list(torch.tensor([comm.rank]), "dp", "x"))[0].wait()
        [tensor([0]), tensor([2])]
        """
        parts = self.all_gather_list(tensor, axis, what)
        return Pending(lambda: parts)

    def start_all_reduce(self, tensor, axis) -> Pending:
        """`all_reduce`, started; the result may reuse `tensor`'s storage (the caller gives it up).

        >>> run_on_mesh(mesh, lambda comm: comm.start_all_reduce(torch.tensor([comm.rank]), "dp").wait())[1]
        tensor([4])
        """
        return self.start_all_gather_list(tensor, axis, "all_reduce").then(_ordered_sum)

    def start_reduce_scatter(self, tensor, axis, dim) -> Pending:
        """`reduce_scatter`, started.

        >>> run_on_mesh(mesh, lambda comm: comm.start_reduce_scatter(torch.tensor([1, 10]), "tp", 0).wait())[1]
        tensor([20])
        """
        k, mine = self.axis_size(axis), self.axis_rank(axis)
        return self.start_all_gather_list(tensor, axis, "reduce_scatter").then(
            lambda parts: _ordered_sum(parts).chunk(k, dim)[mine].contiguous())


class Pending:
    """A collective started by a `Communicator.start_*` method: `wait()` returns its result. The simulator's
    collectives complete when started; a DistCommunicator's run on the backend's threads meanwhile (gloo's
    async_op), so the caller computes while they travel (gradient buckets during backward).

    >>> pending = run_on_mesh(mesh, lambda comm: comm.start_all_reduce(torch.tensor([comm.rank]), "tp"))
    >>> pending[3].wait()
    tensor([5])
    """

    def __init__(self, finish, work=None, comm=None, what: str = "", axis=None):
        self.finish, self.work, self.comm, self.what, self.axis = finish, work, comm, what, axis
        self.started = time.monotonic()

    def then(self, fn) -> Pending:
        """This collective followed by local work `fn(result)` (done in `wait`).

        >>> Pending(lambda: torch.ones(2)).then(lambda t: t * 3).wait()
        tensor([3., 3.])
        """
        finish = self.finish
        self.finish = lambda: fn(finish())
        return self

    def wait(self):
        """Block until the collective completes (within the communicator's timeout), then its result.

        >>> Pending(lambda: torch.zeros(1)).wait()
        tensor([0.])
        """
        if self.work is not None:
            work, self.work = self.work, None
            try:
                completed = work.wait(self.comm.timeout)
            except RuntimeError as exc:
                raise CollectiveTimeout(self.comm.failure(self.what, self.axis, exc,
                                                          time.monotonic() - self.started)) from exc
            if completed is False:
                raise CollectiveTimeout(self.comm.failure(self.what, self.axis, RuntimeError("timed out"),
                                                          time.monotonic() - self.started))
        return self.finish()


class _AllWorks:
    """Several backend works waited on as one (a batch of point-to-point sends and receives)."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout):
        return all(work.wait(timeout) is not False for work in self.works)


def _ordered_sum(parts):
    """parts[0] + parts[1] + ... in that order, into one new tensor: the first sum allocates it and the others add
    into it (each intermediate sum a fresh tensor of the bucket's size had cost its pages' faults: on this VM ~3 us
    a 4 KiB page, a 10 MB gradient bucket's sync 9 ms more). Bitwise the same as the chain of `+`.

    >>> parts = [torch.tensor([1.0, 2.0]), torch.tensor([1e-8, 0.5]), torch.tensor([3.0, 0.25])]
    >>> torch.equal(_ordered_sum(parts), (parts[0] + parts[1]) + parts[2]), _ordered_sum(parts[:1]) is parts[0]
    (True, False)
    """
    if len(parts) == 1:
        return parts[0].clone()
    total = parts[0] + parts[1]
    for part in parts[2:]:
        total.add_(part)
    return total


class DistCommunicator(Communicator):
    """A real rank: torch.distributed sub-groups per mesh axis (gloo on CPU, NCCL on GPUs). Under torchrun
    `autoshard.runtime.launch.communicator_for(mesh)` builds it; `solo` (see the module docstring) has
    no process groups:

    >>> solo.axis_size("pp"), solo.axis_rank("dp")
    (1, 1)
    """

    def __init__(self, mesh: Mesh, rank: int, groups: dict, mesh_group, exact: bool = True,
                 timeout: timedelta = timedelta(seconds=120)):
        super().__init__(mesh, rank)
        self.groups = groups  # axis name -> process group holding this rank
        self.mesh_group = mesh_group  # every rank of the mesh (fingerprint check)
        self.exact = exact
        self.timeout = timeout

    def _run(self, what, axis, fn):
        start = time.monotonic()
        try:
            return fn()
        except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection, or the group timeout passed
            raise CollectiveTimeout(self.failure(what, axis, exc, time.monotonic() - start)) from exc

    def failure(self, what: str, axis, exc: BaseException, seconds: float) -> str:
        """What failed (rank, collective, axis, group, phase), how, and whom to look at.

        >>> error = RuntimeError("Connection closed by peer")
        >>> print(solo.failure("all_reduce", "dp", error, 0.5))  # doctest: +NORMALIZE_WHITESPACE
        rank 1: all_reduce on mesh axis 'dp' (group ranks [0, 1], forward) failed after 0.5 s: Connection closed by
        peer. Rank 0 died, raised, hangs or runs a different plan: look at its error (AUTOSHARD_TIMEOUT_S ...)
        """
        group = list(self.mesh.axis_group(self.rank, axis)) if axis is not None else list(range(self.mesh.size))
        peers = [r for r in group if r != self.rank]
        reason = backend_reason(exc)
        if "timed out" in reason.lower() or "timeout" in reason.lower():
            how = f"did not complete within the {self.timeout.total_seconds():g} s timeout ({reason})"
        else:
            how = f"failed after {seconds:.1f} s: {reason}"
        where = f"on mesh axis {axis!r} " if axis is not None else ""
        phase = _PHASES.get(self.phase, self.phase)
        who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {', '.join(map(str, peers))}"
        return (f"rank {self.rank}: {what} {where}(group ranks {group}, {phase}) {how}. {who.capitalize()} died, "
                "raised, hangs or runs a different plan: look at its error (AUTOSHARD_TIMEOUT_S sets the timeout)")

    def all_gather_list(self, tensor, axis, what):
        """Every rank's `tensor` along `axis` (dist.all_gather on the axis's group; a size-1 axis has none).

        >>> solo.all_gather_list(torch.ones(2), "pp", "example")
        [tensor([1., 1.])]
        """
        import torch.distributed as dist
        if self.axis_size(axis) == 1:  # a size-1 axis has no process group: the collective is the identity
            return [tensor.clone()]
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.axis_size(axis))]
        self._run(what, axis, lambda: dist.all_gather(parts, tensor, group=self.groups[axis]))
        return parts

    def start_all_gather_list(self, tensor, axis, what) -> Pending:
        """`all_gather_list` started on the backend's threads (async_op); `wait()` gives the parts.

        >>> solo.start_all_gather_list(torch.ones(2), "pp", "example").wait()
        [tensor([1., 1.])]
        """
        import torch.distributed as dist
        if self.axis_size(axis) == 1:
            return super().start_all_gather_list(tensor, axis, what)
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.axis_size(axis))]
        work = self._run(what, axis, lambda: dist.all_gather(parts, tensor, group=self.groups[axis], async_op=True))
        return Pending(lambda: parts, work, self, what, axis)

    def start_exchange(self, outgoing, incoming, axis, what) -> Pending:
        """`exchange` as gloo/NCCL point-to-point sends and receives on the axis's group, started.

        >>> solo.start_exchange({0: torch.ones(1)}, {0: torch.zeros(1)}, "pp", "example").wait()
        {0: tensor([1.])}
        """
        import torch.distributed as dist
        mine = self.axis_rank(axis)
        ranks = self.mesh.axis_group(self.rank, axis)  # global ranks (the mesh covers the world from rank 0)
        received, ops = {}, []
        for j, tensor in outgoing.items():
            if j == mine:
                received[j] = tensor.clone()
            else:
                ops.append(dist.P2POp(dist.isend, tensor.contiguous(), ranks[j], self.groups[axis]))
        for i, like in incoming.items():
            if i != mine:
                received[i] = torch.empty_like(like)
                ops.append(dist.P2POp(dist.irecv, received[i], ranks[i], self.groups[axis]))
        if not ops:
            return Pending(lambda: received)
        works = self._run(what, axis, lambda: dist.batch_isend_irecv(ops))
        return Pending(lambda: received, _AllWorks(works), self, what, axis)

    def start_all_reduce(self, tensor, axis) -> Pending:
        """`all_reduce` started: exact (gathered, summed in `wait`) or gloo/NCCL's own, in place on `tensor`.

        >>> solo.start_all_reduce(torch.ones(2), "pp").wait()
        tensor([1., 1.])
        """
        if self.exact or self.axis_size(axis) == 1:
            return super().start_all_reduce(tensor, axis)
        import torch.distributed as dist
        work = self._run("all_reduce", axis, lambda: dist.all_reduce(tensor, group=self.groups[axis], async_op=True))
        return Pending(lambda: tensor, work, self, "all_reduce", axis)

    def start_reduce_scatter(self, tensor, axis, dim) -> Pending:
        """`reduce_scatter` started: exact, or gloo/NCCL's own.

        >>> solo.start_reduce_scatter(torch.arange(2.0), "pp", 0).wait()
        tensor([0., 1.])
        """
        if self.exact or self.axis_size(axis) == 1:
            return super().start_reduce_scatter(tensor, axis, dim)
        import torch.distributed as dist
        chunks = [c.contiguous() for c in tensor.chunk(self.axis_size(axis), dim)]
        out = torch.empty_like(chunks[0])
        work = self._run("reduce_scatter", axis,
                         lambda: dist.reduce_scatter(out, chunks, group=self.groups[axis], async_op=True))
        return Pending(lambda: out, work, self, "reduce_scatter", axis)

    def all_to_all(self, tensor, axis, gather_dim, scatter_dim):
        """`Communicator.all_to_all` as the backend's own all-to-all (gloo's and NCCL's alike: it moves data and adds
        nothing, so it is exact on both): each rank sends 1/k of its tensor where gathering it all would move k
        times that. Every rank's input has this rank's shape (as the gathers assume), `scatter_dim` split evenly.

        >>> solo.all_to_all(torch.arange(4.0).view(2, 2), "pp", gather_dim=0, scatter_dim=1)
        tensor([[0., 1.],
                [2., 3.]])
        """
        k = self.axis_size(axis)
        if k == 1 or tensor.shape[scatter_dim] % k:  # the base class's result (or its error) for these
            return super().all_to_all(tensor, axis, gather_dim, scatter_dim)
        import torch.distributed as dist
        sends = [c.contiguous() for c in tensor.chunk(k, scatter_dim)]
        received = [torch.empty_like(sends[0]) for _ in range(k)]
        self._run("all_to_all", axis, lambda: dist.all_to_all(received, sends, group=self.groups[axis]))
        return torch.cat(received, gather_dim).contiguous()

    def all_reduce(self, tensor, axis):
        """The sum over `axis`: exact (gathered, fixed-order sum) on gloo, NCCL's all_reduce otherwise.

        >>> solo.all_reduce(torch.ones(2), "pp")  # one rank on the axis: the tensor itself
        tensor([1., 1.])
        """
        if self.exact or self.axis_size(axis) == 1:
            return super().all_reduce(tensor, axis)
        import torch.distributed as dist
        out = tensor.clone()
        self._run("all_reduce", axis, lambda: dist.all_reduce(out, group=self.groups[axis]))
        return out

    def reduce_scatter(self, tensor, axis, dim):
        """This rank's chunk of the sum over `axis`: exact on gloo, NCCL's reduce_scatter otherwise.

        >>> solo.reduce_scatter(torch.arange(4.0), "pp", 0)
        tensor([0., 1., 2., 3.])
        """
        if self.exact or self.axis_size(axis) == 1:
            return super().reduce_scatter(tensor, axis, dim)
        import torch.distributed as dist
        chunks = [c.contiguous() for c in tensor.chunk(self.axis_size(axis), dim)]
        out = torch.empty_like(chunks[0])
        self._run("reduce_scatter", axis, lambda: dist.reduce_scatter(out, chunks, group=self.groups[axis]))
        return out
