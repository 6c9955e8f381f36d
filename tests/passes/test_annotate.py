"""annotate: hints resolved onto graph nodes (globs, tied aliases, module outputs, split counts, constrain)."""
import pytest
import torch
from torch import nn

import autoshard
from autoshard.frontend.trace import trace
from autoshard.ir import meta
from autoshard.ir.errors import HintError
from autoshard.ir.mesh import Mesh
from autoshard.ir.placement import P, R, S
from autoshard.passes.annotate import annotate, module_outputs
from autoshard.passes.manager import CompileState
from autoshard.passes.normalize import normalize
from autoshard.zoo import gpt2, mlp


def annotated(model, inputs, hints, mesh=(2, 2), names=("dp", "tp"), loss_fn=None):
    traced = trace(model, inputs, loss_fn)
    state = CompileState(traced.gm, Mesh(mesh, names), traced, hints)
    normalize(state)
    annotate(state)
    return state


def hints_by_path(state) -> dict:
    """{path: {axis name: placement}} of every placeholder with a hint."""
    names = state.mesh.names
    return {n.meta[meta.PATH]: {names[a]: p for a, p in n.meta[meta.HINT].items()}
            for n in state.gm.graph.nodes if n.op == "placeholder" and meta.HINT in n.meta}


def op_hints(state) -> dict:
    names = state.mesh.names
    return {n.name: {names[a]: p for a, p in n.meta[meta.HINT].items()}
            for n in state.gm.graph.nodes if n.op == "call_function" and meta.HINT in n.meta}


@pytest.fixture(scope="module")
def tiny_gpt2():
    return gpt2(batch=2, seq=8, dim=16, n_heads=2, n_layers=2, vocab_size=32)


def test_star_glob_matches_one_path_component_per_star(tiny_gpt2):
    model, inputs, loss_fn = tiny_gpt2
    state = annotated(model, inputs, {"layers.*.mlp.fc1.weight": {"tp": "S(0)"}}, loss_fn=loss_fn)
    assert hints_by_path(state) == {"layers.0.mlp.fc1.weight": {"tp": S(0)},
                                    "layers.1.mlp.fc1.weight": {"tp": S(0)}}


def test_character_class_glob(tiny_gpt2):
    model, inputs, loss_fn = tiny_gpt2
    state = annotated(model, inputs, {"layers.1.attn.[qk].weight": {"tp": "S(0)"},
                                      "layers.*.attn.[qkv].bias": {"dp": "R"}}, loss_fn=loss_fn)
    found = hints_by_path(state)
    assert found["layers.1.attn.q.weight"] == {"tp": S(0)}
    assert found["layers.1.attn.k.weight"] == {"tp": S(0)}
    assert "layers.1.attn.v.weight" not in found and "layers.0.attn.q.weight" not in found
    assert sorted(p for p in found if p.endswith("bias")) == [
        f"layers.{i}.attn.{x}.bias" for i in range(2) for x in "kqv"]


def test_tied_alias_hint_lands_on_the_shared_placeholder(tiny_gpt2):
    model, inputs, loss_fn = tiny_gpt2
    state = annotated(model, inputs, {"lm_head.weight": {"tp": "S(0)"}}, loss_fn=loss_fn)
    node = next(n for n in state.gm.graph.nodes if n.meta.get(meta.PATH) == "wte.weight")
    assert node.meta[meta.ALIASES] == ["lm_head.weight"]
    assert hints_by_path(state) == {"wte.weight": {"tp": S(0)}}


def test_tied_alias_and_owner_hints_agree_or_contradict(tiny_gpt2):
    model, inputs, loss_fn = tiny_gpt2
    state = annotated(model, inputs, {"wte.weight": {"tp": "S(0)"}, "lm_head.weight": {"tp": "S(0)", "dp": "R"}},
                      loss_fn=loss_fn)
    assert hints_by_path(state) == {"wte.weight": {"tp": S(0), "dp": R}}
    with pytest.raises(HintError, match=r"hints 'wte.weight' and 'lm_head.weight' contradict on wte.weight"):
        annotated(model, inputs, {"wte.weight": {"tp": "S(1)"}, "lm_head.weight": {"tp": "S(0)"}}, loss_fn=loss_fn)


def test_module_output_hint_marks_values_leaving_the_module():
    model, inputs, loss_fn = mlp(batch=4, in_dim=8, hidden=16, out_dim=8)
    state = annotated(model, inputs, {"layers.1:output": {"tp": "S(1)", "dp": "S(0)"}}, loss_fn=loss_fn)
    hinted = op_hints(state)
    assert len(hinted) == 1
    (name, placements), = hinted.items()
    node = next(n for n in state.gm.graph.nodes if n.name == name)
    # The bias add that normalize split off the linear is the module's output, not the bias-less matmul.
    assert node.target is torch.ops.aten.add.Tensor and node.meta[meta.PATH] == "layers.1"
    assert placements == {"tp": S(1), "dp": S(0)}


