"""The collective table: every collective the planner emits, in one place — the placement change it makes
on its mesh axis, the ring collective it runs forward and the one its gradient runs backward (the dual,
see DESIGN.md's placement duality), and whose local block each direction moves (the runtime's bytes
convention). The redistribution planner picks collectives by placement change from it, the cost model
prices them from it (the ILP's edges, predict, the stage table), and the runtime's autograd functions
implement it (tests/test_collective_table.py checks each one's backward against the table).

>>> from autoshard.ir.placement import P, R, S
>>> TABLE["reduce_scatter"]
Collective(name='reduce_scatter', change=('P', 'S'), forward='reduce_scatter', backward='all_gather', forward_bytes='src', backward_bytes='src')
>>> collective_for(P, S(0)), collective_for(S(0), S(1))
('reduce_scatter', 'all_to_all')
"""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.ir.placement import Partial, Placement, Shard


@dataclass(frozen=True)
class Collective:
    """One row: `change` is (source, target) placement kind on the axis ("P", "R", "S"; None for a
    gradient-only collective that changes no forward placement); `forward`/`backward` name the ring
    collective each direction runs (None: a local slice or nothing); `forward_bytes`/`backward_bytes` say
    whose local block that direction moves: "src" (the input's) or "dst" (the output's).

    >>> TABLE["chunk"].forward is None, TABLE["chunk"].backward
    (True, 'all_gather')
    """

    name: str
    change: tuple | None
    forward: str | None
    backward: str | None
    forward_bytes: str | None
    backward_bytes: str | None


TABLE = {c.name: c for c in (
    Collective("all_reduce", ("P", "R"), "all_reduce", None, "src", None),
    Collective("reduce_scatter", ("P", "S"), "reduce_scatter", "all_gather", "src", "src"),
    Collective("all_gather", ("S", "R"), "all_gather", None, "dst", None),
    Collective("chunk", ("R", "S"), None, "all_gather", None, "src"),
    Collective("all_to_all", ("S", "S"), "all_to_all", "all_to_all", "src", "dst"),
    # gradient-side and fused forms (insert_comm, zero, fuse_comm)
    Collective("grad_all_reduce", None, None, "all_reduce", None, "src"),
    # ZeRO-3's gather: its backward bytes depend on the node (cost/zero_cost.py's gather_bytes)
    Collective("param_all_gather", ("S", "R"), "all_gather", "reduce_scatter", "dst", None),
    Collective("all_gather_sum_grad", ("S", "R"), "all_gather", "reduce_scatter", "dst", "dst"),
)}


_BY_CHANGE = {TABLE[name].change: name for name in ("all_reduce", "reduce_scatter", "all_gather", "chunk", "all_to_all")}


def _kind(p: Placement) -> str:
    return "P" if isinstance(p, Partial) else "S" if isinstance(p, Shard) else "R"


def collective_for(src: Placement, dst: Placement) -> str:
    """The collective turning placement `src` into `dst` on one axis (they differ; never into a partial).

    >>> collective_for(S(0), R), collective_for(R, S(1))
    ('all_gather', 'chunk')
    """
    if src == dst or isinstance(dst, Partial):
        raise ValueError(f"no collective turns {src!r} into {dst!r}")
    return _BY_CHANGE[(_kind(src), _kind(dst))]


def direction_bytes(name: str, src_bytes: float, dst_bytes: float, with_backward: bool = True) -> tuple:
    """(forward, backward) bytes one rank moves in collective `name`, given its input's and output's local
    block bytes; a value without a gradient (`with_backward=False`) has no backward.

    >>> direction_bytes("all_gather", 256, 1024), direction_bytes("reduce_scatter", 1024, 256, with_backward=False)
    ((1024, 0), (1024, 0))
    """
    row = TABLE[name]
    side = {"src": src_bytes, "dst": dst_bytes, None: 0}
    return side[row.forward_bytes], side[row.backward_bytes] if with_backward else 0

