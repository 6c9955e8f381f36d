"""The global gradient norm of a rank module and clipping by it (`RankModule.clip_grad_norm_`), and the
step's loss as the single device reports it (`RankModule.global_loss`).

`torch.nn.utils.clip_grad_norm_(module.parameters(), ...)` on a rank module would clip by the norm of
that rank's shards: each rank a different factor. Here every rank computes the same norm, the single
device's: each local gradient piece contributes |g|^p divided by the number of ranks holding the same
piece (the mesh axes it is replicated on, after `sync_grads` has reduced the partial ones), one all-
reduce per mesh axis sums the contributions (a max for the inf-norm), and every piece is scaled by
`min(1, max_norm / (norm + 1e-6))`, torch's factor. With ZeRO-2/3 the pieces are the optimizer's
gradient shards; a pipeline rank also sums over the pipeline axis (a weight tied across stages on two
pp ranks is held by both).

The examples run a data-parallel MLP's ranks as threads (the simulator):

>>> import copy
>>> import torch
>>> import autoshard
>>> from autoshard.runtime.simulator import run_ranks
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> model, inputs = model.double(), tuple(x.double() for x in inputs)
>>> megatron = {"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"}, "layers.0.bias": {"tp": "S(0)"},
...             "layers.1.weight": {"tp": "S(1)"}, "layers.1.bias": {"tp": "R"}}
>>> prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"), hints=megatron)
>>> def reference():  # the single-device gradients, on a copy
...     single = copy.deepcopy(model)
...     loss_fn(single(*inputs), *inputs).backward()
...     return single
"""
from __future__ import annotations

import math

import torch

from autoshard.ir.errors import UserInputError
from autoshard.ir.placement import Shard


def _pipeline_holders(module, fqn: str) -> int:
    """How many pipeline ranks hold parameter `fqn` (a weight tied across stages on different ranks is held,
    with the same summed gradient, by each); 1 outside a pipeline and in the simulator (one thread holds every
    stage of its column)."""
    program = module.rank_program
    stages = program.tied_params.get(fqn) if hasattr(module, "full_comm") else None
    return len({program.stage_ranks[s] for s in stages}) if stages else 1


def grad_pieces(module) -> list[tuple[torch.Tensor, int]]:
    """(gradient piece this rank holds, how many ranks hold that same piece) for every parameter gradient.

    >>> pieces = run_ranks(prog, lambda m: (m(*m.local_inputs(*inputs))[0].backward(), m.sync_grads(),
    ...                                     [(tuple(g.shape), n) for g, n in grad_pieces(m)])[2])
    >>> pieces[0]  # split on tp, so held by the 2 dp ranks; layers.1.bias replicated: held by all 4
    [((64, 32), 2), ((64,), 2), ((32, 64), 2), ((32,), 4)]
    """
    program, mesh = module.rank_program, module.comm.mesh
    zero = program.zero
    optimizer = getattr(module, "zero_optimizer", None)
    shards = {e.fqn: e for e in optimizer.entries} if optimizer is not None and zero.stage >= 2 else {}
    pieces = []
    for fqn, param in module.named_local_parameters():
        spec = program.param_spec(fqn)
        replicated = [a for a, placement in enumerate(spec) if not isinstance(placement, Shard)]
        entry = shards.get(fqn)
        if entry is not None and not entry.owned:  # a flat chunk of the gradient on the ZeRO axis
            grad = entry.grad_shard
            replicated = [a for a in replicated if a != mesh.axis(zero.axis)]
        else:
            grad = param.grad
        if grad is not None:
            pieces.append((grad, math.prod(mesh.shape[a] for a in replicated) * _pipeline_holders(module, fqn)))
    return pieces


