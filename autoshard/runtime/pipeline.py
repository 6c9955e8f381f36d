"""Pipeline runtime: a rank's stage modules under torch.distributed.pipelining schedules.

`PipelineRankModule` (real ranks) wraps each of its stages in a `PipelineStage` on the pp axis's
process group and runs the chosen schedule (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble); the stages' own collectives run on the other axes' groups
through the intra-op communicator. Stage-to-stage sends and receives are the schedule's own:
asynchronous (isend/irecv, batched per step of the schedule and waited for only before the compute that
needs them, or at the end of the step for sends). Gradients: summed over micro-batches by autograd, divided
by the micro-batch count (so a step equals one full-batch step of a batch-mean loss; the schedule's own
scaling is off because a tied parameter shared by two local stages would be scaled twice), tied parameters
summed across the pp ranks holding a copy, then reduced after the last micro-batch on their partial axes
(`sync_step`; no overlap: every micro-batch is a backward pass, so a bucket is complete only at the end).
ZeRO runs on each stage's own dp group as in a flat program: stage 1 and 2 through the ZeroOptimizer (stage 2
reduce-scatters the accumulated gradients once per step, last, so nothing touches the full gradient after),
stage 3 also gathers each parameter before each use and reduce-scatters its gradient in every micro-batch's
backward (summed over micro-batches in the shard); a stage's forward saves gathered parameters as shards
for backward. Each stage's forward/backward chunks are timed for the measured timeline.
`SequentialStages` runs all stages of one intra-op rank in order: the in-process simulator.

The examples pipeline a three-layer MLP as two virtual stages on one pp rank, so that a real gloo
process group of one rank in this process can run the schedule (`rank_module()` starts it; each example
ends it); the simulator's examples use `InnerRanks(prog)`, the thread simulator's view of the program:

>>> import os
>>> from unittest import mock
>>> import torch.distributed as dist
>>> import autoshard
>>> from autoshard.program.pipeline_program import InnerRanks
>>> from autoshard.runtime.launch import communicator_for, free_port, init_distributed
>>> from autoshard.runtime.simulator import run_ranks
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=3)
>>> prog = autoshard.parallelize(model, (1,), inputs, loss_fn=loss_fn, axis_names=("pp",),
...                              pipeline={"virtual_stages": 2, "schedule": "interleaved1f1b", "microbatches": 2})
>>> def rank_module():  # rank 0 of a world of one holds both stages
...     env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
...     with mock.patch.dict(os.environ, env):
...         init_distributed("gloo")
...     return prog.module(0, communicator_for(prog.mesh))
"""
from __future__ import annotations

import contextlib
import time

import torch

from autoshard.ir.errors import UserInputError
from autoshard.ir.placement import local_shape, shard_tensor
from autoshard.runtime.collectives import use_communicator
from autoshard.runtime.communicator import (
    CollectiveTimeout,
    DistCommunicator,
    backend_reason,
)
from autoshard.runtime.loss_scale import LossScaler, optimizer_step
from autoshard.runtime.rank_module import RankModule
from autoshard.runtime.rank_program import RankProgram
from autoshard.runtime.rng import RankRng
from autoshard.runtime.zero import ZeroOptimizer
from autoshard.runtime.zero_gather import save_shards_for_backward


