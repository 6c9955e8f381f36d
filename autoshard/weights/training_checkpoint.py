"""Sharded checkpoints through torch.distributed.checkpoint (DCP): save on the mesh, load anywhere.

`save_checkpoint(path, module, optimizer)` writes every rank's local parameter and buffer shards (and
optimizer state) under the model's FQNs; each rank writes only its own shards, replicated ones once.
`load_checkpoint(path, target, optimizer)` reads them back into a rank module of the same plan, of
another plan (other mesh, other sharding), or into the plain single-device `nn.Module`.

Shards are handed to DCP as DTensors: DCP then records each shard's global offsets from its
placements and, on load, reads for every rank exactly the overlapping pieces of whatever shards were
saved. So resharding on load (another mesh or sharding, or full tensors on one device) needs no
offset bookkeeping of ours, and the files stay loadable by plain `torch.distributed.checkpoint`.

Nothing in a checkpoint is executed: tensors are read by DCP with `torch.load(weights_only=True)`,
DCP's pickled `.metadata` index is read by an unpickler that admits only DCP's metadata classes, and
our own `autoshard_checkpoint.json` is JSON. A checkpoint of another model (missing or extra
parameters, other shapes or dtypes) is a CheckpointError naming the key and what to do.
Optimizer hyperparameters (lr, betas, ...) are not saved: build the optimizer as before, then load.

Saving needs real ranks (tests/multirank/test_checkpoint.py runs these on gloo), so the examples are
shown, not run: on every rank (torchrun, or the test pool)

>>> module = prog.module(rank, communicator_for(prog.mesh))  # doctest: +SKIP
>>> opt = torch.optim.Adam(module.parameters())  # doctest: +SKIP
>>> save_checkpoint("ckpt", module, opt)  # doctest: +SKIP
>>> load_checkpoint("ckpt", other_prog.module(rank, comm), other_opt)  # another plan  # doctest: +SKIP
>>> load_checkpoint("ckpt", model)  # one device, no ranks  # doctest: +SKIP
"""
from __future__ import annotations

import json
import os
import pickle
import warnings

import torch

from autoshard.ir.errors import AutoshardError, UserInputError
from autoshard.ir.json_files import read_json_file
from autoshard.ir.placement import Partial, Shard
from autoshard.runtime.launch import device_mesh
from autoshard.runtime.rank_module import rank_module_of

SIDECAR = "autoshard_checkpoint.json"
FORMAT = 1
OPTIMIZER_PREFIX = "optimizer.state."
MAX_SIDECAR_BYTES = 64 << 20


class CheckpointError(UserInputError):
    """A checkpoint that is missing, unreadable, or does not fit the model it is loaded into.

    >>> raise CheckpointError("checkpoint 'ckpt' has no parameter 'fc.weight'")
    Traceback (most recent call last):
    ...
    autoshard.weights.training_checkpoint.CheckpointError: checkpoint 'ckpt' has no parameter 'fc.weight'
    """


def save_checkpoint(path, module, optimizer=None) -> None:
    """Write this rank's shards of `module` (a RankModule on real process groups) and of `optimizer`'s
    state into directory `path`. Every rank of the mesh calls it (it is collective).

    >>> save_checkpoint("ckpt", prog.module(rank, comm), optimizer)  # on every rank  # doctest: +SKIP
    """
    module = rank_module_of(module)
    program, comm = _rank_program(module, "save a checkpoint")
    import torch.distributed.checkpoint as dcp
    specs = program.param_specs
    tensors = dict(_rank_tensors(module, program))
    state = {fqn: _dtensor(t, specs[fqn], program, comm) for fqn, t in tensors.items()}
    if optimizer is not None:
        for fqn, param in module.named_local_parameters():
            for name, value in _param_state(optimizer, param, fqn).items():
                key = f"{OPTIMIZER_PREFIX}{fqn}.{name}"
                state[key] = _dtensor(value, specs[fqn], program, comm) if value.shape == param.shape else value
    if comm.rank == 0:  # before DCP's last collective, so every rank sees it when save returns
        os.makedirs(path, exist_ok=True)
        sidecar = {"format": FORMAT, "params": sorted(f for f in tensors if f in program.params),
                   "buffers": sorted(f for f in tensors if f not in program.params),
                   "optimizer": optimizer is not None, "mesh": program.mesh.to_json(),
                   "plan_fingerprint": program.plan_fingerprint}
        with open(os.path.join(path, SIDECAR), "w", encoding="utf-8") as handle:
            json.dump(sidecar, handle, indent=1, sort_keys=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), process_group=comm.mesh_group)


