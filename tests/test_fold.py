"""Depth folding (autoshard/frontend/fold.py, passes/unfold.py): a model with many identical layers is
planned from three of them and written out whole. The plan equals the unfolded one, the program trains
like one device, a saved plan applies again, and models whose layers differ are not folded."""
import collections
import os

import pytest
import torch

import autoshard
from autoshard.frontend.fold import fold_model
from autoshard.verify.verify import verify_simulated
from autoshard.zoo import gpt2, llama

WIDE = {"dim": 256, "n_heads": 8, "batch": 4, "seq": 64, "device": "meta"}


def _rows(prog) -> collections.Counter:
    return collections.Counter((r.path, r.op, r.type, r.spec, r.collective, r.axis) for r in prog.plan.rows)


CASES = [(llama, (2, 2), ("dp", "tp"))] + ([(gpt2, (4,), ("tp",))] if os.environ.get("AUTOSHARD_FULL_MATRIX") == "1"
                                           else [])


@pytest.mark.parametrize("factory,mesh,names", CASES, ids=[f"{f.__name__}-{'x'.join(map(str, m))}" for f, m, _ in CASES])
def test_the_folded_plan_is_the_whole_models_plan(factory, mesh, names):
    model, inputs, loss_fn = factory(n_layers=8, **WIDE)
    folded = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=names)
    whole = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=names, fold_layers=False)
    assert folded.state.fold is not None and whole.state.fold is None
    assert folded.state.ilp_stats[0]["nodes"] < whole.state.ilp_stats[0]["nodes"] / 2
    assert _rows(folded) == _rows(whole)
    assert folded.plan.predicted == whole.plan.predicted
    assert folded.state.objective_s == pytest.approx(whole.state.objective_s, rel=1e-9)
    assert list(folded.state.traced.params) == list(whole.state.traced.params)


