"""autoshard's program for one rank as a Trainer (forward, backward, sync_grads, SGD step)."""
from __future__ import annotations

import autoshard
from autoshard.runtime.launch import communicator_for
from autoshard.runtime.zero import ZeroOptimizer

from .torch_baselines import Trainer


def autoshard_trainer(model, inputs, loss_fn, rank, mesh_shape, axis_names, plan=None, hints=None,
                      exact=False, zero=None, overlap=True) -> Trainer:
    """`plan`: a plan file (no solving on the ranks). `exact=False` runs gloo's native collectives, as
    torch's own baselines do; exact=True builds every reduction from all_gather (bitwise reproducible).
    `zero`: the ZeRO stage (the SGD step through a ZeroOptimizer); `overlap=False`: the gradient sync after
    backward."""
    prog = autoshard.parallelize(model, tuple(mesh_shape), inputs, loss_fn=loss_fn, axis_names=tuple(axis_names),
                                 plan=plan, hints=hints, zero=zero)
    comm = communicator_for(prog.mesh, exact=exact)
    module = prog.module(rank, comm)
    module.overlap = overlap
    local = module.local_inputs(*inputs)

    def forward_backward():
        comm.phase = "fwd"
        loss, _ = module(*local)
        comm.phase = "bwd"
        loss.backward()
        module.sync_grads()
        return loss

    trainer = Trainer(forward_backward, module)
    if zero is not None:
        trainer.optimizer = ZeroOptimizer(module, trainer.optimizer)
    trainer.comm = comm
    trainer.program = prog
    return trainer
