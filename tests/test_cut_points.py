"""Pipeline cut points in wrapped models (autoshard/frontend/cut_points.py, passes/cut_stages.py): the repeated
layers are found at any depth of the module tree (`inner.model.layers.*`), in folded models every one of them,
and a wrapped transformers Llama pipelines and trains like one device."""
import pytest
import torch
from torch import nn

import autoshard
from autoshard.frontend.cut_points import find_layers
from autoshard.frontend.trace import trace
from autoshard.ir import meta
from autoshard.ir.errors import PlanError
from autoshard.passes import auto_cut as cut_mod
from autoshard.frontend.cut_points import module_stack
from autoshard.verify.verify import verify_simulated
from autoshard.zoo import llama
from autoshard.zoo import transformers_families as families


class Wrapped(nn.Module):
    """What users write: the model inside a module that returns its logits."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        out = self.inner(ids)
        return out.logits if hasattr(out, "logits") else out


def hf_llama(layers=4, **config):
    """A small transformers LlamaForCausalLM (forward(input_ids)), random weights, and its token ids."""
    model, (ids, _), _ = families.causal_lm("LlamaForCausalLM", "LlamaConfig", **dict(
        families.DECODER, num_hidden_layers=layers, **config))
    return model, ids


def _ops(model, inputs, loss_fn=None):
    return [n for n in trace(model, inputs, loss_fn).gm.graph.nodes if n.op == "call_function"]


def test_layers_of_a_wrapped_zoo_model():
    model, inputs, loss_fn = llama(n_layers=3)
    layers = find_layers(_ops(Wrapped(model), inputs, loss_fn))
    assert layers.containers == ("inner.layers",)
    assert layers.layers == ("inner.layers.0", "inner.layers.1", "inner.layers.2")


def test_layers_of_a_wrapped_transformers_model_in_nested_wrappers():
    model, ids = hf_llama(layers=3)
    for wrapper, container in [(Wrapped(model), "inner.model.layers"),
                               (Wrapped(Wrapped(model)), "inner.inner.model.layers"),
                               (nn.Sequential(Wrapped(model)), "0.inner.model.layers")]:  # an index above the list
        layers = find_layers(_ops(wrapper, (ids,)))
        assert layers.containers == (container,), wrapper
        assert layers.layers == tuple(f"{container}.{i}" for i in range(3))
        embedding = next(n for n in _ops(wrapper, (ids,)) if n.target is torch.ops.aten.embedding.default)
        assert layers.layer_of(embedding) == ""  # before the layers: goes with the first stage


class Expert(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class MoeBlock(nn.Module):
    """More experts than the model has layers: the experts all read the block's input (not a sequence)."""

    def __init__(self, dim, experts=6):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))

    def forward(self, x):
        h = self.norm(x)
        return x + sum(expert(h) for expert in self.experts)


class EncoderDecoder(nn.Module):
    """Two lists of blocks of one class (an encoder's and a decoder's) and a list of parallel experts."""

    def __init__(self, dim=8):
        super().__init__()
        self.encoder = nn.ModuleList(MoeBlock(dim) for _ in range(2))
        self.decoder = nn.ModuleList(MoeBlock(dim) for _ in range(3))
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        for block in (*self.encoder, *self.decoder):
            x = block(x)
        return self.head(x)


def test_parallel_experts_are_not_layers_and_every_list_of_the_layer_class_is():
    layers = find_layers(_ops(Wrapped(EncoderDecoder()), (torch.randn(2, 8),)))
    assert layers.containers == ("inner.decoder", "inner.encoder")  # the longest first
    assert layers.layers == ("inner.encoder.0", "inner.encoder.1", "inner.decoder.0", "inner.decoder.1",
                             "inner.decoder.2")


def _stage_of_layers(prog) -> dict:
    """{layer path: the set of stages its ops run in}."""
    out = {}
    for node in prog.state.gm.graph.nodes:
        if node.op == "call_function":
            layer = next((p for p in module_stack(node) if p.startswith("inner.layers.") and p.count(".") == 2), None)
            if layer:
                out.setdefault(layer, set()).add(node.meta[meta.STAGE])
    return out


