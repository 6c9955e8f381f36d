"""Where a rank's weights come from: safetensors files (memory-mapped, read slice by slice), a state
dict, or a DCP checkpoint directory; `open_weights` turns what the user passed into one of them.

A source answers `keys()`, `shape(key)`, `dtype(key)` and `read(key, index)`: the block `index` (one
slice per dim, autoshard.ir.placement.shard_slices) of the tensor stored under `key`. A safetensors
source reads only that block from the mapped file, never the whole tensor.

>>> import tempfile, torch
>>> from safetensors.torch import save_file
>>> folder = tempfile.mkdtemp()
>>> save_file({"fc.weight": torch.arange(12.0).reshape(3, 4)}, f"{folder}/model.safetensors")
>>> source = open_weights(folder)
>>> source.shape("fc.weight"), source.read("fc.weight", (slice(0, 3), slice(2, 4)))[0]
((3, 4), tensor([2., 3.]))
>>> tensors = StateDictWeights({"b": torch.zeros(2, 2, dtype=torch.float64)})
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch

from autoshard.weights.training_checkpoint import SIDECAR, CheckpointError

INDEX = "model.safetensors.index.json"
INIT = "init"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsWeights:
    """Tensors in one or more safetensors files (`files`: key -> path), each opened memory-mapped once.

    >>> type(source).__name__, sorted(source.keys())
    ('SafetensorsWeights', ['fc.weight'])
    """

    def __init__(self, files: dict, description: str, aliases: dict | None = None):
        self.files = files
        self.description = description
        self.aliases = aliases or {}  # stored name -> the other names of that tied tensor (save_weights' index)
        self._handles: dict = {}

    def _open(self, path):
        if path not in self._handles:
            from safetensors import SafetensorError, safe_open
            try:
                self._handles[path] = safe_open(path, framework="pt")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path!r} is not a readable safetensors file ({exc}): it may be truncated or "
                                      "corrupt; write it again (autoshard.save_weights or safetensors' save_file)") \
                    from exc
        return self._handles[path]

    def keys(self) -> set:
        """The stored names.

        >>> source.keys()
        {'fc.weight'}
        """
        return set(self.files)

    def _slice(self, key):
        return self._open(self.files[key]).get_slice(key)

    def shape(self, key) -> tuple:
        """The stored (global) shape of `key`, read from the header.

        >>> source.shape("fc.weight")
        (3, 4)
        """
        return tuple(self._slice(key).get_shape())

    def dtype(self, key) -> torch.dtype:
        """The stored dtype of `key`.

        >>> source.dtype("fc.weight")
        torch.float32
        """
        code = self._slice(key).get_dtype()
        if code not in _DTYPES:
            raise CheckpointError(f"{key!r} in {self.files[key]!r} has dtype {code}, which autoshard cannot read")
        return _DTYPES[code]

    def read(self, key, index: tuple) -> torch.Tensor:
        """The block `index` of `key` (only those bytes are read from the file).

        The file is mapped again for each read and unmapped after it: pages of a mapping stay in the
        process's resident set while it is open, so a rank reading its slices through one long-lived
        mapping would count every slice twice (mapped and copied) at its peak.

        >>> source.read("fc.weight", (slice(1, 2), slice(0, 4)))
        tensor([[4., 5., 6., 7.]])
        """
        self._open(self.files[key])  # a clear error for an unreadable file
        from safetensors import safe_open
        with safe_open(self.files[key], framework="pt") as handle:
            if not index:  # a scalar: the slice object wants no index at all
                return handle.get_tensor(key)
            return handle.get_slice(key)[index].clone()


class StateDictWeights:
    """Tensors of a state dict (name -> tensor), e.g. `torch.load(path, weights_only=True)`.

    >>> tensors.description
    'the state dict'
    """

    def __init__(self, tensors: Mapping, description: str = "the state dict"):
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{description} maps {key!r} to a {type(value).__name__}, not a tensor: pass "
                                      "name -> tensor (model.state_dict(), safetensors' load_file, or torch.load)")
            if value.device.type == "meta":
                raise CheckpointError(f"{description} holds {key!r} on the meta device: it has no values to load")
        self.tensors = tensors
        self.description = description

    def keys(self) -> set:
        """The names.

        >>> tensors.keys()
        {'b'}
        """
        return set(self.tensors)

    def shape(self, key) -> tuple:
        """The shape of `key`.

        >>> tensors.shape("b")
        (2, 2)
        """
        return tuple(self.tensors[key].shape)

    def dtype(self, key) -> torch.dtype:
        """The dtype of `key`.

        >>> tensors.dtype("b")
        torch.float64
        """
        return self.tensors[key].dtype

    def read(self, key, index: tuple) -> torch.Tensor:
        """The block `index` of `key` (a view of the stored tensor).

        >>> tensors.read("b", (slice(0, 1), slice(0, 2))).shape
        torch.Size([1, 2])
        """
        return self.tensors[key][index] if index else self.tensors[key]


class DcpWeights:
    """A directory written by autoshard.save_checkpoint: loaded by DCP into the rank module's shards.

    >>> DcpWeights("ckpt").description
    "DCP checkpoint 'ckpt'"
    """

    def __init__(self, path: str):
        self.path = path
        self.description = f"DCP checkpoint {path!r}"


class InitWeights:
    """`weights="init"`: the model's own initialisation, replayed module by module (weights/replay.py).

    >>> open_weights("init").description
    "weights='init'"
    """

    description = "weights='init'"


def open_weights(weights):
    """The source for `weights`: a `.safetensors` file, a directory holding one or the transformers
    layout (`model.safetensors.index.json` + shards), a DCP directory (save_checkpoint), a state dict,
    or "init".

    >>> open_weights(folder).description.startswith("safetensors file")
    True
    >>> open_weights(os.path.join(folder, "missing"))
    Traceback (most recent call last):
    ...
    autoshard.weights.training_checkpoint.CheckpointError: weights path '...missing' does not exist: ...
    """
    if isinstance(weights, (SafetensorsWeights, StateDictWeights, DcpWeights, InitWeights)):
        return weights
    if isinstance(weights, str) and weights == INIT:
        return InitWeights()
    if isinstance(weights, Mapping):
        return StateDictWeights(weights)
    if not isinstance(weights, (str, os.PathLike)):
        raise CheckpointError(f"weights= takes a path (a .safetensors file or a directory), a state dict or 'init'; "
                              f"got a {type(weights).__name__}")
    path = os.fspath(weights)
    if not os.path.exists(path):
        raise CheckpointError(f"weights path {path!r} does not exist: pass a .safetensors file, a directory of "
                              "safetensors files (the transformers layout), a save_checkpoint directory, or 'init'")
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise CheckpointError(f"weights file {path!r} is not a .safetensors file: load other formats yourself "
                                  "(e.g. torch.load(path, weights_only=True)) and pass the state dict")
        return _single_file(path)
    if os.path.exists(os.path.join(path, SIDECAR)):
        return DcpWeights(path)
    if os.path.exists(os.path.join(path, INDEX)):
        return _indexed(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if len(files) == 1:
        return _single_file(os.path.join(path, files[0]))
    if files:
        raise CheckpointError(f"directory {path!r} holds {len(files)} safetensors files but no {INDEX} saying which "
                              "tensor is in which: add the index (autoshard.save_weights writes one) or pass one file")
    raise CheckpointError(f"directory {path!r} holds no weights: expected a .safetensors file, {INDEX} with its "
                          f"shards, or a save_checkpoint directory ({SIDECAR})")


def load_weights(path) -> dict:
    """The single-device state dict stored at `path` (a `.safetensors` file, a directory holding one, or
    the transformers layout that `autoshard.save_weights` writes), for `model.load_state_dict(...)` on one
    device: every stored tensor, and each other name of a tied tensor (the index's `autoshard_aliases`) as
    that same tensor. transformers' `from_pretrained` reads the same directory and ties weights itself.

    >>> sorted(load_weights(folder))
    ['fc.weight']
    """
    source = open_weights(path)
    if not isinstance(source, SafetensorsWeights):
        raise CheckpointError(f"load_weights reads safetensors files; {path!r} is not one (a DCP directory loads with "
                              "autoshard.load_checkpoint, a state dict needs no loading)")
    state = {key: source.read(key, tuple(slice(0, n) for n in source.shape(key))) for key in sorted(source.files)}
    for stored, others in source.aliases.items():
        if stored not in state:
            raise CheckpointError(f"{source.description}: the index ties {others} to {stored!r}, which it does not "
                                  "store; the index and the shards come from different saves")
        state.update({other: state[stored] for other in others})
    return state


def _single_file(path: str) -> SafetensorsWeights:
    source = SafetensorsWeights({}, f"safetensors file {path!r}")
    source.files = {key: path for key in source._open(path).keys()}
    return source


def _indexed(folder: str) -> SafetensorsWeights:
    index_path = os.path.join(folder, INDEX)
    try:
        with open(index_path, encoding="utf-8") as handle:
            index = json.load(handle)
        weight_map = index["weight_map"]
        aliases = dict((index.get("metadata") or {}).get("autoshard_aliases") or {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index_path!r} is not a safetensors index (JSON with a 'weight_map'): {exc}") from exc
    files = {}
    for key, name in weight_map.items():
        shard = os.path.join(folder, name)
        if not os.path.isfile(shard):
            raise CheckpointError(f"{index_path!r} puts {key!r} in {name!r}, which is not in {folder!r}: the "
                                  "checkpoint is incomplete; copy every shard the index names")
        files[key] = shard
    source = SafetensorsWeights(files, f"safetensors checkpoint {folder!r}", aliases)
    for shard in sorted(set(files.values())):
        stored = set(source._open(shard).keys())
        listed = {k for k, f in files.items() if f == shard}
        if listed - stored:
            raise CheckpointError(f"{index_path!r} lists {sorted(listed - stored)[:3]} in {shard!r}, which does not "
                                  "hold them: the index and the shards come from different saves")
    return source
