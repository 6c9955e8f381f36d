"""Train a zoo model with autoshard under torchrun (gloo on CPU, NCCL on GPUs).

    torchrun --nproc-per-node 4 examples/train_torchrun.py --mesh 2,2 --axis-names dp,tp --steps 3

Every rank plans the same program (the ranks compare plan fingerprints before the first
collective), builds its own module holding only its parameter shards, and trains it.
"""
import argparse

import torch
import torch.distributed as dist

import autoshard
from autoshard.runtime.launch import (
    check_fingerprint,
    communicator_for,
    init_distributed,
)
from autoshard.zoo import FACTORIES
from autoshard.zoo.hints import plan_hints


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2", choices=sorted(FACTORIES))
    parser.add_argument("--mesh", default="2,2")
    parser.add_argument("--axis-names", default="dp,tp")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    mesh = tuple(int(s) for s in args.mesh.split(","))
    names = tuple(args.axis_names.split(","))

    init_distributed()
    model, inputs, loss_fn = FACTORIES[args.model]()
    hints = plan_hints(args.model, names, batch_axes=tuple(n for n in names if n != "tp"),
                       tp_axis="tp" if "tp" in names else None)
    prog = autoshard.parallelize(model, mesh, inputs, hints=hints, loss_fn=loss_fn, axis_names=names)
    comm = communicator_for(prog.mesh)
    check_fingerprint(comm, prog.plan.fingerprint)
    module = prog.module(dist.get_rank(), comm)
    local_inputs = module.local_inputs(*inputs)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for step in range(args.steps):
        opt.zero_grad()
        loss, _ = module(*local_inputs)
        loss.backward()
        module.sync_grads()
        module.clip_grad_norm_(1.0)  # by the single device's global norm
        opt.step()
        total = module.global_loss(loss)  # this rank's loss is a partial sum: the whole batch's, for logging
        if dist.get_rank() == 0:
            print(f"step {step}: loss {total.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