def test_a_folded_wrapped_model_keeps_every_layer_as_a_cut_point():
    """8 layers traced as 3 (folded) and cut between module blocks (the graph has more than 400 ops): a cut may
    go before each of the 8 layers, 8 stages are cut, no layer is split; the embedding runs in the first stage,
    the head after the last layer."""
    model, inputs, loss_fn = llama(n_layers=8, dim=64, n_heads=4, n_kv_heads=2, batch=8, seq=16)
    prog = autoshard.parallelize(Wrapped(model), (8,), inputs, loss_fn=loss_fn, axis_names=("pp",),
                                 pipeline={"microbatches": 8})
    assert prog.state.fold is not None and prog.state.fold.container == "inner.layers"
    assert len(find_layers(_ops(prog.state.fold.model, inputs, loss_fn))) == 3  # the folded trace itself
    ops = [n for n in prog.state.gm.graph.nodes if n.op == "call_function"]
    ops = [n for n in ops if n not in cut_mod.weight_only_ops(ops)]
    assert len(ops) > cut_mod.AUTO_CUT_ALL_POSITIONS  # the module-boundary cut
    costs = cut_mod.CutCosts(prog.state, ops, prog.config)
    assert len(costs.layers) == 8
    starts = {costs.layers.layer_of(ops[k]) for k in costs.positions[1:-1]}
    assert {f"inner.layers.{i}" for i in range(8)} <= starts
    stages = _stage_of_layers(prog)
    assert all(len(s) == 1 for s in stages.values()), stages  # no layer is split
    assert len(prog.plan.pipeline["stage_table"]) == 8
    where = {module_stack(n)[-1]: n.meta[meta.STAGE] for n in prog.state.gm.graph.nodes if n.op == "call_function"
             and module_stack(n) and module_stack(n)[-1] in ("inner.tok_embeddings", "inner.output")}
    assert where["inner.tok_embeddings"] == 0 and where["inner.output"] >= max(set().union(*stages.values()))


def test_too_many_stages_name_the_layers_found(monkeypatch):
    monkeypatch.setattr(cut_mod, "AUTO_CUT_ALL_POSITIONS", 0)
    model, inputs, loss_fn = llama(n_layers=2)
    with pytest.raises(PlanError, match=r"places to cut but the pipeline needs 8 stages \(its 2 repeated layers "
                                        r"are in 'inner.layers'\)"):
        autoshard.parallelize(Wrapped(model), (8,), inputs, loss_fn=loss_fn, axis_names=("pp",),
                              pipeline={"microbatches": 8})


def test_bf16_weights_live_in_the_stage_that_uses_them():
    """Mixed precision casts every weight before the first layer; each cast runs in its weight's stage, so no
    stage receives another's weights (was: every parameter on stage 0)."""
    model, inputs, loss_fn = llama(n_layers=4)
    prog = autoshard.parallelize(Wrapped(model), (2,), inputs, loss_fn=loss_fn, axis_names=("pp",),
                                 pipeline={"microbatches": 2}, mixed_precision="bf16")
    assert prog.plan.pipeline["tied_params"] == {}
    assert all(row["param_bytes"] > 0 for row in prog.plan.pipeline["stage_table"])
    last_layer = [n.meta[meta.STAGE] for n in prog.state.gm.graph.nodes if n.op == "placeholder"
                  and n.meta.get(meta.PATH, "").startswith("inner.layers.3.")]
    assert last_layer and set(last_layer) == {1}


def test_wrapped_transformers_llama_pipelines_like_one_device():
    """pp x dp = (2, 2), two micro-batches, float64: one SGD step equals the single device."""
    model, _ = hf_llama(layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                        intermediate_size=128)
    ids = torch.randint(3, families.VOCAB, (4, 8))
    report, prog = verify_simulated(Wrapped(model), (ids,), mesh=(2, 2), axis_names=("pp", "dp"),
                                    pipeline={"microbatches": 2}, steps=1)
    assert report.ok, report
    assert prog.config.num_stages == 2 and prog.config.microbatches == 2
    table = prog.plan.pipeline["stage_table"]
    assert table[0]["first_module"] == "inner.model.embed_tokens" and table[-1]["last_module"] == "inner.lm_head"


def test_unnamed_mesh_prices_a_pipeline_over_each_axis():
    """A wrapped transformers Llama deep enough to be folded and cut between module blocks: the search plans
    a pipeline over each axis (different sizes) and records its predicted step."""
    model, _ = hf_llama(layers=8)
    ids = torch.randint(3, families.VOCAB, (8, 8))
    prog = autoshard.parallelize(Wrapped(model), (2, 8), (ids,))  # 8 stages: one per layer
    candidates = prog.plan.search["candidates"]
    assert [c["axis"] for c in candidates] == [None, "a0", "a1"]
    for c in candidates[1:]:
        assert c["predicted_step_s"] > 0 and c["microbatches"] >= 2, candidates
    assert "not possible" not in prog.plan.search["why"]


def test_repeated_layers_are_found_under_wrappers():
    """Under an nn.Sequential and a wrapper, whose module paths start with an index ('0.inner.layers.1'), the
    repeated layers are the bare model's, prefixed."""
    model, inputs, loss_fn = llama(n_layers=3)
    found = [find_layers(trace(candidate, inputs, loss_fn).gm.graph.nodes).layers
             for candidate in (model, nn.Sequential(Wrapped(model)))]
    assert found[0] == ("layers.0", "layers.1", "layers.2")
    assert found[1] == tuple(f"0.inner.{layer}" for layer in found[0])