def test_module_output_glob_and_partial_allowed_on_outputs():
    model, inputs, loss_fn = mlp(batch=4, in_dim=8, hidden=16, out_dim=8)
    state = annotated(model, inputs, {"layers.*:output": {"tp": "P"}}, loss_fn=loss_fn)
    assert sorted(state.gm.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor),
                  key=lambda n: n.name) == sorted((n for n in state.gm.graph.nodes if meta.HINT in n.meta),
                                                  key=lambda n: n.name)
    assert all(p == {"tp": P} for p in op_hints(state).values())


def test_module_outputs_of_a_parent_module(tiny_gpt2):
    model, inputs, loss_fn = tiny_gpt2
    traced = trace(model, inputs, loss_fn)
    ops = [n for n in traced.gm.graph.nodes if n.op == "call_function"]
    outs = module_outputs(ops, "layers.0.mlp")
    assert len(outs) == 1 and outs[0].meta[meta.PATH].startswith("layers.0.mlp")


def test_input_hint_and_nested_axes():
    model, inputs, loss_fn = mlp(batch=8, in_dim=8, hidden=16, out_dim=8)
    state = annotated(model, inputs, {"input:0": {"dp": "S(0)", "tp": "S(0)"}}, loss_fn=loss_fn)
    assert hints_by_path(state) == {"input:0": {"dp": S(0), "tp": S(0)}}


def test_negative_dim_is_normalised():
    model, inputs, loss_fn = mlp(batch=4, in_dim=8, hidden=16, out_dim=8)
    state = annotated(model, inputs, {"layers.0.weight": {"tp": "S(-1)"}}, loss_fn=loss_fn)
    assert hints_by_path(state) == {"layers.0.weight": {"tp": S(1)}}


def split_node(state):
    (node,) = [n for n in state.gm.graph.nodes if meta.INPUT_HINT in n.meta]
    return node


def test_split_counts_become_input_hints():
    model, inputs, loss_fn = mlp(batch=4, in_dim=8, hidden=16, out_dim=8)
    state = annotated(model, inputs, {"layers.0:shard": {"in_strategy": [[2, 1], [1, 1]]}}, loss_fn=loss_fn)
    node = split_node(state)
    assert node.target is torch.ops.aten.linear.default and node.meta[meta.PATH] == "layers.0"
    assert node.meta[meta.INPUT_HINT] == {0: {0: S(0)}}  # {axis: {input position: placement}}
    assert hints_by_path(state) == {}


@pytest.mark.parametrize("counts, wanted, weight", [
    # batch and output features split: they cannot share an axis, so the weight takes the other one
    ([[2, 1], [2, 1]], {0: {0: S(0)}, 1: {1: S(0)}}, {"tp": S(0)}),
    # the contracted dim gets the same axis on both operands
    ([[1, 2], [1, 2]], {0: {0: S(1), 1: S(1)}}, {"dp": S(1)}),
    ([[2, 2], [1, 2]], {0: {0: S(0)}, 1: {0: S(1), 1: S(1)}}, {"tp": S(1)}),
    ([[4, 1], [1, 1]], {0: {0: S(0)}, 1: {0: S(0)}}, {}),  # a count of 4 takes both axes
])
def test_split_counts_map_onto_axes_the_op_supports(counts, wanted, weight):
    model, inputs, loss_fn = mlp(batch=4, in_dim=8, hidden=16, out_dim=8)
    state = annotated(model, inputs, {"layers.0:shard": {"in_strategy": counts}}, loss_fn=loss_fn)
    assert split_node(state).meta[meta.INPUT_HINT] == wanted
    assert hints_by_path(state) == ({"layers.0.weight": weight} if weight else {})


def test_split_counts_no_op_supports_are_rejected():
    model, inputs, loss_fn = mlp(batch=4, in_dim=8, hidden=16, out_dim=8)
    with pytest.raises(HintError, match=r"'layers.0:shard'.*no mapping.*aten.linear.default.*contracted dim"):
        annotated(model, inputs, {"layers.0:shard": {"in_strategy": [[1, 2], [1, 1]]}}, loss_fn=loss_fn)


class Constrained(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        return self.b(autoshard.constrain(torch.relu(self.a(x)), {"dp": "S(0)", "tp": "S(1)"}))


def test_constrain_call_becomes_a_hint_on_its_node():
    state = annotated(Constrained(), (torch.randn(4, 8),), None)
    (node,) = state.gm.graph.find_nodes(op="call_function", target=torch.ops.autoshard.constrain.default)
    assert node.args[1] == "dp=S(0);tp=S(1)"
    assert op_hints(state) == {node.name: {"dp": S(0), "tp": S(1)}}


def test_constrain_contradicting_a_module_output_hint_names_both():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            return autoshard.constrain(autoshard.constrain(self.a(x), {"tp": "S(0)"}), {"tp": "R"})

    state = annotated(Twice(), (torch.randn(4, 8),), None)
    assert sorted(op_hints(state).values(), key=repr) == [{"tp": R}, {"tp": S(0)}]


def test_no_hints_leaves_graph_unannotated():
    model, inputs, loss_fn = mlp(batch=4, in_dim=8, hidden=16, out_dim=8)
    state = annotated(model, inputs, None, loss_fn=loss_fn)
    assert not any(meta.HINT in n.meta for n in state.gm.graph.nodes)
    assert not state.hints
