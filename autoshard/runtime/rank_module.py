"""RankModule: one rank's program as an nn.Module — forward, local inputs, gradient sync.

`forward(*local_inputs)` returns `(loss, outputs)` of this rank (local shards; the loss may be a
partial sum on batch-sharded axes, which is the right thing to call `.backward()` on: its gradient
is 1 on every rank). After backward, `sync_grads()` reduces the gradients that came back partial on
some mesh axes (the duality rule), bucketed per axis set; with ZeRO-2/3 the ZeroOptimizer
(autoshard/runtime/zero.py) reduce-scatters the gradients of replicated parameters on the ZeRO axis. With
`overlap` (the default) these reductions start during backward, bucket by bucket, and ZeRO-3's gathers are
prefetched (autoshard/runtime/grad_sync.py, zero_overlap.py); `module.overlap = False` runs them after
backward. Both give bitwise the same gradients.

The examples run the ranks of a data-parallel MLP as threads (`run_ranks`, the simulator):

>>> import copy
>>> import torch
>>> import autoshard
>>> from autoshard.runtime.simulator import run_ranks
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}})
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree

from autoshard.ir.errors import UserInputError
from autoshard.ir.placement import R, Shard, Spec, shard_tensor
from autoshard.runtime.collectives import use_communicator
from autoshard.runtime.communicator import Communicator
from autoshard.runtime.grad_norm import clip_grad_norm_, global_loss
from autoshard.runtime.grad_sync import OverlappedSync, grad_buckets, reduce_buckets
from autoshard.runtime.rank_program import RankProgram
from autoshard.runtime.rng import RankRng
from autoshard.runtime.zero_gather import (
    GatheredMemory,
    overlapping,
    save_shards_for_backward,
)
from autoshard.runtime.zero_overlap import Zero3Overlap


class RankModule(torch.nn.Module):
    """One rank's program (`prog.module(rank, comm)`): an nn.Module holding this rank's parameter shards.

    >>> modules = run_ranks(prog, lambda module: module)
    >>> type(modules[1]).__name__, modules[1].rank
    ('RankModule', 1)
    """

    def __init__(self, gm: torch.fx.GraphModule, comm: Communicator, rank_program: RankProgram, rng: RankRng,
                 program=None):
        super().__init__()
        self.gm = gm
        self.comm = comm
        self.rank = comm.rank
        self.rank_program = rank_program  # all the runtime reads of the plan
        self._program = program  # the Program that planned it, handed back to users (`module.program`)
        self.zero_optimizer = None  # set by ZeroOptimizer: it owns the ZeRO axis's gradient reduction
        self.grads_synced = True  # False from a forward until sync_grads: gradients may still be partial
        self.gathered_memory = GatheredMemory()  # ZeRO-3: bytes of gathered parameters alive at once
        self.rng = rng  # dropout masks (autoshard/runtime/rng.py)
        self.overlap = True  # reduce gradient buckets during backward (autoshard/runtime/grad_sync.py)
        self._overlapped = None  # OverlappedSync, once the first sync_grads has learnt the buckets
        self._no_sync = False
        self._zero3 = None  # Zero3Overlap: ZeRO-3's prefetched gathers and deferred reduce-scatters

    @property
    def program(self):
        """The Program (or PipelineProgram) that planned this module: its plan, specs and names.

        >>> run_ranks(prog, lambda module: module.program is prog)[0]
        True
        """
        return self._program

    def forward(self, *local_inputs):
        """(loss, outputs) of this rank on its local inputs; the loss is partial on batch-sharded axes.

        >>> out = run_ranks(prog, lambda module: module(*module.local_inputs(*inputs)))
        >>> torch.allclose(out[0][0] + out[1][0], loss_fn(model(*inputs), *inputs)), out[0][1].shape
        (True, torch.Size([4, 32]))
        """
        zero = self.rank_program.zero
        zero3 = zero is not None and zero.stage == 3
        regather = save_shards_for_backward(self.gathered_memory) if zero3 else contextlib.nullcontext()
        if zero3 and self._zero3 is None:
            self._zero3 = Zero3Overlap(self)
        self.rng.new_step()
        if self._overlapped is not None:
            self._overlapped.armed = self.overlap and not self._no_sync
        overlap = self._zero3
        if overlap is not None:
            overlap.overlap = self.overlap
        try:
            with use_communicator(self.comm), regather, overlapping(overlap), self.rng.drawing():
                flat = self.gm(*local_inputs)
        finally:
            if overlap is not None:
                overlap.end_forward()
        self.grads_synced = False
        loss, outputs = flat[0], list(flat[1:])
        spec = self.rank_program.output_spec
        return loss, (pytree.tree_unflatten(outputs, spec) if spec is not None else outputs)

    def local_inputs(self, *global_inputs):
        """This rank's blocks of the global inputs, by the plan's input specs.

        >>> blocks = run_ranks(prog, lambda module: module.local_inputs(*inputs)[0])
        >>> torch.equal(blocks[1], inputs[0][4:])  # the batch is split in two on dp
        True
        """
        specs = self.rank_program.input_specs
        self.rank_program.check_inputs(global_inputs)
        return tuple(shard_tensor(x, spec, self.comm.coord, self.comm.mesh.shape)
                     for x, spec in zip(global_inputs, specs))

    def local_inputs_of_rows(self, *rows):
        """This rank's blocks of the inputs from only its rows of the batch (`prog.local_batch(rank, n)`):
        the other dims are split as the plan says.

        >>> x = inputs[0]
        >>> blocks = run_ranks(prog, lambda m: m.local_inputs_of_rows(x[prog.local_batch(m.rank, 8)])[0])
        >>> torch.equal(blocks[1], run_ranks(prog, lambda m: m.local_inputs(x)[0])[1])
        True
        """
        specs = self.rank_program.input_specs
        if len(rows) != len(specs):
            raise UserInputError(f"local_inputs_of_rows takes {len(specs)} inputs (the program's), got {len(rows)}")
        coord, shape = self.comm.coord, self.comm.mesh.shape
        return tuple(shard_tensor(x, Spec([R if isinstance(p, Shard) and p.dim == 0 else p for p in spec]), coord,
                                  shape) for x, spec in zip(rows, specs))

    def named_local_parameters(self):
        """(model FQN, local shard) of every parameter this rank holds.

        >>> shapes = run_ranks(prog, lambda module: [(k, tuple(p.shape)) for k, p in module.named_local_parameters()])
        >>> shapes[0][:2]
        [('layers.0.weight', (128, 32)), ('layers.0.bias', (128,))]
        """
        names = self.rank_program.attr_names
        for fqn, attr in names.items():
            if fqn in self.rank_program.params:
                yield fqn, getattr(self.gm, attr)

    def sync_grads(self) -> None:
        """All-reduce partial gradients on exactly their partial axes (bucketed, fixed order). From the second
        step on, with `overlap` (the default), buckets started during backward are only waited for here;
        `module.overlap = False` reduces everything here, after backward (bitwise the same gradients).

        >>> def step(module):
        ...     module(*module.local_inputs(*inputs))[0].backward()
        ...     module.sync_grads()
        ...     return module.gm.layers_1_bias.grad
        >>> grads = run_ranks(prog, step)
        >>> loss_fn(model(*inputs), *inputs).backward()
        >>> torch.allclose(grads[0], model.layers[1].bias.grad), torch.equal(grads[0], grads[1])
        (True, True)
        """
        if self._zero3 is not None:  # ZeRO-3's reduce-scatters started in backward
            self._zero3.finish()
        zero = self.rank_program.zero
        skip = {fqn: zero.axis for fqn in self._zero_scattered()}  # reduce-scattered on the ZeRO axis
        layout = grad_buckets(self, skip)
        scatter = self.zero_optimizer.scatter_buckets() if self.zero_optimizer is not None else []
        # a gradient also reduced on another axis (dp x tp) is reduce-scattered after that: not with it
        together = not {id(p) for b in scatter for p in b.params} & {id(p) for b in layout for p in b.params}
        if together:
            layout += scatter
        overlapped = self._overlapped
        if overlapped is not None and self.overlap and overlapped.matches(layout):
            overlapped.finish()
        else:
            if overlapped is not None:
                overlapped.close()
            reduce_buckets(layout, self.comm)
            # ZeRO-3 hands a deferred gradient over only in its finish (above), after backward: a bucket holding
            # one (also reduced on a second batch axis: dp x sp, dp x ep, dp x cp) starts in sync_grads
            late = self._zero3.deferrable if self._zero3 is not None else frozenset()
            self._overlapped = OverlappedSync(layout, self.comm, late) if self.overlap and layout else None
        if self.zero_optimizer is not None:
            self.zero_optimizer.reduce_gradients(scattered=together)
        self.grads_synced = True

    @contextlib.contextmanager
    def no_sync(self):
        """Forward and backward passes inside start no gradient reduction (gradient accumulation: wrap every
        pass but the last, as with DDP's no_sync; the last pass's backward and `sync_grads` reduce the sum).

        >>> def accumulate(module):
        ...     for half in (slice(0, 4), slice(4, 8)):
        ...         with module.no_sync() if half.start == 0 else contextlib.nullcontext():
        ...             module(*module.local_inputs_of_rows(inputs[0][half]))[0].backward()
        ...     module.sync_grads()
        ...     return module.gm.layers_1_bias.grad
        >>> grads = run_ranks(prog, accumulate)
        >>> torch.equal(grads[0], grads[1])
        True
        """
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient by the global norm of the single-device model's gradients (collective; after
        `sync_grads()`); returns that norm, as `torch.nn.utils.clip_grad_norm_` does on one device. See
        autoshard/runtime/grad_norm.py.

        >>> def step(module):
        ...     module(*module.local_inputs(*inputs))[0].backward()
        ...     module.sync_grads()
        ...     return module.clip_grad_norm_(1e-3)
        >>> norms = run_ranks(prog, step)
        >>> single = copy.deepcopy(model)  # the single device, its gradients clipped the same way
        >>> loss_fn(single(*inputs), *inputs).backward()
        >>> torch.allclose(norms[0], torch.nn.utils.clip_grad_norm_(single.parameters(), 1e-3))
        True
        """
        return clip_grad_norm_(self, max_norm, norm_type)

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The whole batch's loss as the single device reports it, on every rank (one scalar all-reduce per
        mesh axis the loss is partial on; detached: for logging).

        >>> losses = run_ranks(prog, lambda module: module.global_loss(module(*module.local_inputs(*inputs))[0]))
        >>> torch.allclose(losses[0], loss_fn(model(*inputs), *inputs)), torch.equal(losses[0], losses[1])
        (True, True)
        """
        return global_loss(self, loss)

    def _zero_scattered(self) -> set:
        """Parameters whose gradient the ZeroOptimizer reduce-scatters (ZeRO-2/3 needs one to train)."""
        zero = self.rank_program.zero
        if zero is None or zero.stage < 2:
            return set()
        if self.zero_optimizer is None:
            step = "module.train_step(*batch)" if getattr(self, "pipelined", False) else \
                "backward, module.sync_grads()"
            raise UserInputError(f"this program shards gradients ({zero!r}): wrap the optimizer before training, "
                                 "opt = autoshard.ZeroOptimizer(module, torch.optim.Adam("
                                 f"module.parameters(), ...)), then {step}, opt.step()")
        return self.zero_optimizer.managed()


def rank_module_of(module):
    """This rank's RankModule of `module`: itself, or the one `parallelize` without example inputs (a
    ParallelModule) holds for its last batch's shapes — what saving and loading weights read.

    >>> rank_module_of(prog) is prog
    True
    """
    if not hasattr(module, "when_planned"):  # a RankModule, or whatever the caller checks next
        return module
    if module.rank_module is None:
        raise UserInputError("the module has not planned yet: call it on a batch first (it plans on its first batch "
                             "and only then holds this rank's shards)")
    return module.rank_module

