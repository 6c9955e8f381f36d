"""Loss scaling for float16 mixed precision (`parallelize(..., mixed_precision="fp16")`), agreed by every rank.

`LossScaler(module)` is `torch.amp.GradScaler` for a rank module: the same dynamic scale (start 2**16, halved
and the step skipped when a gradient is inf or NaN, doubled after 2000 good steps) and the same arithmetic
(the loss times a float32 scale; the gradients times its float32 reciprocal), so a parallel run scales,
skips and grows exactly where the single device under GradScaler does. What GradScaler cannot do here:
its overflow check sees only this rank's gradients (an overflow in one rank's shard would skip the step on
that rank alone, and the ranks' weights would part), and its `unscale_` reads the optimizer's parameters
(ZeRO-2/3 keep gradients in flat chunks the optimizer does not see). So `unscale_` walks the module's own
gradient pieces (`grad_norm.grad_pieces`: with ZeRO its chunks) and one all-reduce per mesh axis (and the
pipeline axis) tells every rank whether any rank saw a non-finite value.

The order of calls is GradScaler's, with `sync_grads` before `unscale_`:

    scaler.scale(loss).backward(); module.sync_grads(); scaler.unscale_()
    module.clip_grad_norm_(1.0)  # optional: clip the true gradients
    scaler.step(opt); scaler.update()

A pipeline rank module scales its schedule's loss itself (the schedule runs backward): `train_step` reads the
scale of the LossScaler made for it, and returns the loss unscaled.

>>> import torch
>>> import autoshard
>>> from autoshard.runtime.simulator import run_ranks
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}}, mixed_precision="fp16")
"""
from __future__ import annotations

import torch

from autoshard.ir.errors import UserInputError
from autoshard.runtime.grad_norm import any_rank, grad_pieces


