"""How verify trains both sides. `VerifyOptions`: the steps, learning rate, optimizer and dtype; within it `Training`:
how each verified step trains beyond the optimizer: gradient accumulation over several passes,
clipping by the global gradient norm (`verify --accumulate K --clip-grad-norm X`; the rank modules' side
is `RankModule.clip_grad_norm_`, autoshard/runtime/grad_norm.py) and the random-number mode and seed of
dropout (`verify --rng placement --seed S`; autoshard/runtime/rng.py).

>>> Training(clip_grad_norm=0.5).to_json()
{'accumulate': 1, 'clip_grad_norm': 0.5, 'rng': 'exact', 'seed': 0, 'mixed_precision': None}
>>> VerifyOptions(steps=1, dtype="float32").dtype
torch.float32
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.ir.errors import UserInputError
from autoshard.ir.mixed_precision import policy_call, resolve_policy
from autoshard.runtime.rng import MODES
from autoshard.verify.tolerance import resolve_dtype


@dataclass(frozen=True)
class Training:
    """How each verified step trains, beyond the optimizer: `accumulate` forward/backward passes over as
    many equal slices of the batch (dim 0) before one gradient sync and optimizer step, each pass's loss
    divided by `accumulate` (so the step equals one pass over the whole batch), and clipping by the global
    gradient norm (`clip_grad_norm`: max_norm) before the step. Random ops draw in `rng` mode from `seed`
    (the single device from `torch.manual_seed(seed)`); verify's default, "exact", gives every rank its
    block of the single device's dropout masks, so that the two can be compared. `mixed_precision`
    ("bf16", "fp16") trains both sides under that policy (autoshard/ir/mixed_precision.py); fp16 also scales the
    loss, with GradScaler's dynamic scale on both sides.

    >>> Training(accumulate=2, clip_grad_norm=1.0)
    Training(accumulate=2, clip_grad_norm=1.0, rng='exact', seed=0, mixed_precision=None)
    """

    accumulate: int = 1
    clip_grad_norm: float | None = None
    rng: str = "exact"
    seed: int = 0
    mixed_precision: str | None = None

    def __post_init__(self):
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise UserInputError(f"accumulate={self.accumulate!r}: give the number of passes per step, an int >= 1")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise UserInputError(f"clip_grad_norm={self.clip_grad_norm!r}: give the max norm, a number > 0")
        if self.rng not in MODES:
            raise UserInputError(f"rng={self.rng!r}: use one of {MODES}")
        resolve_policy(self.mixed_precision)  # an unknown policy is an error here already

    def program_options(self) -> dict:
        """The parallelize options this training needs (the random-number mode and seed).

        >>> Training().program_options()
        {'rng': 'exact', 'seed': 0, 'mixed_precision': None}
        """
        return {"rng": self.rng, "seed": self.seed, "mixed_precision": self.mixed_precision}

    def forward(self, model, inputs):
        """The single device's forward under this training's mixed-precision policy.

        >>> Training().forward(torch.nn.Linear(2, 1), (torch.ones(1, 2),)).shape
        torch.Size([1, 1])
        """
        policy = resolve_policy(self.mixed_precision)
        return model(*inputs) if policy is None else policy_call(model, inputs, policy)

    @property
    def loss_scaling(self) -> bool:
        """Whether both sides scale the loss (fp16: torch.amp.GradScaler on one device, a LossScaler per rank).

        >>> Training(mixed_precision="fp16").loss_scaling, Training().loss_scaling
        (True, False)
        """
        policy = resolve_policy(self.mixed_precision)
        return policy is not None and policy.needs_loss_scaling

    def passes(self, inputs) -> list[tuple]:
        """The batch as `accumulate` slices of dim 0 (one pass each).

        >>> Training(accumulate=2).passes((torch.arange(4),))
        [(tensor([0, 1]),), (tensor([2, 3]),)]
        """
        k = self.accumulate
        if k == 1:
            return [tuple(inputs)]
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] % k:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise UserInputError(f"accumulate={k}: example input {i} ({shape}) does not split into {k} equal "
                                     "slices of dim 0; give a batch that is a multiple of the passes")
        return [tuple(x.chunk(k)[j] for x in inputs) for j in range(k)]

    def to_json(self) -> dict:
        """What `verify --json` reports under "training".

        >>> Training().to_json()
        {'accumulate': 1, 'clip_grad_norm': None, 'rng': 'exact', 'seed': 0, 'mixed_precision': None}
        """
        return {"accumulate": self.accumulate, "clip_grad_norm": self.clip_grad_norm, "rng": self.rng,
                "seed": self.seed, "mixed_precision": self.mixed_precision}


PLAIN = Training()  # one pass per step, no clipping: the default everywhere


@dataclass(frozen=True)
class VerifyOptions:
    """What the single device and the ranks of one verify run share, built once by `verify_simulated` or
    `verify_factory` and passed down: `steps` optimizer steps of `optimizer` ("sgd" or "adam") at learning rate
    `lr`, in `dtype` (float64, float32 or bfloat16: a name or the torch dtype), each step trained as `training`
    says. `offload` keeps a ZeRO program's optimizer state on the host (the ranks' side; the single device has
    no ZeRO).

    >>> VerifyOptions(steps=1, dtype="bf16")  # doctest: +ELLIPSIS
    VerifyOptions(steps=1, lr=0.1, optimizer='sgd', offload=False, dtype=torch.bfloat16, training=Training(...))
    """

    steps: int = 2
    lr: float = 0.1
    optimizer: str = "sgd"
    offload: bool = False
    dtype: torch.dtype = torch.float64
    training: Training = PLAIN

    def __post_init__(self):
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))  # a name ("float32", "bf16") or a torch dtype


DEFAULT_OPTIONS = VerifyOptions()  # verify's defaults: 2 SGD steps at lr 0.1 in float64, PLAIN training
