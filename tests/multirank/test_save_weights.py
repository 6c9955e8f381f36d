"""save_weights on real gloo ranks: the written transformers-layout files equal the single-device model's
tensors bit for bit (TP, 2-D sharding, ZeRO-3, a pipeline with a tied embedding); a trained tied
transformers Llama read back by `from_pretrained` is in test_train_then_save.py. Ranks run through the
shared pool; the layout has unit tests too.
"""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

import autoshard
from autoshard.ir.mesh import Mesh
from autoshard.ir.placement import Spec, shard_slices
from autoshard.weights.layout import INDEX, block_runs, nbytes, weights_layout
from autoshard.weights.save import save_weights
from autoshard.zoo import mlp


class TiedLM(torch.nn.Module):
    """Embedding and head share one weight; a persistent and a non-persistent buffer."""

    def __init__(self, vocab=16, dim=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.body = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Tanh(), torch.nn.Linear(dim, dim))
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("shift", torch.full((dim,), 0.1), persistent=False)

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)) * self.scale + self.shift)


def _square_mean(out, *inputs):
    return out.pow(2).mean()


def _case(name):
    """(model, inputs, loss_fn, mesh shape, parallelize keywords) of one case; the same on every process."""
    if name == "pipeline":
        torch.manual_seed(0)
        model = TiedLM().double()
        stages = {"embed:stage": 0, "body.0:stage": 0, "body.2:stage": 1, "head:stage": 1}
        return model, (torch.randint(0, 16, (8, 4)),), _square_mean, (2, 2), {
            "axis_names": ("pp", "dp"), "hints": {"input:0": {"dp": "S(0)"}, **stages}, "pipeline": {"microbatches": 2}}
    model, inputs, loss_fn = mlp(batch=8, in_dim=8, hidden=16, out_dim=8, n_layers=2)
    model, inputs = model.double(), tuple(x.double() for x in inputs)
    if name == "tp":
        hints = {"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"}, "layers.0.bias": {"tp": "S(0)"},
                 "layers.1.weight": {"tp": "S(1)"}, "layers.1.bias": {"tp": "R"}}
        return model, inputs, loss_fn, (2, 2), {"axis_names": ("dp", "tp"), "hints": hints}
    if name == "2d":
        hints = {"layers.0.weight": {"x": "S(0)", "y": "S(1)"}, "layers.1.weight": {"x": "S(1)", "y": "S(0)"}}
        return model, inputs, loss_fn, (2, 2), {"axis_names": ("x", "y"), "hints": hints}
    assert name == "zero3"
    return model, inputs, loss_fn, (4,), {"axis_names": ("dp",), "hints": {"input:0": {"dp": "S(0)"}}, "zero": 3}


def _save_task(rank, world, directory, name, max_shard_bytes):
    from autoshard.runtime.launch import communicator_for
    model, inputs, loss_fn, mesh, options = _case(name)
    comm = communicator_for(Mesh(mesh, options["axis_names"]), strict_world=False)
    if comm is None:
        return None
    prog = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, **options)
    module = prog.module(rank, comm)
    save_weights(directory, module, max_shard_bytes=max_shard_bytes)
    held = dict(module.named_local_parameters())
    out = {"specs": {f: repr(prog.param_spec(f)) for f in held}, "shapes": {f: tuple(p.shape) for f, p in held.items()},
           "tied": dict(getattr(prog, "tied_params", {}))}
    try:  # a path that is a file: every rank raises the same clear error (no hang)
        save_weights(os.path.join(directory, INDEX), module)
    except autoshard.UserInputError as exc:
        out["file_error"] = str(exc)
    return out


def _saved(pool, tmp_path, name, max_shard_bytes=5 * 2**30):
    directory = str(tmp_path / name)
    results = {r: v for r, v in pool.run(_save_task, directory, name, max_shard_bytes).items() if v is not None}
    assert "is a file" in results[0]["file_error"]
    return directory, results


def _read(directory) -> tuple[dict, dict]:
    """(every tensor in the directory, the index), checking that the index names each tensor's file."""
    with open(os.path.join(directory, INDEX), encoding="utf-8") as handle:
        index = json.load(handle)
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        path = os.path.join(directory, file)
        with safe_open(path, framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
        loaded = load_file(path)
        assert all(index["weight_map"][k] == file for k in loaded), file
        tensors.update(loaded)
    assert sorted(tensors) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors, index


def _assert_equal_to_model(directory, model, tied=()):
    tensors, index = _read(directory)
    expected = {k: v for k, v in model.state_dict().items() if k not in tied}
    assert sorted(tensors) == sorted(expected)
    for key, value in expected.items():
        assert tensors[key].dtype == value.dtype and torch.equal(tensors[key], value), key
    return index


def test_megatron_tp_on_dp_x_tp_in_several_files(pool, tmp_path):
    directory, results = _saved(pool, tmp_path, "tp", max_shard_bytes=1100)
    index = _assert_equal_to_model(directory, _case("tp")[0])
    files = [index["weight_map"][k] for k in ("layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias")]
    assert [f[6:11] for f in files] == ["00001", "00002", "00003", "00003"]  # 1 KiB; 128 B; 1 KiB + 64 B
    assert sorted(os.listdir(directory)) == sorted([INDEX] + [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)])
    assert results[1]["specs"]["layers.1.weight"] == "[R, S(1)]"


