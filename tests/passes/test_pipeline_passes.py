"""Tier 1: solve, insert_comm and codegen on tiny graphs (no processes, milliseconds each)."""
import warnings

import pytest
import torch
from torch import nn

import autoshard
import autoshard.verify.verify
from autoshard.ir import meta
from autoshard.zoo import FACTORIES
from autoshard.zoo.hints import plan_hints


class TwoLinear(nn.Module):
    """x -> (q, k, v from one input) -> sum -> row-parallel out: the Megatron attention pattern in small."""

    def __init__(self, d=8):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x):
        h = self.norm(x)  # a value with a gradient, replicated on tp
        return self.out(self.q(h) * self.k(h) + self.v(h)) + x


MEGATRON = {"[qkv].weight": {"tp": "S(0)"}, "out.weight": {"tp": "S(1)"}}


def _plan(model, x, mesh=(2,), names=("tp",), hints=MEGATRON, **kw):
    return autoshard.parallelize(model, mesh, (x,), hints=hints, axis_names=names, debug=True, **kw)


def _comm_ops(prog):
    return [(r.collective, r.axis) for r in prog.plan.collectives()]


def test_megatron_pattern_is_one_grad_all_reduce_and_one_reduction():
    prog = _plan(TwoLinear(), torch.randn(4, 8))
    ops = _comm_ops(prog)
    # q, k, v share one identity-forward/all-reduce-backward node ...
    assert ops[0] == ("grad_all_reduce", "tp") and ops.count(("grad_all_reduce", "tp")) == 1
    # ... and the row-parallel partial sum is reduced once (all-reduce, or reduce-scatter when the rest of
    # the step can run on shards: here the residual input has no gradient, so chunking it is free).
    assert ops.count(("all_reduce", "tp")) + ops.count(("reduce_scatter", "tp")) == 1
    assert prog.plan.grad_reduce == {}


def test_hinted_parameters_keep_their_placement_and_ops_follow():
    prog = _plan(TwoLinear(), torch.randn(4, 8))
    specs = {r.path: r.spec for r in prog.plan.rows if r.kind == "param"}
    assert specs == {"q.weight": "[S(0)]", "k.weight": "[S(0)]", "v.weight": "[S(0)]", "out.weight": "[S(1)]",
                     "norm.weight": "[R]", "norm.bias": "[R]"}
    linear_out = next(r for r in prog.plan.rows if r.path == "q" and r.op == "linear.default")
    assert linear_out.spec == "[S(1)]"  # column parallel: the output's feature dim is sharded


def test_data_parallel_defers_gradient_reduction_to_grad_sync():
    prog = _plan(TwoLinear(), torch.randn(4, 8), names=("dp",), hints={"input:0": {"dp": "S(0)"}})
    assert _comm_ops(prog) == []  # the loss stays a partial sum; its backward needs nothing
    assert prog.plan.grad_reduce == {f"{n}": ("dp",) for n in
                                     ("norm.weight", "norm.bias", "q.weight", "k.weight", "v.weight", "out.weight")}


def test_mixed_use_parameter_gets_in_graph_reduction_not_deferred():
    """A parameter used once by a split op and once replicated cannot be reduced after backward."""
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x, y):
            return (x @ self.w).sum() + self.w.pow(2).sum()

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    model = Mixed().double()
    hints = {"input:0": {"dp": "S(0)"}}
    report, prog = autoshard.verify.verify.verify_simulated(model, (x, y), mesh=(2,), axis_names=("dp",), hints=hints)
    assert report.ok, report
    assert "w" not in prog.plan.grad_reduce
    assert ("grad_all_reduce", "dp") in _comm_ops(prog)


