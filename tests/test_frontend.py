"""The front end and the features that ride on it: meta-device models, fx.GraphModules, grad regions,
export failures, MindSpore split counts and `autoshard.constrain`."""
import pytest
import torch
from torch import nn

import autoshard
from autoshard.frontend.trace import trace
from autoshard.ir import meta
from autoshard.ir.placement import P, R, S, Spec
from autoshard.verify.verify import verify_simulated
from autoshard.zoo import gpt2, mlp
from autoshard.zoo.hints import plan_hints

DP_TP = {"mesh": (2, 2), "axis_names": ("dp", "tp")}


def small_mlp(**kwargs):
    return mlp(**{"batch": 8, "in_dim": 8, "hidden": 16, "out_dim": 8, **kwargs})


def spec_of(prog, name):
    return next(n for n in prog.state.gm.graph.nodes if n.name == name).meta[meta.SPEC]


# --- what the front end finds -----------------------------------------------------------------------


def test_trace_identifies_params_inputs_and_tied_aliases():
    model, inputs, loss_fn = gpt2(batch=2, seq=4, dim=8, n_heads=2, n_layers=1, vocab_size=16)
    traced = trace(model, inputs, loss_fn)
    kinds = {n.meta[meta.PATH]: n.meta[meta.KIND] for n in traced.gm.graph.nodes if n.op == "placeholder"}
    assert kinds["wte.weight"] == "param" and kinds["input:0"] == "input"
    assert "lm_head.weight" not in kinds  # one placeholder for the tied weight
    assert traced.aliases == {"wte.weight": ["lm_head.weight"]}
    assert set(traced.params) == {k for k, _ in model.named_parameters()}
    assert traced.input_names == ["inputs_0"]
    paths = {n.meta[meta.PATH] for n in traced.gm.graph.nodes if n.op == "call_function"}
    assert {"layers.0.attn.q", "layers.0.mlp.fc1", "wte"} <= paths


def test_example_inputs_may_be_a_single_tensor():
    model, (x,), loss_fn = small_mlp()
    assert trace(model, x, loss_fn).input_names == ["inputs_0"]


# --- meta device ---------------------------------------------------------------------------------------


def test_meta_model_plans_without_allocating_weights():
    model, inputs, loss_fn = gpt2(device="meta")
    assert all(p.is_meta for p in model.parameters())
    prog = autoshard.parallelize(model, example_inputs=inputs, loss_fn=loss_fn,
                                 hints=plan_hints("gpt2", ("dp", "tp"), batch_axes=("dp",), tp_axis="tp"), **DP_TP)
    text = str(prog.plan)
    assert "Plan on Mesh(dp=2, tp=2)" in text and "layers.0.mlp.fc1.weight" in text
    assert prog.param_spec("layers.0.mlp.fc1.weight") == Spec((R, S(0)))
    gm = prog.graph(0)
    params = dict(gm.named_parameters())
    assert params and all(p.is_meta for p in params.values())
    assert params["layers_0_mlp_fc1_weight"].shape == (64, 32)  # its tp shard of [128, 32]
    assert params["wte_weight"].shape == (64, 32)


def test_meta_model_auto_plan_and_rank_graph():
    model, inputs, loss_fn = small_mlp(device="meta")
    prog = autoshard.parallelize(model, mesh=(2,), example_inputs=inputs, loss_fn=loss_fn, pipeline=False)
    assert isinstance(prog.graph(1), torch.fx.GraphModule)
    assert all(p.is_meta for p in prog.graph(1).parameters())


# --- fx.GraphModule ------------------------------------------------------------------------------------


def test_symbolic_traced_graph_module_is_accepted_and_verifies():
    model, inputs, loss_fn = small_mlp()
    gm = torch.fx.symbolic_trace(model)
    hints = {"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"}, "layers.0.bias": {"tp": "S(0)"},
             "layers.1.weight": {"tp": "S(1)"}}
    report, prog = verify_simulated(gm, inputs, loss_fn, hints=hints, **DP_TP)
    assert report.ok, report
    assert prog.param_spec("layers.1.weight") == Spec((R, S(1)))
    assert sum(c["fwd"] for c in report.collectives["tp"].values()) >= 1  # row-parallel layers.1 sums partials


def test_graph_module_keeps_module_paths_for_output_hints():
    model, inputs, loss_fn = small_mlp()
    gm = torch.fx.symbolic_trace(model)
    prog = autoshard.parallelize(gm, example_inputs=inputs, loss_fn=loss_fn, mesh=(2,), axis_names=("dp",),
                                 hints={"layers.1:output": {"dp": "S(0)"}})
    hinted = [n for n in prog.state.gm.graph.nodes if meta.HINT in n.meta]
    assert [n.meta[meta.PATH] for n in hinted] == ["layers.1"]


