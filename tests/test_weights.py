"""Weights into rank modules without the full model on any rank (autoshard/weights/): safetensors files,
the transformers layout, state dicts and the replayed initialisation, on models built on the meta device.
Simulator tier (threads); tests/multirank/test_weights_gloo.py trains on real gloo ranks.

Equality is exact: loading and replaying only move bytes and run the same initialisation.
"""
import json
import os
import warnings

import pytest
import torch
from safetensors.torch import save_file

import autoshard
from autoshard import zoo
from autoshard.ir.errors import UserInputError
from autoshard.runtime.simulator import run_ranks
from autoshard.weights.training_checkpoint import CheckpointError
from autoshard.zoo import transformers_families as tf
from autoshard.zoo.transformers_hints import HINTS

ZOO = ["mlp", "bert", "gpt2", "llama", "resnet", "vit"]


def _meta(factory, **kwargs):
    """The factory's model and example inputs built on the meta device (nothing allocated)."""
    import inspect
    if "device" in inspect.signature(factory).parameters:  # zoo.mlp builds on its `device` argument
        kwargs["device"] = "meta"
    with torch.device("meta"):
        model, inputs, _ = factory(**kwargs)
    assert all(p.device.type == "meta" for p in model.parameters())
    return model, inputs


def _reset(module):
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _assembled(prog, weights, **options):
    """{FQN: full tensor} assembled from every rank's blocks (what the ranks hold, put together)."""
    blocks = {r: prog.rank_tensors(r, weights, **options) for r in range(prog.mesh.size)}
    return {fqn: prog.assemble({r: b[fqn] for r, b in blocks.items()}, prog.param_spec(fqn)) for fqn in blocks[0]}


def _plan(model, inputs, loss_fn, mesh=(2, 2), names=("dp", "tp"), hints=None):
    return autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=names, hints=hints)


@pytest.mark.parametrize("name", ZOO if os.environ.get("AUTOSHARD_FULL_MATRIX") == "1" else
                         [m for m in ZOO if m != "resnet"])  # resnet's init adds batch norms only
def test_init_equals_the_single_device_initialisation_under_the_same_seed(name):
    """weights='init' on a meta model: every rank's blocks put together equal `torch.manual_seed(s);
    model.apply(reset_parameters)` on one device, and no rank ever held the whole model."""
    factory = getattr(zoo, name)
    reference, inputs, loss_fn = factory()
    torch.manual_seed(7)
    reference.apply(_reset)
    prog = _plan(*_meta(factory), loss_fn)
    held = _assembled(prog, "init", seed=7)
    state = {**reference.state_dict(), **dict(reference.named_buffers())}
    assert held and all(torch.equal(held[k], state[k]) for k in held), [k for k in held if not torch.equal(held[k], state[k])]


@pytest.fixture(scope="module")
def llama_prog():
    """A transformers Llama built on the meta device (float64), planned once with DP + Megatron TP hints."""
    model, inputs = _meta(tf.llama)
    return _plan(model.double(), inputs, tf.model_loss, hints=HINTS["llama"])


def test_init_of_a_transformers_model_replays_its_init_weights(llama_prog):
    """A transformers model's default init_fn is its `_init_weights` (RMSNorm weights, rotary buffers)."""
    reference = tf.llama()[0].double()
    torch.manual_seed(3)
    reference.apply(reference._init_weights)
    held = _assembled(llama_prog, "init", seed=3)
    state = {**reference.state_dict(), **dict(reference.named_buffers())}
    assert "model.rotary_emb.inv_freq" in held
    assert all(torch.equal(held[k], state[k]) for k in held), [k for k in held if not torch.equal(held[k], state[k])]


def _llama_checkpoint(folder, dtype=torch.float64):
    torch.manual_seed(0)
    model, inputs, loss_fn = tf.llama()
    model = model.to(dtype)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(folder, "model.safetensors"))
    return model, inputs, loss_fn


def _train(module, inputs, steps=2, lr=0.1):
    """Losses, gradients and parameters of `steps` SGD steps on one rank."""
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    losses, grads = [], None
    for _ in range(steps):
        opt.zero_grad()
        loss, _ = module(*module.local_inputs(*inputs))
        loss.backward()
        module.sync_grads()
        grads = {k: p.grad.clone() for k, p in module.named_local_parameters()}
        opt.step()
        losses.append(loss.detach())
    return losses, grads, {k: p.detach().clone() for k, p in module.named_local_parameters()}


