"""What the cost model predicts, as typed records: a plan's `Prediction` (`state.predicted`, `plan.predicted`,
written by predict and adjusted for ZeRO, recomputation and the pipeline cut) and each node's `NodeCost` /
`CommCost` (`node.meta["autoshard.node_cost"]` / `["autoshard.comm_cost"]`).

Code reads the fields (`prediction.memory_bytes_per_rank`). Each record is also a read-only Mapping by key:
the dict form of plan files, `verify --json` and code written when these were dicts
(`plan.predicted["memory"]["params"]`). `to_dict()` (or `dict(record)`) gives that form, nested records as
plain dicts, keys in the order the JSON has always had them. A value read by key is a copy: the passes change
a prediction through its fields and methods (`Prediction.add_comm`), never by key.

>>> from autoshard.cost.prediction import AxisBytes, Prediction
>>> p = Prediction(step_time_s=2.0, compute_s=1.5, comm_s=0.5, comm_bytes_per_step={"dp": AxisBytes(sync=64)},
...                memory_bytes_per_rank=4096)
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields

from autoshard.ir.meta import NODE_COST


@functools.cache
def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _plain(value):
    """A field's value in the dict form: records and dicts of records as plain dicts."""
    if isinstance(value, FieldsMapping):
        return value.to_dict()
    if isinstance(value, dict):
        return {key: _plain(v) for key, v in value.items()}
    return value


class FieldsMapping(Mapping):
    """Read access by key to a dataclass's fields (nested records as plain dicts); equal to any mapping
    with the same dict form.

    >>> cost = NodeCost(seconds=0.5, memory_bytes=64)
    >>> cost["seconds"], cost.get("sync_s"), cost == {"seconds": 0.5, "memory_bytes": 64, "sync_s": 0.0}
    (0.5, 0.0, True)
    """

    def _keys(self) -> tuple[str, ...]:
        return _field_names(type(self))

    def __getitem__(self, key):
        if key not in self._keys():
            raise KeyError(key)
        return _plain(getattr(self, key))

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def to_dict(self) -> dict:
        """The dict form: what a JSON file holds.

        >>> AxisBytes(fwd=8).to_dict()
        {'fwd': 8, 'bwd': 0, 'sync': 0}
        """
        return {key: self[key] for key in self}


@dataclass(eq=False)
class AxisBytes(FieldsMapping):
    """Bytes one rank sends per step on one mesh axis: forward, backward, and gradient/optimizer sync
    (runtime counting convention: an all_gather's gathered output, other collectives' input).

    >>> AxisBytes(fwd=1024, sync=64)
    AxisBytes(fwd=1024, bwd=0, sync=64)
    """

    fwd: int = 0
    bwd: int = 0
    sync: int = 0


@dataclass(eq=False)
class MemoryParts(FieldsMapping):
    """What a rank's predicted memory is made of: parameters, gradients, optimizer state, ZeRO-3's gathered
    copies, inputs, activations saved for backward (after recomputation).

    >>> MemoryParts(params=100, grads=100, activations=50).total()
    250
    """

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    gathered: int = 0
    inputs: int = 0
    activations: int = 0

    def total(self) -> int:
        """The bytes of all parts.

        >>> MemoryParts(inputs=8, activations=24).total()
        32
        """
        return sum(getattr(self, key) for key in self._keys())


# Keys a plan may lack: no recomputation, or a plan file written before the figure was predicted.
_OPTIONAL = ("recompute_s", "memory", "overlapped_step_s")