# --- grad-mode regions -----------------------------------------------------------------------------------


class NoGradInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            scale = h.abs().amax(dim=-1, keepdim=True) + 1
        return self.b(torch.relu(h) / scale)


def test_no_grad_region_is_exported_as_a_higher_order_op():
    traced = trace(NoGradInside(), (torch.randn(4, 8),))
    targets = [str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert any("wrap_with_set_grad_enabled" in t for t in targets)


def test_no_grad_in_forward_verifies_with_correct_gradients():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    report, _prog = verify_simulated(NoGradInside(), (x,), hints={"input:0": {"dp": "S(0)"}}, **DP_TP)
    assert report.ok, report
    assert report.max_diff["grads"] <= 1e-6
    # Gradient through the region would differ: check the reference really stops it.
    model = NoGradInside().double()
    h = model.a(x.double())
    with_region = torch.autograd.grad(model(x.double()).mean(), model.a.weight)[0]
    without = torch.autograd.grad(model.b(torch.relu(h) / (h.abs().amax(-1, keepdim=True) + 1)).mean(),
                                  model.a.weight)[0]
    assert not torch.allclose(with_region, without)


# --- export failures ----------------------------------------------------------------------------------


class ItemBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.max().item() > 0.5:
            return self.fc(x)
        return x


def test_unexportable_model_raises_export_error_naming_the_construct():
    with pytest.raises(autoshard.ExportError) as info:
        autoshard.parallelize(ItemBranch(), mesh=(2,), example_inputs=(torch.randn(2, 4),))
    text = str(info.value)
    assert "data-dependent" in text
    assert "in forward: if x.max().item() > 0.5:" in text
    assert "use torch.where / torch.cond" in text and ".item()" in text


# --- MindSpore split counts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh, names", [((2,), ("dp",)), ((2, 2), ("dp", "tp"))])
def test_split_counts_on_first_linear_shard_the_batch(mesh, names):
    model, inputs, loss_fn = small_mlp()
    report, prog = verify_simulated(model, inputs, loss_fn, mesh=mesh, axis_names=names,
                                    hints={"layers.0:shard": {"in_strategy": [[2, 1], [1, 1]]}})
    assert report.ok, report
    linear = next(n for n in prog.state.gm.graph.nodes if n.meta.get(meta.PATH) == "layers.0"
                  and n.target is torch.ops.aten.linear.default)
    x_spec, w_spec = linear.meta[meta.IN_SPECS]
    assert x_spec[0] == S(0) and all(p == R for p in w_spec)


def test_split_counts_two_dimensional():
    model, inputs, loss_fn = small_mlp()
    report, prog = verify_simulated(model, inputs, loss_fn, hints={"layers.0:shard": {"in_strategy": [[2, 2], [1, 2]]}},
                                    **DP_TP)
    assert report.ok, report
    linear = next(n for n in prog.state.gm.graph.nodes if n.meta.get(meta.PATH) == "layers.0"
                  and n.target is torch.ops.aten.linear.default)
    assert linear.meta[meta.IN_SPECS] == [Spec((S(0), S(1))), Spec((R, S(1)))]
    assert linear.meta[meta.SPEC] == Spec((S(0), P))


# --- autoshard.constrain ---------------------------------------------------------------------------------------


class Constrained(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)
        self.spec = spec

    def forward(self, x):
        return self.b(autoshard.constrain(torch.relu(self.a(x)), self.spec))


def test_constrain_eager_is_a_copy_with_identity_gradient():
    x = torch.randn(3, 4, requires_grad=True)
    y = autoshard.constrain(x, {"dp": "S(0)"})
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    (y * torch.arange(4.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(4.0).expand(3, 4))


def test_constrain_op_passes_opcheck():
    torch.library.opcheck(torch.ops.autoshard.constrain.default, (torch.randn(3, 4, requires_grad=True), "dp=R"))


def test_constrain_survives_export():
    ep = torch.export.export(Constrained({"tp": "S(1)"}), (torch.randn(4, 8),))
    (node,) = [n for n in ep.graph.nodes if n.target is torch.ops.autoshard.constrain.default]
    assert node.args[1] == "tp=S(1)"


@pytest.mark.parametrize("spec, expected", [
    ({"dp": "S(0)", "tp": "S(1)"}, Spec((S(0), S(1)))),
    ({"tp": "S(1)"}, None),
    ({"dp": "R", "tp": "R"}, Spec((R, R))),
])
def test_constrained_activation_gets_that_placement_and_verifies(spec, expected):
    torch.manual_seed(0)
    model = Constrained(spec)
    report, prog = verify_simulated(model, (torch.randn(4, 8),), hints={"input:0": {"dp": "S(0)"}}, debug=True,
                                    **DP_TP)
    assert report.ok, report
    (node,) = prog.state.gm.graph.find_nodes(op="call_function", target=torch.ops.autoshard.constrain.default)
    got = node.meta[meta.SPEC]
    names = prog.mesh.names
    for axis, text in spec.items():
        assert repr(got[names.index(axis)]) == text
    if expected is not None:
        assert got == expected
    assert "constrain" in str(prog.plan)
    # codegen drops the call: rank modules hold no constrain op.
    assert not any(n.target is torch.ops.autoshard.constrain.default for n in prog.graph(0).graph.nodes)


def test_constrain_partial_activation():
    class PartialHidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 16, bias=False)
            self.b = nn.Linear(16, 8)

        def forward(self, x):
            return self.b(torch.relu(autoshard.constrain(self.a(x), {"tp": "P"})))

    hints = {"a.weight": {"tp": "S(1)"}, "input:0": {"tp": "S(1)"}}
    report, prog = verify_simulated(PartialHidden(), (torch.randn(4, 8),), hints=hints, mesh=(2,),
                                    axis_names=("tp",))
    assert report.ok, report
    (node,) = prog.state.gm.graph.find_nodes(op="call_function", target=torch.ops.autoshard.constrain.default)
    assert node.meta[meta.SPEC] == Spec((P,))


def test_pipeline_search_exports_each_shape_once(monkeypatch):
    """Unnamed (2,2) mesh, 2 devices per node: the search plans no pipeline and a pipeline over each axis
    (inter- and intra-node differ). Both pipelines trace the same micro-batch shapes: one export each."""
    from autoshard.cost.profiles import HardwareProfile
    exports = []
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(a[1][0].shape) or export(*a, **k))
    model, inputs, loss_fn = mlp(n_layers=4)
    prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, profile=HardwareProfile(devices_per_node=2))
    pipelined = [c for c in prog.plan.search["candidates"] if c["axis"] is not None and "microbatches" in c]
    assert len(pipelined) == 2 and pipelined[0]["microbatches"] == pipelined[1]["microbatches"]
    # Up to 5 compiles (no pipeline; per axis the first micro-batch count and, when its estimate can still
    # win, a re-plan at the best count) but each shape is traced once.
    assert len(exports) == len(set(exports)) >= 2