def global_grad_norm(module, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients of the single-device model, computed from this rank's pieces (collective:
    every rank of the mesh calls it and gets the same value).

    >>> def norm(m):
    ...     m(*m.local_inputs(*inputs))[0].backward()
    ...     m.sync_grads()
    ...     return global_grad_norm(m)
    >>> norms = run_ranks(prog, norm)
    >>> expected = torch.nn.utils.get_total_norm([p.grad for p in reference().parameters()])
    >>> torch.allclose(norms[0], expected) and all(torch.equal(norms[0], n) for n in norms.values())
    True
    """
    p = float(norm_type)
    pieces = grad_pieces(module)
    dtype = pieces[0][0].dtype if pieces else torch.float32
    acc = torch.float64  # on every rank, also one holding no gradient: the collectives must agree on it
    if math.isinf(p):
        local = max((g.detach().abs().max().to(acc) for g, _ in pieces if g.numel()), default=torch.zeros((), dtype=acc))
        total = local.reshape(1)
        for group, axis in _reduction_axes(module):
            total = group.all_gather(total, axis, 0).max().reshape(1)
        return total[0].to(dtype)
    local = torch.zeros((), dtype=acc)
    for g, copies in pieces:
        local = local + torch.linalg.vector_norm(g.detach().to(acc), p) ** p / copies
    total = local.reshape(1)
    for group, axis in _reduction_axes(module):
        total = group.all_reduce(total, axis)
    return (total[0] ** (1.0 / p)).to(dtype)


def _reduction_axes(module) -> list:
    """(communicator, axis) for every mesh axis the norm is summed over: the module's mesh, and a pipeline
    rank's pipeline axis (its stages hold other parameters than the other pp ranks')."""
    axes = [(module.comm, axis) for axis in module.comm.mesh.names]
    if hasattr(module, "full_comm"):
        axes.append((module.full_comm, module.rank_program.pp_axis))
    return axes


def any_rank(module, flag: bool) -> bool:
    """Whether `flag` is true on any rank (collective: one scalar all-reduce per mesh axis, and over the
    pipeline axis on a pipeline rank); every rank gets the same answer.

    >>> run_ranks(prog, lambda m: any_rank(m, m.rank == 3))
    {0: True, 1: True, 2: True, 3: True}
    """
    total = torch.tensor([float(flag)], dtype=torch.float64)
    for group, axis in _reduction_axes(module):
        total = group.all_reduce(total, axis)
    return bool(total[0] > 0)


def clip_grad_norm_(module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient piece so that the global norm is at most `max_norm`; returns the norm before
    clipping (as torch.nn.utils.clip_grad_norm_ does on one device). Call it after `sync_grads()`.

    >>> def clipped(m):
    ...     m(*m.local_inputs(*inputs))[0].backward(); m.sync_grads()
    ...     total = clip_grad_norm_(m, 0.01)
    ...     return total, dict(m.named_local_parameters())["layers.1.bias"].grad
    >>> out = run_ranks(prog, clipped)
    >>> single = reference()
    >>> expected = torch.nn.utils.clip_grad_norm_(single.parameters(), 0.01)
    >>> torch.allclose(out[0][0], expected), torch.allclose(out[3][1], single.layers[1].bias.grad)
    (True, True)
    """
    if not getattr(module, "grads_synced", True):
        raise UserInputError("clip_grad_norm_ was called before module.sync_grads(): gradients still partial on "
                             "some mesh axes would be counted as shards of the norm; call module.sync_grads() after "
                             "backward, then clip")
    total = global_grad_norm(module, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g, _ in grad_pieces(module):
            g.mul_(coef.to(g.dtype))
    return total


def global_loss(module, loss: torch.Tensor | None) -> torch.Tensor:
    """The loss of the whole batch, as the single device computes it, on every rank: this rank's loss
    summed over the mesh axes where it is a partial sum (one scalar all-reduce per such axis; for
    logging, detached from autograd), in the loss's dtype. On a pipeline rank pass what `train_step`
    returned (None where the rank holds no last stage): the last stage's ranks sum it on their mesh, then
    one float64 all-reduce over the pipeline axis hands it to every rank (in float64).

    >>> losses = run_ranks(prog, lambda m: global_loss(m, m(*m.local_inputs(*inputs))[0]))
    >>> torch.allclose(losses[0], loss_fn(model(*inputs), *inputs)), torch.equal(losses[0], losses[1])
    (True, True)
    """
    program = module.rank_program
    spec = program.output_specs[0]
    pipeline = getattr(module, "full_comm", None)
    if loss is None and pipeline is None:
        raise UserInputError("global_loss(None): pass the loss this rank's forward (or train_step) returned")
    # A pipeline sums in float64 over pp, where ranks without the last stage (no loss, no dtype) add zero.
    dtype = torch.float64 if pipeline is not None else loss.dtype
    total = torch.zeros(1, dtype=dtype) if loss is None else loss.detach().to(dtype).reshape(1).clone()
    if loss is not None:  # in a pipeline, the ranks of the other stages hold no loss and skip these
        for axis in spec.partial_axes() if spec is not None else ():
            total = module.comm.all_reduce(total, module.comm.mesh.names[axis])
    if pipeline is not None:
        total = pipeline.all_reduce(total, program.pp_axis)
    return total[0]
