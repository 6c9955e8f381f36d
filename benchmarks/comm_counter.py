"""Count the collectives any torch code issues on this rank, with their bytes, at the dispatcher.

DTensor issues functional collectives (`_c10d_functional.*`); DDP's reducer, FSDP2 and
`torch.distributed.*` calls end in `c10d.*` dispatcher ops. A TorchDispatchMode sees both (the same
op sets CommDebugMode watches), so one counter measures autoshard, DTensor, DDP and FSDP alike.
Nested ops are not double counted: a mode is switched off while it handles an op.

Bytes follow autoshard's CommLog convention (all_gather: the gathered output; every other
collective: this rank's input), and `wire_bytes` converts each collective to what one rank sends on
a ring (all_reduce 2(k-1)/k, all_gather / reduce_scatter / all_to_all (k-1)/k of the logical bytes),
which is the fair figure when one plan all-reduces and another reduce-scatters and all-gathers.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_funcol = torch.ops._c10d_functional
_c10d = torch.ops.c10d

# op -> (kind, where the logical bytes are: "in" the input, "out" the (gathered) output)
_OPS = {
    _funcol.all_reduce.default: ("all_reduce", "in"),
    _funcol.all_reduce_coalesced.default: ("all_reduce", "in"),
    _funcol.all_gather_into_tensor.default: ("all_gather", "out"),
    _funcol.all_gather_into_tensor_coalesced.default: ("all_gather", "out"),
    _funcol.reduce_scatter_tensor.default: ("reduce_scatter", "in"),
    _funcol.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", "in"),
    _funcol.all_to_all_single.default: ("all_to_all", "in"),
    _funcol.broadcast.default: ("broadcast", "in"),
    _c10d.allreduce_.default: ("all_reduce", "in"),
    _c10d.allreduce_coalesced_.default: ("all_reduce", "in"),
    _c10d._allgather_base_.default: ("all_gather", "out"),
    _c10d.allgather_.default: ("all_gather", "out"),
    _c10d.allgather_into_tensor_coalesced_.default: ("all_gather", "out"),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", "in"),
    _c10d.reduce_scatter_.default: ("reduce_scatter", "in"),
    _c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", "in"),
    _c10d.alltoall_base_.default: ("all_to_all", "in"),
    _c10d.broadcast_.default: ("broadcast", "in"),
}


def ring_factor(kind: str, k: int) -> float:
    """Bytes one rank sends on a ring per logical byte of a collective over k ranks."""
    if k <= 1:
        return 0.0
    return {"all_reduce": 2 * (k - 1) / k, "broadcast": 1.0}.get(kind, (k - 1) / k)


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _group_size(func, args) -> int:
    for a in args:
        if isinstance(a, torch.ScriptObject):  # c10d ops carry the group boxed
            a = dist.ProcessGroup.unbox(a)
        if isinstance(a, dist.ProcessGroup):
            return a.size()
        if isinstance(a, str):  # functional collectives name their group
            try:
                return dist.distributed_c10d._resolve_process_group(a).size()
            except (KeyError, RuntimeError, ValueError):
                continue
    raise ValueError(f"no process group among the arguments of {func}: {[type(a) for a in args]}")


def _logical_bytes(func, args, out, where) -> int:
    name = func._schema.name
    if name.startswith("_c10d_functional::"):
        return _tensor_bytes(args[0] if where == "in" else out)  # functional ops: (input, ...) -> output
    # c10d ops: allgather_/reduce_scatter_ take (outputs, inputs, ...); allreduce_/broadcast_ (tensors, ...)
    if name in ("c10d::allreduce_", "c10d::allreduce_coalesced_", "c10d::broadcast_"):
        return _tensor_bytes(args[0])
    outputs, inputs = args[0], args[1]
    return _tensor_bytes(outputs if where == "out" else inputs)


class CollectiveCounter(TorchDispatchMode):
    """`with CollectiveCounter() as c: ...` then `c.logical`/`c.wire` {kind: bytes}, `c.calls` {kind: n}."""

    def __init__(self):
        super().__init__()
        self.calls: dict = defaultdict(int)
        self.logical: dict = defaultdict(int)
        self.wire: dict = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        entry = _OPS.get(func)
        if entry is not None:
            kind, where = entry
            nbytes = _logical_bytes(func, args, out, where)
            self.calls[kind] += 1
            self.logical[kind] += nbytes
            self.wire[kind] += nbytes * ring_factor(kind, _group_size(func, args))
        return out

    def total_logical(self) -> int:
        return sum(self.logical.values())

    def total_wire(self) -> float:
        return sum(self.wire.values())
