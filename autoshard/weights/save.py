"""save_weights: the full single-device model's weights, written by the ranks that hold them, in the
transformers layout (`model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`).

No rank assembles a sharded tensor and nothing is gathered: every rank computes the same file layout
from the program (autoshard/weights/layout.py) and writes only the bytes of the blocks it owns into
their place in the pre-sized files (`os.pwrite`). A block is owned by the rank with coordinate 0 on
every axis that replicates it; in a pipeline, by the ranks running the first stage that uses it (a
tied embedding is written once). Tied parameters are written under their first name, the others are
listed in the index's `metadata.autoshard_aliases`; non-persistent buffers are left out, as
`state_dict()` leaves them out. Each tensor keeps the dtype the rank module holds it in.

Four steps, each closed by one small all_gather_object on the mesh's process group (under its
timeout), so an error on one rank is raised on every rank with its message instead of hanging the
others: every rank checks its blocks against the plan; global rank 0 creates the sized files with
their headers; every rank writes its blocks; rank 0 writes the index (last: a failed save leaves no
index). The directory must be on a filesystem every rank sees (one machine, or a shared one).

Saving needs real ranks (tests/multirank/test_save_weights.py runs it on gloo), so the example is
shown, not run: on every rank (torchrun), then in one process

>>> save_weights("out", prog.module(rank, communicator_for(prog.mesh)))  # doctest: +SKIP
>>> model.config.save_pretrained("out")  # doctest: +SKIP
>>> AutoModelForCausalLM.from_pretrained("out")  # or load_state_dict of safetensors' load_file  # doctest: +SKIP

Which blocks a rank writes is a function of the plan; for a data x tensor parallel MLP:

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"),
...                              hints={"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"},
...                                     "layers.1.bias": {"tp": "R"}})
"""
from __future__ import annotations

import os
import re
import time

import torch

from autoshard.ir.errors import UserInputError
from autoshard.ir.placement import Partial, Replicate, shard_slices
from autoshard.runtime.communicator import CollectiveTimeout
from autoshard.runtime.rank_module import rank_module_of
from autoshard.runtime.rank_program import RankProgram
from autoshard.weights.layout import INDEX, block_runs, weights_layout
from autoshard.weights.training_checkpoint import CheckpointError

_STALE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # a previous save's shards (save_pretrained's pattern)


