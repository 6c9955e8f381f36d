"""The transformers safetensors layout as a pure function of tensor names, dtypes and shapes.

Which tensor goes in which shard file (`model-00001-of-0000N.safetensors`, filled in order up to
`max_shard_bytes`, as transformers' `save_pretrained` does), each file's header and size, the byte
offset of every tensor, and `model.safetensors.index.json`. Every rank computes the same layout
without talking to the others, so each can write its blocks straight into the right bytes.

A file is what `safetensors.torch.save_file` writes for the same tensors, byte for byte: an 8-byte
little-endian header length, the compact JSON header (`__metadata__` first, then the tensors in data
order) padded with spaces to a multiple of 8, then the data; tensors sorted by dtype, widest first
(so each is aligned to its element size), then by name.

>>> import torch
>>> from safetensors.torch import save
>>> tensors = {"fc.weight": torch.ones(4, 2), "fc.bias": torch.zeros(4), "steps": torch.tensor(3)}
>>> layout = weights_layout([(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()])
>>> [f.name for f in layout.files], layout.files[0].offsets["fc.bias"]
(['model-00001-of-00001.safetensors'], 232)
>>> data = b"".join(tensors[k].numpy().tobytes() for k in ("steps", "fc.bias", "fc.weight"))  # data order
>>> layout.files[0].header + data == save(tensors, metadata={"format": "pt"})
True
"""
from __future__ import annotations

import itertools
import json
import math
import struct
from dataclasses import dataclass, field

import torch

from autoshard.weights.training_checkpoint import CheckpointError

INDEX = "model.safetensors.index.json"
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
# safetensors' dtype names in its own order (narrowest first): a file lists the widest first.
DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
          torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.uint16: "U16", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32", torch.float32: "F32",
          torch.complex64: "C64", torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64"}
_RANK = {dtype: i for i, dtype in enumerate(DTYPES)}


@dataclass
class ShardFile:
    """One safetensors file of the layout: its name, header bytes, size and where each tensor starts.

    >>> layout.files[0].size, len(layout.files[0].header) % 8
    (280, 0)
    """

    name: str
    header: bytes  # the length prefix and the padded JSON header: the file's first bytes
    offsets: dict = field(default_factory=dict)  # tensor name -> byte offset of its first element in the file
    size: int = 0


@dataclass
class Layout:
    """Every shard file, the file of each tensor, and the index JSON (`index`).

    >>> layout.index["weight_map"]["fc.weight"], layout.index["metadata"]
    ('model-00001-of-00001.safetensors', {'total_size': 56})
    """

    files: list
    file_of: dict  # tensor name -> ShardFile
    index: dict

    def index_json(self) -> str:
        """The index file's text (sorted keys, 2-space indent, as transformers writes it).

        >>> layout.index_json().splitlines()[:3]
        ['{', '  "metadata": {', '    "total_size": 56']
        """
        return json.dumps(self.index, indent=2, sort_keys=True) + "\n"


def nbytes(dtype: torch.dtype, shape) -> int:
    """Bytes of a tensor of `dtype` and `shape`.

    >>> nbytes(torch.bfloat16, (3, 4))
    24
    """
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def safetensors_header(tensors, metadata: dict) -> tuple[bytes, dict]:
    """(header bytes, {name: data offset relative to the end of the header}) of one file holding
    `tensors` ([(name, dtype, shape)]), laid out as safetensors lays them out.

    >>> header, offsets = safetensors_header([("a", torch.int8, (3,)), ("b", torch.float32, (1,))], {})
    >>> header[8:].decode().rstrip(), len(header) % 8, offsets
    ('{"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"I8","shape":[3],"data_offsets":[4,7]}}', 0, {'b': 0, 'a': 4})
    """
    for name, dtype, _ in tensors:
        if dtype not in DTYPES:
            raise CheckpointError(f"{name!r} is {dtype}, which safetensors cannot store; convert it (e.g. "
                                  "module.to(torch.float32)) before saving")
    ordered = sorted(tensors, key=lambda t: (-_RANK[t[1]], t[0]))
    entries, offsets, position = {}, {}, 0
    if metadata:
        entries["__metadata__"] = metadata
    for name, dtype, shape in ordered:
        end = position + nbytes(dtype, shape)
        entries[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [position, end]}
        offsets[name] = position
        position = end
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    return struct.pack("<Q", len(text)) + text, offsets


def weights_layout(tensors, max_shard_bytes: int = 5 * 2**30, index_metadata=None) -> Layout:
    """The layout of `tensors` ([(name, dtype, shape)] in model order): files filled in order, a new one
    when the next tensor would pass `max_shard_bytes` (a larger tensor gets a file of its own);
    `index_metadata` is added to the index's "metadata".

    >>> small = weights_layout([("a", torch.float32, (4,)), ("b", torch.float32, (4,)), ("c", torch.float32, (2,))],
    ...                        max_shard_bytes=24)
    >>> {k: v[6:11] for k, v in small.index["weight_map"].items()}
    {'a': '00001', 'b': '00002', 'c': '00002'}
    """
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise CheckpointError(f"max_shard_bytes={max_shard_bytes!r} must be a positive number of bytes, e.g. "
                              "5 * 2**30")
    groups, size = [[]], 0
    for name, dtype, shape in tensors:
        n = nbytes(dtype, shape)
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, dtype, tuple(shape)))
        size += n
    files, file_of = [], {}
    for i, group in enumerate(groups):
        header, offsets = safetensors_header(group, {"format": "pt"})  # transformers refuses files without it
        shard = ShardFile(SHARD_NAME.format(i + 1, len(groups)), header,
                          {k: len(header) + v for k, v in offsets.items()},
                          len(header) + sum(nbytes(d, s) for _, d, s in group))
        files.append(shard)
        file_of.update({name: shard for name, _, _ in group})
    total = sum(nbytes(d, s) for _, d, s in tensors)
    index = {"metadata": {"total_size": total, **(index_metadata or {})},
             "weight_map": {name: file_of[name].name for name, _, _ in tensors}}
    return Layout(files, file_of, index)


def block_runs(shape, index):
    """The contiguous runs of a block (`index`: one slice per dim) inside a row-major tensor of `shape`:
    (element offset in the tensor, element offset in the block, length) each. A block that is full in
    every dim after its last split one is contiguous (one run); otherwise each run is one row of that
    dim, the longest that can be written at once.

    >>> list(block_runs((4, 6), (slice(2, 4), slice(0, 6))))   # rows 2..3: one run
    [(12, 0, 12)]
    >>> list(block_runs((4, 6), (slice(2, 4), slice(3, 6))))   # right half of rows 2..3: one run per row
    [(15, 0, 3), (21, 3, 3)]
    """
    shape = tuple(shape)
    if 0 in shape:
        return
    cut = [d for d, s in enumerate(index) if s.stop - s.start != shape[d]]
    if not cut:
        yield 0, 0, math.prod(shape)
        return
    k = cut[-1]
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    run = (index[k].stop - index[k].start) * strides[k]
    outer = [range(s.start, s.stop) for s in index[:k]]
    for j, position in enumerate(itertools.product(*outer)):
        yield sum(i * strides[d] for d, i in enumerate(position)) + index[k].start * strides[k], j * run, run
