"""ParallelModule: what `autoshard.parallelize(model, mesh)` returns without example inputs — an nn.Module that
plans on its first batch (as torch.compile and FSDP2's fully_shard wrap a model without inputs) and then trains
as this rank's share of the program under torchrun.

The training loop is the single device's:

    module = autoshard.parallelize(model, mesh=(2, 2, 2))      # every rank, under torchrun
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)      # before or after the first batch
    for batch in batches:
        loss = module(*batch)     # the whole batch, the same on every rank; float(loss) is one device's loss
        loss.backward()           # gradients reduced when backward ends (a callback queued by the loss)
        opt.step(); opt.zero_grad()

How each piece is done:
- **Planning** happens on the first call, on a meta-device twin of the model (its parameters never copied):
  rank 0 plans (ILP, hand plans, pipelines: everything `parallelize` does with example inputs) and sends the
  plan to the other ranks, which apply it (no solving) and check the fingerprint before the first collective.
- **Parameters**: `module.parameters()` are the model's own Parameter objects (an optimizer made before the
  first batch keeps working); after planning each holds this rank's shard (the model is changed in place, as
  fully_shard does). Write the whole model with `autoshard.save_weights(directory, module)`.
- **Inputs**: each call takes the whole batch; the module keeps this rank's shard (`local_inputs`).
- **Loss**: the returned scalar's value is the whole batch's loss as one device computes it, on every rank;
  its backward is this rank's share (its gradient 1 on the rank's partial loss, the duality rule).
- **Gradient sync**: a hook — the loss's backward queues `sync_grads` to run when the autograd engine finishes
  the backward pass (FSDP2 does the same), so `opt.step()` sees reduced gradients. Inside `module.no_sync()`
  (gradient accumulation, as with DDP) it does not; the last backward outside it reduces the sum.
- **New input shapes** (the last, smaller batch; another sequence length) re-specialise the same plan's
  decisions to the new shapes without solving (its divisibility checked); only when a decision no longer holds
  is the model planned again, with a warning saying why. Each shape's program is kept.
- **ZeRO-2/3** (chosen by the memory budget or `zero=`): wrap the optimizer, `opt =
  autoshard.ZeroOptimizer(module, torch.optim.AdamW(module.parameters()))`, before or after the first batch.

A process group is needed (torchrun; `autoshard.init_distributed()` is called for the user when torchrun's
environment is set). Without one, pass `example_inputs` to inspect and simulate the plan instead.

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> module = autoshard.parallelize(model, (2,), axis_names=("dp",), loss_fn=loss_fn)
>>> module
ParallelModule(Mesh(dp=2), not planned yet: plans on its first batch)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",))  # for the examples
>>> from autoshard.runtime.simulator import run_ranks
"""
from __future__ import annotations

import contextlib
import copy
import os
import warnings

import torch
import torch.distributed as dist

from autoshard.ir.errors import AutoshardError, UserInputError
from autoshard.plan.plan import Plan
from autoshard.report.accuracy import (
    AccuracyReport,
    StepClock,
    log_bytes,
    peak_memory_bytes,
)
from autoshard.runtime.launch import (
    check_fingerprint,
    communicator_for,
    init_distributed,
)


