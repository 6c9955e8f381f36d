"""Pictures of a plan: the sharded graph, the device mesh, and a timeline of training steps.

- `draw_graph(plan)`: every tensor as a box coloured by its placement (or by pipeline stage, when the
  nodes carry `autoshard.stage`), collectives as red ellipses, boxes grouped in one cluster per
  top-level module; `collapse=["layers.1"]` draws a module as a single box. Rendered by graphviz when
  its `dot` binary is installed, else by a built-in layered layout (a one-line warning says how to
  get graphviz). The result shows as SVG in notebooks and as text in terminals.
- `draw_mesh(mesh, roles)`: the devices as a grid, each axis's size, direction and role.
- `plot_timeline(events)`: a matplotlib Gantt chart of (rank or stage, start, end, kind, microbatch).

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",))
>>> picture = draw_graph(prog.plan, engine="builtin")
>>> picture.svg.startswith("<svg")
True
"""
from __future__ import annotations

import os
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from html import escape

from autoshard.ir import meta
from autoshard.ir.errors import PlanError, UserInputError
from autoshard.ir.placement import describe_type

PALETTE = ("#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#8dd3c7", "#bebada", "#fccde5",
           "#d9d9d9", "#80b1d3", "#ccebc5")
REPLICATED, COLLECTIVE, COLLAPSED = "#f0f0f0", "#d62728", "#e0e0e0"
GRAPHVIZ_HINT = ("graphviz's `dot` binary is not installed; drawing with autoshard's built-in layout (for "
                 "graphviz's layout install it: `apt-get install graphviz`, `brew install graphviz` or "
                 "`conda install graphviz`)")
TIMELINE_COLORS = {"F": "#1f77b4", "B": "#2ca02c", "W": "#9467bd", "S": "#ff7f0e", "idle": "#dddddd"}


@dataclass
class Picture:
    """An SVG picture with a text version: SVG in notebooks (`_repr_svg_`), text in terminals (`repr`).

    >>> p = Picture("<svg xmlns='http://www.w3.org/2000/svg'/>", "a picture")
    >>> p
    a picture
    """

    svg: str
    text: str

    def _repr_svg_(self) -> str:
        return self.svg

    def __repr__(self) -> str:
        return self.text

    def save(self, path) -> None:
        """Write the SVG (or the text, when `path` ends in `.txt`).

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "graph.svg")
        >>> picture.save(path)  # picture: see the module docstring
        >>> open(path).read() == picture.svg
        True
        """
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(self.text if str(path).endswith(".txt") else self.svg)


@dataclass
class Box:
    """One box of the graph picture: a node, or a collapsed module standing for several.

    >>> boxes, legend = graph_boxes(prog.state)
    >>> [b.lines[0] for b in boxes if b.collective]
    []
    """

    key: str
    lines: list
    cluster: str
    fill: str
    stage: object = None
    collective: bool = False
    inputs: list = field(default_factory=list)


