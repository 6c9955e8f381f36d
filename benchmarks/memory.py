"""Per-rank memory of one training step, measured on the rank's own tensors.

Model state: local parameter bytes x (1 parameter + 1 gradient + `optimizer_factor` optimizer states;
2 = Adam), the convention of autoshard's `plan.predicted["memory_bytes_per_rank"]`. Saved activations:
the distinct storages autograd keeps for backward (saved_tensors_hooks), parameters excluded.
"""
from __future__ import annotations

import contextlib

import torch

OPTIMIZER_FACTOR = 2.0  # Adam's two moments, as autoshard's memory prediction assumes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor's shard on this rank


def model_state_bytes(params) -> int:
    total = sum(_local(p).numel() * _local(p).element_size() for p in params)
    return int(total * (2 + OPTIMIZER_FACTOR))


@contextlib.contextmanager
def saved_activations(params_fn):
    """`with saved_activations(model.parameters) as saved: step()`; then `saved["bytes"]`.
    `params_fn` is called at every save: FSDP swaps unsharded parameters in during forward."""
    saved = {"bytes": 0}
    seen: set = set()

    def pack(t):
        local = _local(t)
        if isinstance(local, torch.Tensor) and not local.is_meta:
            storage = local.untyped_storage()
            key = storage.data_ptr()
            params = {_local(p).untyped_storage().data_ptr() for p in params_fn()}
            if key not in seen and key not in params and storage.nbytes():
                seen.add(key)
                saved["bytes"] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved
