"""One rank's shards of every parameter and buffer, read from a weight source (weights/sources.py) or
made by replaying the model's initialisation (weights/replay.py): `rank_weights`.

Names are the single-device model's (either name of a tied tensor is accepted), or those of a model it
wraps: a checkpoint that `save_pretrained` wrote from `wrapper.inner` is read under `inner.`. Each kept tensor is
read block by block (`shard_slices`): a rank never holds a full sharded tensor from a file. Buffers a
file does not hold (non-persistent ones: rotary frequencies, masks) are taken from the model when it
holds real values, else computed by replaying their module's initialisation. Every mismatch between
the file and the model is a CheckpointError naming the key, the file and what to do; a dtype mismatch
is cast to the model's dtype with one warning.

>>> import tempfile
>>> import torch
>>> import autoshard
>>> from safetensors.torch import save_file
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> folder = tempfile.mkdtemp()
>>> save_file(net.state_dict(), f"{folder}/model.safetensors")
>>> prog = autoshard.parallelize(net, (2,), (torch.randn(4, 4),), axis_names=("tp",), hints={"0.weight": {"tp": "S(0)"}})
"""
from __future__ import annotations

import warnings

import torch

from autoshard.ir.placement import shard_slices
from autoshard.runtime.rank_program import RankProgram
from autoshard.weights.key_prefix import checkpoint_prefix
from autoshard.weights.replay import replay_init
from autoshard.weights.sources import InitWeights, StateDictWeights, open_weights
from autoshard.weights.training_checkpoint import CheckpointError


def rank_weights(program: RankProgram, rank: int, weights, model=None, buffers=None, *, keep=None, init_fn=None,
                 seed: int = 0, strict: bool = True) -> dict:
    """{FQN: this rank's block} for every parameter and buffer of the planned model (only FQNs in `keep`
    when given): from `weights` (see sources.open_weights) under the plan's specs (`program`,
    `prog.rank_program`), on the rank's mesh coordinate. Buffers the source lacks come from `buffers` (the traced
    model's, {FQN: tensor}) when they hold values, else from replaying `model`'s initialisation. `init_fn` and
    `seed` apply to weights="init" (and to buffers computed by replay); `strict=False` ignores names the model
    does not have.

    >>> from autoshard.ir.placement import shard_tensor
    >>> blocks = rank_weights(prog.rank_program, 1, folder, model=net)
    >>> prog.param_spec("2.weight"), torch.equal(blocks["0.weight"], net[0].weight.detach()[4:])
    ([S(1)], True)
    >>> torch.equal(blocks["2.weight"], shard_tensor(net[2].weight.detach(), prog.param_spec("2.weight"), (1,), (2,)))
    True
    """
    source = open_weights(weights)
    entries = _entries(program)
    keep = set(entries) if keep is None else set(keep) & set(entries)
    coord, mesh_shape = program.mesh.coord(rank), program.mesh.shape
    out: dict = {}

    def take(fqn, full):
        name = _canonical(program, fqn)
        if name in keep and name not in out:
            spec, shape, dtype, _ = entries[name]
            out[name] = _block(lambda index: full[index], shape, spec, coord, mesh_shape, dtype).clone()

    if isinstance(source, InitWeights):
        _need_model(model, "weights='init'")
        replay_init(model, take, seed=seed, init_fn=init_fn)
        return out
    if not hasattr(source, "keys"):
        raise CheckpointError(f"{source.description} is read by DCP into a rank module: pass it to prog.module(rank, "
                              "comm, weights=...) on real ranks")
    found = _match_keys(program, source, entries, strict)
    computed = []
    for fqn in sorted(keep):
        spec, shape, dtype, kind = entries[fqn]
        if fqn in found:
            key = found[fqn]
            stored = source.shape(key)
            if stored != shape:
                raise CheckpointError(f"{source.description} holds {key!r} with shape {stored}, but the model's is "
                                      f"{shape}: the checkpoint is of another configuration of this model")
            cast = source.dtype(key) != dtype
            if cast:
                _warn_cast(source, source.dtype(key), dtype)
            block = _block(lambda index, key=key: source.read(key, index), shape, spec, coord, mesh_shape, dtype)
            out[fqn] = block.clone() if isinstance(source, StateDictWeights) and not cast else block
        else:
            computed.append(fqn)
    _compute_buffers(buffers or {}, model, computed, take, init_fn, seed, source)
    return out


