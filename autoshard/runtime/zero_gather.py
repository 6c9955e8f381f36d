"""ZeRO-3's parameter gather: all-gathered just before use, never kept from forward to backward.

`ParamAllGather` (collective `param_all_gather`): forward all-gathers a parameter shard S(d) -> R on the
ZeRO axis; backward reduce-scatters its gradient (partial there, as the consumer splits the batch: the
duality rule) or takes this rank's chunk of a replicated one. Autograd would keep the gathered copy alive
for the consumers' backward (a matmul saves its weight), so the rank module runs forward inside
`save_shards_for_backward()`: a saved tensor that is a gathered parameter (or a view of one) is saved as
a handle holding only the shard, and backward re-gathers it once, on first use, dropping the copy when
the parameter's gradient is reduce-scattered. A rank module runs forward `overlapping` a Zero3Overlap:
gathers prefetched, reduce-scatters started per layer in backward (autoshard/runtime/zero_overlap.py).
`GatheredMemory` measures the bytes of gathered copies alive at once (ZeRO-3's transient memory).

The examples gather a parameter split over two ranks (threads of the simulator):

>>> import torch
>>> from autoshard.ir.mesh import Mesh
>>> from autoshard.runtime.simulator import run_on_mesh
>>> mesh = Mesh((2,), ("dp",))
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch

_LOCAL = threading.local()  # the simulator runs one rank per thread


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def compact(t: torch.Tensor) -> torch.Tensor:
    """`t` in storage of its own size: a shard cut from a gathered or summed buffer would keep all of it.

    >>> full = torch.zeros(1000)
    >>> compact(full[:10]).untyped_storage().nbytes(), compact(full) is full
    (40, True)
    """
    return t if t.untyped_storage().nbytes() == _nbytes(t) else t.clone()


class GatheredMemory:
    """Bytes of gathered parameter copies alive now and at most (peak) since `reset`.

    >>> memory = GatheredMemory()
    >>> copy = torch.zeros(256)
    >>> memory.track(copy)
    >>> memory.live, memory.peak
    (1024, 1024)
    >>> del copy  # the copy is freed: live drops, the peak remains
    >>> memory.live, memory.peak
    (0, 1024)
    """

    def __init__(self):
        self.live = 0
        self.peak = 0

    def reset(self) -> None:
        """Start a new peak from what is alive now (e.g. at the start of a step).

        >>> memory = GatheredMemory()
        >>> memory.peak = 4096
        >>> memory.reset()
        >>> memory.peak
        0
        """
        self.peak = self.live

    def track(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s bytes as alive until it is freed.

        >>> memory = GatheredMemory()
        >>> kept = torch.zeros(2, 4)
        >>> memory.track(kept)
        >>> memory.live
        32
        """
        nbytes = _nbytes(tensor)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes


class _Handle:
    """What backward needs to re-gather one parameter: its shard and where to gather it; under overlap the
    Zero3Overlap that may have started the re-gather already (`pending`) and learns the backward's order."""

    __slots__ = ("axis", "comm", "dim", "full", "index", "memory", "overlap", "pending", "shard", "siblings")

    def __init__(self, shard, comm, axis, dim, memory):
        self.shard, self.comm, self.axis, self.dim, self.memory = shard, comm, axis, dim, memory
        self.full = self.pending = self.overlap = self.siblings = self.index = None

    def regather(self) -> torch.Tensor:
        if self.full is None:
            if self.pending is not None:
                self.full, self.pending = self.pending.wait(), None
            else:
                self.full = self.comm.all_gather(self.shard, self.axis, self.dim)
            self.comm.log.record(self.axis, "all_gather", _nbytes(self.full), "bwd")
            if self.memory is not None:
                self.memory.track(self.full)
            if self.overlap is not None:
                self.overlap.regathered(self)
        return self.full


class _SavedView:
    """A saved gathered parameter (or view of it): handle plus the view's geometry."""

    __slots__ = ("handle", "offset", "size", "stride")

    def __init__(self, handle, t):
        self.handle, self.size, self.stride, self.offset = handle, t.size(), t.stride(), t.storage_offset()