def test_a_custom_autograd_function_is_named_because_export_drops_its_backward():
    """torch.export inlines an autograd.Function's forward and drops its backward (transformers' YOSO: its
    approximate backward made verify differ by 0.48 in the gradients): the trace says so, naming the Function."""
    import warnings

    from autoshard.frontend.trace import trace

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, grad):
            return grad * 2.0

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return Twice.apply(x * self.w).sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace(Model(), (torch.ones(3),), lambda out, x: out)
    assert any("torch.autograd.Function" in str(w.message) and "Twice" in str(w.message) for w in caught)
    assert "apply" in torch.autograd.Function.__dict__  # the hook is gone after the trace


class _NormThenNorm(torch.nn.Module):
    """A BatchNorm straight into another (MobileViT's reduce_1x1 before its transformer): the first one's bias has
    a gradient of exactly zero, which float64 computes as the round-off of large terms."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)
        self.first, self.second = torch.nn.BatchNorm1d(16), torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.second(self.first(self.proj(x))))).square().mean() * 100.0


def test_a_gradient_zero_in_exact_arithmetic_is_compared_at_the_models_gradient_scale():
    """verify compares such a gradient, and the parameter it moves, at a millionth of the model's largest gradient
    (autoshard/verify/report.py: ZERO_GRAD_SHARE), not relative to its own round-off."""
    torch.manual_seed(0)
    model, x = _NormThenNorm(), torch.randn(16, 8)
    report, _ = verify_simulated(model, (x,), mesh=(2,), axis_names=("dp",), hints={"input:0": {"dp": "S(0)"}})
    assert report.ok, report
    model.double()
    model(x.double()).backward()
    bias, scale = model.first.bias.grad.abs().max(), model.head.weight.grad.abs().max()
    assert 1e-16 < bias < 1e-9 * scale  # round-off, not a signal (two steps of it moved the bias by 1e-5 of 1e-9)