class SavedActivations:
    """Counts the bytes autograd saves for backward while they are alive (saved_tensors_hooks): the
    measured activation memory of a pipeline rank (1F1B keeps fewer micro-batches alive than GPipe).

    >>> saved = SavedActivations()
    >>> x = torch.ones(256, requires_grad=True)
    >>> with saved.track():
    ...     y = (x * 2).exp()  # exp saves its 1 KiB output for backward
    >>> saved.live, saved.peak
    (1024, 1024)
    >>> y.sum().backward()  # backward releases what it saved
    >>> saved.live, saved.peak
    (0, 1024)
    """

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.storages: dict = {}  # storage -> [saved tensors holding it, its bytes]: views of one count once

    def track(self):
        """A context manager: tensors autograd saves inside it are counted while alive (see the class).

        >>> with SavedActivations().track():
        ...     pass
        """
        counter = self

        class Held:
            __slots__ = ("key", "tensor")

            def __init__(self, tensor):
                self.tensor = tensor
                base = tensor if tensor._base is None else tensor._base
                weight = base.is_leaf and base.requires_grad  # parameters are not activations
                self.key = None if weight else tensor.untyped_storage()._cdata
                if self.key is None:
                    return
                entry = counter.storages.setdefault(self.key, [0, tensor.untyped_storage().nbytes()])
                entry[0] += 1
                if entry[0] == 1:
                    counter.live += entry[1]
                    counter.peak = max(counter.peak, counter.live)

            def __del__(self):
                entry = counter.storages.get(self.key)
                if entry is None:
                    return
                entry[0] -= 1
                if entry[0] == 0:
                    counter.live -= entry[1]
                    del counter.storages[self.key]

        return torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.tensor)