class LossScaler:
    """The dynamic loss scale of one rank module (GradScaler's defaults and update rule).

    >>> def step(module, init_scale=2.0 ** 10):
    ...     scaler = LossScaler(module, init_scale=init_scale)
    ...     opt = torch.optim.SGD(module.parameters(), lr=0.1)
    ...     loss, _ = module(*module.local_inputs(*inputs))
    ...     scaler.scale(loss).backward()
    ...     module.sync_grads()
    ...     scaler.unscale_()
    ...     scaler.step(opt)
    ...     scaler.update()
    ...     return scaler.get_scale(), scaler.skipped_steps
    >>> run_ranks(prog, step)  # no overflow: the step ran, the scale stays (it grows after 2000 such steps)
    {0: (1024.0, 0), 1: (1024.0, 0)}
    """

    def __init__(self, module, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise UserInputError(f"LossScaler(init_scale={init_scale}, growth_factor={growth_factor}, backoff_factor="
                                 f"{backoff_factor}, growth_interval={growth_interval}): need init_scale > 0, "
                                 "growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1 (GradScaler's)")
        self.module = module
        self._scale = torch.tensor(float(init_scale), dtype=torch.float32)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0
        self.skipped_steps = 0
        self.found_inf: bool | None = None  # after unscale_: whether any rank saw inf/NaN
        module.loss_scaler = self  # a pipeline's train_step scales its schedule's loss by it

    def get_scale(self) -> float:
        """The current scale.

        >>> run_ranks(prog, lambda module: LossScaler(module).get_scale())[0]
        65536.0
        """
        return float(self._scale)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the scale (as GradScaler: a float32 product), to call backward on.

        >>> run_ranks(prog, lambda module: LossScaler(module, init_scale=4.0).scale(torch.tensor(0.5)))[0]
        tensor(2.)
        """
        return loss * self._scale

    def unscale_(self) -> bool:
        """Divide every gradient piece this rank holds by the scale; returns whether any rank found an inf
        or NaN (collective: every rank calls it after `sync_grads()`).

        >>> def overflow(module):
        ...     scaler = LossScaler(module, init_scale=2.0 ** 100)  # the scaled float16 loss overflows
        ...     scaler.scale(module(*module.local_inputs(*inputs))[0]).backward()
        ...     module.sync_grads()
        ...     return scaler.unscale_()
        >>> run_ranks(prog, overflow)
        {0: True, 1: True}
        """
        if not getattr(self.module, "grads_synced", True):
            raise UserInputError("LossScaler.unscale_ was called before module.sync_grads(): call "
                                 "module.sync_grads() after backward, then unscale_")
        if self.found_inf is not None:
            raise UserInputError("LossScaler.unscale_ was called twice in one step; call it once, then step() and "
                                 "update()")
        inv_scale = self._scale.double().reciprocal().float()  # GradScaler's reciprocal
        found = False
        with torch.no_grad():
            for grad, _ in grad_pieces(self.module):
                grad.mul_(inv_scale.to(grad.dtype))
                found = found or not bool(torch.isfinite(grad).all())
        self.found_inf = any_rank(self.module, found)
        return self.found_inf

    def step(self, optimizer) -> bool:
        """`optimizer.step()` unless a rank found an inf or NaN (then the step is skipped everywhere); unscales
        first if `unscale_` was not called. Returns whether the step ran.

        >>> def skipped(module):
        ...     scaler = LossScaler(module, init_scale=2.0 ** 100)
        ...     opt = torch.optim.SGD(module.parameters(), lr=0.1)
        ...     before = [p.detach().clone() for p in module.parameters()]
        ...     scaler.scale(module(*module.local_inputs(*inputs))[0]).backward()
        ...     module.sync_grads()
        ...     ran = scaler.step(opt)
        ...     return ran, all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
        >>> run_ranks(prog, skipped)
        {0: (False, True), 1: (False, True)}
        """
        if self.found_inf is None:
            self.unscale_()
        if self.found_inf:
            return False
        if optimizer is not None:
            optimizer.step()
        return True

    def update(self) -> None:
        """GradScaler's rule: after an overflow scale by backoff_factor, after growth_interval good steps in a
        row by growth_factor.

        >>> def grow(module):
        ...     scaler = LossScaler(module, init_scale=8.0, growth_interval=1)
        ...     scaler.scale(module(*module.local_inputs(*inputs))[0]).backward()
        ...     module.sync_grads()
        ...     scaler.step(None)
        ...     scaler.update()
        ...     return scaler.get_scale()
        >>> run_ranks(prog, grow)
        {0: 16.0, 1: 16.0}
        """
        if self.found_inf is None:
            raise UserInputError("LossScaler.update() needs unscale_() or step() first in this step")
        if self.found_inf:
            self._scale = self._scale * self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self._scale = self._scale * self.growth_factor
                self.growth_tracker = 0
        self.found_inf = None

    def state_dict(self) -> dict:
        """What a checkpoint keeps to resume the scale where it was.

        >>> run_ranks(prog, lambda module: LossScaler(module, init_scale=8.0).state_dict())[0]
        {'scale': 8.0, 'growth_tracker': 0, 'skipped_steps': 0}
        """
        return {"scale": self.get_scale(), "growth_tracker": self.growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`.

        >>> def resumed(module):
        ...     scaler = LossScaler(module)
        ...     scaler.load_state_dict({"scale": 2.0, "growth_tracker": 5, "skipped_steps": 1})
        ...     return scaler.get_scale(), scaler.growth_tracker
        >>> run_ranks(prog, resumed)[0]
        (2.0, 5)
        """
        self._scale = torch.tensor(float(state["scale"]), dtype=torch.float32)
        self.growth_tracker, self.skipped_steps = int(state["growth_tracker"]), int(state["skipped_steps"])


def optimizer_step(optimizer, scaler: LossScaler | None = None, scales: list | None = None) -> None:
    """One optimizer step: plain, or through `scaler` (skipped where a rank overflowed, then the scale
    updated and appended to `scales`).

    >>> def step(module):
    ...     scaler, scales = LossScaler(module, init_scale=2.0 ** 100), []
    ...     scaler.scale(module(*module.local_inputs(*inputs))[0]).backward()
    ...     module.sync_grads()
    ...     optimizer_step(torch.optim.SGD(module.parameters(), lr=0.1), scaler, scales)
    ...     return scales
    >>> run_ranks(prog, step)[0]
    [6.338253001141147e+29]
    """
    if scaler is None:
        if optimizer is not None:
            optimizer.step()
        return
    scaler.step(optimizer)
    scaler.update()
    if scales is not None:
        scales.append(scaler.get_scale())
