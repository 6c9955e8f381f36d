"""Plan: what the compiler decided, as a table for people and as deterministic JSON for tools.

Every tensor's placement per mesh axis, every collective with its axis and bytes, the parameters whose
gradients are reduced after backward, and the predicted communication per mesh axis. The JSON is
byte-identical for the same inputs (sorted keys, no addresses, no hash order); its sha256 is the
plan fingerprint that ranks compare before their first collective. Every row carries the node's chosen
strategy per mesh axis (`choice`), so `Plan.save` / `Plan.load` (autoshard/plan/io.py: JSON only,
checked against a schema) and `parallelize(..., plan=...)` reproduce the program without solving.

The examples in this file use this plan (data parallel on dp, one weight sharded on tp, the other
parameters replicated there):

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp()
>>> prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"),
...                              hints={"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"},
...                                     "layers.0.bias": {"tp": "R"}, "layers.[12].*": {"tp": "R"}})
>>> plan = prog.plan
>>> plan.rows[0].type
'f32[128@tp, 32]'
"""
from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import math
from dataclasses import dataclass, field
from html import escape

import torch

from autoshard.cost.prediction import NodeCost, Prediction
from autoshard.ir import meta
from autoshard.ir.errors import PlanError
from autoshard.ir.mesh import Mesh
from autoshard.ir.meta import COMM_COST, NODE_COST
from autoshard.ir.placement import Shard, Spec, describe_type, dtype_name
from autoshard.plan.diff import diff_plans
from autoshard.plan.explain import explain_nodes
from autoshard.plan.io import (
    PLAN_VERSION,
    check_fingerprint,
    plan_parts,
    read_plan_file,
    save_plan,
)
from autoshard.plan.memory_summary import memory_lines
from autoshard.report.viz import draw_graph, draw_mesh
from autoshard.solver.time_limit import describe_stopped