class ParamAllGather(torch.autograd.Function):
    """The autograd function behind `collectives.param_all_gather(x, axis, dim, reduce_grad)`.

    >>> def shard_of(comm):  # each rank holds half of w = [1, 2, 3, 4]
    ...     return (torch.tensor([1.0, 2.0]) + 2 * comm.rank).requires_grad_()
    >>> run_on_mesh(mesh, lambda comm: ParamAllGather.apply(shard_of(comm), comm, "dp", 0, True).tolist())
    {0: [1.0, 2.0, 3.0, 4.0], 1: [1.0, 2.0, 3.0, 4.0]}
    """

    @staticmethod
    def forward(ctx, x, comm, axis, dim, reduce_grad, dtype=None):
        """All-gather the shard `x` on `axis` (dim `dim`), first cast to `dtype` when given (mixed
        precision: FSDP2's param_dtype); keep a handle that can re-gather it.

        >>> run_on_mesh(mesh, lambda comm: ParamAllGather.apply(torch.ones(1) * comm.rank, comm, "dp", 0, True))
        {0: tensor([0., 1.]), 1: tensor([0., 1.])}
        >>> run_on_mesh(mesh, lambda comm: ParamAllGather.apply(torch.ones(1), comm, "dp", 0, True, torch.bfloat16))
        {0: tensor([1., 1.], dtype=torch.bfloat16), 1: tensor([1., 1.], dtype=torch.bfloat16)}
        """
        gathered = getattr(_LOCAL, "gathered", None)
        memory = gathered[1] if gathered is not None else None
        shard = x.detach() if dtype is None else x.detach().to(dtype)
        overlap = getattr(_LOCAL, "overlap", None)
        out = comm.all_gather(shard, axis, dim) if overlap is None else overlap.gather(x, shard, comm, axis, dim, dtype)
        comm.log.record(axis, "all_gather", _nbytes(out), "fwd", out.dtype)
        handle = _Handle(shard, comm, axis, dim, memory)
        if overlap is not None:
            overlap.track(handle, x)
        if gathered is not None:
            gathered[0][id(out)] = (weakref.ref(out), handle)
        if memory is not None:
            memory.track(out)
        ctx.handle, ctx.reduce_grad, ctx.master_dtype = handle, reduce_grad, x.dtype
        ctx.overlap, ctx.param = (overlap, x) if overlap is not None and x.is_leaf else (None, None)
        return out

    @staticmethod
    def backward(ctx, grad):
        """The shard's gradient: with `reduce_grad` the reduce-scatter of the (partial) gradient, else this
        rank's chunk of it; in the master's dtype, cast before the reduction (FSDP2's reduce_dtype).

        >>> def step(comm):  # rank r weighs the gathered w by r + 1: w's gradient is partial
        ...     shard = torch.ones(2, requires_grad=True)
        ...     (ParamAllGather.apply(shard, comm, "dp", 0, True) * (comm.rank + 1)).sum().backward()
        ...     return shard.grad
        >>> run_on_mesh(mesh, step)  # 1 + 2 for every element
        {0: tensor([3., 3.]), 1: tensor([3., 3.])}
        """
        handle = ctx.handle
        handle.full = None  # every consumer's backward has run: the re-gathered copy can go
        comm, axis, dim = handle.comm, handle.axis, handle.dim
        grad = grad.to(ctx.master_dtype)
        if ctx.reduce_grad:
            comm.log.record(axis, "reduce_scatter", _nbytes(grad), "bwd", grad.dtype)
            if ctx.overlap is not None and ctx.overlap.defer(ctx.param, grad.contiguous(), comm, axis, dim):
                return None, None, None, None, None, None  # the shard reaches the parameter in sync_grads
            shard = comm.reduce_scatter(grad.contiguous(), axis, dim)
        else:
            shard = grad.chunk(comm.axis_size(axis), dim)[comm.axis_rank(axis)].contiguous()
        return compact(shard), None, None, None, None, None


def _pack(t: torch.Tensor):
    gathered = getattr(_LOCAL, "gathered", None)
    if gathered is None:
        return t
    base = t if t._base is None else t._base
    entry = gathered[0].get(id(base))
    if entry is None or entry[0]() is not base:
        return t
    return _SavedView(entry[1], t)


def _unpack(saved):
    if isinstance(saved, _SavedView):
        return saved.handle.regather().as_strided(saved.size, saved.stride, saved.offset)
    return saved


@contextlib.contextmanager
def overlapping(overlap):
    """Run a ZeRO-3 forward with `overlap` (a Zero3Overlap, autoshard/runtime/zero_overlap.py, or None):
    gathers prefetched one layer ahead, reduce-scatters of the gradients started in backward.

    >>> with overlapping(None):  # nothing to overlap: every gather runs when called
    ...     run_on_mesh(mesh, lambda comm: ParamAllGather.apply(torch.ones(1), comm, "dp", 0, True))[0]
    tensor([1., 1.])
    """
    previous = getattr(_LOCAL, "overlap", None)
    _LOCAL.overlap = overlap
    try:
        yield
    finally:
        _LOCAL.overlap = previous


@contextlib.contextmanager
def save_shards_for_backward(memory: GatheredMemory | None = None):
    """Run a ZeRO-3 forward: gathered parameters are saved for backward as shards (re-gathered there).

    >>> def step(comm):
    ...     memory = GatheredMemory()
    ...     shard = torch.ones(512, 2, requires_grad=True)
    ...     with save_shards_for_backward(memory):
    ...         weight = ParamAllGather.apply(shard, comm, "dp", 0, True)  # [1024, 2]: 8 KiB
    ...         loss = (torch.ones(3, 1024) @ weight).sum()  # the matmul saves the weight for backward
    ...         del weight
    ...     after_forward = memory.live
    ...     loss.backward()  # re-gathers the weight once
    ...     return after_forward, memory.peak
    >>> run_on_mesh(mesh, step)[0]  # the forward's gathered copy is gone before backward
    (0, 8192)
    """
    previous = getattr(_LOCAL, "gathered", None)
    _LOCAL.gathered = ({}, memory)
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _LOCAL.gathered = previous
