"""Live tensor memory of one training step, measured on a rank's own tensors (CPU: no allocator statistics).

`LiveStorages` is a TorchDispatchMode: every storage an op allocates while it is active (an output whose
storage is none of the op's inputs': views and in-place writes allocate nothing) is tracked by a weak
reference until it is freed; after every op the bytes still alive are summed, so `peak` is the most bytes
allocated inside the step and alive at once, at op boundaries (a kernel's scratch freed inside the op is
not seen; the collectives' output buffers are, being tensors). Forward and backward run on the calling
thread on CPU, so the mode sees both, the optimizer step too.

`measure_step` runs one measured training step (after a warm-up step that creates the optimizer state) and
splits it into the terms of autoshard's prediction (`plan.predicted["memory"]`):
  params      distinct storages of the rank's local parameters
  grads       distinct gradient storages after backward and the gradient sync (ZeRO-2/3: the shards kept)
  optimizer   Adam's moments and ZeRO's master shards (distinct storages, parameters excluded)
  inputs      the rank's local inputs
  activations storages allocated in forward and still alive when forward returns: what autograd saved
              for backward (the returned loss included, the outputs dropped)
  gathered    ZeRO-3's gathered parameter copies alive at once, the runtime's own count (GatheredMemory)
and `peak` = params + optimizer + inputs (alive before the step) + the peak of storages allocated in the step.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autoshard.runtime.zero import unique_bytes


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages allocated while active and still alive (`live`), and their most at once (`peak`)."""

    def __init__(self):
        super().__init__()
        self.refs: dict = {}  # storage id -> (weak reference, bytes)
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or (key in self.refs and not self.refs[key][0].expired()):
                continue
            self.refs[key] = (StorageWeakRef(storage), storage.nbytes())
        self.sample()
        return out

    def sample(self) -> int:
        """Drop the freed storages; the bytes alive now (and the peak so far)."""
        dead = [key for key, (ref, _) in self.refs.items() if ref.expired()]
        for key in dead:
            del self.refs[key]
        self.live = sum(n for _, n in self.refs.values())
        self.peak = max(self.peak, self.live)
        return self.live


def _optimizer_state(opt) -> list:
    inner = getattr(opt, "optim", opt)
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    masters = [e.master for e in getattr(opt, "entries", ()) if e.master is not e.param]
    return masters + state


def _grads(module, opt) -> list:
    params = [p for _, p in module.named_local_parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    return grads + [e.grad_shard for e in getattr(opt, "entries", ()) if e.grad_shard is not None]


def measure_step(module, opt, local_inputs) -> dict:
    """One warm-up step, then the measured one: {term: bytes} as in the module docstring, plus "peak"."""
    params = [p for _, p in module.named_local_parameters()]

    def step():
        loss, _ = module(*local_inputs)
        loss.backward()
        module.sync_grads()
        opt.step()

    step()
    opt.zero_grad(set_to_none=True)
    module.gathered_memory.reset()
    seen: set = set()
    out = {"params": unique_bytes(params, seen), "optimizer": unique_bytes(_optimizer_state(opt), seen),
           "inputs": unique_bytes(list(local_inputs), seen)}
    with LiveStorages() as live:
        loss, outputs = module(*local_inputs)
        del outputs
        after_forward = live.sample()
        gathered_then = module.gathered_memory.live
        loss.backward()
        module.sync_grads()
        out["grads"] = unique_bytes(_grads(module, opt), set())
        del loss
        opt.step()
    out["activations"] = after_forward - gathered_then
    out["gathered"] = module.gathered_memory.peak
    out["peak"] = out["params"] + out["optimizer"] + out["inputs"] + live.peak
    return out