def test_two_dim_sharded_blocks_are_written_as_runs(pool, tmp_path):
    directory, results = _saved(pool, tmp_path, "2d")
    _assert_equal_to_model(directory, _case("2d")[0])
    assert results[3]["specs"]["layers.0.weight"] == "[S(0), S(1)]"
    assert results[3]["shapes"]["layers.0.weight"] == (8, 4)  # not contiguous in the (16, 8) tensor


def test_zero3_shards_are_what_the_rank_modules_hold(pool, tmp_path):
    directory, results = _saved(pool, tmp_path, "zero3")
    _assert_equal_to_model(directory, _case("zero3")[0])
    assert results[2]["specs"]["layers.0.weight"].startswith("[S(")  # sharded on dp by ZeRO-3
    rows, cols = results[2]["shapes"]["layers.0.weight"]
    assert rows * cols * 4 == 16 * 8  # the rank holds a quarter of it


def test_pipeline_with_a_tied_embedding(pool, tmp_path):
    directory, results = _saved(pool, tmp_path, "pipeline")
    assert results[0]["tied"] == {"embed.weight": (0, 1)}  # used by stage 0 and stage 1: written by stage 0
    index = _assert_equal_to_model(directory, _case("pipeline")[0], tied={"head.weight"})
    assert index["metadata"]["autoshard_aliases"] == {"embed.weight": ["head.weight"]}
    assert "shift" not in index["weight_map"] and "scale" in index["weight_map"]  # non-persistent: left out


def test_the_layout_is_what_safetensors_writes_and_the_index_names_each_file(tmp_path):
    torch.manual_seed(0)
    tensors = {"a": torch.randn(4, 3), "b": torch.arange(6, dtype=torch.int64), "c": torch.randn(2, dtype=torch.float64),
               "d": torch.randn(5).to(torch.bfloat16), "e": torch.tensor(True), "f": torch.randn(0, 3)}
    layout = weights_layout([(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], max_shard_bytes=50,
                            index_metadata={"autoshard_aliases": {"a": ["a2"]}})
    assert [sorted(k for k, f in layout.file_of.items() if f is shard) for shard in layout.files] == \
        [["a"], ["b"], ["c", "d", "e", "f"]]  # 48 B; 48 B; 16 + 10 + 1 + 0 B
    for shard in layout.files:  # one writer per file here: header, then every tensor at its offset
        data = bytearray(shard.header) + bytearray(shard.size - len(shard.header))
        group = {k: t for k, t in tensors.items() if layout.file_of[k] is shard}
        for key, t in group.items():
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            data[shard.offsets[key]:shard.offsets[key] + len(raw)] = raw
        assert bytes(data) == save(group, metadata={"format": "pt"})  # byte for byte
        (tmp_path / shard.name).write_bytes(bytes(data))
    (tmp_path / INDEX).write_text(layout.index_json())
    read, index = _read(str(tmp_path))
    assert all(torch.equal(read[k], t) for k, t in tensors.items())
    assert index["metadata"] == {"total_size": sum(nbytes(t.dtype, t.shape) for t in tensors.values()),
                                 "autoshard_aliases": {"a": ["a2"]}}


@pytest.mark.parametrize("spec", ["[S(0), S(1)]", "[S(2), S(0)]", "[S(2), S(2)]", "[R, S(2)]", "[S(0), S(0)]"])
def test_block_runs_place_every_block(spec):
    full = torch.arange(4 * 6 * 4).reshape(4, 6, 4)
    out = torch.full((full.numel(),), -1)
    for coord in [(i, j) for i in range(2) for j in range(2)]:
        index = shard_slices(tuple(full.shape), Spec.parse(spec), coord, (2, 2))
        block = full[index].reshape(-1)
        for at, start, length in block_runs(tuple(full.shape), index):
            out[at:at + length] = block[start:start + length]
    assert torch.equal(out, full.reshape(-1))


def test_save_weights_needs_a_rank_module_on_real_ranks(tmp_path):
    from autoshard.runtime.simulator import run_ranks
    model, inputs, loss_fn, mesh, options = _case("zero3")
    prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
                                 hints={"input:0": {"dp": "S(0)"}})
    with pytest.raises(autoshard.UserInputError, match="in-process simulator"):
        save_weights(str(tmp_path), run_ranks(prog, lambda module: module)[0])
    with pytest.raises(autoshard.UserInputError, match="prog.module\\(rank, comm\\)"):
        save_weights(str(tmp_path), model)
    assert os.listdir(tmp_path) == []