class ParallelModule(torch.nn.Module):
    """`model` parallelized on `mesh`, planned on its first batch by `planner(model, inputs, plan=None,
    other_shapes=False) -> Program` (api.parallelize's, with the user's options; `has_loss_fn`: the user gave
    one, else the model must return its loss); `weights`, `init_fn` and
    `seed` are `Program.module`'s, for a model on the meta device (default "init": its initialisation replayed).

    >>> module.module is model, module.program is None
    (True, True)
    """

    def __init__(self, model: torch.nn.Module, mesh, planner, has_loss_fn: bool = False, weights=None, init_fn=None,
                 seed: int = 0):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise UserInputError(f"parallelize without example_inputs takes an nn.Module, got {type(model).__name__}; "
                                 "pass example_inputs to plan other callables")
        self.module = model  # registered: parameters() are the model's own Parameter objects
        self.mesh = mesh
        self._planner = planner
        self._has_loss_fn = has_loss_fn
        self._load = {"weights": weights, "init_fn": init_fn, "seed": seed}
        self._twin = None  # the model on the meta device: what every plan traces
        self._by_shape: dict = {}  # input signature -> (Program, RankModule)
        self._current = None
        self._zero_pending: list = []  # ZeroOptimizers made before the first batch
        self._no_sync = False
        self.comm = None
        # each step's phases and bytes, for report(); the first step (planning, warm-up) is not counted
        self._clock = StepClock(warmup=1, bytes_now=lambda: log_bytes(self.comm) if self.comm is not None else {})

    def __repr__(self) -> str:
        if self._current is None:
            return f"ParallelModule({self.mesh!r}, not planned yet: plans on its first batch)"
        prog, rank_module = self._current
        return (f"ParallelModule({prog.mesh!r}, rank {rank_module.rank}, {len(self._by_shape)} input "
                f"shape{'s' if len(self._by_shape) > 1 else ''} planned, fingerprint={prog.plan.fingerprint})")

    @property
    def program(self):
        """The Program (or PipelineProgram) of the last batch's shapes; None before the first batch.

        >>> module.program is None
        True
        """
        return self._current[0] if self._current is not None else None

    @property
    def rank_module(self):
        """This rank's RankModule for the last batch's shapes (`sync_grads`, `clip_grad_norm_`, `local_inputs`);
        None before the first batch.

        >>> module.rank_module is None
        True
        """
        return self._current[1] if self._current is not None else None

    def forward(self, *batch):
        """The whole batch's loss as one device computes it (see the module docstring); plans on the first call.

        >>> module(*inputs)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        autoshard.ir.errors.UserInputError: the module returned by parallelize without example_inputs runs on ...
        """
        self._clock.mark("forward")
        prog, rank_module = self._for_batch(batch)
        if getattr(rank_module, "pipelined", False):
            return self._pipeline_step(prog, rank_module, batch)
        loss, _ = rank_module(*rank_module.local_inputs(*batch))
        whole = rank_module.global_loss(loss)
        self._clock.mark("forward_end")
        if not torch.is_grad_enabled() or not loss.requires_grad:
            return whole
        shown = loss + (whole - loss).detach()  # one device's value; backward reaches this rank's partial loss
        return shown if self._no_sync else _SyncWhenBackwardEnds.apply(shown, self)

    def _pipeline_step(self, prog, rank_module, batch):
        """A pipelined plan's schedule interleaves every micro-batch's forward and backward, so the call runs both
        (the gradients of the whole batch's loss accumulate, summed over calls as backward passes sum on one
        device); the returned loss has nothing left to do in backward."""
        if not torch.is_grad_enabled():
            raise UserInputError(f"the plan pipelines over axis {prog.plan.pipeline['axis']!r}, whose schedule trains "
                                 "as it runs: a pipelined module has no forward-only (evaluation) call yet; evaluate "
                                 "with a plan made with pipeline=False")
        loss, _ = rank_module.train_step(*batch, sync=False)
        self._clock.mark("forward_end")  # the schedule's forward and backward passes
        if not self._no_sync:
            self._clock.mark("sync")
            rank_module.sync_step(1)  # a mean over the micro-batches; passes accumulated under no_sync add up
            rank_module.unsynced_passes = 0
            self._clock.mark("sync_end")
        return rank_module.global_loss(loss).detach().requires_grad_()

    def sync_grads(self) -> None:
        """Reduce this rank's gradients now (the loss's backward does it by itself; see the module docstring).

        >>> module.sync_grads()  # nothing planned yet: nothing to reduce
        """
        if self._current is not None:
            self._clock.mark("sync")
            self._current[1].sync_grads()
            self._clock.mark("sync_end")

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside reduce nothing (gradient accumulation, as DDP's `no_sync`); the first backward
        after it reduces the accumulated sum.

        >>> with module.no_sync():
        ...     pass
        """
        previous, self._no_sync = self._no_sync, True
        inner = self._current[1].no_sync() if self._current is not None else contextlib.nullcontext()
        try:
            with inner:
                yield
        finally:
            self._no_sync = previous

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the single device's global gradient norm (after backward); returns that norm.
        `torch.nn.utils.clip_grad_norm_(module.parameters(), ...)` would see only this rank's shards.

        >>> module.clip_grad_norm_(1.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        autoshard.ir.errors.UserInputError: clip_grad_norm_ needs the module planned: call it on a batch first
        """
        if self._current is None:
            raise UserInputError("clip_grad_norm_ needs the module planned: call it on a batch first")
        return self._current[1].clip_grad_norm_(max_norm, norm_type)

    def report(self) -> AccuracyReport:
        """The plan's predictions against this rank's measured training steps (after the first): step time and
        its phases (forward, backward, gradient sync, optimizer: the time from the sync to the next forward), the
        bytes sent on each mesh axis, and on CUDA the peak memory, each with predicted / measured
        (autoshard/report/accuracy.py). Print it, or log `report().to_json()`.

        >>> print(module.report())
        no complete training step measured yet (forward, backward with the gradient sync, then the next forward)
        """
        if self._current is None:
            return AccuracyReport.of(None, None)
        rank_module = self._current[1]
        device = next((p.device for _, p in rank_module.named_local_parameters()), torch.device("cpu"))
        comm = getattr(rank_module, "comm", None)
        prog = self._current[0]
        stages = getattr(rank_module, "stage_graphs", None)  # a pipeline's rank: its own pp rank's prediction
        pp_rank = prog.config.stage_rank(stages[0].index) if stages else None
        return AccuracyReport.of(prog, self._clock.phases(), peak_memory_bytes(device),
                                 exact=bool(getattr(comm, "exact", False)), overlap=getattr(rank_module, "overlap", True),
                                 pp_rank=pp_rank)

    def when_planned(self, callback) -> None:
        """Call `callback(rank_module)` once this rank's module exists (now, when it does): how a ZeroOptimizer
        made before the first batch binds to the shards.

        >>> module.when_planned(lambda rank_module: None)
        """
        if self._current is not None:
            callback(self._current[1])
        else:
            self._zero_pending.append(callback)

    # ------------------------------------------------------------------ planning
    def _for_batch(self, batch):
        if not batch or not all(isinstance(x, torch.Tensor) for x in batch):
            raise UserInputError("the module takes the batch's tensors as positional arguments, "
                                 f"got {[type(x).__name__ for x in batch]}")
        key = (self.training, tuple((tuple(x.shape), x.dtype) for x in batch))
        if key not in self._by_shape:
            self._by_shape[key] = self._plan(batch)
        self._current = self._by_shape[key]
        return self._current

    def _plan(self, batch):
        self._ensure_process_group()
        if self._twin is None:  # kept out of the module tree: its meta parameters are not this module's
            object.__setattr__(self, "_twin", meta_twin(self.module))
        self._twin.train(self.training)
        first = not self._by_shape
        prog = self._planned(batch, None if first else self._current[0])
        comm = self.comm or communicator_for(prog.mesh)
        if comm is None:
            raise UserInputError(f"rank {dist.get_rank()} is outside the mesh {prog.mesh!r}: launch exactly "
                                 f"{prog.mesh.size} processes")
        self.comm = comm
        check_fingerprint(comm, prog.plan.fingerprint)
        self._check_loss(prog)
        if first:
            rank_module = prog.module(comm.rank, comm, weights=self._first_weights(), init_fn=self._load["init_fn"],
                                      seed=self._load["seed"])
            adopt_parameters(self.module, rank_module)
            for callback in self._zero_pending:
                callback(rank_module)
            self._zero_pending.clear()
        else:
            rank_module = module_sharing(prog, comm, self._current[1])
        return prog, rank_module

    def _planned(self, batch, previous):
        """The Program for `batch`'s shapes: planned on rank 0 and sent to the others (which apply it); at new
        shapes the previous plan re-specialised where it still holds, else planned again."""
        rank = dist.get_rank()
        if previous is not None:
            try:
                return self._planner(self._twin, batch, plan=_decisions(previous.plan), other_shapes=True)
            except AutoshardError as exc:  # every rank reaches the same verdict (the same plan and shapes)
                warnings.warn(f"autoshard: planning again for inputs {[tuple(x.shape) for x in batch]}: the plan made "
                              f"for the first batch does not apply to them ({str(exc).splitlines()[0]})", stacklevel=4)
        data = [_decisions(self._planner(self._twin, batch).plan).to_json() if rank == 0 else None]
        dist.broadcast_object_list(data, src=0)  # every rank, 0 included, then applies the same decisions
        plan = Plan.from_json(dict(data[0], fingerprint=None))
        return self._planner(self._twin, batch, plan=plan)

    def _first_weights(self):
        weights = self._load["weights"]
        if weights is not None:
            return weights
        tensors = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        if any(t.device.type == "meta" for t in tensors.values()):
            return "init"  # a meta model: its initialisation replayed on this rank's shards
        return {name: t.detach() for name, t in tensors.items()}

    def _ensure_process_group(self) -> None:
        if dist.is_available() and dist.is_initialized():
            return
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun's environment: start the group
            init_distributed()
            return
        raise UserInputError(
            "the module returned by parallelize without example_inputs runs on this rank's share of "
            f"{self.mesh!r}, but no process group is up: launch with torchrun --nproc-per-node {self.mesh.size} "
            "(or call autoshard.init_distributed()); to inspect or simulate the plan in one process, pass "
            "example_inputs to parallelize")

    def _check_loss(self, prog) -> None:
        """The module returns a loss: the model's own (a scalar) or `loss_fn`'s; anything else is an error now,
        before the first step, not a surprise later."""
        output = next(n for n in prog.state.traced.gm.graph.nodes if n.op == "output")
        shapes = [tuple(v.shape) for a in output.args[0][1:] for v in [a.meta.get("val")]
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        if not self._has_loss_fn and shapes:
            raise UserInputError(
                f"the model returns tensors that are not a loss (shapes {shapes[:3]}) and no loss_fn was given: the "
                "module returns the loss, so pass loss_fn=lambda outputs, *batch: ... to parallelize, or wrap the "
                "model in a module whose forward returns its loss")


def _decisions(plan: Plan) -> Plan:
    """`plan` as a plan file holds it (decisions only), to apply at other shapes."""
    return Plan.from_json(dict(plan.to_json(), fingerprint=plan.fingerprint))


class _SyncWhenBackwardEnds(torch.autograd.Function):
    """Identity on the loss; its backward queues the module's gradient sync for when the engine has finished the
    whole backward pass (every gradient accumulated)."""

    @staticmethod
    def forward(ctx, loss, module):
        ctx.module = module
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        # torch's engine hook for "backward is done" (FSDP2 uses it too; no public spelling exists)
        torch.autograd.Variable._execution_engine.queue_callback(ctx.module.sync_grads)
        return grad, None


def meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters and buffers are meta tensors of the same shapes (nothing copied): what a
    plan traces once the model's own parameters hold shards.

    >>> twin = meta_twin(model)
    >>> twin.layers[0].weight.device, twin.layers[0].weight.shape == model.layers[0].weight.shape
    (device(type='meta'), True)
    """
    memo = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def adopt_parameters(model: torch.nn.Module, rank_module) -> None:
    """Make `rank_module` train `model`'s own Parameter objects: each becomes this rank's shard (swapped in place,
    `torch.utils.swap_tensors`: a meta parameter too) and replaces the rank module's copy (an optimizer built on `model.parameters()` then steps the shards). A
    parameter this rank does not hold (another pipeline stage's) keeps no storage.

    >>> copies = [copy.deepcopy(model) for _ in range(2)]
    >>> def adopt(rank_module):
    ...     adopt_parameters(copies[rank_module.rank], rank_module)
    ...     return rank_module.gm.layers_0_weight is copies[rank_module.rank].layers[0].weight
    >>> run_ranks(prog, adopt)
    {0: True, 1: True}
    """
    held = dict(rank_module.named_local_parameters())
    attrs = rank_module.rank_program.attr_names
    for fqn, param in model.named_parameters():
        canonical = rank_module.program.canonical_param(fqn) if rank_module.program is not None else fqn
        shard = held.get(canonical)
        if shard is None:
            torch.utils.swap_tensors(param, torch.nn.Parameter(torch.empty(0, dtype=param.dtype),
                                                               requires_grad=param.requires_grad))
            continue
        holders = [gm for gm in graph_modules(rank_module) if getattr(gm, attrs[canonical], None) is shard]
        torch.utils.swap_tensors(param, shard)  # the same Python object, now the shard (meta to CPU included)
        for gm in holders:
            setattr(gm, attrs[canonical], param)


def graph_modules(rank_module) -> list:
    """The GraphModules of a rank module: its one graph, or each of its pipeline stages'.

    >>> run_ranks(prog, lambda m: len(graph_modules(m)))
    {0: 1, 1: 1}
    """
    stages = getattr(rank_module, "stage_graphs", None)
    return [s.gm for s in stages] if stages is not None else [rank_module.gm]


def module_sharing(prog, comm, other):
    """This rank's module of `prog` (the same plan at other input shapes) holding `other`'s parameters and
    buffers: training goes on with the same weights, whichever shapes' module ran last.

    >>> same = run_ranks(prog, lambda m: module_sharing(prog, m.comm, m).gm.layers_0_weight is m.gm.layers_0_weight)
    >>> same
    {0: True, 1: True}
    """
    attrs = other.rank_program.attr_names
    held = {fqn: getattr(gm, attr) for gm in graph_modules(other) for fqn, attr in attrs.items() if hasattr(gm, attr)}
    module = prog.module_of_blocks(comm.rank, comm, {fqn: t.detach() for fqn, t in held.items()})
    params = dict(other.named_local_parameters())
    for fqn, attr in module.rank_program.attr_names.items():
        for gm in graph_modules(module):
            if fqn in params and hasattr(gm, attr):
                setattr(gm, attr, params[fqn])
    module.zero_optimizer = other.zero_optimizer
    return module


