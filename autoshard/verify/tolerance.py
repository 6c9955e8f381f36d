"""How closely `verify`'s parallel run must match the single device, per dtype.

float64 (the default): every largest relative difference within 1e-6; round-off is ~1e-16, so anything
above 1e-6 is a real mismatch.

float32 and bfloat16 (`--dtype`, for models with ops that have no float64 kernel): the parallel program
and the single-device reference both run in that dtype, and their rounding differs (sums split across
ranks are added in another order), so a fixed bound would be either too tight or blind. The bound
comes from the model's own numerical noise, measured per compared tensor:

1. train the single-device reference a second time, from weights and floating inputs each nudged by
   about one unit in the last place of the dtype (multiplied by 1 + eps or 1 - eps, eps the dtype's
   machine epsilon, sign drawn per element with seed 0) — a change as large as one rounding, which is
   what a different summation order makes of every partial sum;
2. the noise of a tensor (a loss, an output, a gradient, a parameter after the last step) is the
   largest relative difference between the two references, measured exactly as verify measures the
   parallel run (max |a - b| / max |b|);
3. its tolerance is `SAFETY` (10) x max(noise, eps): a tenfold margin over the model's own noise,
   floored at ten units of rounding for tensors the nudge leaves unchanged.

A tensor that is zero in exact arithmetic (e.g. the gradient of an attention key bias) is pure noise in
both runs, so its tolerance is loose while the others stay tight. Why not a float64 reference instead:
the models that need `--dtype` are exactly those that cannot run in float64; and splitting the batch
(another reduction order) changes the math of models that mix the batch (batch norm, batch-mean losses).

>>> tolerance_for(0.0, torch.float32) == 10 * torch.finfo(torch.float32).eps
True
"""
from __future__ import annotations

import copy
import re

import torch
import torch.utils._pytree as pytree

from autoshard.ir.errors import UserInputError

FLOAT64_TOLERANCE = 1e-6
SAFETY = 10.0
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
RULE = "10 x max(own noise, eps) per tensor; noise: the reference trained again from weights and inputs nudged by 1 ulp"


def resolve_dtype(dtype) -> torch.dtype:
    """The torch dtype verify compares in: a name in DTYPES (or 'bf16') or one of those torch dtypes.

    >>> resolve_dtype("bf16"), resolve_dtype(torch.float32)
    (torch.bfloat16, torch.float32)
    >>> resolve_dtype("float16")
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: dtype 'float16' is not one verify compares in; use one of float64, ...
    """
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    name = {"bf16": "bfloat16", "fp32": "float32", "fp64": "float64"}.get(dtype, dtype)
    if name not in DTYPES:
        raise UserInputError(f"dtype {dtype!r} is not one verify compares in; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32.

    >>> dtype_name(torch.bfloat16)
    'bfloat16'
    """
    return str(dtype).removeprefix("torch.")


def to_dtype(model, inputs, dtype=torch.float64):
    """A copy of `model` and of the floating inputs in `dtype` (integer inputs, e.g. token ids, stay).

    >>> from autoshard.zoo import mlp
    >>> model, inputs, _ = mlp(n_layers=2)
    >>> low, (x,) = to_dtype(model, inputs, torch.bfloat16)
    >>> low.layers[0].weight.dtype, x.dtype, model.layers[0].weight.dtype
    (torch.bfloat16, torch.bfloat16, torch.float32)
    """
    model = copy.deepcopy(model).to(dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    return model, inputs


def nudged(model, inputs, seed: int = 0, unit=None):
    """Copies of `model` (parameters) and `inputs` (floating ones) each multiplied by 1 + eps or 1 - eps of
    their dtype (of `unit`, a dtype, where given: mixed precision nudges by the compute dtype's eps, which
    its casts would otherwise round away), the sign drawn per element: the same math, rounded differently.

    >>> from autoshard.zoo import mlp
    >>> model, inputs, _ = mlp(n_layers=2)
    >>> moved, (x,) = nudged(model, inputs)
    >>> rel = ((x - inputs[0]).abs() / inputs[0].abs().clamp_min(1e-30)).max().item()
    >>> 0 < rel <= 2.5 * torch.finfo(torch.float32).eps
    True
    """
    generator = torch.Generator().manual_seed(seed)

    def nudge(t):
        eps = torch.finfo(unit or t.dtype).eps
        sign = torch.randint(0, 2, t.shape, generator=generator).to(torch.float64) * 2 - 1
        return (t.double() * (1 + eps * sign)).to(t.dtype)  # exact in float64, then one rounding

    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(nudge(p))
    return model, tuple(nudge(x) if x.is_floating_point() else x for x in inputs)


def coarsest_dtype(graph, dtype: torch.dtype) -> torch.dtype:
    """The least precise float dtype the program computes in (`dtype`, or lower inside autocast regions
    and under mixed precision): the noise run nudges by its eps and tolerances are measured in it.

    >>> import autoshard
    >>> from autoshard.zoo import mlp
    >>> model, inputs, loss_fn = mlp(n_layers=2)
    >>> prog = autoshard.parallelize(model, (1,), inputs, loss_fn=loss_fn, mixed_precision="bf16")
    >>> coarsest_dtype(prog.state.gm.graph, torch.float32)
    torch.bfloat16
    """
    found = [dtype]
    for node in graph.nodes:
        for val in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                found.append(val.dtype)
    return max(found, key=lambda d: torch.finfo(d).eps)


def tolerance_for(noise: float, dtype: torch.dtype) -> float:
    """The tolerance of one compared tensor: SAFETY x max(its noise, eps of dtype).

    >>> tolerance_for(3e-6, torch.float32)
    3e-05
    """
    return SAFETY * max(noise, torch.finfo(dtype).eps)


# "expected Double", "float != double" (a matmul of the model's own float32 tensor), a float32 fill value that a
# float64 extreme overflows
_NO_FLOAT64 = re.compile(r"\b[Dd]ouble\b|float64|cannot be converted to type float without overflow")


def float64_unsupported(exc: BaseException, model_name: str) -> UserInputError | None:
    """The error to raise when running a model in float64 failed for want of float64 (an op without a
    float64 kernel, or the model making float32 tensors of its own), else None.

    >>> err = float64_unsupported(RuntimeError("expected Float, got Double"), "MoE")
    >>> print(str(err).split(";")[0])
    the model MoE cannot run in float64, verify's default: RuntimeError: expected Float, got Double
    >>> float64_unsupported(RuntimeError("out of memory"), "MoE") is None
    True
    >>> float64_unsupported(RuntimeError("expected m1 and m2 to have the same dtype: float != double"), "M") is None
    False
    """
    text = str(exc).strip()
    if not isinstance(exc, (RuntimeError, NotImplementedError, TypeError)) or not _NO_FLOAT64.search(text):
        return None
    first = text.splitlines()[0] if text else type(exc).__name__
    return UserInputError(f"the model {model_name} cannot run in float64, verify's default: {type(exc).__name__}: "
                          f"{first}; an op has no float64 kernel on this device, or the model makes float32 tensors "
                          "of its own. Compare in the model's dtype instead: verify --dtype float32 (or bfloat16; "
                          "verify_factory/verify_simulated(..., dtype='float32')), whose tolerance comes from the "
                          "model's own rounding noise")
