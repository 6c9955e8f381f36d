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
import numbers
from dataclasses import dataclass

from autoshard.ir.errors import UserInputError


@dataclass(frozen=True)
class Mesh:
    """An N-D device mesh; `names=None` leaves every axis's role to the planner (named a0, a1, ...).

    >>> Mesh((2, 4), ("dp", "tp")).size
    8
    >>> Mesh((2, 2))          # unnamed: the planner picks each axis's role
    Mesh(a0=2, a1=2)
    """

    shape: tuple[int, ...]
    names: tuple[str, ...] | None = None

    def __post_init__(self):
        shape = self.shape
        if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)) or not shape:
            raise UserInputError(f"mesh={self.shape!r} is not a non-empty tuple of axis sizes; pass e.g. "
                                 "mesh=(2, 4) for 2 x 4 devices")
        for i, size in enumerate(shape):
            if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
                raise UserInputError(f"mesh={tuple(shape)!r}: axis {i} has size {size!r}, but every axis needs a "
                                     "positive integer size (the number of devices along it); pass e.g. mesh=(2, 4)")
        object.__setattr__(self, "shape", tuple(int(size) for size in shape))
        names = self.names
        object.__setattr__(self, "named", names is not None)
        if names is None:
            names = tuple(f"a{i}" for i in range(len(shape)))
        if isinstance(names, str) or not isinstance(names, (tuple, list)):
            raise UserInputError(f"axis_names={names!r} is not a tuple of names; pass e.g. axis_names=('dp', 'tp')")
        names = tuple(names)
        if len(names) != len(shape):
            raise UserInputError(f"mesh={tuple(shape)!r} has {len(shape)} axes but axis_names={names!r} has "
                                 f"{len(names)}; give one name per axis, e.g. mesh=(2, 4), "
                                 "axis_names=('dp', 'tp')")
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise UserInputError(f"axis_names={names!r}: {name!r} is not an identifier; use names like "
                                     "'dp', 'tp', 'pp'")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise UserInputError(f"axis_names={names!r} repeats {', '.join(map(repr, repeated))}: each mesh axis "
                                 "needs its own name, e.g. ('dp', 'tp')")
        object.__setattr__(self, "names", names)

    @classmethod
    def of(cls, mesh, axis_names=None) -> Mesh:
        """Accept a Mesh, a tuple of sizes or an int.

        >>> Mesh.of(4), Mesh.of((2, 2), ("dp", "tp"))
        (Mesh(a0=4), Mesh(dp=2, tp=2))
        """
        if isinstance(mesh, Mesh):
            if axis_names is not None and tuple(axis_names) != mesh.names:
                raise UserInputError(f"axis_names={tuple(axis_names)!r} disagree with the names of {mesh!r}; "
                                     "leave axis_names out when passing a Mesh")
            return mesh
        if isinstance(mesh, int):
            mesh = (mesh,)
        return cls(tuple(mesh) if isinstance(mesh, (list, tuple)) else mesh, axis_names)

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape)) + ")"

    @property
    def ndim(self) -> int:
        """Number of mesh axes.

        >>> Mesh((2, 2, 2)).ndim
        3
        """
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of devices (ranks).

        >>> Mesh((2, 4)).size
        8
        """
        return math.prod(self.shape)

    def axis(self, name_or_index) -> int:
        """Index of an axis given by name or index; errors list the names.

        >>> Mesh((2, 4), ("dp", "tp")).axis("tp")
        1
        """
        if isinstance(name_or_index, int) and 0 <= name_or_index < self.ndim:
            return name_or_index
        if name_or_index in self.names:
            return self.names.index(name_or_index)
        raise UserInputError(f"unknown mesh axis {name_or_index!r}: {self!r} has axes {list(self.names)}; "
                             "use one of those names")

    def coord(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinate of `rank` (row-major, the last axis fastest).

        >>> Mesh((2, 4)).coord(5)
        (1, 1)
        """
        coord = []
        for size in reversed(self.shape):
            coord.append(rank % size)
            rank //= size
        return tuple(reversed(coord))

    def rank(self, coord) -> int:
        """The rank at mesh coordinate `coord` (inverse of `coord`).

        >>> Mesh((2, 4)).rank((1, 1))
        5
        """
        rank = 0
        for c, size in zip(coord, self.shape):
            rank = rank * size + c
        return rank

    def coords(self):
        """Every coordinate, in rank order.

        >>> Mesh((2, 2)).coords()
        [(0, 0), (0, 1), (1, 0), (1, 1)]
        """
        return list(itertools.product(*(range(n) for n in self.shape)))

    def axis_group(self, rank: int, axis) -> tuple[int, ...]:
        """Ranks that share every coordinate with `rank` except on `axis` (ordered by that coordinate).

        >>> Mesh((2, 4), ("dp", "tp")).axis_group(5, "dp")
        (1, 5)
        """
        axis = self.axis(axis)
        coord = list(self.coord(rank))
        group = []
        for c in range(self.shape[axis]):
            coord[axis] = c
            group.append(self.rank(coord))
        return tuple(group)

    def axis_groups(self, axis) -> list[tuple[int, ...]]:
        """Every group along `axis`, in rank order; all ranks create them in this order.

        >>> Mesh((2, 2), ("dp", "tp")).axis_groups("dp")
        [(0, 2), (1, 3)]
        """
        seen, groups = set(), []
        for rank in range(self.size):
            group = self.axis_group(rank, axis)
            if group not in seen:
                seen.add(group)
                groups.append(group)
        return groups

    def to_json(self) -> dict:
        """The mesh as JSON (`from_json` reads it back).

        >>> Mesh((2, 4), ("dp", "tp")).to_json()
        {'shape': [2, 4], 'names': ['dp', 'tp'], 'named': True}
        """
        return {"shape": list(self.shape), "names": list(self.names), "named": self.named}

    @classmethod
    def from_json(cls, data) -> Mesh:
        """A mesh from `to_json`'s output.

        >>> Mesh.from_json({"shape": [2, 4], "names": ["dp", "tp"], "named": True})
        Mesh(dp=2, tp=4)
        """
        return cls(tuple(data["shape"]), tuple(data["names"]) if data.get("named", True) else None)