def _reference(model, inputs, loss_fn, steps=2, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], None
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(*inputs), *inputs)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        losses.append(loss.detach())
    return losses, grads, {k: p.detach().clone() for k, p in model.named_parameters()}


def _check_training(prog, results, reference):
    ref_losses, ref_grads, ref_params = reference
    for step, ref_loss in enumerate(ref_losses):
        loss = prog.assemble({r: res[0][step] for r, res in results.items()}, prog.output_specs[0])
        assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=1e-9), (step, loss, ref_loss)
    for i, ref in ((1, ref_grads), (2, ref_params)):
        for fqn in results[0][i]:
            full = prog.assemble({r: res[i][fqn] for r, res in results.items()}, prog.param_spec(fqn))
            assert torch.allclose(full, ref[fqn], rtol=1e-6, atol=1e-9), fqn


def test_meta_transformers_model_from_safetensors_trains_like_the_single_device(tmp_path, llama_prog):
    """A transformers Llama built on meta, loaded from a safetensors file written by the seeded
    single-device model, trains 2 SGD steps like the single device loaded from the same file (float64)."""
    model, inputs, loss_fn = _llama_checkpoint(tmp_path)
    prog = llama_prog
    results = run_ranks(prog, lambda module: _train(module, inputs), weights=str(tmp_path))
    _check_training(prog, results, _reference(model, inputs, loss_fn))


def test_state_dict_and_transformers_layout_load_the_same_blocks(tmp_path, llama_prog):
    """A sharded checkpoint (index + two shard files) and a state dict give the same blocks as one file."""
    model, inputs, loss_fn = _llama_checkpoint(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(state)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for file, names in halves.items():
        save_file({k: state[k] for k in names}, sharded / file)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, names in halves.items() for k in names}}))
    prog = llama_prog
    one = _assembled(prog, str(tmp_path / "model.safetensors"))
    assert all(torch.equal(one[k], state[k]) for k in state)
    for other in (_assembled(prog, str(sharded)), _assembled(prog, state)):
        assert all(torch.equal(other[k], one[k]) for k in one)


def test_pipeline_stages_read_only_their_tensors(tmp_path):
    """A pipeline rank reads the tensors of its own stages (the others stay meta), and the simulated
    pipeline trains like the single device."""
    torch.manual_seed(0)
    model, inputs, loss_fn = zoo.mlp(n_layers=4)
    model = model.double()
    inputs = tuple(x.double() for x in inputs)
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    meta_model, meta_inputs = _meta(zoo.mlp, n_layers=4)
    prog = autoshard.parallelize(meta_model.double(), (2,), tuple(x.double() for x in meta_inputs), loss_fn=loss_fn,
                                 axis_names=("pp",),
                                 pipeline={"microbatches": 2})
    keep = prog.stage_tensors({1})
    blocks = prog.rank_tensors(0, str(tmp_path), keep=keep)
    assert set(blocks) == keep and "layers.0.weight" not in blocks
    from autoshard.program.pipeline_program import InnerRanks
    from autoshard.runtime.pipeline import simulated_rank_step
    losses = run_ranks(InnerRanks(prog), lambda module: simulated_rank_step(module, inputs)[0], weights=str(tmp_path))
    assert torch.allclose(losses[0], loss_fn(model(*inputs), *inputs), rtol=1e-9)


# ----------------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def planned():
    torch.manual_seed(0)
    model, inputs, loss_fn = zoo.mlp(n_layers=2)
    prog = _plan(*_meta(zoo.mlp, n_layers=2), loss_fn, mesh=(2,), names=("tp",),
                 hints={"layers.0.weight": {"tp": "S(0)"}})
    return model, prog


def _save(folder, tensors, name="model.safetensors"):
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, name))
    return str(folder)


def test_a_meta_model_without_weights_is_an_error(planned):
    _, prog = planned
    with pytest.raises(UserInputError, match="meta device.*pass weights="):
        prog.module(0, None)


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: {k: v for k, v in s.items() if k != "layers.1.weight"}, "lacks parameter 'layers.1.weight'"),
    (lambda s: {**s, "extra.weight": torch.zeros(2)}, "holds 'extra.weight', which the model does not have.*strict=False"),
    (lambda s: {**s, "layers.0.weight": torch.zeros(3, 3)}, "'layers.0.weight' with shape \\(3, 3\\).*another configuration"),
    (lambda s: {f"encoder.{k}": v for k, v in s.items()}, "not a checkpoint of this model"),
])
def test_a_checkpoint_that_does_not_fit_names_the_key(planned, tmp_path, change, message):
    model, prog = planned
    folder = _save(tmp_path, change(model.state_dict()))
    with pytest.raises(CheckpointError, match=message):
        prog.rank_tensors(0, folder)


