"""`plan.diff(other)`: what changed between two plans and what the change is predicted to cost.

Nodes are matched by name (export names them deterministically for one model). Collectives are
matched by what they do — module path, collective, mesh axis and bytes — because their node names
shift when one is added earlier in the graph. Works on plans loaded from JSON too: it reads only the
rows, the gradient reductions and the predicted totals.

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp()
>>> dp = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("x",),
...                            hints={"input:0": {"x": "S(0)"}})
>>> tp = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("x",),
...                            hints={"layers.0.weight": {"x": "S(0)"}})
>>> d = dp.plan.diff(tp.plan)
>>> bool(d), len(d.placements) > 0
(True, True)
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from html import escape

from autoshard.ir.placement import Spec

_TOTALS = (("step_time_s", "predicted step", "s"), ("compute_s", "compute", "s"), ("comm_s", "communication", "s"),
           ("memory_bytes_per_rank", "memory per rank", "B"))


@dataclass(frozen=True)
class PlacementChange:
    """One node whose placement differs: its types and specs before and after.

    >>> PlacementChange("w", "param", "fc.weight", "f32[8, 4]", "f32[8@tp, 4]", "[R]", "[S(0)]").axes(("tp",))
    'tp: R -> S(0)'
    """

    name: str
    op: str
    path: str
    type_before: str
    type_after: str
    spec_before: str
    spec_after: str

    def axes(self, names_before, names_after=None) -> str:
        """The axes whose placement changed, as `axis: before -> after` (whole specs if the meshes differ).

        >>> PlacementChange("x", "input", "input:0", "", "", "[S(0), R]", "[R, R]").axes(("dp", "tp"))
        'dp: S(0) -> R'
        """
        names_after = names_before if names_after is None else names_after
        before, after = Spec.parse(self.spec_before), Spec.parse(self.spec_after)
        if tuple(names_before) != tuple(names_after) or len(before) != len(after):
            return f"{self.spec_before} -> {self.spec_after}"
        return ", ".join(f"{n}: {b!r} -> {a!r}" for n, b, a in zip(names_before, before, after) if b != a)


@dataclass(frozen=True)
class CollectiveChange:
    """A collective that only one of the two plans has (`added` True: only the new plan).

    >>> CollectiveChange(True, "all_reduce", "dp", "layers.1", 1024, 0)
    + all_reduce@dp in layers.1 (fwd 1024 B, bwd 0 B)
    """

    added: bool
    collective: str
    axis: str
    path: str
    bytes_fwd: int
    bytes_bwd: int

    def __repr__(self) -> str:
        return (f"{'+' if self.added else '-'} {self.collective}@{self.axis} in {self.path or '(top level)'} "
                f"(fwd {self.bytes_fwd} B, bwd {self.bytes_bwd} B)")


@dataclass
class PlanDiff:
    """The differences from plan `before` to plan `after`; falsy when they made the same decisions.

    `placements`: nodes whose spec changed; `collectives`: collectives added (+) or removed (-);
    `grad_reduce`: {parameter: (axes before, axes after)}; `totals`: {key: (before, after)} of the
    predicted step time, compute, communication and memory per rank; `axis_bytes`: {axis: (before,
    after)} communicated bytes per step (forward + backward + gradient sync); `only_before` /
    `only_after`: node names present in one plan only (a different model or inputs).

    >>> before, after = d.totals["step_time_s"]  # d: see the module docstring
    >>> (before, after) == (dp.plan.predicted.step_time_s, tp.plan.predicted.step_time_s)
    True
    """

    before: object
    after: object
    placements: list = field(default_factory=list)
    collectives: list = field(default_factory=list)
    grad_reduce: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)
    axis_bytes: dict = field(default_factory=dict)
    only_before: list = field(default_factory=list)
    only_after: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.placements or self.collectives or self.grad_reduce or self.only_before or self.only_after
                    or self.before.mesh != self.after.mesh)

    def _header(self) -> str:
        mesh = (f"{self.before.mesh!r} -> {self.after.mesh!r}" if self.before.mesh != self.after.mesh
                else f"{self.before.mesh!r}")
        return f"Plan diff on {mesh} (fingerprint {self.before.fingerprint} -> {self.after.fingerprint})"

    def _total_lines(self) -> list[str]:
        lines = [f"{label} {_amount(*self.totals[key], unit)}" for key, label, unit in _TOTALS if key in self.totals]
        axes = [f"{axis} {_amount(b, a, 'B')}" for axis, (b, a) in self.axis_bytes.items() if b != a]
        return ["; ".join(lines), "bytes/step per axis: " + (", ".join(axes) or "unchanged")]

    def __repr__(self) -> str:
        if not self:
            return f"{self._header()}: the same decisions"
        names = self.before.mesh.names, self.after.mesh.names
        lines = [self._header()] + [f"  {line}" for line in self._total_lines()]
        if self.placements:
            lines.append(f"  placements changed ({len(self.placements)} nodes):")
            rows = [(c.path or "(top level)", c.name, c.op, c.axes(*names), f"{c.type_before} -> {c.type_after}")
                    for c in self.placements]
            widths = [max(len(row[i]) for row in rows) for i in range(4)]
            lines += ["    " + "  ".join(x.ljust(w) for x, w in zip(row, widths)) + f"  {row[4]}" for row in rows]
        if self.collectives:
            added = sum(c.added for c in self.collectives)
            lines.append(f"  collectives: {added} added, {len(self.collectives) - added} removed")
            lines += [f"    {c!r}" for c in self.collectives]
        if self.grad_reduce:
            lines.append("  gradient reduction changed:")
            lines += [f"    {fqn}: {_axes(b)} -> {_axes(a)}" for fqn, (b, a) in self.grad_reduce.items()]
        for label, names_ in (("only in the first plan", self.only_before),
                              ("only in the second plan", self.only_after)):
            if names_:
                lines.append(f"  nodes {label} ({len(names_)}): {', '.join(names_[:10])}"
                             + (" ..." if len(names_) > 10 else ""))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """Notebook view: the totals, then a table of placement changes and one of collective changes."""
        parts = [f"<div><p><b>{escape(self._header())}</b></p>"]
        if not self:
            return parts[0] + "<p>the same decisions</p></div>"
        parts.append("<p>" + "<br>".join(escape(line) for line in self._total_lines()) + "</p>")
        names = self.before.mesh.names, self.after.mesh.names
        if self.placements:
            parts.append(_html_table(("module path", "node", "op", "change", "type before", "type after"),
                                     [(c.path, c.name, c.op, c.axes(*names), c.type_before, c.type_after)
                                      for c in self.placements]))
        if self.collectives:
            parts.append(_html_table(("", "collective", "axis", "module path", "fwd bytes", "bwd bytes"),
                                     [("added" if c.added else "removed", c.collective, c.axis, c.path, c.bytes_fwd,
                                       c.bytes_bwd) for c in self.collectives]))
        if self.grad_reduce:
            parts.append(_html_table(("parameter", "gradient reduced on (before)", "(after)"),
                                     [(k, _axes(b), _axes(a)) for k, (b, a) in self.grad_reduce.items()]))
        return "".join(parts) + "</div>"


def diff_plans(before, after) -> PlanDiff:
    """What changed from plan `before` to plan `after` (both `autoshard.Plan`, compiled or loaded).

    >>> diff_plans(dp.plan, tp.plan).placements == dp.plan.diff(tp.plan).placements
    True
    """
    old = {r.name: r for r in before.rows if r.kind != "comm"}
    new = {r.name: r for r in after.rows if r.kind != "comm"}
    # On meshes with other axis names specs are not comparable, the named types are: `f32[8@dp, 32]`.
    same_axes = before.mesh.names == after.mesh.names
    placements = [PlacementChange(name, r.op, r.path, r.type, new[name].type, r.spec, new[name].spec)
                  for name, r in old.items() if name in new
                  and (r.spec != new[name].spec if same_axes else r.type != new[name].type)]
    removed, added = _collective_counts(before), _collective_counts(after)
    collectives = [CollectiveChange(False, *key) for key in sorted((removed - added).elements())]
    collectives += [CollectiveChange(True, *key) for key in sorted((added - removed).elements())]
    grad = {fqn: (tuple(before.grad_reduce.get(fqn, ())), tuple(after.grad_reduce.get(fqn, ())))
            for fqn in sorted(set(before.grad_reduce) | set(after.grad_reduce))}
    totals = {key: (getattr(before.predicted, key), getattr(after.predicted, key)) for key, _, _ in _TOTALS}
    return PlanDiff(before, after, placements, collectives, {k: v for k, v in grad.items() if v[0] != v[1]}, totals,
                    _axis_bytes(before, after), [n for n in old if n not in new], [n for n in new if n not in old])


def _collective_counts(plan) -> Counter:
    return Counter((r.collective, r.axis, r.path, r.bytes_fwd, r.bytes_bwd) for r in plan.rows if r.collective)


def _axis_bytes(before, after) -> dict:
    def per_axis(plan):
        return {axis: sent.fwd + sent.bwd + sent.sync for axis, sent in plan.predicted.comm_bytes_per_step.items()}
    old, new = per_axis(before), per_axis(after)
    return {axis: (old.get(axis, 0), new.get(axis, 0)) for axis in dict.fromkeys([*old, *new])}


def _axes(axes) -> str:
    return ", ".join(axes) if axes else "none"


def _amount(before, after, unit: str) -> str:
    """`1.2e-04 s -> 3.4e-05 s (-72%)`; bytes as B, KiB, MiB or GiB."""
    def show(x):
        if unit != "B":
            return f"{x:.3g} {unit}"
        for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(x) >= scale:
                return f"{x / scale:.1f} {name}"
        return f"{int(x)} B"
    change = f"{(after - before) / before:+.0%}" if before else ("new" if after else "unchanged")
    return f"{show(before)} -> {show(after)} ({change})" if before != after else f"{show(before)} (unchanged)"


def _html_table(head, rows) -> str:
    return ("<table><thead><tr>" + "".join(f"<th>{escape(str(h))}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
            + "</tbody></table>")
