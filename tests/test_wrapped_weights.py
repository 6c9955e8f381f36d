"""A transformers model inside a user's module (autoshard/zoo/wrapped.py), built on the meta device (issue 29):
weights='init' replays the inner model's own `_init_weights` (rotary tables included) without init_fn=, and
the checkpoint the inner model writes (`save_pretrained`, names without the wrapper's `inner.`) loads as it
is, its tied head included. Simulator tier; tests/multirank/test_wrapped_transformers_gloo.py trains on gloo.
"""
import pytest
import torch
from safetensors.torch import save_file

import autoshard
from autoshard.runtime.simulator import run_ranks
from autoshard.verify.report import TOLERANCE, rel_diff
from autoshard.verify.training import VerifyOptions
from autoshard.verify.verify import rank_run, reference_run
from autoshard.weights import module_inits
from autoshard.weights.training_checkpoint import CheckpointError
from autoshard.zoo.wrapped import HINTS, wrapped_llama


def _assembled(prog, weights, **options):
    blocks = {r: prog.rank_tensors(r, weights, **options) for r in range(prog.mesh.size)}
    return {fqn: prog.assemble({r: b[fqn] for r, b in blocks.items()}, prog.param_spec(fqn)) for fqn in blocks[0]}


def _everything(model) -> dict:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


@pytest.fixture(scope="module")
def wrapped_prog():
    """The wrapped Llama on the meta device (float64), planned with the family's DP + Megatron TP hints."""
    with torch.device("meta"):
        model, inputs, _ = wrapped_llama()
    return autoshard.parallelize(model.double(), (2, 2), inputs, axis_names=("dp", "tp"), hints=HINTS)


def test_the_default_initialisation_is_the_innermost_transformers_models_own():
    """As transformers' initialize_weights dispatches: LlamaModel's rule inside it, LlamaForCausalLM's for
    its head, none for the wrapper (its reset_parameters)."""
    model = wrapped_llama()[0]
    inits = module_inits(model)
    assert "" not in inits and inits["inner.lm_head"] == model.inner._init_weights
    assert inits["inner.model.rotary_emb"] == model.inner.model._init_weights


def test_init_of_a_wrapped_transformers_model_replays_its_init_weights(wrapped_prog):
    reference = wrapped_llama()[0].double()
    torch.manual_seed(3)
    reference.apply(reference.inner._init_weights)
    held = _assembled(wrapped_prog, "init", seed=3)
    expected = _everything(reference)
    assert "inner.model.rotary_emb.inv_freq" in held
    assert all(torch.equal(held[k], expected[k]) for k in held), [k for k in held if not torch.equal(held[k], expected[k])]


def test_the_inner_models_save_pretrained_loads_into_the_wrapper_and_trains(tmp_path, wrapped_prog):
    """`model.inner.save_pretrained(dir)` (the tied head saved once, under the inner model's names) loads
    into the wrapper's ranks as it is, and trains 2 SGD steps like the single device (float64)."""
    model, inputs, _ = wrapped_llama()
    model = model.double()
    model.inner.save_pretrained(tmp_path)
    assert not any(k.startswith("inner.") for k in autoshard.load_weights(str(tmp_path)))
    held = _assembled(wrapped_prog, str(tmp_path))
    expected = _everything(model)
    assert all(torch.equal(held[k], expected[k]) for k in held)
    ranks = run_ranks(wrapped_prog, lambda module: rank_run(module, inputs, VerifyOptions(steps=2, lr=0.1)), weights=str(tmp_path))
    ref = reference_run(model, inputs, lambda out, *_: out, VerifyOptions(steps=2, lr=0.1))
    for step, loss in enumerate(ref["loss"]):  # transformers computes the loss in float32: verify's tolerance
        got = wrapped_prog.assemble({r: res["loss"][step] for r, res in ranks.items()}, wrapped_prog.output_specs[0])
        assert rel_diff(got, loss) <= TOLERANCE, (step, got, loss)
    for fqn, trained in ref["params"].items():
        got = wrapped_prog.assemble({r: res["params"][fqn] for r, res in ranks.items()}, wrapped_prog.param_spec(fqn))
        assert rel_diff(got, trained) <= TOLERANCE, fqn


def test_a_checkpoint_of_two_wrapped_copies_is_ambiguous_and_names_the_prefixes(tmp_path):
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.student, self.teacher = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.student(x) + self.teacher(x)

    prog = autoshard.parallelize(Pair(), (2,), (torch.randn(2, 4),), axis_names=("dp",))
    save_file({k: v.contiguous() for k, v in torch.nn.Linear(4, 4).state_dict().items()}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="several prefixes \\('student.', 'teacher.'.*load_weights"):
        prog.rank_tensors(0, str(tmp_path))


class Wrapper(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x)


def test_keys_left_over_under_the_prefix_are_named(tmp_path):
    model = Wrapper()
    prog = autoshard.parallelize(model, (2,), (torch.randn(2, 4),), axis_names=("dp",))
    state = {**model.inner.state_dict(), "extra.weight": torch.zeros(2)}
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="read as 'inner.' \\+ key\\) holds 'extra.weight'.*strict=False"):
        prog.rank_tensors(0, str(tmp_path))
    assert set(prog.rank_tensors(0, str(tmp_path), strict=False)) == {"inner.weight", "inner.bias"}