def module_of(node) -> str:
    """The module a node belongs to: its module path; a parameter's or buffer's owning module.

    >>> [module_of(n) for n in prog.state.gm.graph.nodes][:2]   # parameters belong to their module
    ['layers.0', 'layers.0']
    """
    path = node.meta.get(meta.PATH, "")
    if node.op == "placeholder":
        return path.rsplit(".", 1)[0] if node.meta.get(meta.KIND) in ("param", "buffer") and "." in path else ""
    return path


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def graph_boxes(state, collapse=(), color_by: str = "auto", cluster_depth: int = 1):
    """(boxes in graph order, legend {label: colour}) for the compiled graph in `state`.

    >>> boxes, legend = graph_boxes(prog.state, collapse=["layers.1"])
    >>> [b.key for b in boxes if b.key.startswith("module")]
    ['module layers.1']
    """
    if color_by not in ("auto", "placement", "stage"):
        raise UserInputError(f"color_by={color_by!r}: use 'auto', 'placement' or 'stage'")
    if color_by == "auto":
        color_by = "stage" if any(meta.STAGE in n.meta for n in state.gm.graph.nodes) else "placement"
    collapse = [collapse] if isinstance(collapse, str) else list(collapse)
    colours: dict = {}
    boxes: dict = {}
    key_of: dict = {}
    for node in state.gm.graph.nodes:
        spec = node.meta.get(meta.SPEC)
        if spec is None and node.op != "output":
            continue
        module = module_of(node)
        folded = next((m for m in collapse if _inside(module, m)), None)
        key = f"module {folded}" if folded else node.name
        key_of[node] = key
        inputs = [key_of[i] for i in node.all_input_nodes if i in key_of and key_of[i] != key]
        if key in boxes:  # another node of a collapsed module
            boxes[key].inputs += [i for i in inputs if i not in boxes[key].inputs]
            boxes[key].lines[1] = f"{int(boxes[key].lines[1].split()[0]) + 1} nodes"
            continue
        cluster = ".".join(module.split(".")[:cluster_depth]) if module else ""
        if folded:
            boxes[key] = Box(key, [folded, "1 nodes"], cluster, COLLAPSED, node.meta.get(meta.STAGE), inputs=inputs)
            continue
        comm = node.meta.get(meta.COMM)
        stage = node.meta.get(meta.STAGE)
        label = "stage" if color_by == "stage" else "spec"
        value = (f"stage {stage}" if stage is not None else "no stage") if label == "stage" else repr(spec)
        if comm:
            fill = "#ffffff"
        elif spec is None or (label == "spec" and spec.is_replicated()):
            fill = REPLICATED
        else:
            fill = colours.setdefault(value, PALETTE[len(colours) % len(PALETTE)])
        op = node.meta.get(meta.KIND, "input") if node.op == "placeholder" else str(node.target).replace("aten.", "")
        head = f"{comm['op']}@{comm['axis']}" if comm else f"{node.name}: {op}"
        lines = [head, _type_of(node, state.mesh), repr(spec)] if spec is not None else ["output"]
        if stage is not None:
            lines.append(f"stage {stage}")
        boxes[key] = Box(key, lines, cluster, fill, stage, bool(comm), inputs)
    legend = dict(colours)
    legend.setdefault("replicated" if color_by == "placement" else "no stage", REPLICATED)
    return list(boxes.values()), legend


def _type_of(node, mesh) -> str:
    import torch

    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return ""
    return describe_type(tuple(val.shape), node.meta.get(meta.SPEC), mesh.names, val.dtype)


def draw_graph(plan, collapse=(), color_by: str = "auto", engine: str = "auto",
               cluster_depth: int = 1) -> Picture:
    """The sharded graph of a compiled plan (or Program) as a Picture.

    `collapse`: module paths drawn as one box each; `color_by`: "placement", "stage", or "auto" (by
    stage when the plan has pipeline stages, else by placement);
    `engine`: "graphviz", "builtin", or "auto" (graphviz when `dot` is installed, else builtin with a
    warning); `cluster_depth`: how many module-path components name a cluster (1: top-level modules).

    >>> folded = draw_graph(prog.plan, collapse=["layers.1"], engine="builtin")
    >>> "module layers.1" in repr(folded)
    True
    """
    state = getattr(getattr(plan, "plan", plan), "_state", None)
    if state is None:
        raise PlanError("drawing the graph needs the compiled program; a plan loaded from JSON keeps only "
                        "decisions: compile it with autoshard.parallelize(..., plan=path) and draw prog.plan")
    boxes, legend = graph_boxes(state, collapse, color_by, cluster_depth)
    text = graph_text(boxes, state.mesh)
    if engine not in ("auto", "graphviz", "builtin"):
        raise UserInputError(f"engine={engine!r}: use 'auto', 'graphviz' or 'builtin'")
    has_dot = shutil.which("dot") is not None
    if engine == "graphviz" and not has_dot:
        raise UserInputError(GRAPHVIZ_HINT.replace("drawing with autoshard's built-in layout", "use "
                                                   "engine='builtin'"))
    if engine == "auto" and not has_dot:
        warnings.warn(GRAPHVIZ_HINT, stacklevel=_user_stacklevel())
    if engine != "builtin" and has_dot:
        svg = graphviz_graph(boxes, legend).pipe(format="svg", encoding="utf-8")
    else:
        svg = _builtin_svg(boxes, legend)
    return Picture(svg, text)


