"""ColossalAI tensor-parallel configs as hints, their communication per layer against the papers'
formulas (cost model, no processes), and sequence parallelism found by the solver."""
import pytest
import torch

import autoshard
from autoshard.frontend.tp_modes import (
    colossal_hints,
    layer_comm_formula,
    llama_layer_linears,
)
from autoshard.ir import meta
from autoshard.ir.errors import UserInputError
from autoshard.zoo import gpt2, llama
from autoshard.zoo.hints import megatron


def test_config_shortcut_gives_mesh_and_hints():
    three = colossal_hints("llama", dict(tensor=dict(size=8, mode="3d")))
    assert (three.mesh_shape, three.axis_names) == ((2, 2, 2), ("x", "y", "z"))
    assert three.hints["layers.*.attn.[qkv].weight"] == {"x": "S(0)", "y": "S(0)", "z": "S(1)"}
    assert three.hints["layers.*.attn.wo:input"] == {"x": "S(2)", "y": "S(0)", "z": "R"}
    tess = colossal_hints("gpt2", dict(data=2, tensor=dict(size=8, mode="2.5d", depth=2)))
    assert (tess.mesh_shape, tess.axis_names) == ((2, 2, 2, 2), ("dp", "dep", "row", "col"))
    assert tess.hints["input:0"] == {"dp": "S(0)", "dep": "S(0)", "row": "S(0)"}
    one = colossal_hints("gpt2", dict(tensor=dict(size=4, mode="1d")))
    assert one.hints["layers.*.attn.proj.weight"] == {"tp": "S(1)"} and one.mesh_shape == (4,)


@pytest.mark.parametrize("parallel,message", [
    (dict(tensor=dict(size=8, mode="2d")), "'2d' needs a square size"),
    (dict(tensor=dict(size=8, mode="2.5d")), "'2.5d' needs depth="),
    (dict(tensor=dict(size=4, mode="3d")), "'3d' needs a cubic size"),
    (dict(tensor=dict(size=4, mode="4d")), "mode in"),
    (dict(pipeline=2, tensor=dict(size=4, mode="2d")), "pipeline"),
])
def test_bad_configs_say_what_is_valid(parallel, message):
    with pytest.raises(UserInputError, match=message):
        colossal_hints("gpt2", parallel)


def test_unknown_model_asks_for_linear_roles():
    with pytest.raises(UserInputError, match="pass column="):
        colossal_hints("resnet", dict(tensor=dict(size=4, mode="2d")))


def test_parallelize_takes_the_config():
    model, inputs, loss_fn = llama()
    prog = autoshard.parallelize(model, None, inputs, loss_fn=loss_fn, parallel=dict(tensor=dict(size=4, mode="2d")))
    assert prog.mesh.names == ("row", "col")
    with pytest.raises(UserInputError, match="needs mesh"):
        autoshard.parallelize(model, (4,), inputs, loss_fn=loss_fn, parallel=dict(tensor=dict(size=4, mode="2d")))


def _per_layer_prediction(mode, size, depth=None):
    """Predicted bytes per axis of one Llama layer (a 2-layer plan minus a 1-layer plan)."""
    tp = colossal_hints("llama", dict(tensor=dict(size=size, mode=mode, depth=depth)))
    found = []
    for layers in (1, 2):
        model, inputs, loss_fn = llama(n_layers=layers)
        prog = autoshard.parallelize(model.double(), tp.mesh_shape, inputs, loss_fn=loss_fn,
                                     axis_names=tp.axis_names, hints=tp.hints)
        found.append(prog.plan.predicted["comm_bytes_per_step"])
    return {a: {d: found[1][a][d] - found[0][a][d] for d in ("fwd", "bwd", "sync")} for a in tp.axis_names}


def _formula(mode, depth=1):
    cfg = llama()[0].cfg
    linears = llama_layer_linears(cfg.dim, cfg.ffn_dim, cfg.n_kv_heads * cfg.head_dim)
    return layer_comm_formula(mode, linears, tokens=8 * 16, q=2, depth=depth)


def test_2d_layer_communication_is_summas():
    assert _per_layer_prediction("2d", 4) == _formula("2d")


def test_2p5d_layer_communication_is_tesseracts_inside_each_depth_slice():
    # Including the depth all-reduce of the weight *blocks* (deferred to the gradient sync, after the
    # row reduce-scatter), not of the gathered panels.
    assert _per_layer_prediction("2.5d", 8, 2) == _formula("2.5d", 2)


def test_3d_layer_communication_is_the_papers_on_every_axis():
    # z: column outputs reduce-scattered, row inputs all-gathered (backward: the duals, fused), not an
    # all-reduce of the column outputs.
    assert _per_layer_prediction("3d", 8) == _formula("3d")


def test_solver_shards_norm_regions_over_tp_when_memory_requires_it():
    """Sequence parallelism by search: Megatron weights on tp=4, no activation hints. Unbounded, the
    norms run replicated between all-reduces; under a tight budget the solver shards their tokens on
    tp and reaches them by reduce-scatter, leaving by an all-gather whose backward is a reduce-scatter."""
    model, inputs, loss_fn = gpt2(batch=8, seq=64, dim=64)

    def plan(**kwargs):
        return autoshard.parallelize(model, (4,), inputs, loss_fn=loss_fn, axis_names=("tp",),
                                     hints=megatron("gpt2", "tp"), **kwargs)

    def norm_specs(prog):
        return [n.meta[meta.SPEC] for n in prog.state.gm.graph.nodes if n.target is torch.ops.aten.layer_norm.default]

    def ops(prog):
        return {n.meta[meta.COMM]["op"] for n in prog.state.gm.graph.nodes if n.meta.get(meta.KIND) == "comm"}

    free = plan()
    assert all(spec.is_replicated() for spec in norm_specs(free)) and "reduce_scatter" not in ops(free)
    budget = 0.7 * free.plan.predicted["memory_bytes_per_rank"]
    tight = plan(memory_budget=budget)
    assert tight.plan.predicted["memory_bytes_per_rank"] <= budget
    assert sum(not spec.is_replicated() for spec in norm_specs(tight)) >= 2
    assert {"reduce_scatter", "all_gather_sum_grad"} <= ops(tight)