def test_unexpected_keys_are_ignored_with_strict_false(planned, tmp_path):
    model, prog = planned
    folder = _save(tmp_path, {**model.state_dict(), "extra.weight": torch.zeros(2)})
    assert set(prog.rank_tensors(0, folder, strict=False)) == set(model.state_dict())


def test_a_dtype_mismatch_is_cast_with_one_warning(planned, tmp_path):
    model, prog = planned
    folder = _save(tmp_path, {k: v.double() for k, v in model.state_dict().items()})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        blocks = prog.rank_tensors(0, folder)
    assert all(b.dtype == torch.float32 for b in blocks.values())
    cast = [w for w in caught if "cast to the model's torch.float32" in str(w.message)]
    assert len({str(w.message) for w in cast}) == 1


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_safetensors_file_is_named(planned, tmp_path, damage):
    model, prog = planned
    folder = _save(tmp_path, model.state_dict())
    path = os.path.join(folder, "model.safetensors")
    data = open(path, "rb").read()
    with open(path, "wb") as handle:
        handle.write(data[:-16] if damage == "truncated" else b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file.*truncated or corrupt"):
        prog.rank_tensors(0, folder)


def test_a_directory_without_weights_and_other_bad_paths(planned, tmp_path):
    _, prog = planned
    with pytest.raises(CheckpointError, match="holds no weights"):
        prog.rank_tensors(0, str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        prog.rank_tensors(0, str(tmp_path / "nowhere"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a .safetensors file"):
        prog.rank_tensors(0, str(tmp_path / "weights.bin"))
    with pytest.raises(CheckpointError, match="takes a path"):
        prog.rank_tensors(0, 42)
    (tmp_path / "a.safetensors").write_bytes(b"")
    (tmp_path / "b.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="2 safetensors files but no model.safetensors.index.json"):
        prog.rank_tensors(0, str(tmp_path))


def test_an_index_naming_a_missing_shard_is_an_error(planned, tmp_path):
    model, prog = planned
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001-of-00002.safetensors" for k in model.state_dict()}}))
    with pytest.raises(CheckpointError, match="not in .*checkpoint is incomplete"):
        prog.rank_tensors(0, str(tmp_path))


def test_init_of_a_module_without_an_initialisation_is_an_error():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.gain

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), Scale())
    prog = autoshard.parallelize(model, (2,), (torch.empty(2, 4, device="meta"),), axis_names=("dp",),
                                 hints={"input:0": {"dp": "S(0)"}})
    with pytest.raises(CheckpointError, match="initialisation of 1 \\(Scale\\) does not set '1.gain'.*init_fn="):
        prog.rank_tensors(0, "init")


@pytest.mark.parametrize("pipeline", [False, True], ids=["flat", "pipeline"])
def test_a_meta_model_plans_with_real_example_inputs(pipeline):
    """Real example inputs of a meta model are traced as meta tensors; the plan then runs on real inputs."""
    torch.manual_seed(0)
    model, inputs, loss_fn = zoo.mlp(n_layers=4)
    meta_model, _ = _meta(zoo.mlp, n_layers=4)
    options = {"pipeline": {"microbatches": 2}, "axis_names": ("pp",)} if pipeline else \
        {"axis_names": ("dp",), "hints": {"input:0": {"dp": "S(0)"}}}
    prog = autoshard.parallelize(meta_model, (2,), inputs, loss_fn=loss_fn, **options)
    expected = loss_fn(model(*inputs), *inputs)
    if pipeline:
        from autoshard.program.pipeline_program import InnerRanks
        from autoshard.runtime.pipeline import simulated_rank_step
        loss = run_ranks(InnerRanks(prog), lambda m: simulated_rank_step(m, inputs, train=False)[0],
                         weights=model.state_dict())[0]
    else:
        losses = run_ranks(prog, lambda m: m(*m.local_inputs(*inputs))[0], weights=model.state_dict())
        loss = losses[0] + losses[1]
    assert torch.allclose(loss, expected, rtol=1e-6)