def _user_stacklevel() -> int:
    """The stacklevel of the first caller outside autoshard, so a warning names the user's line."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def graph_text(boxes, mesh) -> str:
    """The text picture: per cluster, each box with its type, spec and inputs.

    >>> print(graph_text(graph_boxes(prog.state)[0], prog.mesh).splitlines()[0])  # print(prog.plan.draw())
    graph on Mesh(dp=2) (...):
    """
    lines = [f"graph on {mesh!r} ({len(boxes)} boxes; collectives marked <>):"]
    for cluster in dict.fromkeys(b.cluster for b in boxes):
        lines.append(f"[{cluster or 'top level'}]")
        for b in (b for b in boxes if b.cluster == cluster):
            name = f"<{b.lines[0]}>" if b.collective else b.lines[0]
            inputs = f"  <- {', '.join(b.inputs)}" if b.inputs else ""
            lines.append(f"  {b.key if b.key.startswith('module ') else name}  {'  '.join(b.lines[1:])}{inputs}")
    return "\n".join(lines)


def graphviz_graph(boxes, legend):
    """The picture as a `graphviz.Digraph` (one dashed cluster per module); `.source` is its dot text.

    >>> graphviz_graph(*graph_boxes(prog.state)).source.startswith("digraph")
    True
    """
    import graphviz
    dot = graphviz.Digraph(graph_attr={"rankdir": "TB", "fontname": "Helvetica"},
                           node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica",
                                      "fontsize": "10"})
    clusters: dict = {}
    for b in boxes:
        clusters.setdefault(b.cluster, []).append(b)
    for cluster, members in clusters.items():
        if not cluster:
            _graphviz_nodes(dot, members)
            continue
        with dot.subgraph(name=f"cluster_{cluster}") as g:
            g.attr(label=cluster, style="rounded,dashed", color="#888888")
            _graphviz_nodes(g, members)
    for b in boxes:
        for i in b.inputs:
            dot.edge(i, b.key)
    with dot.subgraph(name="cluster_legend") as g:
        g.attr(label="legend", style="dashed")
        for label, colour in legend.items():
            g.node(f"legend {label}", label, fillcolor=colour)
    return dot


def _graphviz_nodes(graph, boxes) -> None:
    for b in boxes:
        attrs = {"shape": "ellipse", "color": COLLECTIVE, "penwidth": "2"} if b.collective else {}
        graph.node(b.key, "\n".join(b.lines), fillcolor=b.fill, **attrs)


CHAR_W, LINE_H, GAP_X, GAP_Y, PAD = 7.0, 14, 24, 36, 8


def layered_layout(boxes) -> dict:
    """{box key: (x, y, width, height)}: layers by longest path from the graph's inputs (parameters sit
    one layer above their first user), boxes of a layer ordered by cluster, then graph order.

    >>> boxes, _ = graph_boxes(prog.state)
    >>> x, y, width, height = layered_layout(boxes)["linear_default"]
    """
    by_key = {b.key: b for b in boxes}
    layer: dict = {}
    for b in boxes:
        layer[b.key] = 1 + max((layer[i] for i in b.inputs if i in layer), default=-1)
    users: dict = {}
    for b in boxes:
        for i in b.inputs:
            users.setdefault(i, []).append(layer[b.key])
    for b in boxes:  # sources (parameters, inputs) next to where they are used
        if not b.inputs and b.key in users:
            layer[b.key] = max(0, min(users[b.key]) - 1)
    clusters = list(dict.fromkeys(b.cluster for b in boxes))
    rows: dict = {}
    for b in sorted(boxes, key=lambda b: (layer[b.key], clusters.index(b.cluster))):
        rows.setdefault(layer[b.key], []).append(b.key)
    out, y = {}, PAD + 20
    for depth in sorted(rows):
        x, height = PAD, 0
        for key in rows[depth]:
            lines = by_key[key].lines
            w = max(len(s) for s in lines) * CHAR_W + 2 * PAD
            h = len(lines) * LINE_H + PAD
            out[key] = (x, y, w, h)
            x += w + GAP_X
            height = max(height, h)
        y += height + GAP_Y
    return out


def _builtin_svg(boxes, legend) -> str:
    pos = layered_layout(boxes)
    parts = []
    clusters: dict = {}
    for b in boxes:
        if b.cluster:
            clusters.setdefault(b.cluster, []).append(pos[b.key])
    for name, rects in clusters.items():  # a dashed frame around each cluster's boxes
        x0, y0 = min(r[0] for r in rects) - 4, min(r[1] for r in rects) - 16
        x1, y1 = max(r[0] + r[2] for r in rects) + 4, max(r[1] + r[3] for r in rects) + 4
        parts.append(f'<rect x="{x0:.0f}" y="{y0:.0f}" width="{x1 - x0:.0f}" height="{y1 - y0:.0f}" rx="6" '
                     f'fill="none" stroke="#888" stroke-dasharray="4 3"/>'
                     f'<text x="{x0 + 4:.0f}" y="{y0 + 11:.0f}" font-size="10" fill="#555">{escape(name)}</text>')
    for b in boxes:
        x, y, w, h = pos[b.key]
        for i in b.inputs:
            sx, sy, sw, sh = pos[i]
            parts.append(f'<line x1="{sx + sw / 2:.0f}" y1="{sy + sh:.0f}" x2="{x + w / 2:.0f}" y2="{y:.0f}" '
                         'stroke="#666" marker-end="url(#arrow)"/>')
    for b in boxes:
        x, y, w, h = pos[b.key]
        stroke = f'stroke="{COLLECTIVE}" stroke-width="2"' if b.collective else 'stroke="#333"'
        radius = h / 2 if b.collective else 5
        parts.append(f'<g><title>{escape(" | ".join(b.lines))}</title><rect x="{x:.0f}" y="{y:.0f}" '
                     f'width="{w:.0f}" height="{h:.0f}" rx="{radius:.0f}" fill="{b.fill}" {stroke}/>')
        for k, line in enumerate(b.lines):
            parts.append(f'<text x="{x + PAD:.0f}" y="{y + PAD / 2 + LINE_H * (k + 0.8):.0f}" '
                         f'font-family="monospace" font-size="11">{escape(line)}</text>')
        parts.append("</g>")
    width = max((x + w for x, _, w, _ in pos.values()), default=100) + PAD
    height = max((y + h for _, y, _, h in pos.values()), default=40) + GAP_Y
    for k, (label, colour) in enumerate(legend.items()):
        parts.append(f'<rect x="{PAD}" y="{height + k * 18:.0f}" width="14" height="12" fill="{colour}" '
                     f'stroke="#333"/><text x="{PAD + 20}" y="{height + k * 18 + 10:.0f}" font-size="11">'
                     f'{escape(label)}</text>')
    height += len(legend) * 18 + PAD
    return _svg_document(max(width, 200), height, "".join(parts))


def _svg_document(width, height, body) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif">'
            '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" '
            'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#666"/></marker></defs>'
            f'{body}</svg>')


def draw_mesh(mesh, roles: dict | None = None) -> Picture:
    """The device mesh: ranks in a grid (last axis along a row, the one before down a column, outer axes
    as separate panels) and, per axis, its size, direction and role (`plan.axis_roles()`).

    >>> from autoshard.ir.mesh import Mesh
    >>> print(draw_mesh(Mesh((2, 2), ("dp", "tp")), {"dp": "data parallel", "tp": "tensor parallel"}))
    Mesh(dp=2, tp=2): 4 devices
      dp (size 2, down a column): data parallel
      tp (size 2, along a row): tensor parallel
      [0 1]
      [2 3]
    """
    roles = roles or {}
    shape = mesh.shape
    cols = shape[-1]
    rows = shape[-2] if mesh.ndim >= 2 else 1
    panels = mesh.size // (rows * cols)
    where = {mesh.ndim - 1: "along a row", mesh.ndim - 2: "down a column"}
    axis_lines = [f"{n} (size {s}, {where.get(a, 'across panels')}): {roles.get(n, '')}".rstrip(": ")
                  for a, (n, s) in enumerate(zip(mesh.names, shape))]
    grid = []
    for p in range(panels):
        if panels > 1:
            grid.append(f"{_panel_name(mesh, p * rows * cols)}:")
        for r in range(rows):
            first = (p * rows + r) * cols
            grid.append("[" + " ".join(str(first + c) for c in range(cols)) + "]")
    text = "\n".join([f"{mesh!r}: {mesh.size} devices", *[f"  {line}" for line in axis_lines],
                      *[f"  {line}" for line in grid]])
    cell, gap = 44, 24
    parts = []
    panel_w = cols * cell + gap
    for p in range(panels):
        x0 = PAD + p * panel_w
        if panels > 1:
            parts.append(f'<text x="{x0}" y="14" font-size="11">{escape(_panel_name(mesh, p * rows * cols))}</text>')
        for r in range(rows):
            for c in range(cols):
                rank = (p * rows + r) * cols + c
                x, y = x0 + c * cell, 22 + r * cell
                parts.append(f'<rect x="{x}" y="{y}" width="{cell - 6}" height="{cell - 6}" rx="4" fill="#a6cee3" '
                             f'stroke="#333"/><text x="{x + 6}" y="{y + 16}" font-size="12">{rank}</text>'
                             f'<text x="{x + 4}" y="{y + 32}" font-size="8">{escape(str(mesh.coord(rank)))}</text>')
    top = 22 + rows * cell + 10
    for k, line in enumerate(axis_lines):
        parts.append(f'<text x="{PAD}" y="{top + 16 * k}" font-size="12">{escape(line)}</text>')
    width = max(PAD + panels * panel_w, PAD + max(len(s) for s in axis_lines) * 7) + PAD
    return Picture(_svg_document(width, top + 16 * len(axis_lines) + PAD, "".join(parts)), text)


def _panel_name(mesh, first_rank: int) -> str:
    """`pp=1`: the outer axes' coordinates of a panel of the mesh picture."""
    return ", ".join(f"{n}={c}" for n, c in zip(mesh.names, mesh.coord(first_rank)[:-2]))


