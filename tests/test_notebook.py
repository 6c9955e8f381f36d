"""examples/inspect_plan.ipynb executes, and its outputs hold the HTML plan, an SVG graph and a figure.

Also the plan's HTML table itself (no kernel): the columns a reader needs, and per-row predicted time
and memory that add up to the plan's totals.
"""
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import autoshard
from autoshard.zoo import mlp

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "inspect_plan.ipynb"


class _Table(HTMLParser):
    """Header cells and body rows of the first <table>."""

    def __init__(self):
        super().__init__()
        self.head, self.rows, self._cell, self._in, self.done = [], [], None, None, False

    def handle_starttag(self, tag, attrs):
        if self.done:
            return
        if tag in ("th", "td"):
            self._cell = ""
        elif tag == "tr":
            self._in = []

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if self.done:
            return
        if tag == "table":
            self.done = True
        elif tag == "th":
            self.head.append(self._cell)
        elif tag == "td":
            self._in.append(self._cell)
        elif tag == "tr" and self._in:
            self.rows.append(self._in)
        if tag in ("th", "td"):
            self._cell = None


def _table(html):
    parser = _Table()
    parser.feed(html)
    return parser


def _check_columns(head, mesh):
    axes = [f"{n} ({s})" for n, s in zip(mesh.names, mesh.shape)]
    expected = ["op", "module path", *axes, "stage", "collective", "fwd bytes", "bwd bytes",
                "predicted time (s)", "predicted memory (B)"]
    assert [h for h in head if h in expected] == expected, head  # all there, in reading order


def test_plan_html_columns_and_row_costs():
    model, inputs, loss_fn = mlp(n_layers=2)
    prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"),
                                 hints={"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"}})
    plan = prog.plan
    table = _table(plan._repr_html_())
    _check_columns(table.head, plan.mesh)
    assert len(table.rows) == len(plan.rows)
    col = {h: i for i, h in enumerate(table.head)}
    by_name = {row[col["node"]]: row for row in table.rows}
    assert by_name["p_model_layers_0_weight"][col["tp (2)"]] == "S(0)"
    assert all(row[col["stage"]] == "" for row in table.rows)  # no pipeline
    comm = next(r for r in plan.rows if r.collective)
    assert by_name[comm.name][col["collective"]] == f"{comm.collective}@{comm.axis}"
    seconds = sum(float(row[col["predicted time (s)"]]) for row in table.rows)
    memory = sum(int(row[col["predicted memory (B)"]]) for row in table.rows)
    assert math.isclose(seconds, plan.predicted["step_time_s"], rel_tol=1e-2)  # cells round to 3 digits
    assert abs(memory - plan.predicted["memory_bytes_per_rank"]) <= len(table.rows)


def test_plan_text_table_has_the_html_columns_and_totals_per_axis():
    model, inputs, loss_fn = mlp(n_layers=2)
    prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"),
                                 hints={"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"}})
    plan = prog.plan
    html_tables = plan._repr_html_().split("</table>")
    text_rows, text_totals = plan.table().split("\n\n")
    head = _table(html_tables[0]).head
    assert re.split(" {2,}", text_rows.splitlines()[0]) == head
    assert len(text_rows.splitlines()) == len(plan.rows) + 1
    totals = _table(html_tables[1][html_tables[1].index("<table>"):])
    assert re.split(" {2,}", text_totals.splitlines()[0]) == totals.head
    by_axis = {row[0]: dict(zip(totals.head, row)) for row in totals.rows}
    assert list(by_axis) == ["dp", "tp", "all axes"]
    for axis in ("dp", "tp"):
        comms = [r for r in plan.collectives() if r.axis == axis]
        assert int(by_axis[axis]["collectives"]) == len(comms)
        assert int(by_axis[axis]["fwd bytes"]) == plan.predicted["comm_bytes_per_step"][axis]["fwd"]
        assert int(by_axis[axis]["bwd bytes"]) == plan.predicted["comm_bytes_per_step"][axis]["bwd"]
    assert int(by_axis["dp"]["gradients reduced"]) == len(plan.grad_reduce)
    assert abs(int(by_axis["all axes"]["predicted memory (B)"]) - plan.predicted["memory_bytes_per_rank"]) <= 1
    only = plan.table("layers.1*").split("\n\n")[0].splitlines()[1:]
    assert only and all("layers.1" in line for line in only)


def test_pipelined_plan_table_shows_each_rows_stage():
    model, inputs, loss_fn = mlp(n_layers=2)
    prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("pp", "dp"),
                                 hints={"input:0": {"dp": "S(0)"}}, pipeline={"microbatches": 2})
    head, body = prog.plan.table_cells()
    stages = [line[head.index("stage")] for line in body]
    assert set(stages) == {"0", "1"}
    html = _table(prog.plan._repr_html_())
    assert [row[html.head.index("stage")] for row in html.rows] == stages


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}})
    client.execute()
    return [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]


def test_notebook_runs_without_errors(executed):
    assert not [o for o in executed if o.output_type == "error"]


def test_notebook_shows_the_plan_as_an_html_table(executed):
    html = [o.data["text/html"] for o in executed if "text/html" in o.get("data", {})]
    tables = [_table(h) for h in html if "<table>" in h]
    assert tables, "no HTML plan table in the notebook's outputs"
    table = tables[0]
    _check_columns(table.head, autoshard.Mesh((2, 2), ("dp", "tp")))
    assert any("all_reduce@tp" in row for row in table.rows)  # Megatron's all-reduces are listed
    assert any(row[table.head.index("module path")].startswith("layers.0.attn") for row in table.rows)


def test_notebook_draws_the_graph_as_svg_and_the_timeline_as_a_figure(executed):
    svgs = [o.data["image/svg+xml"] for o in executed if "image/svg+xml" in o.get("data", {})]
    assert any("all_reduce@tp" in s and "layers.1" in s for s in svgs), "no sharded-graph SVG"
    assert any("dp (size 2" in s for s in svgs), "no mesh SVG"
    assert [o for o in executed if "image/png" in o.get("data", {})], "no matplotlib figure"