def save_weights(directory, module, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write the full model's weights from this rank's module (`prog.module(rank, comm)`, a flat or a
    pipeline rank module on real process groups) into `directory`, as transformers lays them out; files
    up to `max_shard_bytes`. Every rank of the mesh calls it; it returns when the directory is complete.

    >>> save_weights("out", module)  # on every rank  # doctest: +SKIP
    """
    module = rank_module_of(module)
    program, comm, full = _rank_parts(module)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise UserInputError(f"max_shard_bytes={max_shard_bytes!r} must be a positive number of bytes, e.g. "
                             "5 * 2**30")
    directory = os.fspath(directory)
    blocks, error = {}, None
    try:
        _check_directory(directory)
        stages = [s.index for s in module.stage_graphs] if hasattr(module, "stage_graphs") else None
        for fqn, index in rank_blocks(program, comm.coord, stages).items():
            blocks[fqn] = (index, _held(module, program, fqn, index))
    except Exception as exc:  # reported to every rank below, so none waits for this one
        error = exc
    held = {fqn: str(t.dtype) for fqn, (_, t) in blocks.items()}
    dtypes = _agreed_dtypes(_agree(full, error, "checking the blocks", held))
    entries = [(fqn, dtypes.get(fqn, dtype), shape) for fqn, dtype, shape in written_tensors(program)]
    shapes = {fqn: shape for fqn, _, shape in entries}
    aliases = {first: list(others) for first, others in program.aliases.items() if first in shapes}
    layout = weights_layout(entries, max_shard_bytes, {"autoshard_aliases": aliases} if aliases else None)

    _step(full, full.rank == 0, "creating the files", lambda: _create_files(directory, layout))
    _step(full, True, "writing the blocks", lambda: _write_blocks(directory, layout, blocks, shapes))
    _step(full, full.rank == 0, "writing the index", lambda: _write_index(directory, layout))


def written_tensors(program: RankProgram) -> list:
    """[(FQN, dtype, global shape)] of what a save writes, in model order: every parameter (a tied one
    under its first name) and persistent buffer, in the planned dtype. A partial-sum spec is an error.

    >>> [(fqn, tuple(shape)) for fqn, _, shape in written_tensors(prog.rank_program)][:2]
    [('layers.0.weight', (128, 32)), ('layers.0.bias', (128,))]
    """
    specs = program.param_specs
    out = []
    for fqn, (shape, dtype) in {**program.param_meta, **program.buffer_meta}.items():
        if fqn in program.non_persistent:
            continue
        if any(isinstance(p, Partial) for p in specs[fqn]):
            raise UserInputError(f"{fqn!r} is stored as partial sums (spec {specs[fqn]!r}), which no rank can write "
                                 "as its value; re-plan without 'P' hints on parameters and buffers")
        out.append((fqn, dtype, tuple(shape)))
    return out


def rank_blocks(program: RankProgram, coord, stages=None) -> dict:
    """{FQN: block index (one slice per dim)} of the blocks the rank at mesh `coord` writes: those it
    holds at coordinate 0 of every axis that replicates them. For a pipeline, `coord` is on the mesh
    without the pp axis and `stages` are the rank's stages: it writes the tensors whose first user is
    one of them.

    >>> rank_blocks(prog.rank_program, (0, 1))["layers.0.weight"]  # rows 64..127: its half on tp
    (slice(64, 128, None), slice(0, 32, None))
    >>> rp = prog.rank_program
    >>> rank_blocks(rp, (0, 0))["layers.1.bias"], "layers.1.bias" in rank_blocks(rp, (0, 1))  # tp replicates it
    ((slice(0, 32, None),), False)
    >>> rank_blocks(rp, (1, 0))  # dp replicates everything: the dp=1 ranks write nothing
    {}
    """
    specs, first = program.param_specs, program.first_stage
    out = {}
    for fqn, _, shape in written_tensors(program):
        spec = specs[fqn]
        if any(isinstance(p, Replicate) and coord[axis] for axis, p in enumerate(spec)):
            continue
        if stages is not None:
            if fqn not in first:
                raise CheckpointError(f"{fqn!r} is used by no pipeline stage, so no pipeline rank holds it; save "
                                      "the weights from a plan without a pipeline")
            if first[fqn] not in stages:
                continue
        out[fqn] = shard_slices(shape, spec, coord, program.mesh.shape)
    return out


def _rank_parts(module):
    """(RankProgram, communicator of the sharding mesh, communicator of the full mesh); clear errors otherwise."""
    program = getattr(module, "rank_program", None)
    comm = getattr(module, "comm", None)
    if program is None or comm is None or not hasattr(module, "named_local_parameters"):
        raise UserInputError(f"save_weights takes this rank's module, prog.module(rank, comm), on every rank; got "
                             f"{type(module).__name__} (to save a single-device model use its save_pretrained or "
                             "safetensors' save_file)")
    full = getattr(module, "full_comm", comm)  # a pipeline rank's comm is its mesh without the pp axis
    if not hasattr(full, "mesh_group"):
        raise UserInputError("save_weights cannot run in the in-process simulator: the weights are written by real "
                             "ranks (torch.distributed; communicator_for(prog.mesh) under torchrun)")
    return program, comm, full


def _check_directory(directory: str) -> None:
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{directory!r} is a file: save_weights writes a directory (created if absent); pass "
                              "another path")
    if os.path.exists(os.path.join(directory, "model.safetensors")):
        raise CheckpointError(f"{directory!r} holds model.safetensors, which transformers would load instead of the "
                              f"shards and {INDEX} written here; remove it or save into another directory")


def _held(module, program, fqn: str, index) -> torch.Tensor:
    """This rank's block of `fqn`, checked against the plan's block shape."""
    attr = program.attr_names[fqn]
    graphs = [s.gm for s in module.stage_graphs] if hasattr(module, "stage_graphs") else [module.gm]
    tensor = next((t for t in (getattr(gm, attr, None) for gm in graphs)
                   if isinstance(t, torch.Tensor) and t.device.type != "meta"), None)
    expected = tuple(s.stop - s.start for s in index)
    if tensor is None or tuple(tensor.shape) != expected:
        what = "does not hold it" if tensor is None else f"holds shape {tuple(tensor.shape)}"
        raise CheckpointError(f"rank {module.comm.rank}: {fqn!r} should be a block of shape {expected} here, but the "
                              f"module {what}; pass the module prog.module(rank, comm) built, unchanged in shape")
    return tensor.detach()


def _agree(full, error, what: str, payload=None) -> list:
    """Every rank's payload, after all have reached this point; an error on any rank is raised on all."""
    import torch.distributed as dist
    gathered = [None] * full.mesh.size
    start = time.monotonic()
    try:
        dist.all_gather_object(gathered, (None if error is None else str(error), payload), group=full.mesh_group)
    except RuntimeError as exc:
        raise CollectiveTimeout(full.failure(f"save_weights ({what})", None, exc, time.monotonic() - start)) from exc
    if error is not None:
        raise error
    failed = [(rank, message) for rank, (message, _) in enumerate(gathered) if message is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"save_weights failed on rank {rank} while {what}: {message}")
    return [p for _, p in gathered]


def _step(full, active: bool, what: str, action) -> None:
    """Run `action` where `active`, then agree with every rank that it succeeded."""
    error = None
    if active:
        try:
            action()
        except Exception as exc:
            error = exc
    _agree(full, error, what)


def _agreed_dtypes(held: list) -> dict:
    """FQN -> the dtype its owners hold it in (they must agree)."""
    out: dict = {}
    for rank, dtypes in enumerate(held):
        for fqn, name in dtypes.items():
            dtype = getattr(torch, name.removeprefix("torch."))
            if out.setdefault(fqn, (dtype, rank))[0] != dtype:
                raise CheckpointError(f"ranks {out[fqn][1]} and {rank} hold {fqn!r} as {out[fqn][0]} and {dtype}: cast "
                                      "every rank's module alike before saving")
    return {fqn: dtype for fqn, (dtype, _) in out.items()}


def _create_files(directory: str, layout) -> None:
    os.makedirs(directory, exist_ok=True)
    names = {f.name for f in layout.files}
    for name in os.listdir(directory):  # the previous index and shards would mix with this save's
        if name == INDEX or (_STALE.fullmatch(name) and name not in names):
            os.remove(os.path.join(directory, name))
    for shard in layout.files:
        with open(os.path.join(directory, shard.name), "wb") as handle:
            handle.write(shard.header)
            handle.truncate(shard.size)  # sized now: every rank writes into it in place


def _write_blocks(directory: str, layout, blocks: dict, shapes: dict) -> None:
    fds: dict = {}
    try:
        for fqn, (index, tensor) in blocks.items():
            shard = layout.file_of[fqn]
            if shard.name not in fds:
                fds[shard.name] = os.open(os.path.join(directory, shard.name), os.O_WRONLY)
            data = tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            size = tensor.element_size()
            for at, start, length in block_runs(shapes[fqn], index):
                _pwrite(fds[shard.name], memoryview(data[start * size:(start + length) * size]),
                        shard.offsets[fqn] + at * size)
    finally:
        for fd in fds.values():
            os.close(fd)


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _write_index(directory: str, layout) -> None:
    path = os.path.join(directory, INDEX)
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        handle.write(layout.index_json())
    os.replace(path + ".tmp", path)  # readers never see half an index