def _entries(program: RankProgram) -> dict:
    """FQN -> (spec, global shape, dtype, "param" | "buffer") of the planned model's tensors."""
    kinds = [(program.param_meta, "param"), (program.buffer_meta, "buffer")]
    return {fqn: (program.param_specs[fqn], shape, dtype, kind)
            for tensors, kind in kinds for fqn, (shape, dtype) in tensors.items()}


def _canonical(program: RankProgram, name: str) -> str:
    for first, others in program.aliases.items():
        if name in others:
            return first
    return name


def _match_keys(program: RankProgram, source, entries: dict, strict: bool) -> dict:
    """Canonical FQN -> the source's key for it; errors for unexpected keys and missing parameters. Keys
    written by a model the planned one wraps are read under the wrapper's prefix (key_prefix.py)."""
    names = set(entries) | {other for others in program.aliases.values() for other in others}
    prefix = checkpoint_prefix(source.keys(), names, source.description)
    where = f"{source.description} (its keys read as {prefix!r} + key)" if prefix else source.description
    found, unexpected = {}, []
    for key in sorted(source.keys()):
        name = _canonical(program, prefix + key)
        if name in entries:
            found.setdefault(name, key)
        else:
            unexpected.append(key)
    params = [f for f, e in entries.items() if e[3] == "param"]
    missing = [f for f in params if f not in found]
    if missing and len(missing) * 2 > len(params):
        raise CheckpointError(f"{where} is not a checkpoint of this model: {len(missing)} of the model's "
                              f"{len(params)} parameters are missing (e.g. {missing[0]!r}; the file holds "
                              f"{_some(unexpected or sorted(source.keys()))}"
                              f"{'' if prefix else ', and no prefix puts its keys onto the model names'}); load the "
                              "checkpoint of this model")
    if missing:
        raise CheckpointError(f"{where} lacks parameter{'s' if len(missing) > 1 else ''} "
                              f"{_some(missing)}: save the checkpoint from the full model, or initialise those "
                              "parameters with weights='init'")
    if unexpected and strict:
        raise CheckpointError(f"{where} holds {_some(unexpected)}, which the model does not have: load "
                              "the checkpoint of this model, or pass strict=False to ignore them")
    return found


def _compute_buffers(buffers: dict, model, fqns, take, init_fn, seed, source) -> None:
    """Buffers the source does not hold: taken from the model's real values, else replayed."""
    if not fqns:
        return
    persistent = set(model.state_dict()) if model is not None else set()
    replay = []
    for fqn in fqns:
        if fqn in persistent:
            raise CheckpointError(f"{source.description} lacks buffer {fqn!r}, which the model saves in its state "
                                  "dict: save the checkpoint from the full model (model.state_dict())")
        tensor = buffers.get(fqn)
        if tensor is not None and tensor.device.type != "meta":
            take(fqn, tensor.detach())
        else:
            replay.append(fqn)
    if replay:
        _need_model(model, f"computing buffers {_some(replay)}")
        owners = {fqn.rpartition(".")[0] for fqn in replay}
        replay_init(model, lambda fqn, full: take(fqn, full) if fqn in replay else None, seed=seed, init_fn=init_fn,
                    modules=owners)


def _block(read, shape, spec, coord, mesh_shape, dtype) -> torch.Tensor:
    """This rank's block: read by `read(index)`, in the model's dtype; zero on non-zero partial coordinates."""
    block = read(shard_slices(shape, spec, coord, mesh_shape)).to(dtype)
    if any(coord[axis] != 0 for axis in spec.partial_axes()):
        block = torch.zeros_like(block)
    return block.contiguous()


def _need_model(model, what: str) -> None:
    if model is None:
        raise CheckpointError(f"{what} needs the model that was planned; plan it with autoshard.parallelize")


def _warn_cast(source, stored, wanted) -> None:
    # One message per source and dtype pair (not per key), so that the warning shows once per job.
    warnings.warn(f"autoshard: {source.description} stores tensors as {stored}; they are cast to the model's "
                  f"{wanted}", stacklevel=4)


def _some(keys) -> str:
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:3])
    return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