@dataclass(eq=False)
class Prediction(FieldsMapping):
    """A plan's predicted costs per step and rank: step time (compute + communication, not overlapped),
    communication bytes per mesh axis, memory (its total and parts), recompute time and the step as the
    runtime overlaps it. Optional figures that are None are absent from the dict form. A pipelined plan's times are
    its micro-batch program's (one micro-batch): its step is `Plan.step_s`.

    >>> p.step_time_s, p["comm_bytes_per_step"], "memory" in p
    (2.0, {'dp': {'fwd': 0, 'bwd': 0, 'sync': 64}}, False)
    """

    step_time_s: float
    compute_s: float
    comm_s: float
    comm_bytes_per_step: dict[str, AxisBytes]
    memory_bytes_per_rank: int
    recompute_s: float | None = None
    memory: MemoryParts | None = None
    overlapped_step_s: float | None = None

    def _keys(self) -> tuple[str, ...]:
        return tuple(key for key in _field_names(type(self)) if key not in _OPTIONAL or getattr(self, key) is not None)

    def add_comm(self, seconds: float) -> None:
        """Communication the step waits for: counted in `comm_s` and `step_time_s`.

        >>> q = p.copy()
        >>> q.add_comm(0.25)
        >>> q.comm_s, q.step_time_s
        (0.75, 2.25)
        """
        self.comm_s += seconds
        self.step_time_s += seconds

    def add_compute(self, seconds: float) -> None:
        """Compute the step runs (recomputation): counted in `compute_s` and `step_time_s`.

        >>> q = p.copy()
        >>> q.add_compute(0.5)
        >>> q.compute_s, q.step_time_s
        (2.0, 2.5)
        """
        self.compute_s += seconds
        self.step_time_s += seconds

    def copy(self) -> Prediction:
        """An independent copy (its per-axis bytes and memory parts too).

        >>> q = p.copy()
        >>> q.comm_bytes_per_step["dp"].sync += 1
        >>> p.comm_bytes_per_step["dp"].sync, q == p
        (64, False)
        """
        return Prediction.from_dict(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping) -> Prediction:
        """The record of a dict form (a plan file's `predicted`, checked by autoshard/plan/io.py).

        >>> Prediction.from_dict(p.to_dict()) == p, Prediction.from_dict(p.to_dict()).comm_bytes_per_step["dp"].sync
        (True, 64)
        """
        memory = data.get("memory")
        return cls(data["step_time_s"], data["compute_s"], data["comm_s"],
                   {axis: AxisBytes(**sent) for axis, sent in data["comm_bytes_per_step"].items()},
                   data["memory_bytes_per_rank"], data.get("recompute_s"),
                   None if memory is None else MemoryParts(**memory), data.get("overlapped_step_s"))


@dataclass(frozen=True, eq=False)
class NodeCost(FieldsMapping):
    """What one node adds per step and rank (`node.meta["autoshard.node_cost"]`): seconds (an op's forward +
    backward compute, a collective's time), memory bytes (a parameter's held bytes with gradient and
    optimizer state, an op's or a collective's output saved for backward) and a parameter's gradient
    sync seconds.

    >>> NodeCost(seconds=3e-6, memory_bytes=1024)
    NodeCost(seconds=3e-06, memory_bytes=1024, sync_s=0.0, forward_s=None)
    >>> dict(NodeCost(seconds=3e-6))  # the dict form leaves out an unsplit forward
    {'seconds': 3e-06, 'memory_bytes': 0, 'sync_s': 0.0}
    """

    seconds: float = 0.0
    memory_bytes: int = 0
    sync_s: float = 0.0
    forward_s: float | None = None  # an op's forward part of `seconds` (None: a third, backward twice forward)

    def _keys(self) -> tuple[str, ...]:
        return tuple(key for key in _field_names(type(self)) if key != "forward_s" or self.forward_s is not None)

    def forward_seconds(self) -> float:
        """The forward part of `seconds`: `forward_s` where predict split it, else a third.

        >>> NodeCost(seconds=3.0).forward_seconds(), NodeCost(seconds=3.0, forward_s=2.0).forward_seconds()
        (1.0, 2.0)
        """
        return self.seconds / 3 if self.forward_s is None else self.forward_s


NO_COST = NodeCost()  # what a node predict did not price costs (ops without a tensor output)


@dataclass(frozen=True, eq=False)
class CommCost(FieldsMapping):
    """A collective's bytes per step one rank sends, forward and backward, and its seconds
    (`node.meta["autoshard.comm_cost"]`); `sync_s`: of those seconds, what runs in the gradient sync rather than in
    backward (ZeRO-3's deferred reduce-scatters).

    >>> CommCost(fwd_bytes=1024, bwd_bytes=0, seconds=1e-5)["fwd_bytes"]
    1024
    """

    fwd_bytes: int
    bwd_bytes: int
    seconds: float
    sync_s: float = 0.0


def node_cost(node) -> NodeCost:
    """A node's predicted cost; NO_COST where predict wrote none.

    >>> import torch.fx
    >>> node_cost(torch.fx.Graph().placeholder("x"))
    NodeCost(seconds=0.0, memory_bytes=0, sync_s=0.0, forward_s=None)
    """
    return node.meta.get(NODE_COST, NO_COST)
