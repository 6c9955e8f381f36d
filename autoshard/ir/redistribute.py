"""Plan the collectives that turn a tensor of spec `src` into spec `dst` (per mesh axis steps).

Order matters when a dim is sharded over several axes (outer axis = coarser blocks):
1. all_to_all where one axis moves its shard from dim d to dim e directly;
2. gathers, innermost axis first, until each dim's shard axes are a common prefix of src and dst;
3. additions in dst order per dim: `chunk` from R or `reduce_scatter` from P;
4. all_reduce for partial axes that end replicated (after the chunks, so on less data).
A full tensor can never become a partial sum: asking for it is an error.

>>> from autoshard.ir.placement import Spec, S, R, P
>>> plan_redistribute(Spec([S(0), S(0)]), Spec([R, R]))
[all_gather(axis=1, dim=0), all_gather(axis=0, dim=0)]
>>> plan_redistribute(Spec([P, R]), Spec([S(1), R]))
[reduce_scatter(axis=0, dim=1)]
"""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.ir.collective_table import TABLE, collective_for
from autoshard.ir.errors import PlanError
from autoshard.ir.placement import Partial, R, Replicate, Shard, Spec


@dataclass(frozen=True)
class Step:
    """One collective on one mesh axis; `dim`/`to_dim` are tensor dims where the op needs them.

    >>> Step("all_to_all", axis=1, dim=0, to_dim=1)
    all_to_all(axis=1, gather_dim=0, scatter_dim=1)
    """

    op: str  # all_gather | chunk | reduce_scatter | all_reduce | all_to_all
    axis: int
    dim: int | None = None
    to_dim: int | None = None

    def __repr__(self) -> str:
        args = [f"axis={self.axis}"]
        if self.op == "all_to_all":
            args += [f"gather_dim={self.dim}", f"scatter_dim={self.to_dim}"]
        elif self.dim is not None:
            args.append(f"dim={self.dim}")
        return f"{self.op}({', '.join(args)})"

    def apply(self, spec: Spec) -> Spec:
        """The spec after this step.

        >>> Step("chunk", axis=0, dim=1).apply(Spec([R, S(0)]))
        [S(1), S(0)]
        """
        target = TABLE[self.op].change[1]
        if target == "R":
            return spec.with_axis(self.axis, R)
        return spec.with_axis(self.axis, Shard(self.to_dim if self.op == "all_to_all" else self.dim))


def _axes_of(spec, dim):
    return [a for a, p in enumerate(spec) if p == Shard(dim)]


def plan_redistribute(src: Spec, dst: Spec) -> list[Step]:
    """The steps turning spec `src` into `dst` (empty when equal); a partial sum cannot be created.

    >>> plan_redistribute(Spec([S(0), R]), Spec([S(1), R]))
    [all_to_all(axis=0, gather_dim=0, scatter_dim=1)]
    >>> plan_redistribute(Spec([R]), Spec([P]))
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.PlanError: cannot turn [R] into [P]: axis 0 would have to become a partial sum
    """
    if src == dst:
        return []
    for axis, (s, d) in enumerate(zip(src, dst)):
        if isinstance(d, Partial) and not isinstance(s, Partial):
            raise PlanError(f"cannot turn {src!r} into {dst!r}: axis {axis} would have to become a partial sum")
    dims = sorted({p.dim for p in (*src, *dst) if isinstance(p, Shard)})
    steps: list[Step] = []
    cur = Spec(src)

    def prefix(dim):
        s, d = _axes_of(cur, dim), _axes_of(dst, dim)
        n = 0
        while n < min(len(s), len(d)) and s[n] == d[n]:
            n += 1
        return s, d, n

    for axis, (s, d) in enumerate(zip(src, dst)):  # 1. direct moves of one axis's shard between dims
        if isinstance(s, Shard) and isinstance(d, Shard) and s.dim != d.dim:
            s_axes, _, n_s = prefix(s.dim)
            e_cur, e_dst, n_e = prefix(d.dim)
            if s_axes[n_s:] == [axis] and n_e == len(e_cur) and e_dst[n_e:n_e + 1] == [axis]:
                step = Step("all_to_all", axis, s.dim, d.dim)
                steps.append(step)
                cur = step.apply(cur)
    for dim in dims:  # 2. gathers, innermost first
        s_axes, _, n = prefix(dim)
        for axis in reversed(s_axes[n:]):
            step = Step("all_gather", axis, dim)
            steps.append(step)
            cur = step.apply(cur)
    for dim in dims:  # 3. shards in dst order
        s_axes, d_axes, n = prefix(dim)
        for axis in d_axes[n:]:
            step = Step(collective_for(cur[axis], Shard(dim)), axis, dim)
            steps.append(step)
            cur = step.apply(cur)
    for axis, (c, d) in enumerate(zip(cur, dst)):  # 4. remaining partial sums
        if isinstance(c, Partial) and isinstance(d, Replicate):
            step = Step(collective_for(c, d), axis)
            steps.append(step)
            cur = step.apply(cur)
    if cur != dst:
        raise AssertionError(f"autoshard bug: redistributing {src!r} -> {dst!r} ended at {cur!r}")
    return steps