class _StagesModule(RankModule):
    """Shared by the real and simulated pipeline ranks: stage graphs, local parameters, grad sync."""

    pipelined = True

    def __init__(self, stage_graphs, comm, rank_program: RankProgram, rng: RankRng, program=None):
        super().__init__(torch.nn.ModuleList([s.gm for s in stage_graphs]), comm, rank_program, rng, program)
        self.stage_graphs = stage_graphs
        self.overlap = False  # a step runs one backward per micro-batch: its gradients are reduced after the last

    def named_local_parameters(self):
        seen = set()
        for fqn, attr in self.rank_program.attr_names.items():
            if fqn not in self.rank_program.params or fqn in seen:
                continue
            for stage in self.stage_graphs:
                if hasattr(stage.gm, attr):
                    seen.add(fqn)
                    yield fqn, getattr(stage.gm, attr)
                    break

    def local_microbatches(self, *global_inputs, local_rows: bool = False) -> list[tuple]:
        """This rank's block of every micro-batch, by the plan's input specs. With `local_rows` the inputs
        are only this rank's rows (`prog.local_batch`), concatenated in micro-batch order."""
        if local_rows:
            m = self.rank_program.microbatches
            if any(x.shape[0] % m for x in global_inputs):
                raise UserInputError(f"train_step(local_rows=True): {[tuple(x.shape) for x in global_inputs]} do "
                                     f"not split into the plan's {m} micro-batches; load the rows "
                                     "prog.local_batch(rank, batch) gives, concatenated")
            return [self.local_inputs_of_rows(*chunk) for chunk in zip(*(x.chunk(m) for x in global_inputs))]
        rp = self.rank_program
        rp.check_inputs(global_inputs)
        coord, shape = self.comm.coord, self.comm.mesh.shape
        return [tuple(shard_tensor(x, spec, coord, shape) for x, spec in zip(mb, rp.input_specs))
                for mb in rp.split_microbatches(global_inputs)]

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward starts from: times the scale of this module's LossScaler, if it has one (the
        schedule runs backward, so the pipeline scales for the user; autoshard/runtime/loss_scale.py)."""
        scaler = getattr(self, "loss_scaler", None)
        return loss if scaler is None else scaler.scale(loss)

    def unscaled(self, loss: torch.Tensor) -> torch.Tensor:
        """A scaled loss as the model computed it (the scale is a power of two: exact)."""
        scaler = getattr(self, "loss_scaler", None)
        return loss if scaler is None else loss / scaler.get_scale()

    def scale_grads(self, passes: int = 1) -> None:
        """Divide the summed micro-batch gradients by the micro-batches (times the accumulated passes)."""
        m = self.rank_program.microbatches * passes
        for _, param in self.named_local_parameters():
            if param.grad is not None:
                param.grad.div_(m)

    def stage_forward(self):
        """The context a stage's forward runs in: under ZeRO-3 gathered parameters are saved for backward as
        their shards and re-gathered there (as the flat rank module's forward does), not kept per micro-batch."""
        zero = self.rank_program.zero
        if zero is None or zero.stage != 3:
            return contextlib.nullcontext()
        return save_shards_for_backward(self.gathered_memory)

    def sync_tied_grads(self) -> None:
        """Sum the gradients of parameters tied across pp ranks: none here, every stage of a simulated column
        is in this module (tied copies share one Parameter, one gradient)."""

    def sync_step(self, passes: int = 1) -> None:
        """After a step's last micro-batch: divide the gradients by the micro-batches (`passes`: accumulated
        passes), sum tied copies over pp, then reduce on their partial axes; last, because with ZeRO-2/3 the
        reduction reduce-scatters each gradient into this rank's shard and frees the full one."""
        self.scale_grads(passes)
        self.sync_tied_grads()
        self.sync_grads()


class SequentialStages(_StagesModule):
    """Every stage of one intra-op rank, run in order for each micro-batch (one thread = one pp column).

    >>> [len(m.stage_graphs) for m in run_ranks(InnerRanks(prog), lambda module: module).values()]
    [2]
    """


    def run_microbatch(self, local_inputs, microbatch: int = 0):
        """(loss, *outputs) of one micro-batch through every stage.

        >>> micro = prog.microbatches(inputs)[0]
        >>> loss = run_ranks(InnerRanks(prog), lambda module: module.run_microbatch(micro)[0])[0]
        >>> torch.allclose(loss, loss_fn(model(*micro), *micro))
        True
        """
        values = tuple(local_inputs)
        with use_communicator(self.comm), self.rng.drawing(microbatch), self.stage_forward():
            for stage in self.stage_graphs:
                values = tuple(stage.gm(*values))
        return values  # (loss, *outputs)


def simulated_rank_step(module: SequentialStages, inputs, train: bool = True, sync: bool = True) -> list:
    """One step over all micro-batches: [loss (mean), then per output its list of micro-batch blocks].

    >>> loss, outputs = run_ranks(InnerRanks(prog), lambda module: simulated_rank_step(module, inputs))[0]
    >>> torch.allclose(loss, loss_fn(model(*inputs), *inputs)), [tuple(b.shape) for b in outputs]
    (True, [(4, 32), (4, 32)])
    """
    losses, outputs = [], []
    module.rng.new_step()
    for m, local in enumerate(module.local_microbatches(*inputs)):
        module.comm.phase = "fwd"
        loss, *outs = module.run_microbatch(local, m)
        if train and loss.requires_grad:
            module.comm.phase = "bwd"
            with use_communicator(module.comm):
                module.scaled(loss).backward()
        losses.append(loss.detach())
        outputs.append([o.detach() for o in outs])
    if train:
        module.unsynced_passes = getattr(module, "unsynced_passes", 0) + 1
        if sync:
            module.sync_step(module.unsynced_passes)
            module.unsynced_passes = 0
    return [torch.stack(losses).mean(), *[list(blocks) for blocks in zip(*outputs)]]


class PipelineRankModule(_StagesModule):
    """A real rank's stages of the pipeline; `train_step(*global_inputs)` runs one schedule step.

    >>> module = rank_module()
    >>> [sg.index for sg in module.stage_graphs], module.pp_group is not None
    ([0, 1], True)
    >>> dist.destroy_process_group()
    """

    def __init__(self, stage_graphs, comm: DistCommunicator, full_comm: DistCommunicator, rank: int,
                 rank_program: RankProgram, rng: RankRng, program=None):
        super().__init__(stage_graphs, comm, rank_program, rng, program)
        self.full_comm = full_comm  # `comm` is this rank's intra-op communicator
        self.global_rank = rank
        self.pp_group = full_comm.groups[rank_program.pp_axis]
        self.timeline: list[tuple] = []  # (stage, "F"|"B"|"W", micro-batch, start_s, end_s)
        self._schedule = None
        self._outputs: list = []
        self.saved = SavedActivations()  # live bytes saved for backward, and their peak in a step

    # ------------------------------------------------------------------------- building the schedule
    def _examples(self, names):
        out = []
        for name in names:
            shape, dtype, needs_grad = self.rank_program.boundary_values[name]
            t = torch.zeros(shape, dtype=dtype)
            out.append(t.requires_grad_() if needs_grad else t)
        return tuple(out)

    def _build_schedule(self):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import (
            PipelineScheduleSingle,
            get_schedule_class,
        )

        rp = self.rank_program
        device = torch.device("cuda", torch.cuda.current_device()) if not self.comm.exact else torch.device("cpu")
        stages = []
        for sg in self.stage_graphs:
            stage = PipelineStage(OwnedOutputs(sg.gm), sg.index, rp.num_stages, device,
                                  input_args=self._examples(sg.inputs), output_args=self._examples(sg.outputs),
                                  group=self.pp_group)
            self._instrument(stage)
            stages.append(stage)
        cls = get_schedule_class(rp.schedule)

        def loss_fn(output, _target):
            self._outputs.append([o.detach() for o in output[1:]])
            return self.scaled(output[0])

        single = issubclass(cls, PipelineScheduleSingle)
        self._schedule = cls(stages[0] if single else stages, rp.microbatches, loss_fn=loss_fn, scale_grads=False)
        self._stages = stages

    def _instrument(self, stage):
        """Time each chunk's forward/backward (the measured timeline) and tag collectives fwd/bwd."""
        for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                             ("backward_weight_one_chunk", "W")):
            original = getattr(stage, method)

            def timed(chunk, *args, _original=original, _kind=kind, _index=stage.stage_index, **kwargs):
                self.comm.phase = "fwd" if _kind == "F" else "bwd"
                start = time.perf_counter()
                try:
                    if _kind == "F":
                        with self.saved.track(), self.rng.drawing(chunk), self.stage_forward():
                            return _original(chunk, *args, **kwargs)
                    return _original(chunk, *args, **kwargs)
                finally:
                    self.timeline.append((_index, _kind, chunk, start, time.perf_counter()))
            setattr(stage, method, timed)

    # ------------------------------------------------------------------------- one step
    def train_step(self, *global_inputs, sync: bool = True, local_rows: bool = False):
        """One training step over all micro-batches: (loss or None, outputs or None) on this rank; the
        loss and outputs exist on the rank holding the last stage (`global_loss` shares it). Gradients are
        ready afterwards. With `sync=False` the gradients stay local and unscaled: gradient accumulation runs
        several such passes and syncs on the last (its gradients are then the mean over every pass's
        micro-batches). With `local_rows` the inputs are only this rank's rows (`prog.local_batch`).

        >>> module = rank_module()
        >>> loss, outputs = module.train_step(*inputs)
        >>> torch.allclose(loss, loss_fn(model(*inputs), *inputs)), sorted({kind for _, kind, *_ in module.timeline})
        (True, ['B', 'F'])
        >>> dist.destroy_process_group()
        """
        local = self.local_microbatches(*global_inputs, local_rows=local_rows)
        if self._schedule is None:
            self._build_schedule()
        self._outputs.clear()
        self.timeline.clear()
        self.saved.peak = self.saved.live
        losses: list = []
        first = any(sg.index == 0 for sg in self.stage_graphs)
        args = tuple(torch.cat([mb[i] for mb in local]) for i in range(len(local[0]))) if first else ()
        target = torch.zeros(self.rank_program.microbatches)
        self.step_start = time.perf_counter()
        self.rng.new_step()
        try:
            with use_communicator(self.comm):
                self._schedule.step(*args, target=target, losses=losses, return_outputs=False)
        except RuntimeError as exc:
            if isinstance(exc, CollectiveTimeout) or not _is_transport_failure(exc):
                raise
            raise CollectiveTimeout(self._p2p_failure(exc)) from exc
        self.step_end = time.perf_counter()
        self.unsynced_passes = getattr(self, "unsynced_passes", 0) + 1
        if sync:
            self.comm.phase = "sync"
            self.sync_step(self.unsynced_passes)
            self.unsynced_passes = 0
        self.comm.phase = "fwd"
        if not losses:
            return None, None
        outputs = [list(blocks) for blocks in zip(*self._outputs)]
        return self.unscaled(torch.stack([loss.detach() for loss in losses]).mean()), outputs

    def _p2p_failure(self, exc) -> str:
        """Which pipeline neighbours this rank was exchanging activations/gradients with, and how it failed."""
        rp, mesh = self.rank_program, self.full_comm.mesh
        coord = list(self.full_comm.coord)
        peers = set()
        for sg in self.stage_graphs:
            for other in (sg.index - 1, sg.index + 1):
                if 0 <= other < rp.num_stages:
                    coord[mesh.axis(rp.pp_axis)] = rp.stage_ranks[other]
                    peers.add(mesh.rank(tuple(coord)))
        peers.discard(self.global_rank)
        return (f"rank {self.global_rank}: a pipeline send/recv on mesh axis {rp.pp_axis!r} (stages "
                f"{[sg.index for sg in self.stage_graphs]}, {rp.schedule}) failed: {backend_reason(exc)}. "
                f"Rank(s) {sorted(peers)} (the neighbouring stages) died, raised, hang or run a different plan: look "
                "at their errors (AUTOSHARD_TIMEOUT_S sets the timeout)")

    def sync_tied_grads(self) -> None:
        """Sum the gradients of parameters used by stages on different pp ranks (zeros where absent);
        `sync_step` calls it. Here every stage is on one rank, so there is nothing to sum:

        >>> module = rank_module()
        >>> module.sync_tied_grads()
        >>> prog.tied_params
        {}
        >>> dist.destroy_process_group()
        """
        rp = self.rank_program
        params = dict(self.named_local_parameters())
        for fqn, stages in sorted(rp.tied_params.items()):
            holders = {rp.stage_ranks[s] for s in stages}
            if len(holders) < 2:
                continue  # every copy is on one rank: they share one Parameter, one gradient
            param = params.get(fqn)
            if param is not None and param.grad is not None:
                grad = param.grad
            else:
                shape, dtype = rp.param_meta[fqn]
                grad = torch.zeros(local_shape(shape, rp.param_spec(fqn), rp.mesh.shape), dtype=dtype)
            self.full_comm.log.record(rp.pp_axis, "all_reduce", grad.numel() * grad.element_size(), "sync")
            total = self.full_comm.all_reduce(grad, rp.pp_axis)
            if param is not None:
                if param.grad is None:
                    param.grad = total
                else:
                    param.grad.copy_(total)


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; the gradient made contiguous backward (it is sent to the previous stage)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class OwnedOutputs(torch.nn.Module):
    """A stage module whose outputs own contiguous storage: the zero-bubble schedules detach stage outputs in
    place, which fails on views (e.g. a slice of a RoPE buffer carried to the next stage), and gloo sends only
    contiguous tensors (a transposed activation at a cut: the automatic cut may fall inside attention); the
    gradients of its inputs, sent back, are made contiguous too.

    >>> class Stage(torch.nn.Module):
    ...     def forward(self, x):
    ...         return (x.transpose(0, 1) * 2, x[:1])  # not contiguous; a view
    >>> x = torch.ones(2, 3, requires_grad=True)
    >>> out = OwnedOutputs(Stage())(x)
    >>> [(o.is_contiguous(), o._base is None) for o in out]
    [(True, True), (True, True)]
    >>> x_t = torch.ones(3, 2, requires_grad=True)  # a gradient that comes back strided
    >>> (grad,) = torch.autograd.grad(OwnedOutputs(Stage())(x_t)[0].sum(), x_t)
    >>> grad.is_contiguous()
    True
    """

    def __init__(self, gm):
        super().__init__()
        self.gm = gm

    def forward(self, *args):
        """The stage's outputs, each a contiguous tensor of its own (a copy where it was a view or strided).

        >>> class Transpose(torch.nn.Module):
        ...     def forward(self, x):
        ...         return (x.t(),)
        >>> OwnedOutputs(Transpose())(torch.ones(3, 2))[0].stride()
        (3, 1)
        """
        args = tuple(_ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)
        return tuple(o.clone(memory_format=torch.contiguous_format)
                     if isinstance(o, torch.Tensor) and (o._base is not None or not o.is_contiguous()) else o
                     for o in self.gm(*args))