def test_solver_respects_every_hint_and_spec_invariants_hold():
    model, inputs, loss_fn = FACTORIES["llama"]()
    names = ("dp", "tp")
    hints = plan_hints("llama", names, ("dp",), "tp")
    prog = autoshard.parallelize(model, (2, 2), inputs, hints=hints, loss_fn=loss_fn, axis_names=names, debug=True)
    for node in prog.state.gm.graph.nodes:
        for axis, placement in node.meta.get(meta.HINT, {}).items():
            assert node.meta[meta.SPEC][axis] == placement, node.name


def test_codegen_rank_module_has_local_shards_and_local_view_shapes():
    model, inputs, loss_fn = FACTORIES["gpt2"]()
    prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("tp",),
                                 hints=plan_hints("gpt2", ("tp",), (), "tp"))
    gm = prog.graph(1)
    assert gm.layers_0_attn_q_weight.shape == (16, 32)  # column shard of [32, 32]
    assert torch.equal(gm.layers_0_attn_q_weight, model.layers[0].attn.q.weight[16:])
    assert gm.layers_0_attn_proj_weight.shape == (32, 16)  # row shard
    views = [n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default]
    assert any(list(n.args[1]) == [8, 16, 2, 8] for n in views)  # 4 heads -> 2 local heads
    text = gm.print_readable(print_output=False)
    assert "autoshard_runtime_collectives_all_reduce(" in text and "'tp'" in text


def test_history_records_each_pass_with_sharded_types():
    prog = _plan(TwoLinear(), torch.randn(4, 8))
    assert [e.name for e in prog.history] == ["normalize", "annotate", "strategies", "solve", "zero", "unfold",
                                              "insert_comm", "fuse_comm", "predict", "recompute", "check_hints",
                                              "codegen"]
    assert "f32[8@tp, 8]" in prog.history[-1].graph_text
    assert "# after insert_comm" in repr(prog.history)


def test_zoo_graphs_have_a_rule_for_every_op():
    for name, factory in FACTORIES.items():
        model, inputs, loss_fn = factory()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
                                  hints={"input:0": {"dp": "S(0)"}})
        missing = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
        assert not missing, (name, missing)


def test_unknown_op_is_replicated_with_a_warning_naming_it():
    class Odd(nn.Module):
        def forward(self, x):
            return torch.special.i0(x)

    with pytest.warns(UserWarning, match=r"no sharding rule for aten\.special_i0"):
        prog = autoshard.parallelize(Odd(), (2,), (torch.randn(4, 4),), axis_names=("dp",),
                                     hints={"input:0": {"dp": "S(0)"}})
    node = next(r for r in prog.plan.rows if "i0" in r.op)
    assert node.spec == "[R]"


def test_plan_json_is_deterministic_and_fingerprinted():
    a = _plan(TwoLinear(), torch.randn(4, 8))
    b = _plan(TwoLinear(), torch.randn(4, 8))
    assert a.plan.dumps() == b.plan.dumps()
    assert a.plan.fingerprint == b.plan.fingerprint and len(a.plan.fingerprint) == 16


def test_simulate_equals_the_model():
    torch.manual_seed(0)
    model = TwoLinear().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    prog = _plan(model, x, mesh=(2, 2), names=("dp", "tp"), hints={**MEGATRON, "input:0": {"dp": "S(0)"}})
    loss, out = prog.simulate(x)
    expected = model(x)
    assert torch.allclose(out, expected, rtol=1e-12, atol=1e-12)
    assert torch.allclose(loss, expected.mean(), rtol=1e-12)


def test_a_full_batch_that_does_not_split_into_the_micro_batches_is_named():
    model, _, loss_fn = FACTORIES["mlp"]()
    prog = autoshard.parallelize(model, (2,), (torch.randn(8, 32),), loss_fn=loss_fn, axis_names=("pp",),
                                 pipeline={"microbatches": 2})
    with pytest.raises(autoshard.UserInputError, match=r"the batch \(\[5\]\) must split into 2 micro-batches"):
        prog.check_inputs((torch.randn(5, 32),))
    prog.check_inputs((torch.randn(8, 32),))  # the full batch the program was planned for
