"""The simulator's ranks: threads of one process that exchange tensors through a ThreadHub (one slot and
barrier per axis group), with the collectives of autoshard/runtime/communicator.py on top.

>>> import torch
>>> from autoshard.ir.mesh import Mesh
>>> from autoshard.runtime.simulator import run_on_mesh
>>> mesh = Mesh((2, 2), ("dp", "tp"))
"""
from __future__ import annotations

import threading

from autoshard.ir.mesh import Mesh
from autoshard.runtime.communicator import CollectiveTimeout, Communicator, Pending


class ThreadHub:
    """Shared state of the in-process simulator: one exchange slot and barrier per axis group.

    >>> sorted(ThreadHub(mesh).slots)  # (axis, ranks of one group along it)
    [(0, (0, 2)), (0, (1, 3)), (1, (0, 1)), (1, (2, 3))]
    """

    def __init__(self, mesh: Mesh, timeout_s: float = 60.0):
        self.mesh = mesh
        self.timeout_s = timeout_s
        self.slots: dict = {}
        self.barriers: dict = {}
        for axis in range(mesh.ndim):
            for group in mesh.axis_groups(axis):
                self.slots[(axis, group)] = [None] * len(group)
                self.barriers[(axis, group)] = threading.Barrier(len(group), timeout=timeout_s)

    def abort(self):
        """Break every barrier: ranks waiting in a collective raise CollectiveTimeout (a rank failed).

        >>> hub = ThreadHub(mesh)
        >>> hub.abort()
        >>> ThreadCommunicator(hub, 0).all_reduce(torch.ones(1), "dp")
        Traceback (most recent call last):
        ...
        autoshard.runtime.communicator.CollectiveTimeout: rank 0: all_reduce on mesh axis 'dp' (group [0, 2]) ...
        """
        for barrier in self.barriers.values():
            barrier.abort()


class ThreadCommunicator(Communicator):
    """A rank of the simulator: threads of one process exchange tensors through a ThreadHub.

    >>> type(run_on_mesh(mesh, lambda comm: comm)[0]).__name__
    'ThreadCommunicator'
    """

    def __init__(self, hub: ThreadHub, rank: int):
        super().__init__(hub.mesh, rank)
        self.hub = hub

    def all_gather_list(self, tensor, axis, what):
        """Every rank's `tensor` along `axis` (snapshots taken when each rank arrives), in axis order.

        >>> run_on_mesh(mesh, lambda comm: comm.all_gather_list(torch.tensor(comm.rank), "tp", "example"))[3]
        [tensor(2), tensor(3)]
        """
        return self.meet(axis, tensor.detach().clone(), what)  # a snapshot: the owner may update it in place

    def start_exchange(self, outgoing, incoming, axis, what) -> Pending:
        """`exchange` by meeting: each rank leaves its messages, addressed by axis index, and takes its own.

        >>> run_on_mesh(mesh, lambda comm: comm.start_exchange({0: torch.tensor([comm.rank])}, {}, "tp", "x").wait())[0]
        {}
        """
        mine = self.axis_rank(axis)
        boxes = self.meet(axis, {j: t.detach().clone() for j, t in outgoing.items()}, what)
        received = {i: boxes[i][mine] for i in incoming}
        return Pending(lambda: received)

    def meet(self, axis, value, what):
        """Every rank's `value` along `axis`, in axis order, through the hub's slot and barrier of the group.

        >>> run_on_mesh(mesh, lambda comm: comm.meet("tp", comm.rank * 10, "example"))[3]
        [20, 30]
        """
        index = self.mesh.axis(axis)
        group = self.mesh.axis_group(self.rank, index)
        key = (index, group)
        slot, barrier = self.hub.slots[key], self.hub.barriers[key]
        try:
            slot[self.coord[index]] = value
            barrier.wait()
            parts = list(slot)
            barrier.wait()
        except threading.BrokenBarrierError:
            raise CollectiveTimeout(
                f"rank {self.rank}: {what} on mesh axis {axis!r} (group {list(group)}) did not complete within "
                f"{self.hub.timeout_s:.0f} s: another rank failed or runs a different plan") from None
        return parts