@dataclass
class PlanRow:
    """One node of the plan.

    >>> row = plan.rows[0]
    >>> row.path, row.spec, row.type
    ('layers.0.weight', '[R, S(0)]', 'f32[128@tp, 32]')
    """

    name: str
    op: str
    path: str
    kind: str
    type: str
    spec: str
    strategy: str = ""
    collective: str = ""
    axis: str = ""
    bytes_fwd: int = 0
    bytes_bwd: int = 0
    choice: list = field(default_factory=list)  # per mesh axis: AxisStrategy.to_json()
    stage: int | None = None  # the pipeline stage (pipelined plans only)

    def to_json(self) -> dict:
        """The row as a plan file's node entry (`stage` only in pipelined plans).

        >>> sorted(plan.rows[0].to_json())[:4]
        ['axis', 'bytes_bwd', 'bytes_fwd', 'choice']
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.stage is None:
            del out["stage"]
        return out


@dataclass
class Plan:
    """The compiled plan: mesh, one row per tensor, gradient reductions, hints, predicted costs.

    >>> plan.mesh, plan.grad_reduce["layers.0.weight"]
    (Mesh(dp=2, tp=2), ('dp',))
    """
    mesh: Mesh
    rows: list[PlanRow]
    grad_reduce: dict = field(default_factory=dict)
    hints: dict = field(default_factory=dict)
    predicted: Prediction | None = None  # None only for a Plan built by hand without costs
    _state: object = field(default=None, repr=False, compare=False)
    pipeline: dict = field(default_factory=dict)  # a pipelined program: axis, stages, schedule, cut, stage table
    search: dict = field(default_factory=dict)  # an unnamed mesh: the axis-role candidates and why one won

    @classmethod
    def from_state(cls, state) -> Plan:
        """The plan of a compiled program (`prog.plan` calls this after the passes ran).

        >>> Plan.from_state(prog.state).fingerprint == plan.fingerprint
        True
        """
        mesh = state.mesh
        rows = []
        for node in state.gm.graph.nodes:
            if meta.SPEC not in node.meta:
                continue
            val = node.meta.get("val")
            spec = node.meta[meta.SPEC]
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
            dtype = dtype_name(val.dtype) if isinstance(val, torch.Tensor) else "tuple"
            row = PlanRow(node.name, op_name(node), node.meta.get(meta.PATH, ""), node.meta.get(meta.KIND, ""),
                          describe_type(shape, spec, mesh.names, dtype), repr(spec))
            choice = node.meta.get(meta.CHOICE)
            if choice and node.op == "call_function":
                row.strategy = " | ".join(repr(c) for c in choice)
            if choice:
                row.choice = [c.to_json() for c in choice]
            comm = node.meta.get(meta.COMM)
            if comm:
                row.collective, row.axis = comm["op"], comm["axis"]
                row.bytes_fwd = node.meta[COMM_COST].fwd_bytes
                row.bytes_bwd = node.meta[COMM_COST].bwd_bytes
            rows.append(row)
        hints = state.hints.to_json() if hasattr(state.hints, "to_json") else {}
        return cls(mesh, rows, dict(sorted(state.grad_reduce.items())), hints, state.predicted.copy(), state)

    @property
    def step_s(self) -> float | None:
        """The predicted time of one training step: a pipelined plan's schedule (`pipeline["predicted_step_s"]`: its
        `predicted` prices one micro-batch's program), else `predicted.step_time_s`; None for a plan without costs.

        >>> plan.step_s == plan.predicted.step_time_s  # no pipeline
        True
        """
        if self.pipeline:
            return self.pipeline["predicted_step_s"]
        return None if self.predicted is None else self.predicted.step_time_s

    def save(self, path) -> None:
        """Write the plan as JSON (with its fingerprint) for `Plan.load` / `parallelize(..., plan=path)`.

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
        >>> plan.save(path)
        >>> Plan.load(path).fingerprint == plan.fingerprint
        True
        """
        save_plan(self, path)

    @classmethod
    def load(cls, path) -> Plan:
        """Read a plan file written by `save`: JSON only, at most 64 MiB, checked against the plan schema;
        anything wrong raises PlanFileError saying what, where (JSON path, node) and what to do.

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
        >>> plan.save(path)
        >>> loaded = Plan.load(path)  # or autoshard.parallelize(..., plan=path)
        >>> loaded.fingerprint == plan.fingerprint, loaded.dumps() == plan.dumps(), loaded.row_costs()
        (True, True, {})
        """
        return cls.from_parts(read_plan_file(path))

    @classmethod
    def from_json(cls, data, source: str = "plan") -> Plan:
        """The Plan of a plan file's content (`to_json()` plus "fingerprint"), checked against the schema
        (autoshard/plan/io.py); no compiled state: decisions only.

        >>> import json
        >>> data = dict(json.loads(plan.dumps()), fingerprint=plan.fingerprint)
        >>> Plan.from_json(data).fingerprint == plan.fingerprint
        True
        """
        return cls.from_parts(plan_parts(data, source))

    @classmethod
    def from_parts(cls, parts: dict) -> Plan:
        """Build the Plan from plan_io's checked parts and check the file's fingerprint against it.

        >>> import json
        >>> Plan.from_parts(plan_parts(json.loads(plan.dumps()) | {"fingerprint": None})).dumps() == plan.dumps()
        True
        """
        rows = [PlanRow(**fields) for fields in parts["rows"]]
        records = parts["records"]  # pipelined plans and mesh searches: records only (not applied by plan=)
        plan = cls(parts["mesh"], rows, parts["grad_reduce"], parts["hints"], parts["predicted"],
                   pipeline=records.get("pipeline", {}), search=records.get("search", {}))
        check_fingerprint(plan, parts["fingerprint"], parts["source"])
        return plan

    def explain(self, path: str = "") -> str:
        """Why the ops under module `path` got their placements: each axis's alternatives and costs.

        >>> print(plan.explain("layers.0").splitlines()[0])
        layers.0: linear_default = aten.linear.default  spec [S(0), S(1)]
        """
        if self._state is None:
            raise PlanError("explain needs the compiled program; a plan loaded from JSON keeps only decisions")
        return explain_nodes(self._state, path)

    def to_json(self) -> dict:
        """The plan as a JSON-serialisable dict (the content of a plan file, without its fingerprint).

        >>> plan.to_json()["mesh"]
        {'shape': [2, 2], 'names': ['dp', 'tp'], 'named': True}
        """
        return {"version": PLAN_VERSION, "mesh": self.mesh.to_json(), "hints": self.hints,
                "nodes": [r.to_json() for r in self.rows],
                "grad_reduce": {k: list(v) for k, v in self.grad_reduce.items()},
                "predicted": {} if self.predicted is None else self.predicted.to_dict(),
                **({"pipeline": self.pipeline} if self.pipeline else {}),
                **({"search": self.search} if self.search else {})}

    def dumps(self) -> str:
        """Canonical JSON text (sorted keys, no spaces): byte-identical for the same plan.

        >>> plan.dumps() == Plan.from_state(prog.state).dumps()
        True
        """
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @property
    def fingerprint(self) -> str:
        """16 hex digits of the sha256 of `dumps()`; ranks compare it before their first collective.

        >>> len(plan.fingerprint)
        16
        """
        return hashlib.sha256(self.dumps().encode()).hexdigest()[:16]

    def collectives(self) -> list[PlanRow]:
        """The rows that are inserted collectives.

        >>> [(r.collective, r.axis, r.path) for r in plan.collectives()]
        [('all_to_all', 'tp', 'layers.0')]
        """
        return [r for r in self.rows if r.collective]

    def filter(self, glob: str) -> list[PlanRow]:
        """Rows whose module path matches a glob (`layers.0.*`) or equals it.

        >>> [r.name for r in plan.filter("layers.0")]
        ['p_model_layers_0_weight', 'p_model_layers_0_bias', 'linear_default', 'all_to_all', 'add_tensor']
        """
        return [r for r in self.rows if fnmatch.fnmatchcase(r.path, glob) or r.path == glob
                or r.path.startswith(glob + ".")]

    def table_cells(self, rows=None) -> tuple[list[str], list[list[str]]]:
        """(header, one list of cells per row): the columns `table()` prints and `_repr_html_` shows — node,
        op, module path, sharded type, the placement on each mesh axis (one column per axis), pipeline stage
        (blank without a pipeline), collective, bytes, and predicted time and memory per step and rank
        (blank for a plan loaded from JSON, which keeps only decisions). `rows`: all, a list, or a glob.

        >>> head, body = plan.table_cells("layers.0.weight")
        >>> dict(zip(head, body[0]))["tp (2)"], dict(zip(head, body[0]))["predicted memory (B)"]
        ('S(0)', '32768')
        """
        rows = self._rows(rows)
        head = ["node", "op", "module path", "type", *[f"{n} ({s})" for n, s in zip(self.mesh.names, self.mesh.shape)],
                "stage", "collective", "fwd bytes", "bwd bytes", "predicted time (s)", "predicted memory (B)"]
        costs = self.row_costs()
        body = []
        for r in rows:
            cost = costs.get(r.name)
            stage = r.stage  # rows carry a stage only in pipeline plans
            body.append([r.name, r.op, r.path, r.type, *[repr(p) for p in Spec.parse(r.spec)],
                         "" if stage is None else str(stage), f"{r.collective}@{r.axis}" if r.collective else "",
                         str(r.bytes_fwd or ""), str(r.bytes_bwd or ""),
                         f"{cost.seconds + cost.sync_s:.3g}" if cost else "",
                         str(int(cost.memory_bytes)) if cost else ""])
        return head, body

    def totals_cells(self, rows=None) -> tuple[list[str], list[list[str]]]:
        """(header, cells) of the totals under the table: per mesh axis its collectives, their bytes and
        predicted time, and the gradients reduced on it; then all rows' predicted time and memory.

        >>> head, body = plan.totals_cells()
        >>> [dict(zip(head, line))["collectives"] for line in body]
        ['0', '1', '1']
        >>> body[-1][0], float(body[-1][-2]) == float(f"{plan.predicted.step_time_s:.3g}")
        ('all axes', True)
        """
        rows = self._rows(rows)
        costs = self.row_costs()
        head = ["mesh axis", "collectives", "fwd bytes", "bwd bytes", "gradients reduced", "predicted time (s)",
                "predicted memory (B)"]
        body = []
        for name in self.mesh.names:
            comms = [r for r in rows if r.collective and r.axis == name]
            reduced = [r for r in rows if r.kind == "param" and name in self.grad_reduce.get(r.path, ())]
            seconds = sum(costs[r.name].seconds for r in comms if r.name in costs)
            body.append([name, str(len(comms)), str(sum(r.bytes_fwd for r in comms)),
                         str(sum(r.bytes_bwd for r in comms)), str(len(reduced)),
                         f"{seconds:.3g}" if costs else "", ""])
        shown = [costs[r.name] for r in rows if r.name in costs]
        body.append(["all axes", str(sum(1 for r in rows if r.collective)), str(sum(r.bytes_fwd for r in rows)),
                     str(sum(r.bytes_bwd for r in rows)),
                     str(sum(1 for r in rows if r.kind == "param" and self.grad_reduce.get(r.path))),
                     f"{sum(c.seconds + c.sync_s for c in shown):.3g}" if costs else "",
                     str(int(sum(c.memory_bytes for c in shown))) if costs else ""])
        return head, body

    def table(self, rows=None) -> str:
        """The rows (all, a list such as `filter(glob)`'s, or a module glob) as aligned text with the
        columns of `table_cells`, then the totals per mesh axis (`totals_cells`). The example's long lines
        are wrapped.

        >>> print(plan.table(plan.collectives()))  # doctest: +NORMALIZE_WHITESPACE
        node        op          module path  type               dp (2)  tp (2)  stage  collective     fwd bytes
            bwd bytes  predicted time (s)  predicted memory (B)
        all_to_all  all_to_all  layers.0     f32[8@dp@tp, 128]  S(0)    S(0)           all_to_all@tp  1024
            1024       1e-05               0
        mesh axis  collectives  fwd bytes  bwd bytes  gradients reduced  predicted time (s)  predicted memory (B)
        dp         0            0          0          0                  0
        tp         1            1024       1024       0                  1e-05
        all axes   1            1024       1024       0                  1e-05               0
        """
        head, body = self.table_cells(rows)
        totals_head, totals = self.totals_cells(rows)
        return _aligned(head, body) + "\n\n" + _aligned(totals_head, totals)

    def _rows(self, rows) -> list[PlanRow]:
        if rows is None:
            return self.rows
        return self.filter(rows) if isinstance(rows, str) else list(rows)

    def axis_roles(self) -> dict:
        """What the plan uses each mesh axis for, in words (the planner decides this on unnamed meshes).

        >>> plan.axis_roles()["tp"]
        'model parallel: 1 of 6 parameters sharded'
        """
        roles = {}
        for axis, name in enumerate(self.mesh.names):
            batch = any(r.kind == "input" and Spec.parse(r.spec)[axis] == Shard(0) for r in self.rows)
            params = [r for r in self.rows if r.kind == "param"]
            sharded = [r for r in params if isinstance(Spec.parse(r.spec)[axis], Shard)]
            reduced = [p for p, axes in self.grad_reduce.items() if name in axes]
            parts = []
            if batch:
                parts.append("data parallel: the batch is sharded" + (f", {len(reduced)} gradients reduced"
                                                                       if reduced else ""))
            if sharded:
                parts.append(f"model parallel: {len(sharded)} of {len(params)} parameters sharded")
            if not parts:
                other = any(isinstance(p, Shard) for r in self.rows for p in [Spec.parse(r.spec)[axis]])
                parts.append("activations sharded" if other else "unused (everything replicated)")
            roles[name] = "; ".join(parts)
        return roles

    def summary(self) -> str:
        """Predicted step time and memory, and per mesh axis its role, collectives and bytes per step.

        >>> print(plan.summary().splitlines()[0])  # doctest: +ELLIPSIS
        Plan on Mesh(dp=2, tp=2): 19 nodes, 1 collectives, fingerprint ...
        """
        counts: dict = {}
        for r in self.collectives():
            counts.setdefault(r.axis, {}).setdefault(r.collective, 0)
            counts[r.axis][r.collective] += 1
        roles = self.axis_roles()
        p = self.predicted
        lines = [(f"Plan on {self.mesh!r}: {len(self.rows)} nodes, {len(self.collectives())} collectives, "
                  f"fingerprint {self.fingerprint}"),
                 # A pipeline's rows are one micro-batch's program; its step is the pipeline line's.
                 (f"  {'one micro-batch' if self.pipeline else 'predicted step'} {p.step_time_s:.3g} s (compute "
                  f"{p.compute_s:.3g} s, communication {p.comm_s:.3g} s"
                  + ("" if self.pipeline or p.overlapped_step_s is None else
                     f"; {p.overlapped_step_s:.3g} s overlapped") +
                  f"), memory per rank {p.memory_bytes_per_rank / 2**20:.1f} MiB")]
        lines += memory_lines(p, self.hints)
        for axis in self.mesh.names:
            b = p.comm_bytes_per_step[axis]
            ops = ", ".join(f"{n} {k}" for k, n in sorted(counts.get(axis, {}).items())) or "none"
            lines.append(f"  axis {axis} ({roles[axis]}): {ops}; bytes/step fwd {b.fwd}, bwd {b.bwd}, "
                         f"grad sync {b.sync}")
        if self.grad_reduce:
            lines.append(f"  gradients reduced after backward: {len(self.grad_reduce)} parameters "
                         f"(on {sorted({a for v in self.grad_reduce.values() for a in v})})")
        if self.pipeline:
            lines += self._pipeline_lines()
        if self.search.get("why"):
            lines.append(f"  axis search: {self.search['why']}")
        stopped = getattr(self._state, "ilp_stopped", None)
        if stopped:
            lines.append(f"  solver: {describe_stopped(stopped)}")
        return "\n".join(lines)

    def memory_budget(self) -> float | None:
        """The bytes per device the plan was made to fit (the compile's option: None for a plan loaded from
        JSON, or when unbounded).

        >>> plan.memory_budget() / 1e9  # the default profile's 80 GB less the 10% headroom
        72.0
        """
        if self._state is None:
            return None
        options = self._state.options
        budget = options.checkpoint_budget if options.checkpoint == "auto" else options.memory_budget
        return budget if budget is not None and math.isfinite(budget) else None

    def _pipeline_lines(self) -> list[str]:
        """The pipeline part of the summary: axis, schedule, cut, predicted step and bubble, stage table
        (figures per micro-batch; the rows above are the intra-op plan of one micro-batch)."""
        p = self.pipeline
        lines = [(f"  axis {p['axis']} (pipeline): {p['stages']} stages on {p['pp_size']} ranks "
                  f"({p['virtual_stages']} per rank), {p['schedule']}, {p['microbatches']} micro-batches, cut "
                  f"{p['cut']}; predicted step {p['predicted_step_s']:.3g} s, bubble {p['predicted_bubble']:.1%}")]
        for row in p["stage_table"]:
            lines.append(f"    stage {row['stage']} (pp rank {p['stage_ranks'][row['stage']]}): {row['ops']} ops "
                         f"{row['first_module'] or '-'} .. {row['last_module'] or '-'}, fwd+bwd "
                         f"{row['seconds']:.3g} s/micro-batch, params {row['param_bytes'] / 2**20:.2f} MiB, "
                         f"activations {row['activation_bytes'] / 2**20:.2f} MiB/micro-batch")
        if p.get("tied_params"):
            lines.append(f"    tied parameters summed over {p['axis']}: {sorted(p['tied_params'])}")
        return lines

    def __repr__(self) -> str:
        return self.summary() + "\n\n" + self.table()

    def row_costs(self) -> dict[str, NodeCost]:
        """{node name: its predicted NodeCost (seconds, memory_bytes, sync_s) per step and rank} from the
        predict pass; empty for a plan loaded from JSON (which keeps only decisions and totals).

        >>> plan.row_costs()["linear_default"].seconds > 0  # forward + backward compute seconds
        True
        """
        if self._state is None:
            return {}
        return {n.name: n.meta[NODE_COST] for n in self._state.gm.graph.nodes if NODE_COST in n.meta}

    def diff(self, other: Plan):
        """What changed from this plan to `other`: placements, collectives, predicted time/memory/bytes.

        >>> bool(plan.diff(plan))  # nothing changed; print it, or display it in a notebook (HTML)
        False
        """
        return diff_plans(self, other)

    def draw(self, collapse=(), color_by: str = "auto"):
        """The sharded graph as a picture (SVG in notebooks, text in terminals); see `autoshard.report.viz`.

        >>> import warnings
        >>> with warnings.catch_warnings():  # without graphviz's `dot`: the built-in layout, with a warning
        ...     warnings.simplefilter("ignore")
        ...     picture = plan.draw(collapse=["layers.1"])
        >>> "<svg" in picture.svg and "layers.1" in repr(picture)
        True
        """
        return draw_graph(self, collapse=collapse, color_by=color_by)

    def to_svg(self, collapse=(), color_by: str = "auto") -> str:
        """The sharded graph as SVG text (graphviz when its `dot` binary is installed, else a built-in layout).

        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     svg = plan.to_svg()
        >>> svg.rstrip().endswith("</svg>")
        True
        """
        return self.draw(collapse, color_by).svg

    def draw_mesh(self):
        """The device mesh as a picture: each axis's size and what the plan uses it for.

        >>> "<svg" in plan.draw_mesh().svg
        True
        """
        return draw_mesh(self.mesh, self.axis_roles())

    def _repr_html_(self) -> str:
        """Notebook view: the summary, the table of `table_cells` (the columns `table()` prints), then the
        totals per mesh axis."""
        summary = "<br>".join(escape(line) for line in self.summary().splitlines())
        return f"<div><p><code>{summary}</code></p>{_html(*self.table_cells())}{_html(*self.totals_cells())}</div>"


def _aligned(head, body) -> str:
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body])


def _html(head, body) -> str:
    return ("<table><thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in line) + "</tr>" for line in body)
            + "</tbody></table>")


def op_name(node) -> str:
    """The op a plan row names: a placeholder's kind, a collective's name, or the ATen op without "aten.".

    >>> import torch
    >>> graph = torch.fx.Graph()
    >>> x = graph.placeholder("x")
    >>> op_name(x), op_name(graph.call_function(torch.ops.aten.relu.default, (x,)))
    ('input', 'relu.default')
    """
    if node.op == "placeholder":
        return node.meta.get(meta.KIND, "input")
    comm = node.meta.get(meta.COMM)
    if comm:
        return comm["op"]
    return str(node.target).replace("aten.", "")
