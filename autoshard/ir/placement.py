"""Placements of a tensor on one mesh axis, and specs (one placement per mesh axis).

`S(d)` shards tensor dim `d`, `R` replicates, `P` holds a partial sum pending reduction. A spec is a
tuple of placements, one per mesh axis, printed `[S(0), R]` (the DTensor convention). One tensor dim
may be sharded over several axes; the axis order of the mesh is the nesting order (outer axis =
coarser blocks), as in DTensor.

>>> spec = Spec.parse("[S(0), R]")
>>> spec
[S(0), R]
>>> describe_type((8, 512), spec, ("dp", "tp"), "f32")
'f32[8@dp, 512]'
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True, order=True)
class Placement:
    """Base of S, R and P; immutable and hashable.

    >>> isinstance(S(0), Placement), isinstance(R, Placement), isinstance(P, Placement)
    (True, True, True)
    """


@dataclass(frozen=True, order=True)
class Shard(Placement):
    """`S(d)`: tensor dim `d` is split in equal contiguous blocks over the axis.

    >>> Shard(1), Shard(1) == S(1)
    (S(1), True)
    """

    dim: int

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, order=True)
class Replicate(Placement):
    """`R`: every rank on the axis holds the whole tensor.

    >>> Replicate() == R
    True
    """

    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True, order=True)
class Partial(Placement):
    """`P`: every rank holds a summand; the tensor is the sum over the axis.

    >>> Spec([P, R]).partial_axes()
    (0,)
    """

    def __repr__(self) -> str:
        return "P"


R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    """Shorthand for `Shard(dim)`; `S(0)` shards the first dim.

    >>> S(0)
    S(0)
    """
    return Shard(dim)


_PLACEMENT_RE = re.compile(r"^\s*(?:(R)|(P)|S\(\s*(-?[0-9]{1,6})\s*\))\s*$")


def parse_placement(text: str, where: str = "") -> Placement:
    """Parse `"S(1)"`, `"R"` or `"P"`; errors name `where` the text came from.

    >>> parse_placement("S(1)"), parse_placement("R"), parse_placement("P")
    (S(1), R, P)
    """
    match = _PLACEMENT_RE.match(text) if isinstance(text, str) else None
    if match is None:
        at = f" in {where}" if where else ""
        shown = repr(text) if len(repr(text)) <= 60 else repr(text)[:40] + f"... ({len(repr(text))} characters)"
        raise ValueError(f"malformed placement {shown}{at}: write 'S(<dim>)', 'R' or 'P', e.g. 'S(0)'")
    if match.group(1):
        return R
    if match.group(2):
        return P
    return Shard(int(match.group(3)))


class Spec(tuple):
    """One placement per mesh axis; printed `[S(0), R]`.

    >>> Spec([S(0), R])
    [S(0), R]
    >>> Spec([S(0), R]) == Spec.parse("[S(0), R]")
    True
    """

    def __new__(cls, placements=()):
        return super().__new__(cls, tuple(placements))

    def __repr__(self) -> str:
        return "[" + ", ".join(repr(p) for p in self) + "]"

    @classmethod
    def replicated(cls, ndim: int) -> Spec:
        """The spec that replicates on every one of `ndim` mesh axes.

        >>> Spec.replicated(2)
        [R, R]
        """
        return cls((R,) * ndim)

    @classmethod
    def parse(cls, text: str) -> Spec:
        """Parse the printed form `[S(0), R]` (one placement per mesh axis).

        >>> Spec.parse("[S(0), P]")
        [S(0), P]
        """
        inner = text.strip()
        if not (inner.startswith("[") and inner.endswith("]")):
            raise ValueError(f"malformed spec {text!r}: write e.g. '[S(0), R]'")
        parts = [p for p in re.split(r",(?![^(]*\))", inner[1:-1]) if p.strip()]
        return cls(parse_placement(p, text) for p in parts)

    def axes_sharding(self, dim: int) -> tuple[int, ...]:
        """Mesh axes (outer first) that shard tensor dim `dim`.

        >>> Spec([S(0), S(0), R]).axes_sharding(0)   # dim 0 sharded over axes 0 and 1
        (0, 1)
        """
        return tuple(a for a, p in enumerate(self) if isinstance(p, Shard) and p.dim == dim)

    def partial_axes(self) -> tuple[int, ...]:
        """Mesh axes on which the tensor is a pending partial sum.

        >>> Spec([P, S(0), P]).partial_axes()
        (0, 2)
        """
        return tuple(a for a, p in enumerate(self) if isinstance(p, Partial))

    def is_replicated(self) -> bool:
        """True when every mesh axis holds the whole tensor.

        >>> Spec([R, R]).is_replicated(), Spec([R, S(0)]).is_replicated()
        (True, False)
        """
        return all(isinstance(p, Replicate) for p in self)

    def with_axis(self, axis: int, placement: Placement) -> Spec:
        """This spec with mesh axis `axis` changed to `placement`.

        >>> Spec([R, R]).with_axis(1, S(0))
        [R, S(0)]
        """
        items = list(self)
        items[axis] = placement
        return Spec(items)


def local_shape(shape, spec: Spec, mesh_shape) -> tuple[int, ...]:
    """Shape of one rank's block; requires every sharded dim to divide evenly.

    >>> local_shape((8, 512), Spec([S(0), S(1)]), (2, 4))
    (4, 128)
    """
    out = list(shape)
    for axis, placement in enumerate(spec):
        if isinstance(placement, Shard):
            size = mesh_shape[axis]
            if out[placement.dim] % size:
                raise ValueError(
                    f"dim {placement.dim} of size {shape[placement.dim]} does not split evenly "
                    f"over mesh axis {axis} of size {size} (spec {spec!r})")
            out[placement.dim] //= size
    return tuple(out)


def shard_index(spec: Spec, dim: int, coord, mesh_shape) -> tuple[int, int]:
    """(block index, block count) of the rank at mesh `coord` along tensor dim `dim`.

    >>> shard_index(Spec([S(0), S(0)]), 0, (1, 0), (2, 2))   # dim 0 in 4 blocks; rank (1, 0) holds block 2
    (2, 4)
    """
    index, count = 0, 1
    for axis in spec.axes_sharding(dim):
        index = index * mesh_shape[axis] + coord[axis]
        count *= mesh_shape[axis]
    return index, count


def shard_slices(shape, spec: Spec, coord, mesh_shape) -> tuple[slice, ...]:
    """The index of the block of a global tensor of `shape` held by the rank at `coord`: one slice per
    dim (what a checkpoint reader reads, what a writer writes).

    >>> shard_slices((8, 6), Spec([S(1), S(0)]), (1, 0), (3, 2))   # dim 1 in 3 blocks, dim 0 in 2
    (slice(0, 4, None), slice(2, 4, None))
    """
    out = []
    for dim, size in enumerate(shape):
        index, count = shard_index(spec, dim, coord, mesh_shape)
        if size % count:
            raise ValueError(f"dim {dim} of size {size} does not split evenly into {count} blocks")
        block = size // count
        out.append(slice(index * block, (index + 1) * block))
    return tuple(out)


def shard_tensor(tensor: torch.Tensor, spec: Spec, coord, mesh_shape) -> torch.Tensor:
    """The block of a global tensor held by the rank at `coord` (partial axes: rank 0 holds it).

    >>> import torch
    >>> shard_tensor(torch.arange(8), Spec([S(0)]), (1,), (2,))
    tensor([4, 5, 6, 7])
    """
    local = tensor[shard_slices(tuple(tensor.shape), spec, coord, mesh_shape)]
    for axis in spec.partial_axes():
        if coord[axis] != 0:
            local = torch.zeros_like(local)
    return local.contiguous()


def unshard_tensors(blocks: dict, spec: Spec, mesh_shape) -> torch.Tensor:
    """Rebuild the global tensor from `{coord: block}` of every rank (sums partial axes).

    >>> import torch
    >>> blocks = {(0,): torch.tensor([0, 1]), (1,): torch.tensor([2, 3])}
    >>> unshard_tensors(blocks, Spec([S(0)]), (2,))
    tensor([0, 1, 2, 3])
    >>> unshard_tensors(blocks, Spec([P]), (2,))    # partial: the blocks are summed
    tensor([2, 4])
    """
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    # Sum over partial axes: keep coords with 0 on those axes and add the others into them.
    partial = set(spec.partial_axes())
    reps = {}
    for coord in coords:
        key = tuple(0 if a in partial else c for a, c in enumerate(coord))
        reps[key] = blocks[coord] if key not in reps else reps[key] + blocks[coord]
    # Concatenate shards, dim by dim: group coords by everything except the axes of dim d.
    ndim = next(iter(reps.values())).dim()
    current = reps
    for dim in range(ndim):
        axes = spec.axes_sharding(dim)
        if not axes:
            continue
        grouped: dict = {}
        for key, block in sorted(current.items()):
            base = tuple(0 if a in axes else c for a, c in enumerate(key))
            index, _ = shard_index(spec, dim, key, mesh_shape)
            grouped.setdefault(base, {})[index] = block
        current = {base: torch.cat([parts[i] for i in sorted(parts)], dim) for base, parts in grouped.items()}
    return current[tuple(0 for _ in mesh_shape)]


_DTYPE_NAMES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.uint8: "u8", torch.int8: "i8",
}


def dtype_name(dtype) -> str:
    """The short dtype name used in types (`f32`, `bf16`, `i64`, ...).

    >>> import torch
    >>> dtype_name(torch.bfloat16)
    'bf16'
    """
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def describe_type(shape, spec: Spec | None, axis_names, dtype="f32") -> str:
    """`f32[8@dp, 512@tp]`: global sizes, the axes sharding each dim after `@`, `P@axis` for partials.

    >>> describe_type((8, 512), Spec([S(0), P]), ("dp", "tp"), "f32")
    'f32[8@dp, 512]{P@tp}'
    """
    if not isinstance(dtype, str):
        dtype = dtype_name(dtype)
    dims = []
    for d, size in enumerate(shape):
        axes = spec.axes_sharding(d) if spec is not None else ()
        dims.append(f"{size}@{'@'.join(axis_names[a] for a in axes)}" if axes else str(size))
    text = f"{dtype}[{', '.join(dims)}]"
    if spec is not None and spec.partial_axes():
        text += "{P@" + ",".join(axis_names[a] for a in spec.partial_axes()) + "}"
    return text