def load_checkpoint(path, target, optimizer=None) -> None:
    """Load a checkpoint written by `save_checkpoint` into `target`, in place: a RankModule of any plan
    of the same model (every rank of its mesh calls this), or the plain single-device nn.Module.
    With `optimizer` (over `target`'s parameters) its state is loaded too.

    >>> load_checkpoint("ckpt", model)  # the unsharded model, in one process  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    sidecar = _read_sidecar(path)
    index = read_metadata(path).state_dict_metadata
    target = rank_module_of(target)
    if hasattr(target, "named_local_parameters"):
        program, comm = _rank_program(target, "load a checkpoint")
        specs = program.param_specs
        local = dict(_rank_tensors(target, program))
        params = dict(target.named_local_parameters())
        wanted = {fqn: _dtensor(t.detach(), specs[fqn], program, comm) for fqn, t in local.items()}
        shapes = {fqn: tuple(program.param_meta.get(fqn, program.buffer_meta.get(fqn))[0]) for fqn in local}
        buffers = set(local) - set(program.params)
        load_options = {"process_group": comm.mesh_group}
    elif isinstance(target, torch.nn.Module):
        program = comm = None
        params, wanted, buffers = _module_tensors(target, set(index))
        shapes = {k: tuple(t.shape) for k, t in wanted.items()}
        load_options = {"no_dist": True}
    else:
        raise UserInputError(f"load_checkpoint loads into a RankModule (prog.module(rank, comm)) or a torch.nn.Module, "
                             f"got {type(target).__name__}")
    _check_keys(path, sidecar, index, set(params), buffers, shapes, wanted)
    if optimizer is not None:
        if not sidecar["optimizer"]:
            raise CheckpointError(f"checkpoint {str(path)!r} holds no optimizer state: it was saved without "
                                  "optimizer=; load without optimizer= or save again with it")
        slots = _optimizer_slots(path, index, params, shapes, specs if program else None, program, comm)
        wanted.update({key: target_ for key, (_, _, target_) in slots.items()})
    with warnings.catch_warnings():  # DCP warns about a single-process load even when it was asked for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, storage_reader=_safe_reader(path), **load_options)
    if optimizer is not None:
        for param, name, loaded in slots.values():
            value = loaded.to_local() if hasattr(loaded, "to_local") else loaded
            optimizer.state.setdefault(param, {})[name] = value


def _rank_program(module, what: str):
    """(RankProgram, communicator) of a RankModule on real process groups; clear errors otherwise."""
    comm = getattr(module, "comm", None)
    if not hasattr(module, "named_local_parameters") or comm is None:
        raise UserInputError(f"to {what} on the mesh pass this rank's module, prog.module(rank, comm); got "
                             f"{type(module).__name__}")
    if not hasattr(comm, "mesh_group"):
        raise UserInputError(f"cannot {what} from the in-process simulator: checkpoints are written and read by "
                             "real ranks (torch.distributed; communicator_for(prog.mesh) under torchrun)")
    return module.rank_program, comm


def _rank_tensors(module, program):
    """(FQN, local shard) of every parameter and buffer the rank module holds."""
    for fqn, attr in program.attr_names.items():
        yield fqn, getattr(module.gm, attr)


def _dtensor(local, spec, program, comm):
    """The local shard as a DTensor on the mesh's DeviceMesh (sharing the shard's storage)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DShard

    if any(isinstance(p, Partial) for p in spec):
        raise AutoshardError(f"a parameter or buffer with spec {spec!r} holds partial sums; checkpoints need "
                             "sharded or replicated tensors (re-plan without 'P' hints on parameters)")
    placements = [DShard(p.dim) if isinstance(p, Shard) else Replicate() for p in spec]
    shape = list(local.shape)
    for axis, p in enumerate(spec):
        if isinstance(p, Shard):
            shape[p.dim] *= program.mesh.shape[axis]
    return DTensor.from_local(local.detach(), device_mesh(program.mesh)[0], placements, run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


def _param_state(optimizer, param, fqn) -> dict:
    """The optimizer's tensors for one local parameter: shaped like it (sharded like it) or scalars."""
    if not isinstance(getattr(optimizer, "state", None), dict):
        raise UserInputError(f"optimizer {type(optimizer).__name__} keeps no per-parameter `state` dict; "
                             "save_checkpoint takes a torch.optim optimizer over the rank module's parameters")
    state = {}
    for name, value in optimizer.state.get(param, {}).items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise UserInputError(f"optimizer state {name!r} of parameter {fqn!r} is a {type(value).__name__}, not a "
                                 "tensor; checkpoints hold tensors only (use an optimizer that keeps tensor state)")
        # Anything else (e.g. ZeRO's flat shards) would be saved as if every rank held the same value.
        if value.shape != param.shape and value.dim() != 0:
            raise UserInputError(f"optimizer state {name!r} of parameter {fqn!r} has shape {tuple(value.shape)}, "
                                 f"neither the local parameter's {tuple(param.shape)} nor a scalar; save_checkpoint "
                                 "supports optimizers whose state is shaped like the parameters (not ZeRO's "
                                 "sharded optimizer state yet)")
        state[name] = value.detach()
    return state


def _module_tensors(model, saved: set):
    """(parameters, {key: tensor to load into}, buffer keys) of a plain module; a tied parameter is
    loaded under whichever of its names the checkpoint used."""
    state = model.state_dict()
    by_tensor: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    params, wanted = {}, {}
    for names in by_tensor.values():
        key = next((n for n in names if n in saved), names[0])
        params[key] = model.get_parameter(names[0])
        wanted[key] = state[names[0]]
    tied = {n for names in by_tensor.values() for n in names}
    buffers = {k for k in state if k not in tied}
    wanted.update({k: state[k] for k in buffers})
    return params, wanted, buffers


def _check_keys(path, sidecar, index, params: set, buffers: set, shapes: dict, wanted: dict) -> None:
    where = f"checkpoint {str(path)!r}"
    saved_params = set(sidecar["params"])
    missing = sorted((params - saved_params) | {b for b in buffers if b not in index})
    if missing:
        raise CheckpointError(f"{where} has no {missing[0]!r} (and {len(missing) - 1} more missing), which the model "
                              f"has: it was saved from another model (it holds {_some(saved_params)}); load a "
                              "checkpoint of this model, or copy the matching tensors by hand")
    extra = sorted(saved_params - params)
    if extra:
        raise CheckpointError(f"{where} has parameter {extra[0]!r} (and {len(extra) - 1} more) which the model does "
                              f"not have: it was saved from another model (the model has {_some(params)}); load a "
                              "checkpoint of this model")
    for key, shape in shapes.items():
        meta = index.get(key)
        if not hasattr(meta, "size"):
            raise CheckpointError(f"{where}: {key!r} is not a tensor in the checkpoint; it was not written by "
                                  "autoshard.save_checkpoint for this model")
        if tuple(meta.size) != shape:
            raise CheckpointError(f"{where}: {key!r} has shape {tuple(meta.size)} in the checkpoint but "
                                  f"{shape} in the model: it was saved from a model of another size; build "
                                  "the model with the configuration it was saved with")
        if meta.properties.dtype != wanted[key].dtype:
            raise CheckpointError(f"{where}: {key!r} is {meta.properties.dtype} in the checkpoint but "
                                  f"{wanted[key].dtype} in the model; convert the model (e.g. model.to("
                                  f"{meta.properties.dtype})) before loading, then convert it back")


def _some(keys) -> str:
    keys = sorted(keys)
    return ", ".join(repr(k) for k in keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "") or "nothing"


def _optimizer_slots(path, index, params: dict, shapes: dict, specs, program, comm) -> dict:
    """{checkpoint key: (parameter, state name, tensor to load into)} for the saved optimizer state."""
    slots = {}
    for key, saved in sorted(index.items()):
        if not key.startswith(OPTIMIZER_PREFIX):
            continue
        fqn, _, name = key[len(OPTIMIZER_PREFIX):].rpartition(".")
        if fqn not in params:
            raise CheckpointError(f"checkpoint {str(path)!r} has optimizer state for {fqn!r}, which the model does "
                                  "not have; load a checkpoint of this model")
        param = params[fqn]
        if tuple(saved.size) == shapes[fqn] and specs is not None:  # shaped like the parameter: sharded like it
            target = _dtensor(torch.zeros_like(param, dtype=saved.properties.dtype), specs[fqn], program, comm)
        else:
            target = torch.zeros(tuple(saved.size), dtype=saved.properties.dtype)
        slots[key] = (param, name, target)
    return slots


def _read_sidecar(path) -> dict:
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {str(path)!r} is not a directory; pass the directory save_checkpoint "
                              "wrote")
    sidecar_path = os.path.join(path, SIDECAR)
    if not os.path.exists(sidecar_path):
        raise CheckpointError(f"{str(path)!r} has no {SIDECAR}: it is not a checkpoint written by "
                              "autoshard.save_checkpoint; check the path")
    data = read_json_file(sidecar_path, "checkpoint index", MAX_SIDECAR_BYTES, CheckpointError)
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("params"), list):
        raise CheckpointError(f"{sidecar_path!r} is not a format-{FORMAT} autoshard checkpoint index; save the "
                              "checkpoint again with this version of autoshard")
    return data


