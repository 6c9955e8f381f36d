"""The device mesh: a shape and one name per axis, abstract while planning.

Axis order is slow -> fast: outer axes cross nodes, the last axis lives inside a node. Ranks are
numbered row-major over the mesh, as in torch's DeviceMesh.

>>> mesh = Mesh((2, 4), ("dp", "tp"))
>>> mesh
Mesh(dp=2, tp=4)
>>> mesh.coord(5), mesh.axis_group(5, "tp")
((1, 1), (4, 5, 6, 7))
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Mesh:
    """An N-D device mesh; `names=None` leaves every axis's role to the planner (named a0, a1, ...)."""

    shape: tuple[int, ...]
    names: tuple[str, ...] | None = None

    def __post_init__(self):
        shape = self.shape
        if isinstance(shape, int):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)) or not shape:
            raise ValueError(f"mesh shape {self.shape!r} is not a non-empty tuple of sizes, e.g. (2, 2, 2)")
        for size in shape:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh shape {tuple(shape)!r} has size {size!r}: every axis needs a positive "
                                 "integer size, e.g. mesh=(2, 4)")
        object.__setattr__(self, "shape", tuple(shape))
        names = self.names
        object.__setattr__(self, "named", names is not None)
        if names is None:
            names = tuple(f"a{i}" for i in range(len(shape)))
        names = tuple(names)
        if len(names) != len(shape):
            raise ValueError(f"mesh {tuple(shape)!r} has {len(shape)} axes but {len(names)} axis names "
                             f"{names!r}: give one name per axis, e.g. axis_names=('dp', 'tp')")
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"axis name {name!r} is not an identifier: use names like 'dp', 'tp', 'pp'")
        if len(set(names)) != len(names):
            raise ValueError(f"axis names {names!r} repeat a name: each mesh axis needs its own name")
        object.__setattr__(self, "names", names)

    @classmethod
    def of(cls, mesh, axis_names=None) -> "Mesh":
        """Accept a Mesh, a tuple of sizes or an int."""
        if isinstance(mesh, Mesh):
            if axis_names is not None and tuple(axis_names) != mesh.names:
                raise ValueError(f"axis_names {tuple(axis_names)!r} disagree with the mesh's names {mesh.names!r}")
            return mesh
        if isinstance(mesh, int):
            mesh = (mesh,)
        return cls(tuple(mesh) if isinstance(mesh, (list, tuple)) else mesh, axis_names)

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape)) + ")"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis(self, name_or_index) -> int:
        """Index of an axis given by name or index; errors list the names."""
        if isinstance(name_or_index, int) and 0 <= name_or_index < self.ndim:
            return name_or_index
        if name_or_index in self.names:
            return self.names.index(name_or_index)
        raise ValueError(f"unknown mesh axis {name_or_index!r}: this mesh has axes {list(self.names)}")

    def coord(self, rank: int) -> tuple[int, ...]:
        coord = []
        for size in reversed(self.shape):
            coord.append(rank % size)
            rank //= size
        return tuple(reversed(coord))

    def rank(self, coord) -> int:
        rank = 0
        for c, size in zip(coord, self.shape):
            rank = rank * size + c
        return rank

    def coords(self):
        return list(itertools.product(*(range(n) for n in self.shape)))

    def axis_group(self, rank: int, axis) -> tuple[int, ...]:
        """Ranks that share every coordinate with `rank` except on `axis` (ordered by that coordinate)."""
        axis = self.axis(axis)
        coord = list(self.coord(rank))
        group = []
        for c in range(self.shape[axis]):
            coord[axis] = c
            group.append(self.rank(coord))
        return tuple(group)

    def axis_groups(self, axis) -> list[tuple[int, ...]]:
        """Every group along `axis`, in rank order; all ranks create them in this order."""
        seen, groups = set(), []
        for rank in range(self.size):
            group = self.axis_group(rank, axis)
            if group not in seen:
                seen.add(group)
                groups.append(group)
        return groups

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "names": list(self.names), "named": self.named}

    @classmethod
    def from_json(cls, data) -> "Mesh":
        return cls(tuple(data["shape"]), tuple(data["names"]) if data.get("named", True) else None)
