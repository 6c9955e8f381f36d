"""torch's own ways to train a zoo model on gloo ranks: Megatron via DTensor parallelize_module
(ColwiseParallel/RowwiseParallel), DDP and FSDP2 (fully_shard). Each returns a Trainer whose `step()`
runs forward, backward, gradient sync and an SGD step, like autoshard's runner in autoshard_runner.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .models.local_heads import use_local_heads

# The Megatron plan per block (the same as autoshard.zoo.hints.megatron).
MEGATRON_BLOCK_PLANS = {
    "gpt2": {"attn.q": "col", "attn.k": "col", "attn.v": "col", "attn.proj": "row", "mlp.fc1": "col",
             "mlp.fc2": "row"},
    "llama": {"attn.q": "col", "attn.k": "col", "attn.v": "col", "attn.wo": "row", "mlp.w1": "col",
              "mlp.w3": "col", "mlp.w2": "row"},
}


@dataclass
class Trainer:
    """One rank's training step: `forward_backward()` runs forward, backward and gradient sync, returns the loss."""

    forward_backward: Callable[[], torch.Tensor]
    module: torch.nn.Module
    lr: float = 1e-3

    def __post_init__(self):
        self.optimizer = torch.optim.SGD(list(self.module.parameters()), lr=self.lr)

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.forward_backward()
        self.optimizer.step()
        return loss.detach()

    def parameters(self):
        return list(self.module.parameters())


def batch_share(inputs, parts: int, index: int):
    return tuple(x.chunk(parts)[index] for x in inputs)


def megatron_dtensor(model_name, model, inputs, loss_fn, mesh_shape, axis_names) -> Trainer:
    """Megatron on the last mesh axis with parallelize_module; data parallel (flat gradient all-reduce,
    as DDP would) on the first axis of a 2-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=tuple(axis_names))
    tp_mesh = mesh[axis_names[-1]]
    use_local_heads(model_name, model, tp_mesh.size())
    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    for block in model.layers:
        parallelize_module(block, tp_mesh, {k: styles[v]() for k, v in MEGATRON_BLOCK_PLANS[model_name].items()})
    dp_group = mesh[axis_names[0]].get_group() if len(mesh_shape) == 2 else None
    if dp_group is not None:
        inputs = batch_share(inputs, mesh_shape[0], mesh[axis_names[0]].get_local_rank())

    def forward_backward():
        loss = loss_fn(model(*inputs), *inputs)
        loss.backward()
        if dp_group is not None:
            grads = [p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
                     for p in model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=dp_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g) / mesh_shape[0])
                offset += g.numel()
        return loss

    return Trainer(forward_backward, model)


def ddp(model, inputs, loss_fn) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel
    wrapped = DistributedDataParallel(model)
    inputs = batch_share(inputs, dist.get_world_size(), dist.get_rank())

    def forward_backward():
        loss = loss_fn(wrapped(*inputs), *inputs)
        loss.backward()
        return loss

    return Trainer(forward_backward, wrapped)


def fsdp(model, inputs, loss_fn) -> Trainer:
    """FSDP2: every block a unit, the root holds embeddings and head (ZeRO-3 with per-block gathers)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inputs = batch_share(inputs, dist.get_world_size(), dist.get_rank())

    def forward_backward():
        loss = loss_fn(model(*inputs), *inputs)
        loss.backward()
        return loss

    return Trainer(forward_backward, model)
