"""autoshard's program for one rank as a Trainer (forward, backward, sync_grads, SGD step)."""
from __future__ import annotations

import autoshard
from autoshard.runtime.launch import communicator_for

from .torch_baselines import Trainer


def autoshard_trainer(model, inputs, loss_fn, rank, mesh_shape, axis_names, plan=None, hints=None,
                      exact=False) -> Trainer:
    """`plan`: a plan file (no solving on the ranks). `exact=False` runs gloo's native collectives, as
    torch's own baselines do; exact=True builds every reduction from all_gather (bitwise reproducible)."""
    prog = autoshard.parallelize(model, tuple(mesh_shape), inputs, loss_fn=loss_fn, axis_names=tuple(axis_names),
                                 plan=plan, hints=hints)
    comm = communicator_for(prog.mesh, exact=exact)
    module = prog.module(rank, comm)
    local = module.local_inputs(*inputs)

    def forward_backward():
        comm.phase = "fwd"
        loss, _ = module(*local)
        comm.phase = "bwd"
        loss.backward()
        module.sync_grads()
        return loss

    trainer = Trainer(forward_backward, module)
    trainer.comm = comm
    trainer.program = prog
    return trainer