def _is_transport_failure(exc: BaseException) -> bool:
    text = str(exc)
    return any(k in text for k in ("Connection closed", "Connection reset", "Timed out", "timed out", "timeout"))


def pipeline_rank_run(module, inputs, steps: int, lr: float, clip_grad_norm: float | None = None,
                      accumulate: int = 1, loss_scaling: bool = False, opt=None) -> dict:
    """verify's rank function for a pipeline rank (real or simulated): train `steps` optimizer steps of
    `accumulate` passes each over as many slices of the batch (one gradient sync per step), clipping the
    gradients by their global norm first when `clip_grad_norm` is given; with `loss_scaling` (fp16) through
    a LossScaler. `opt`: the optimizer over the module's parameters (a ZeroOptimizer under ZeRO); default
    SGD at `lr`, wrapped in a ZeroOptimizer when the plan has ZeRO.

    >>> result = run_ranks(InnerRanks(prog), lambda module: pipeline_rank_run(module, inputs, steps=2, lr=0.1))[0]
    >>> len(result["loss"]), bool(result["loss"][1] < result["loss"][0]), sorted(result["grads"])[:2]
    (2, True, ['layers.0.bias', 'layers.0.weight'])
    """
    params = dict(module.named_local_parameters())
    if opt is None and params:
        opt = torch.optim.SGD(params.values(), lr=lr)
        opt = ZeroOptimizer(module, opt) if module.rank_program.zero is not None else opt
    scaler = LossScaler(module) if loss_scaling else None
    module.comm.log.clear()
    n_outputs = len(module.rank_program.output_specs) - 1
    losses, outputs, grads, counts, scales = [], None, None, None, []
    passes = [tuple(x.chunk(accumulate)[j] for x in inputs) for j in range(accumulate)]
    for step in range(steps):
        module.zero_grad()
        pass_losses, pass_outputs = [], []
        for j, chunk in enumerate(passes):
            last = j == accumulate - 1
            if isinstance(module, SequentialStages):
                loss, *pass_outs = simulated_rank_step(module, chunk, sync=last)
            else:
                loss, pass_outs = module.train_step(*chunk, sync=last)
            pass_losses.append(loss)
            pass_outputs.append(pass_outs)
        outs = pass_outputs[0]  # verify compares the first pass's outputs
        loss = None if pass_losses[0] is None else torch.stack(pass_losses).mean()
        if scaler is not None:
            scaler.unscale_()
        if clip_grad_norm is not None:
            module.clip_grad_norm_(clip_grad_norm)
        losses.append(loss)
        if grads is None and (scaler is None or not scaler.found_inf):  # verify compares a step that ran
            grads = opt.full_grads() if hasattr(opt, "full_grads") else \
                {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
        optimizer_step(opt, scaler, scales)
        if step == 0:  # the counts include the optimizer's step (ZeRO all-gathers the updated shards there)
            outputs = list(outs) if outs is not None else [None] * n_outputs
            counts = module.comm.log.summary()
            full = getattr(module, "full_comm", None)
            if full is not None:
                for axis, kinds in full.log.summary().items():
                    counts.setdefault(axis, {}).update(kinds)
    return {"loss": losses, "outputs": outputs, "grads": grads, "counts": counts, "loss_scale": scales,
            "params": {k: p.detach().clone() for k, p in params.items()},
            "timeline": list(getattr(module, "timeline", [])),
            "peak_saved_bytes": module.saved.peak if hasattr(module, "saved") else 0,
            "step_s": getattr(module, "step_end", 0.0) - getattr(module, "step_start", 0.0)}
