"""RankModule: one rank's program as an nn.Module — forward, local inputs, gradient sync.

`forward(*local_inputs)` returns `(loss, outputs)` of this rank (local shards; the loss may be a
partial sum on batch-sharded axes, which is the right thing to call `.backward()` on: its gradient
is 1 on every rank). After backward, `sync_grads()` reduces the gradients that came back partial on
some mesh axes (the duality rule), bucketed per axis set.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from ..placement import shard_tensor
from .collectives import use_communicator
from .communicator import Communicator

BUCKET_BYTES = 25 << 20


class RankModule(torch.nn.Module):
    def __init__(self, gm: torch.fx.GraphModule, comm: Communicator, program):
        super().__init__()
        self.gm = gm
        self.comm = comm
        self.rank = comm.rank
        self._program = program

    def forward(self, *local_inputs):
        with use_communicator(self.comm):
            flat = self.gm(*local_inputs)
        loss, outputs = flat[0], list(flat[1:])
        spec = self._program.output_spec
        return loss, (pytree.tree_unflatten(outputs, spec) if spec is not None else outputs)

    def local_inputs(self, *global_inputs):
        """This rank's blocks of the global inputs, by the plan's input specs."""
        specs = self._program.input_specs
        self._program.check_inputs(global_inputs)
        return tuple(shard_tensor(x, spec, self.comm.coord, self.comm.mesh.shape)
                     for x, spec in zip(global_inputs, specs))

    def named_local_parameters(self):
        """(model FQN, local shard) of every parameter this rank holds."""
        names = self._program.attr_names
        for fqn, attr in names.items():
            if fqn in self._program.traced.params:
                yield fqn, getattr(self.gm, attr)

    def sync_grads(self) -> None:
        """All-reduce partial gradients on exactly their partial axes (bucketed, fixed order)."""
        groups: dict = {}
        for fqn, param in self.named_local_parameters():
            axes = self._program.grad_reduce.get(fqn)
            if axes and param.grad is not None:
                groups.setdefault(axes, []).append(param)
        for axes, params in groups.items():
            for bucket in _buckets(params):
                flat = torch.cat([p.grad.reshape(-1) for p in bucket])
                for axis in axes:
                    self.comm.log.record(axis, "all_reduce", flat.numel() * flat.element_size(), "sync")
                    flat = self.comm.all_reduce(flat, axis)
                offset = 0
                for p in bucket:
                    n = p.grad.numel()
                    p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                    offset += n


def _buckets(params):
    bucket, size = [], 0
    for p in params:
        nbytes = p.grad.numel() * p.grad.element_size()
        if bucket and (size + nbytes > BUCKET_BYTES or p.grad.dtype != bucket[0].grad.dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += nbytes
    if bucket:
        yield bucket
