"""fuse_comm and the `:input` hint: Megatron-SP's all-gather / reduce-scatter pairs, forward and backward."""
import pytest
import torch

import autoshard
from autoshard.ir import meta
from autoshard.ir.errors import HintError
from autoshard.ir.placement import R
from autoshard.verify.verify import verify_simulated
from autoshard.zoo import gpt2, llama
from autoshard.zoo.hints import data_parallel, megatron_sp


def _comm_ops(prog, axis):
    return [n.meta[meta.COMM]["op"] for n in prog.state.gm.graph.nodes
            if n.meta.get(meta.KIND) == "comm" and n.meta[meta.COMM]["axis"] == axis]


@pytest.mark.parametrize("name,factory", [("gpt2", gpt2), ("llama", llama)])
def test_sequence_parallel_replaces_all_reduces_by_gather_and_scatter(name, factory):
    model, inputs, loss_fn = factory()
    prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("tp",),
                                 hints=megatron_sp(name, "tp"))
    ops = _comm_ops(prog, "tp")
    layers = model.cfg.n_layers
    # Per layer: a gather before attention's and the MLP's column matmuls, a scatter after their row matmuls.
    assert ops.count("all_gather_sum_grad") == 2 * layers
    assert ops.count("reduce_scatter") == 2 * layers
    assert "all_reduce" not in ops and "grad_all_reduce" not in ops and "all_gather" not in ops


@pytest.mark.parametrize("name,factory", [("gpt2", gpt2), ("llama", llama)])
def test_sequence_parallel_backward_is_the_dual(name, factory):
    model, inputs, loss_fn = factory()
    hints = {**megatron_sp(name, "tp"), **data_parallel(name, ("dp",))}
    report, _ = verify_simulated(model, inputs, loss_fn, mesh=(2, 2), axis_names=("dp", "tp"), hints=hints)
    assert report.ok, report
    tp = report.collectives["tp"]
    layers = model.cfg.n_layers
    # forward all-gather <-> backward reduce-scatter and forward reduce-scatter <-> backward all-gather
    assert tp["all_gather"]["fwd"] == tp["reduce_scatter"]["fwd"] == 2 * layers
    assert tp["reduce_scatter"]["bwd"] == 2 * layers
    assert tp["all_gather"]["bwd"] >= 2 * layers
    assert "all_reduce" not in tp or tp["all_reduce"]["fwd"] == tp["all_reduce"]["bwd"] == 0  # only grad sync


def test_module_input_hint_constrains_what_ops_inside_consume():
    model, inputs, loss_fn = gpt2()
    prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("tp",),
                                 hints={"layers.*.mlp.fc1:input": {"tp": "R"}, "layers.*.ln2:output": {"tp": "S(1)"}})
    fc1 = [n for n in prog.state.gm.graph.nodes if n.meta.get(meta.PATH) == "layers.0.mlp.fc1"
           and n.target is torch.ops.aten.linear.default]
    assert fc1 and fc1[0].meta[meta.INPUT_HINT] == {0: {0: R}}  # the activation, not the weight
    assert fc1[0].meta[meta.IN_SPECS][0] == (R,)


def test_module_input_hint_on_unknown_module_names_it():
    model, inputs, loss_fn = gpt2()
    with pytest.raises(HintError, match=r"'layers\.\*\.mlp\.fc9:input' matches no module"):
        autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("tp",),
                              hints={"layers.*.mlp.fc9:input": {"tp": "R"}})
