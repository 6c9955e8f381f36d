"""Pictures: graph SVG (built-in layout and graphviz source), text fallback, mesh, timeline figure."""
import itertools
import math
import shutil
import xml.etree.ElementTree as ET

import matplotlib
import pytest

import autoshard
from autoshard.ir import meta
from autoshard.ir.errors import PlanError, UserInputError
from autoshard.ir.mesh import Mesh
from autoshard.plan.plan import Plan
from autoshard.report import viz
from autoshard.zoo import mlp

matplotlib.use("Agg")
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def prog():
    model, inputs, loss_fn = mlp(n_layers=2)
    return autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"),
                                 hints={"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"}})


def _collective(prog) -> str:
    """The plan's one collective (which one the cost model picks for the row-parallel output may change)."""
    [name] = [n.name for n in prog.state.gm.graph.nodes if meta.COMM in n.meta]
    return name


def _titles(svg):
    return [t.text for t in ET.fromstring(svg).iter(f"{SVG}title")]


def test_builtin_svg_has_a_box_per_node_coloured_by_placement(prog):
    picture = viz.draw_graph(prog.plan, engine="builtin")
    titles = _titles(picture.svg)  # parses: the SVG is well-formed XML
    drawn = {n.name for n in prog.state.gm.graph.nodes if "autoshard.spec" in n.meta}
    comm = _collective(prog)  # the row-parallel linear's output, reduced on tp (its name is its collective's)
    assert {t.split(":")[0].split(" | ")[0] for t in titles} >= drawn - {comm}
    assert any(t.startswith(f"{comm}@tp") for t in titles)
    assert f'stroke="{viz.COLLECTIVE}"' in picture.svg  # the collective is outlined in red
    assert "[R, S(0)]" in picture.svg and "replicated" in picture.svg  # legend entries
    assert picture._repr_svg_() == picture.svg
    text = repr(picture)
    assert text.startswith("graph on Mesh(dp=2, tp=2)") and f"<{comm}@tp>" in text and "[layers]" in text


def test_collapsing_a_module_draws_it_as_one_box(prog):
    full = viz.draw_graph(prog.plan, engine="builtin")
    folded = viz.draw_graph(prog.plan, collapse=["layers.1"], engine="builtin")
    assert len(_titles(folded.svg)) == len(_titles(full.svg)) - 5 + 1  # linear, its collective, add, weight, bias
    assert "module layers.1  5 nodes  <- gelu" in repr(folded)
    assert "linear_default_1" not in repr(folded) and "p_model_layers_1_weight" not in repr(folded)
    assert "<- module layers.1" in repr(folded)  # its users now point at the box


def test_stages_colour_the_graph_when_present():
    model, inputs, loss_fn = mlp(n_layers=2)
    prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",))
    for node in prog.state.gm.graph.nodes:  # what the pipeline's cut_stages pass writes
        node.meta[meta.STAGE] = 1 if node.meta.get("autoshard.path", "").startswith("layers.1") else 0
    boxes, legend = viz.graph_boxes(prog.state)
    assert set(legend) == {"stage 0", "stage 1", "no stage"}
    assert {b.fill for b in boxes if "stage 1" in b.lines} == {legend["stage 1"]}
    assert "stage 1" in repr(viz.draw_graph(prog.plan, engine="builtin"))
    _, by_placement = viz.graph_boxes(prog.state, color_by="placement")
    assert "replicated" in by_placement
    with pytest.raises(UserInputError, match="color_by"):
        viz.graph_boxes(prog.state, color_by="rainbow")


def test_graphviz_source_has_one_cluster_per_top_level_module(prog):
    boxes, legend = viz.graph_boxes(prog.state)
    source = viz.graphviz_graph(boxes, legend).source
    assert "subgraph cluster_layers" in source and "subgraph cluster_legend" in source
    assert f"linear_default_1 -> {_collective(prog)}" in source
    assert source.count("->") == sum(len(b.inputs) for b in boxes)


def test_missing_dot_binary_warns_and_falls_back(prog, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.warns(UserWarning, match=r"`dot` binary is not installed.*apt-get install graphviz"):
        picture = prog.plan.draw()
    assert picture.svg.startswith("<svg")
    with pytest.raises(UserInputError, match="engine='builtin'"):
        viz.draw_graph(prog.plan, engine="graphviz")


def test_dot_binary_present_renders_with_graphviz(prog, monkeypatch):
    import graphviz
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/dot")
    monkeypatch.setattr(graphviz.Digraph, "pipe", lambda self, format, encoding: f"<svg>{len(self.source)}</svg>")
    assert prog.plan.to_svg() == f"<svg>{len(viz.graphviz_graph(*viz.graph_boxes(prog.state)).source)}</svg>"


def test_loaded_plan_cannot_be_drawn(prog, tmp_path):
    prog.plan.save(tmp_path / "p.json")
    with pytest.raises(PlanError, match="compiled program"):
        Plan.load(tmp_path / "p.json").draw()


def test_mesh_picture_names_axes_roles_and_ranks():
    picture = viz.draw_mesh(Mesh((2, 2, 2), ("pp", "dp", "tp")), {"tp": "tensor parallel"})
    text = repr(picture)
    assert "tp (size 2, along a row): tensor parallel" in text and "pp (size 2, across panels)" in text
    assert "pp=1:\n  [4 5]\n  [6 7]" in text
    root = ET.fromstring(picture.svg)
    assert len(root.findall(f"{SVG}rect")) == 8


def test_plan_mesh_picture_uses_axis_roles(prog):
    text = repr(prog.plan.draw_mesh())
    for role in prog.plan.axis_roles().values():
        assert role in text


def test_timeline_draws_one_bar_per_event_and_one_row_per_label():
    events = [("stage 0", 0.0, 1.0, "F", 0), ("stage 1", 1.0, 2.0, "F", 0), ("stage 1", 2.0, 4.0, "B", 0),
              ("stage 0", 1.0, 4.0, "idle", None), ("stage 0", 4.0, 6.0, "B", 0), ("stage 0", 6.0, 7.0, "W", 0)]
    fig = viz.plot_timeline(events, title="1F1B")
    ax = fig.axes[0]
    assert len(ax.patches) == len(events)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1"]
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"forward", "backward", "weight grad", "idle"}
    bar = ax.patches[2]
    assert (bar.get_x(), bar.get_width()) == (2.0, 2.0)
    with pytest.raises(UserInputError, match="event 0 has kind 'X'"):
        viz.plot_timeline([("r", 0, 1, "X", 0)])
    with pytest.raises(UserInputError, match="ends"):
        viz.plot_timeline([("r", 2, 1, "F", 0)])


def test_planned_events_add_up_to_the_predicted_step(prog):
    events = viz.planned_events(prog.plan)
    total = sum(end - start for _, start, end, _, _ in events)
    assert math.isclose(total, prog.plan.predicted["step_time_s"], rel_tol=1e-9)
    assert all(a[2] == pytest.approx(b[1]) for a, b in itertools.pairwise(events))  # back to back
    kinds = [e[3] for e in events if e[3] != "idle"]
    assert kinds == sorted(kinds, key=lambda k: k != "F")  # every forward before every backward
