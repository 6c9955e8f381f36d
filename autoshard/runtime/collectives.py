"""The collectives per-rank graphs call, as autograd functions whose backward is the dual one.

Placement duality (DESIGN): a gradient's placement is the dual of its tensor's forward placement,
S(d) <-> S(d), P <-> R, R <-> R. So each forward redistribution has a fixed backward:

  forward                   backward
  all_reduce     P -> R     identity        (Megatron's g)
  grad_all_reduce R -> R    all_reduce      (Megatron's f: the consumer splits its work, so the
                                             gradient of its replicated input comes back partial)
  all_gather     S -> R     chunk
  chunk          R -> S     all_gather
  reduce_scatter P -> S     all_gather
  all_gather_sum_grad S->R  reduce_scatter  (the consumer splits its work, so the gathered tensor's
                                             gradient comes back partial: Megatron-SP's g-bar)
  all_to_all     S(d)->S(e) all_to_all S(e)->S(d)

The functions find the calling rank's communicator via `use_communicator` (set by the rank module
around its forward) and keep it in the autograd context for the backward.

The examples run two ranks as threads; `grads(fn, x)` is each rank's gradient of `fn(x).sum()`:

>>> import torch
>>> from autoshard.ir.mesh import Mesh
>>> from autoshard.runtime.simulator import run_on_mesh
>>> mesh = Mesh((2,), ("tp",))
>>> def grads(fn, rank_value):
...     def step(comm):
...         x = rank_value(comm.rank).requires_grad_()
...         fn(x).sum().backward()
...         return x.grad
...     return run_on_mesh(mesh, step)
"""
from __future__ import annotations

import contextlib
import threading
import types

import torch

from autoshard.runtime.communicator import Communicator
from autoshard.runtime.zero_gather import ParamAllGather, compact

_LOCAL = threading.local()


@contextlib.contextmanager
def use_communicator(comm: Communicator):
    """Make `comm` the calling thread's communicator for the collectives inside the `with` block.

    >>> from autoshard.runtime.communicator import DistCommunicator
    >>> solo = DistCommunicator(Mesh((1,), ("dp",)), 0, groups={}, mesh_group=None)
    >>> with use_communicator(solo):
    ...     all_reduce(torch.ones(2), "dp")  # one rank on the axis: the identity
    tensor([1., 1.])
    """
    previous = getattr(_LOCAL, "comm", None)
    _LOCAL.comm = comm
    try:
        yield comm
    finally:
        _LOCAL.comm = previous


def current() -> Communicator:
    """The calling thread's communicator (set by `use_communicator`); an error outside a rank.

    >>> current()
    Traceback (most recent call last):
    ...
    RuntimeError: a per-rank autoshard module ran outside its rank: call it through RankModule ...
    """
    comm = getattr(_LOCAL, "comm", None)
    if comm is None:
        raise RuntimeError("a per-rank autoshard module ran outside its rank: call it through RankModule "
                           "(prog.module(rank)) or prog.simulate(...), not the bare GraphModule")
    return comm


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis):
        comm.log.record(axis, "all_reduce", _nbytes(x), "fwd")
        return comm.all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.comm.log.record(ctx.axis, "all_reduce", _nbytes(grad), "bwd")
        return ctx.comm.all_reduce(grad, ctx.axis), None, None


def _chunk(comm, x, axis, dim):
    k = comm.axis_size(axis)
    return x.chunk(k, dim)[comm.axis_rank(axis)].contiguous()


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis, dim):
        ctx.comm, ctx.axis, ctx.dim = comm, axis, dim
        out = comm.all_gather(x, axis, dim)
        comm.log.record(axis, "all_gather", _nbytes(out), "fwd")
        return out

    @staticmethod
    def backward(ctx, grad):
        # a chunk of dim 0 is a view: as a parameter's gradient it would keep the whole gathered gradient alive
        return compact(_chunk(ctx.comm, grad, ctx.axis, ctx.dim)), None, None, None