def test_a_folded_program_trains_like_one_device_and_its_plan_applies_again():
    model, inputs, loss_fn = llama(n_layers=8, dropout=0.1)
    report, prog = verify_simulated(model, inputs, loss_fn, mesh=(2, 2), axis_names=("dp", "tp"),
                                    hints={"input:0": {"dp": "S(0)"}, "layers.*.attn.q.weight": {"tp": "S(0)"}})
    assert report.ok, report
    assert prog.state.fold is not None
    again = autoshard.parallelize(model.double(), (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"),
                                  plan=prog.plan, rng="exact", seed=0)
    assert again.plan.fingerprint == prog.plan.fingerprint


def test_layers_that_differ_or_hints_naming_one_layer_are_not_folded():
    model = llama(n_layers=8, device="meta")[0]
    assert fold_model(model, {"layers.3.attn.q.weight": {"tp": "S(0)"}}) is None  # the hint needs layer 3 itself
    assert fold_model(model, {"layers.*.attn.q.weight": {"tp": "S(0)"}}) is not None
    model.layers[5].attn.sliding_window = 4  # an attribute that changes what one layer computes
    assert fold_model(model) is None
    del model.layers[5].attn.sliding_window
    model.layers[2].register_forward_hook(lambda *args: None)
    assert fold_model(model) is None


@pytest.mark.skipif(os.environ.get("AUTOSHARD_FULL_MATRIX") != "1",
                    reason="AUTOSHARD_FULL_MATRIX=1 runs it (about 6 s; the zoo models' folds run by default)")
def test_transformers_llama_in_mixed_precision_folds_with_its_casts():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    kw = {"axis_names": ("dp", "tp"), "mixed_precision": "bf16", "loss_fn": lambda out, ids: out.logits.float().mean()}
    folded = autoshard.parallelize(model, (2, 2), (ids,), **kw)
    whole = autoshard.parallelize(model, (2, 2), (ids,), fold_layers=False, **kw)
    assert folded.state.fold is not None
    assert _rows(folded) == _rows(whole) and folded.plan.predicted == whole.plan.predicted


class _IndexedEmbeddings(torch.nn.Module):
    """MarkupLM's shape: a long ModuleList indexed one by one (`tables[i](ids[:, i])`), not looped over."""

    def __init__(self, n=10):
        super().__init__()
        self.tables = torch.nn.ModuleList(torch.nn.Embedding(16, 8) for _ in range(n))

    def forward(self, ids):
        return sum(self.tables[i](ids[:, i]) for i in range(ids.shape[1]))


def test_a_list_indexed_one_by_one_is_traced_whole():
    """Folding keeps three of the ten tables; indexing the others used to fail the export with KeyError: '2'.
    The folded trace now calls the middle table in their place, differs from the whole model's and is
    discarded: the plan covers every table."""
    torch.manual_seed(0)
    model, ids = _IndexedEmbeddings(), torch.randint(0, 16, (4, 10))
    assert fold_model(model) is not None
    report, program = verify_simulated(model, (ids,), mesh=(2,), axis_names=("dp",), hints={"input:0": {"dp": "S(0)"}})
    assert report.ok, report
    assert sum(r.kind == "param" for r in program.plan.rows) == 10


class _CountsItsLayers(torch.nn.Module):
    """A forward that checks how many layers it holds: its folded copy (three layers) fails to trace."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(8))

    def forward(self, x):
        if len(self.layers) != 8:
            raise ValueError(f"expected 8 layers, got {len(self.layers)}")
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def test_a_folded_copy_that_does_not_trace_is_traced_whole():
    torch.manual_seed(0)
    model, x = _CountsItsLayers(), torch.randn(4, 8)
    assert fold_model(model) is not None
    report, program = verify_simulated(model, (x,), mesh=(2,), axis_names=("dp",), hints={"input:0": {"dp": "S(0)"}})
    assert report.ok, report
    assert sum(r.kind == "param" for r in program.plan.rows) == 16  # every layer's weight and bias


def test_a_running_load_balancing_loss_folds():
    """The zoo's MoE sums its layers' load-balancing losses at the top level (`aux = aux + layer_aux`): the folded
    trace carries that sum through its middle layer (mark_carried), so the model folds; its plan is the whole
    model's, and the program trains like one device (the sum of every layer's loss, none dropped or doubled)."""
    from autoshard.zoo.moe import moe_llama
    shape = {"dim": 32, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 32, "n_experts": 4, "top_k": 2, "vocab_size": 64,
             "n_layers": 8, "batch": 8, "seq": 8, "group_size": 8}
    model, inputs, loss_fn = moe_llama(**shape)
    kw = {"axis_names": ("dp", "ep"), "hints": {"input:0": {"dp": "S(0)"}, "layers.*.moe.w1": {"ep": "S(0)"}}}
    folded = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, **kw)
    whole = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, fold_layers=False, **kw)
    assert folded.state.fold is not None
    assert _rows(folded) == _rows(whole) and folded.plan.predicted == whole.plan.predicted
    adds = [r for r in folded.plan.rows if r.path == "" and r.op == "add.Tensor"]
    assert len(adds) == 8  # one per layer after the first, and the loss's own
    report, _ = verify_simulated(model, inputs, loss_fn, mesh=(2, 2), **kw)
    assert report.ok, report


def test_mixed_precision_folds_whatever_order_exports_dtype_checks_take():
    """Under bf16 every layer casts the rotary tables it is given; export's check of each cast lands where the
    table is read next, so the first layer's checks sat elsewhere than the others' and the zoo's llama and MoE were
    traced whole in mixed precision. The checks are not compared (nothing flows out of them)."""
    model, inputs, loss_fn = llama(n_layers=8, **WIDE)
    kw = {"axis_names": ("dp", "tp"), "mixed_precision": "bf16"}
    folded = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, **kw)
    whole = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, fold_layers=False, **kw)
    assert folded.state.fold is not None
    assert _rows(folded) == _rows(whole) and folded.plan.predicted == whole.plan.predicted
    # and the layers are wired as the whole model's: twins matched without the checks (a misplaced one would shift
    # every later twin), so a bf16 program trains like one bf16 device
    small, small_inputs, small_loss = llama(n_layers=8)
    report, prog = verify_simulated(small, small_inputs, small_loss, mesh=(2,), axis_names=("dp",),
                                    hints={"input:0": {"dp": "S(0)"}}, mixed_precision="bf16")
    assert report.ok, report
    assert prog.state.fold is not None
