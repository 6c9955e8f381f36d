"""The strategy registry: ATen op -> rule listing per-axis sharding candidates (see base.py).

>>> import torch
>>> REGISTRY.lookup(torch.ops.aten.gelu.default).note
'elementwise'
"""
from autoshard.strategies import attention, einsum, nn_ops, pointwise, reduction, views  # noqa: F401  (rules register on import)
from autoshard.strategies.base import (
    REGISTRY,
    AxisStrategy,
    RuleContext,
    candidates_for,
    mutated_positions,
    register,
    tensor_inputs,
)

__all__ = ["REGISTRY", "AxisStrategy", "RuleContext", "candidates_for", "mutated_positions", "register", "tensor_inputs"]