class _Chunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis, dim):
        ctx.comm, ctx.axis, ctx.dim = comm, axis, dim
        return _chunk(comm, x, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        out = ctx.comm.all_gather(grad.contiguous(), ctx.axis, ctx.dim)
        ctx.comm.log.record(ctx.axis, "all_gather", _nbytes(out), "bwd")
        return out, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis, dim):
        ctx.comm, ctx.axis, ctx.dim = comm, axis, dim
        comm.log.record(axis, "reduce_scatter", _nbytes(x), "fwd")
        return comm.reduce_scatter(x, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        out = ctx.comm.all_gather(grad.contiguous(), ctx.axis, ctx.dim)
        ctx.comm.log.record(ctx.axis, "all_gather", _nbytes(out), "bwd")
        return out, None, None, None


class _AllGatherSumGrad(_AllGather):
    """All-gather whose gradient comes back partial: the backward reduce-scatters (sequence parallel)."""

    @staticmethod
    def backward(ctx, grad):
        ctx.comm.log.record(ctx.axis, "reduce_scatter", _nbytes(grad), "bwd")
        return ctx.comm.reduce_scatter(grad.contiguous(), ctx.axis, ctx.dim), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis, gather_dim, scatter_dim):
        ctx.comm, ctx.axis, ctx.dims = comm, axis, (gather_dim, scatter_dim)
        comm.log.record(axis, "all_to_all", _nbytes(x), "fwd")
        return comm.all_to_all(x.contiguous(), axis, gather_dim, scatter_dim)

    @staticmethod
    def backward(ctx, grad):
        gather_dim, scatter_dim = ctx.dims
        ctx.comm.log.record(ctx.axis, "all_to_all", _nbytes(grad), "bwd")
        return ctx.comm.all_to_all(grad.contiguous(), ctx.axis, scatter_dim, gather_dim), None, None, None, None


def all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """P -> R on `axis` (backward: identity).

    >>> run_on_mesh(mesh, lambda comm: all_reduce(torch.tensor([1.0, 2.0]) * (comm.rank + 1), "tp"))
    {0: tensor([3., 6.]), 1: tensor([3., 6.])}
    >>> grads(lambda x: all_reduce(x, "tp"), lambda rank: torch.ones(2))
    {0: tensor([1., 1.]), 1: tensor([1., 1.])}
    """
    return _AllReduce.apply(x, current(), axis)


