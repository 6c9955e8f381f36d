"""The collectives as torch custom ops, so that torch.compile keeps them inside one graph (compile=True).

`torch.ops.autoshard.collective(x, comm, name, axis, dims)` runs collective `name` forward as its autograd
function does (autoshard/runtime/collectives.py `run_collective`), through the communicator registered
under the key `comm`; its registered gradient is `torch.ops.autoshard.collective_grad`, that function's
backward. To dynamo and inductor they are opaque ops with known output shapes: a rank program is one
forward graph and one backward graph (AOTAutograd) with the collectives called from inside them, instead
of one graph per stretch between collectives. Every rank compiles the same graph (one plan, equal local
shapes), so all ranks call their collectives in the same order; AOTAutograd never recomputes an op it
does not know in backward, so nothing communicates twice.

The communicator is a constant of the graph (each rank compiles its own module): `register(comm)` gives
its key.

>>> import torch
>>> from autoshard.ir.mesh import Mesh
>>> from autoshard.runtime.simulator import run_on_mesh
>>> mesh = Mesh((2,), ("tp",))
"""
from __future__ import annotations

import weakref

import torch

from autoshard.runtime.collectives import run_collective

_COMMS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
IN_GRAPH = ("all_reduce", "grad_all_reduce", "all_gather", "chunk", "reduce_scatter", "all_gather_sum_grad",
            "all_to_all")
# How each collective changes its input's shape on an axis of k ranks: (dim argument, factor) pairs.
_GROWS = {"all_gather": ((0, 1),), "all_gather_sum_grad": ((0, 1),), "chunk": ((0, -1),),
          "reduce_scatter": ((0, -1),), "all_to_all": ((0, 1), (1, -1))}


def register(comm) -> int:
    """The key under which the graph ops find `comm` (kept while the communicator lives).

    >>> run_on_mesh(mesh, lambda comm: _COMMS[register(comm)] is comm)
    {0: True, 1: True}
    """
    _COMMS[id(comm)] = comm
    return id(comm)


def _fresh(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A custom op's output may not alias its input (identity collectives return it, or a view)."""
    return out.clone() if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else out


def _shape(name: str, shape, k: int, dims, backward: bool) -> list:
    out = list(shape)
    for position, sign in _GROWS.get(name, ()):
        grow = sign > 0 if not backward else sign < 0
        dim = dims[position]
        out[dim] = out[dim] * k if grow else out[dim] // k
    return out


@torch.library.custom_op("autoshard::collective", mutates_args=())
def collective(x: torch.Tensor, comm: int, name: str, axis: str, dims: list[int]) -> torch.Tensor:
    """Collective `name` on `axis` forward, with the registered communicator `comm` (see the module docstring).

    >>> run_on_mesh(mesh, lambda c: collective(torch.tensor([c.rank]), register(c), "all_gather", "tp", [0]))
    {0: tensor([0, 1]), 1: tensor([0, 1])}
    """
    return _fresh(run_collective(name, x, _COMMS[comm], axis, *dims), x)


@collective.register_fake
def _(x, comm, name, axis, dims):
    return x.new_empty(_shape(name, x.shape, _COMMS[comm].axis_size(axis), dims, backward=False))


@torch.library.custom_op("autoshard::collective_grad", mutates_args=())
def collective_grad(grad: torch.Tensor, comm: int, name: str, axis: str, dims: list[int]) -> torch.Tensor:
    """The gradient of `collective(x, comm, name, axis, dims)` from the gradient of its output: the dual
    collective, as the autograd function's backward runs it.

    >>> run_on_mesh(mesh, lambda c: collective_grad(torch.tensor([5, 6]), register(c), "all_gather", "tp", [0]))
    {0: tensor([5]), 1: tensor([6])}
    """
    return _fresh(run_collective(name, grad, _COMMS[comm], axis, *dims, backward=True), grad)


@collective_grad.register_fake
def _(grad, comm, name, axis, dims):
    return grad.new_empty(_shape(name, grad.shape, _COMMS[comm].axis_size(axis), dims, backward=True))


def _setup(ctx, inputs, output):
    ctx.args = inputs[1:]


def _backward(ctx, grad):
    return collective_grad(grad.contiguous(), *ctx.args), None, None, None, None


collective.register_autograd(_backward, setup_context=_setup)