# What DCP's `.metadata` pickle may name: its metadata dataclasses, torch's dtype/layout/Size, paths.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
     ("torch", "Size"), ("collections", "OrderedDict")} | {("pathlib", name) for name in (
         "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}  # the checkpoint id DCP keeps


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                    torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def read_metadata(path):
    """DCP's index of a checkpoint directory, read without running any code the file names.

    >>> read_metadata("ckpt").state_dict_metadata["fc.weight"].size  # doctest: +SKIP
    torch.Size([16, 8])
    """
    from torch.distributed.checkpoint.metadata import Metadata
    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except OSError as exc:
        raise CheckpointError(f"cannot read {file!r}: {exc.strerror or exc}; the checkpoint is incomplete (did "
                              "every rank finish save_checkpoint?)") from exc
    except Exception as exc:  # any malformed or hostile pickle
        raise CheckpointError(f"{file!r} is not a torch.distributed.checkpoint index autoshard can read safely "
                              f"({exc}); save the checkpoint again") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file!r} is not a torch.distributed.checkpoint index; save the checkpoint again")
    return metadata


def _safe_reader(path):
    """DCP's file reader for `path`, with its index read by `read_metadata` instead of `pickle.load`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):  # defined here: importing DCP costs a second, only pay it when used
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)