def grad_all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity forward; all-reduces the gradient on `axis` in backward.

    >>> grads(lambda x: grad_all_reduce(x, "tp") * 2, lambda rank: torch.ones(2))  # each rank's grad 2: sum 4
    {0: tensor([4., 4.]), 1: tensor([4., 4.])}
    """
    return _GradAllReduce.apply(x, current(), axis)


def all_gather(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """S(dim) -> R on `axis` (backward: take this rank's chunk).

    >>> run_on_mesh(mesh, lambda comm: all_gather(torch.tensor([comm.rank]), "tp", 0))
    {0: tensor([0, 1]), 1: tensor([0, 1])}
    >>> grads(lambda x: all_gather(x, "tp", 0) * torch.tensor([1.0, 2.0]), lambda rank: torch.ones(1))
    {0: tensor([1.]), 1: tensor([2.])}
    """
    return _AllGather.apply(x, current(), axis, dim)


def chunk(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """R -> S(dim) on `axis`, no communication (backward: all_gather).

    >>> run_on_mesh(mesh, lambda comm: chunk(torch.tensor([5, 6]), "tp", 0))
    {0: tensor([5]), 1: tensor([6])}
    >>> grads(lambda x: chunk(x, "tp", 0), lambda rank: torch.ones(2))
    {0: tensor([1., 1.]), 1: tensor([1., 1.])}
    """
    return _Chunk.apply(x, current(), axis, dim)


def reduce_scatter(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """P -> S(dim) on `axis` (backward: all_gather).

    >>> run_on_mesh(mesh, lambda comm: reduce_scatter(torch.tensor([1, 10]) * (comm.rank + 1), "tp", 0))
    {0: tensor([3]), 1: tensor([30])}
    """
    return _ReduceScatter.apply(x, current(), axis, dim)


def all_gather_sum_grad(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """S(dim) -> R on `axis` for a consumer that splits its work (backward: reduce_scatter of the
    partial gradient, i.e. all_gather + grad_all_reduce fused).

    >>> def step(comm):  # rank r weighs the gathered [x0, x1] by (r + 1) * [1, 2]
    ...     x = torch.ones(1, requires_grad=True)
    ...     (all_gather_sum_grad(x, "tp", 0) * torch.tensor([1.0, 2.0]) * (comm.rank + 1)).sum().backward()
    ...     return x.grad
    >>> run_on_mesh(mesh, step)  # x0's gradient sums both ranks' weights of it: 1 + 2; x1's: 2 + 4
    {0: tensor([3.]), 1: tensor([6.])}
    """
    return _AllGatherSumGrad.apply(x, current(), axis, dim)


def all_to_all(x: torch.Tensor, axis: str, gather_dim: int, scatter_dim: int) -> torch.Tensor:
    """S(gather_dim) -> S(scatter_dim) on `axis` (backward: the reverse all_to_all).

    >>> out = run_on_mesh(mesh, lambda comm: all_to_all(torch.arange(2).view(1, 2) + 2 * comm.rank, "tp", 0, 1))
    >>> out[0].tolist(), out[1].tolist()  # rows were split over ranks; now columns are
    ([[0], [2]], [[1], [3]])
    """
    return _AllToAll.apply(x, current(), axis, gather_dim, scatter_dim)


COLLECTIVES = {"all_reduce": all_reduce, "grad_all_reduce": grad_all_reduce, "all_gather": all_gather,
               "chunk": chunk, "reduce_scatter": reduce_scatter, "all_to_all": all_to_all,
               "all_gather_sum_grad": all_gather_sum_grad}


def param_all_gather(x: torch.Tensor, axis: str, dim: int, reduce_grad: bool, dtype=None) -> torch.Tensor:
    """ZeRO-3: a parameter shard S(dim) -> R on `axis` right before its use (backward: reduce_scatter of
    the partial gradient when `reduce_grad`, else this rank's chunk); backward re-gathers the parameter
    instead of keeping the gathered copy (autoshard/runtime/zero_gather.py). With `dtype` (mixed
    precision) the shard is cast before the gather and the gradient back to the shard's dtype before the
    reduce-scatter.

    >>> run_on_mesh(mesh, lambda comm: param_all_gather(torch.tensor([comm.rank + 0.0]), "tp", 0, reduce_grad=True))
    {0: tensor([0., 1.]), 1: tensor([0., 1.])}
    """
    return ParamAllGather.apply(x, current(), axis, dim, reduce_grad, dtype)


COLLECTIVES["param_all_gather"] = param_all_gather

_FUNCTIONS = {"all_reduce": _AllReduce, "grad_all_reduce": _GradAllReduce, "all_gather": _AllGather, "chunk": _Chunk,
              "reduce_scatter": _ReduceScatter, "all_gather_sum_grad": _AllGatherSumGrad, "all_to_all": _AllToAll}


def run_collective(name: str, x: torch.Tensor, comm: Communicator, axis: str, *dims, backward: bool = False):
    """Collective `name`'s forward on `x` (with `backward`: its backward on the gradient `x`) exactly as its
    autograd function runs it, outside autograd: a compiled rank program calls it from inside its graph
    (autoshard/runtime/compiled.py), where AOTAutograd, not this function, connects forward and backward.

    >>> run_on_mesh(mesh, lambda comm: run_collective("all_gather", torch.tensor([comm.rank]), comm, "tp", 0))
    {0: tensor([0, 1]), 1: tensor([0, 1])}
    >>> run_on_mesh(mesh, lambda comm: run_collective("all_gather", torch.tensor([5, 6]), comm, "tp", 0, backward=True))
    {0: tensor([5]), 1: tensor([6])}
    """
    function = _FUNCTIONS[name]
    ctx = types.SimpleNamespace(comm=comm, axis=axis, dim=dims[0] if dims else None, dims=tuple(dims))
    return function.backward(ctx, x)[0] if backward else function.forward(ctx, x, comm, axis, *dims)