def plot_timeline(events, ax=None, title: str | None = None):
    """A Gantt chart of training-step events; returns the matplotlib Figure.

    `events`: iterable of `(row label, start_s, end_s, kind, microbatch)` with kind "F" (forward), "B"
    (backward), "W" (weight-gradient), "S" (gradient sync) or "idle"; one row per label (a rank or a pipeline stage) in the
    order first seen; `microbatch` (int or None) is written inside bars wide enough for it.

    >>> fig = plot_timeline([("stage 0", 0.0, 1.0, "F", 0), ("stage 1", 1.0, 2.0, "F", 0),
    ...                      ("stage 1", 2.0, 4.0, "B", 0), ("stage 0", 1.0, 4.0, "idle", None)])
    >>> [t.get_text() for t in fig.axes[0].get_yticklabels()]
    ['stage 0', 'stage 1']
    """
    events = list(events)
    for i, event in enumerate(events):
        if not (isinstance(event, (tuple, list)) and len(event) == 5):
            raise UserInputError(f"timeline event {i} is {event!r}; each event is (label, start_s, end_s, kind, "
                                 "microbatch)")
        _, start, end, kind, _ = event
        if kind not in TIMELINE_COLORS:
            raise UserInputError(f"timeline event {i} has kind {kind!r}; use one of {list(TIMELINE_COLORS)}")
        if not end >= start:
            raise UserInputError(f"timeline event {i} ends ({end}) before it starts ({start})")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    labels = list(dict.fromkeys(str(e[0]) for e in events))
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 1.4 + 0.5 * max(len(labels), 1)))
    else:
        fig = ax.figure
    span = max((e[2] for e in events), default=1.0) - min((e[1] for e in events), default=0.0) or 1.0
    scale, unit = next(((f, u) for f, u in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))
                        if span >= f), (1e-9, "ns"))  # readable tick numbers
    for label, start, end, kind, micro in events:
        row = labels.index(str(label))
        ax.barh(row, (end - start) / scale, left=start / scale, height=0.7, color=TIMELINE_COLORS[kind],
                edgecolor="white", linewidth=0.5, hatch="//" if kind == "idle" else None)
        if micro is not None and (end - start) > span / 40:
            ax.text((start + end) / 2 / scale, row, str(micro), ha="center", va="center", fontsize=8, color="white")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(len(labels) - 0.5, -0.5)  # first label on top
    ax.set_xlabel(f"time ({unit})")
    kinds = [k for k in TIMELINE_COLORS if any(e[3] == k for e in events)]
    names = {"F": "forward", "B": "backward", "W": "weight grad", "S": "gradient sync", "idle": "idle"}
    ax.legend(handles=[Patch(color=TIMELINE_COLORS[k], label=names[k]) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def planned_events(plan, label: str = "rank 0"):
    """Single-stage timeline events from a compiled plan's predicted per-node times: forward ops in graph
    order, then backward (twice each op's forward) in reverse; collectives and gradient sync show as
    "idle" (waiting on communication; the model assumes no overlap).

    >>> events = planned_events(prog.plan)  # plot_timeline(events, title="predicted step") draws them
    >>> len(events) > 0
    True
    """
    costs = plan.row_costs()
    if not costs:
        raise PlanError("planned events need the compiled program's per-node costs; a plan loaded from JSON "
                        "has none: compile it with autoshard.parallelize(..., plan=path)")
    steps = []  # (forward seconds, backward seconds, is a collective) in graph order
    for row in plan.rows:
        cost = costs.get(row.name)
        if cost is None or row.kind in ("param", "buffer", "input"):
            continue
        if row.collective:  # its seconds cover both directions; split them by bytes
            total = (row.bytes_fwd + row.bytes_bwd) or 1
            steps.append((cost.seconds * row.bytes_fwd / total, cost.seconds * row.bytes_bwd / total, True))
        else:  # predict charges 3x the forward for forward + backward
            steps.append((cost.forward_seconds(), cost.seconds - cost.forward_seconds(), False))
    events, t = [], 0.0
    for seconds, kind in [(f, "idle" if c else "F") for f, _, c in steps] + \
            [(b, "idle" if c else "B") for _, b, c in reversed(steps)] + \
            [(sum(c.sync_s for c in costs.values()), "idle")]:
        if seconds > 0:
            events.append((label, t, t + seconds, kind, None))
            t += seconds
    return events
