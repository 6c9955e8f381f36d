"""ZeroOptimizer: any elementwise torch optimizer stepping on this rank's shards (ZeRO stages 1-3).

The wrapped optimizer's param_groups survive with their options (a scheduler may change `lr` on
`opt.param_groups`); each parameter is replaced by its master shard on this rank of the ZeRO axis:
- a parameter the plan stores sharded there (ZeRO-3, spec S(d)) is its own shard: the optimizer steps
  the parameter in place (or a master copy, for offload or low precision);
- a replicated one is flattened, padded to a multiple of the axis size k and cut in k chunks; this rank
  steps chunk r. Stage 1 takes it from the all-reduced gradient; stage 2 (and ZeRO-3's replicated
  leftovers) reduce-scatter the gradient in `reduce_gradients` (called by `RankModule.sync_grads`) and
  free the full one. After the step the chunks are all-gathered back into the parameter.
Communication is bucketed in a rank-major layout ([k, sum of chunks]): one reduce-scatter / all-gather
per bucket gives every rank its chunk of every parameter.

Master shards are float32 at least (float16/bfloat16 parameters get float32 masters) and live on the
parameters' device, or on the CPU with `offload=True` (optimizer state too: gradient shards go there,
updated parameters come back). Only elementwise optimizers are exact on shards: LBFGS, Adafactor and
SparseAdam are refused.

The examples train a ZeRO-2 data-parallel MLP on two simulated ranks; `train(module)` is what a rank
runs (with torchrun, the same on each real rank):

>>> import torch
>>> import autoshard
>>> from autoshard.runtime.simulator import run_ranks
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}}, zero=2)
>>> def train(module, steps=1):
...     opt = ZeroOptimizer(module, torch.optim.Adam(module.parameters(), lr=1e-3))
...     for _ in range(steps):
...         loss, _ = module(*module.local_inputs(*inputs))
...         loss.backward()
...         module.sync_grads()  # reduce-scatters the gradients into this rank's chunks
...         opt.step()           # steps the chunks, all-gathers the updated parameters
...         opt.zero_grad()
...     return opt
>>> opts = run_ranks(prog, train)
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch

from autoshard.ir.errors import UserInputError
from autoshard.ir.placement import Shard
from autoshard.runtime.grad_sync import buckets
from autoshard.runtime.zero_gather import compact

_NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "SparseAdam")


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's master shard: float32 for float16 and bfloat16 parameters, else their own.

    >>> master_dtype(torch.bfloat16), master_dtype(torch.float64)
    (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass
class _Entry:
    """One parameter: its shard on this rank (`master`) and how its gradient reaches it."""

    fqn: str
    param: torch.nn.Parameter
    owned: bool  # the parameter is itself this rank's shard (ZeRO-3)
    reduce: bool  # its gradient is partial on the ZeRO axis after backward
    chunk: int  # elements per rank of the padded flat parameter (replicated parameters)
    master: torch.Tensor
    grad_shard: torch.Tensor | None = None


class ZeroOptimizer:
    """`optimizer` (built on `module.parameters()`) stepping on the shards of `module`'s ZeRO axis.

    >>> opts[1]
    ZeroOptimizer(Adam, ZeRO-2 on 'dp' (rank 1 of 2), 4 parameters, master shards on the parameters' device)
    """

    def __init__(self, module, optimizer: torch.optim.Optimizer, offload: bool = False):
        self.optim = None
        if hasattr(module, "when_planned"):  # parallelize's module without example inputs: bind to its shards
            module.when_planned(lambda rank_module: self._bind(rank_module, optimizer, offload))  # once it plans
        else:
            self._bind(module, optimizer, offload)

    def _bind(self, module, optimizer: torch.optim.Optimizer, offload: bool) -> None:
        program = module.rank_program
        self.config = program.zero
        if self.config is None:
            raise UserInputError("ZeroOptimizer needs a program planned with ZeRO: parallelize(..., zero=1, 2 or 3)")
        kind = type(optimizer).__name__
        if kind in _NOT_ELEMENTWISE:
            raise UserInputError(f"{kind} is not elementwise (it couples values across a parameter), so stepping it "
                                 "on shards would differ from one device; use Adam, AdamW, SGD or another "
                                 "elementwise torch optimizer with ZeRO")
        if optimizer.state:
            raise UserInputError("wrap the optimizer in ZeroOptimizer before its first step (it already holds state)")
        self.module, self.comm, self.offload = module, module.comm, offload
        self.axis = self.config.axis
        self.k = self.comm.axis_size(self.axis)
        self.rank = self.comm.axis_rank(self.axis)
        axis_index = program.mesh.axis(self.axis)
        names = {id(p): fqn for fqn, p in module.named_local_parameters()}
        self.entries: list[_Entry] = []
        groups = []
        for g, group in enumerate(optimizer.param_groups):
            masters = []
            for p in group["params"]:
                if id(p) not in names:
                    raise UserInputError(f"param_groups[{g}] holds a tensor of shape {tuple(p.shape)} that is not a "
                                         "parameter of this rank module; build the optimizer on module.parameters()")
                fqn = names[id(p)]
                owned = isinstance(program.param_spec(fqn)[axis_index], Shard)
                entry = self._entry(fqn, p, owned, self.axis in program.grad_reduce.get(fqn, ()))
                self.entries.append(entry)
                masters.append(entry.master)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        self.optim = _same_optimizer(optimizer, groups)
        module.zero_optimizer = self  # sync_grads hands it the gradients to reduce-scatter

    @property
    def param_groups(self) -> list:
        """The wrapped optimizer's groups over the master shards (a scheduler may change their options).

        >>> [p.shape for p in opts[0].param_groups[0]["params"]][:2]  # flat chunks of [128, 32] and [128]
        [torch.Size([2048]), torch.Size([64])]
        """
        return self.optim.param_groups

    @property
    def state(self):
        """The optimizer state of this rank's shards (1/k of the unsharded state).

        >>> sorted(next(iter(opts[0].state.values())))
        ['exp_avg', 'exp_avg_sq', 'step']
        """
        return self.optim.state

    def __repr__(self) -> str:
        if self.optim is None:
            return "ZeroOptimizer(not bound yet: binds to the module's shards on its first batch)"
        where = "cpu (offload)" if self.offload else "the parameters' device"
        return (f"ZeroOptimizer({type(self.optim).__name__}, ZeRO-{self.config.stage} on {self.axis!r} "
                f"(rank {self.rank} of {self.k}), {len(self.entries)} parameters, master shards on {where})")

    def _entry(self, fqn, p, owned, reduce) -> _Entry:
        dtype = master_dtype(p.dtype)
        device = torch.device("cpu") if self.offload else p.device
        if owned:
            chunk = p.numel()
            keep = not self.offload and dtype == p.dtype
            master = p if keep else p.detach().to(device, dtype, copy=True)
        else:
            chunk = math.ceil(p.numel() / self.k)
            master = self._flat_chunk(p.detach(), chunk).to(device, dtype, copy=True)
        return _Entry(fqn, p, owned, reduce, chunk, master)

    def _flat_chunk(self, t: torch.Tensor, chunk: int) -> torch.Tensor:
        """This rank's chunk of `t` flattened and zero-padded to k * chunk elements."""
        flat = t.reshape(-1)
        start = self.rank * chunk
        piece = flat[start:start + chunk]
        if piece.numel() < chunk:
            piece = torch.cat([piece, piece.new_zeros(chunk - piece.numel())])
        return piece

    def _flat_entries(self):
        return [e for e in self.entries if not e.owned]

    def managed(self) -> set[str]:
        """FQNs whose gradient on the ZeRO axis this optimizer reduces (stage >= 2).

        >>> sorted(opts[0].managed())[:2]
        ['layers.0.bias', 'layers.0.weight']
        """
        return {e.fqn for e in self._flat_entries() if e.reduce} if self.config.stage >= 2 else set()

    def scatter_buckets(self) -> list:
        """Stage >= 2: the reduce-scatter buckets of the partial gradients of replicated parameters now, last
        parameter first (`RankModule.sync_grads` starts them during backward, as it does its all-reduces).

        >>> def layout(module):
        ...     opt = ZeroOptimizer(module, torch.optim.SGD(module.parameters(), lr=0.1))
        ...     module(*module.local_inputs(*inputs))[0].backward()
        ...     return [len(b.params) for b in opt.scatter_buckets()]
        >>> run_ranks(prog, layout)[0]
        [4]
        """
        if self.config.stage < 2:
            return []
        reduced = [e for e in reversed(self._flat_entries()) if e.reduce and e.param.grad is not None]
        return [ScatterBucket((self.axis,), tuple(e.param for e in bucket), tuple(bucket), self.k)
                for bucket in buckets(reduced, lambda e: e.param.grad)]

    def reduce_gradients(self, scattered: bool = False) -> None:
        """Stage >= 2: reduce-scatter the partial gradients of replicated parameters into this rank's chunks
        (bucketed; already done when `scattered`) and free the full gradients; replicated gradients just keep
        their chunk. `RankModule.sync_grads` calls it:

        >>> def backward_only(module):
        ...     opt = ZeroOptimizer(module, torch.optim.SGD(module.parameters(), lr=0.1))
        ...     module(*module.local_inputs(*inputs))[0].backward()
        ...     module.sync_grads()
        ...     return module.gm.layers_0_weight.grad, opt.full_grads()["layers.0.weight"].shape
        >>> run_ranks(prog, backward_only)[0]  # the full gradient is freed; the rank keeps its chunk
        (None, torch.Size([128, 32]))
        """
        if self.config.stage < 2:
            return
        if not scattered:
            for bucket in self.scatter_buckets():
                bucket.finish(bucket.start(self.comm).wait())
        for e in self._flat_entries():
            if e.param.grad is not None and not e.reduce:
                e.grad_shard = self._flat_chunk(e.param.grad.detach(), e.chunk).clone()
            e.param.grad = None

    def _grad_shard(self, e: _Entry):
        if e.owned or self.config.stage == 1:
            if e.param.grad is None:
                return None
            return e.param.grad if e.owned else self._flat_chunk(e.param.grad, e.chunk)
        return e.grad_shard

    @torch.no_grad()
    def step(self) -> None:
        """Step the wrapped optimizer on this rank's shards, then all-gather the updated parameters.

        >>> trained = run_ranks(prog, lambda module: (train(module, steps=2), module.gm.layers_0_weight)[1])
        >>> torch.equal(trained[0], trained[1])  # every rank holds the same updated parameters
        True
        """
        if self.optim is None:
            raise UserInputError("opt.step() before the module's first batch: call the module on a batch and "
                                 "backward first (it plans then, and the ZeroOptimizer binds to its shards)")
        for e in self.entries:
            grad = self._grad_shard(e)
            if e.master is not e.param:
                e.master.grad = None if grad is None else grad.to(e.master.device, e.master.dtype)
        self.optim.step()
        for e in self.entries:
            if e.owned and e.master is not e.param:
                e.param.copy_(e.master.to(e.param.device, e.param.dtype))
        stepped = [e for e in self._flat_entries() if e.master.grad is not None]
        for bucket in buckets(stepped, lambda e: e.param):
            mine = torch.cat([e.master.to(e.param.device, e.param.dtype) for e in bucket]).unsqueeze(0)
            rows = self.comm.all_gather(mine, self.axis, 0)  # [k, sum of chunks]
            self.comm.log.record(self.axis, "all_gather", rows.numel() * rows.element_size(), "sync")
            for e, cols in zip(bucket, rows.split([e.chunk for e in bucket], dim=1)):
                e.param.copy_(cols.reshape(-1)[:e.param.numel()].view_as(e.param))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the module's gradients and this rank's gradient shards.

        >>> [e.grad_shard for e in opts[0].entries][:2]  # train() ended with zero_grad
        [None, None]
        """
        if self.optim is None:
            return  # not bound yet (the module has not seen a batch): no gradients exist
        self.module.zero_grad(set_to_none=set_to_none)
        for e in self.entries:
            e.grad_shard = None
            if e.master is not e.param:
                e.master.grad = None

    def full_grads(self) -> dict:
        """{FQN: this rank's whole local gradient} for checking (gathers the chunks; not logged); see
        `reduce_gradients` for an example.

        >>> opts[0].full_grads()  # after zero_grad: none
        {}
        """
        out = {}
        for e in self.entries:
            grad = self._grad_shard(e)
            if grad is None:
                continue
            if e.owned or self.config.stage == 1:
                out[e.fqn] = e.param.grad.detach().clone()
                continue
            rows = self.comm.all_gather(grad.unsqueeze(0), self.axis, 0)
            out[e.fqn] = rows.reshape(-1)[:e.param.numel()].view_as(e.param).clone()
        return out

    def memory_bytes(self) -> dict:
        """Bytes this rank holds: {"params", "grads", "optimizer"} (master copies count as optimizer state).

        >>> opts[0].memory_bytes()  # optimizer: a master copy and Adam's two moments of half the parameters
        {'params': 33408, 'grads': 0, 'optimizer': 50128}
        """
        params = [p for _, p in self.module.named_local_parameters()]
        grads = [p.grad for p in params if p.grad is not None] + \
                [e.grad_shard for e in self.entries if e.grad_shard is not None] + \
                [e.master.grad for e in self.entries if e.master is not e.param and e.master.grad is not None]
        state = [e.master for e in self.entries if e.master is not e.param]
        state += [v for s in self.optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        seen: set = set()
        return {"params": unique_bytes(params, seen), "grads": unique_bytes(grads, seen),
                "optimizer": unique_bytes(state, seen)}


@dataclass(frozen=True)
class ScatterBucket:
    """Gradients of replicated parameters reduce-scattered together on the ZeRO axis, in the rank-major
    layout [k, sum of chunks]: each rank gets its chunk of every parameter (see `scatter_buckets`).

    >>> def reduce(module):
    ...     opt = ZeroOptimizer(module, torch.optim.SGD(module.parameters(), lr=0.1))
    ...     module(*module.local_inputs(*inputs))[0].backward()
    ...     bucket = opt.scatter_buckets()[0]
    ...     bucket.finish(bucket.start(module.comm).wait())
    ...     return [e.grad_shard.shape for e in bucket.entries], bucket.params[0].grad
    >>> run_ranks(prog, reduce)[1]  # this rank's chunks; the full gradients are freed
    ([torch.Size([16]), torch.Size([2048]), torch.Size([64]), torch.Size([2048])], None)
    """

    axes: tuple
    params: tuple
    entries: tuple
    k: int

    def start(self, comm):
        """Start the reduce-scatter of the bucket's padded gradient rows (see the class).

        >>> def start(module):
        ...     opt = ZeroOptimizer(module, torch.optim.SGD(module.parameters(), lr=0.1))
        ...     module(*module.local_inputs(*inputs))[0].backward()
        ...     return opt.scatter_buckets()[0].start(module.comm).wait().shape
        >>> run_ranks(prog, start)[0]  # [1, sum of this rank's chunks]
        torch.Size([1, 4176])
        """
        rows = torch.cat([_padded_rows(e.param.grad, self.k, e.chunk) for e in self.entries], dim=1)
        comm.log.record(self.axes[0], "reduce_scatter", rows.numel() * rows.element_size(), "sync", rows.dtype)
        return comm.start_reduce_scatter(rows, self.axes[0], 0)

    def finish(self, rows: torch.Tensor, views: bool = False) -> None:
        """Keep this rank's chunk of each parameter's reduced gradient and free the full gradient (`views`
        changes nothing: the chunks are views of the reduced rows either way).

        >>> def finish(module):
        ...     opt = ZeroOptimizer(module, torch.optim.SGD(module.parameters(), lr=0.1))
        ...     module(*module.local_inputs(*inputs))[0].backward()
        ...     bucket = opt.scatter_buckets()[0]
        ...     bucket.finish(bucket.start(module.comm).wait())
        ...     return sorted(opt.full_grads())
        >>> run_ranks(prog, finish)[0]
        ['layers.0.bias', 'layers.0.weight', 'layers.1.bias', 'layers.1.weight']
        """
        mine = compact(rows).reshape(-1)
        for e, piece in zip(self.entries, mine.split([e.chunk for e in self.entries])):
            e.grad_shard = piece
            e.param.grad = None


def unique_bytes(tensors, seen: set) -> int:
    """Bytes of the storages behind `tensors` not counted yet (views and aliases count once).

    >>> t = torch.zeros(4)
    >>> unique_bytes([t, t[:2], t.view(2, 2)], seen=set())
    16
    """
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _padded_rows(grad: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    flat = grad.reshape(-1)
    if flat.numel() < k * chunk:
        flat = torch.cat([flat, flat.new_zeros(k * chunk - flat.numel())])
    return flat.view(k, chunk)


def _same_optimizer(optimizer, groups):
    """A new optimizer of the wrapped one's class over `groups` (each keeps all its options); constructor
    arguments come from the wrapped one's defaults (those its signature takes) and the defaults are copied."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    try:
        new = cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    except TypeError as exc:
        raise UserInputError(f"cannot rebuild {cls.__name__} on the shards from its defaults ({exc}); "
                             "ZeroOptimizer supports optimizers whose constructor takes (params, **defaults), as "
                             "torch.optim's do") from exc
    new.defaults.update(optimizer.defaults)
    return new
