"""Mixed precision (`parallelize(..., mixed_precision="bf16")`): fp32 master weights, bf16 compute.

The policy is FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) made part of the
traced program: the forward casts each floating parameter and floating input to bfloat16 where it is used
(`policy_call`), so the graph's parameters stay float32 (the master copy of each local shard, which the
optimizer updates; ZeRO shards them like any parameter), the compute and the activation collectives run
in bfloat16, and each gradient arrives on its master in float32 through the cast's backward, so the
gradient reductions (sync_grads, ZeRO's reduce-scatter) run in float32. The cost model reads the dtypes
from the graph: parameters, gradients and optimizer state at 4 bytes, activations and their collectives
at 2, and the bf16 copy of a weight a matmul saves for backward as an activation. Buffers keep their dtype
(as in FSDP). The single device "under the same policy" is the same call on the whole model.
`mixed_precision="fp16"` is the same policy in float16, whose small range needs the loss scaled: train
with `autoshard.runtime.loss_scale.LossScaler` (torch.amp.GradScaler's rule, overflow agreed by all ranks).

>>> import torch
>>> model = torch.nn.Linear(4, 2)
>>> out = policy_call(model, (torch.ones(3, 4),), resolve_policy("bf16"))
>>> out.dtype, model.weight.dtype
(torch.bfloat16, torch.float32)
>>> out.sum().float().backward(); model.weight.grad.dtype  # the master's gradient is float32
torch.float32
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.func import functional_call

from autoshard.ir import meta
from autoshard.ir.errors import UserInputError

aten = torch.ops.aten
_CASTS = (aten._to_copy.default, aten.to.dtype)


@dataclass(frozen=True)
class Policy:
    """Which dtype parameters and inputs are cast to for compute (the masters and reductions stay float32).

    >>> resolve_policy("bf16")
    Policy(name='bf16', compute_dtype=torch.bfloat16)
    """

    name: str
    compute_dtype: torch.dtype

    @property
    def needs_loss_scaling(self) -> bool:
        """float16's range is too small for small gradients: train with a LossScaler
        (autoshard/runtime/loss_scale.py), as torch.amp.GradScaler on one device.

        >>> resolve_policy("fp16").needs_loss_scaling, resolve_policy("bf16").needs_loss_scaling
        (True, False)
        """
        return self.compute_dtype == torch.float16


POLICIES = {"bf16": Policy("bf16", torch.bfloat16), "fp16": Policy("fp16", torch.float16)}


def resolve_policy(value) -> Policy | None:
    """`parallelize`'s `mixed_precision=` as a Policy (None: no cast); unsupported values are errors.

    >>> resolve_policy(None) is None, resolve_policy("bf16").compute_dtype
    (True, torch.bfloat16)
    >>> resolve_policy("float16")
    Policy(name='fp16', compute_dtype=torch.float16)
    >>> resolve_policy("int8")
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: mixed_precision='int8' is not a policy autoshard knows; use 'bf16' ...
    """
    if value is None or isinstance(value, Policy):
        return value
    aliases = {"bfloat16": "bf16", torch.bfloat16: "bf16", "float16": "fp16", torch.float16: "fp16"}
    name = aliases.get(value, value)
    if name in POLICIES:
        return POLICIES[name]
    raise UserInputError(f"mixed_precision={value!r} is not a policy autoshard knows; use 'bf16' (fp32 masters, "
                         "bf16 compute, fp32 gradient reductions), 'fp16' (the same in float16, with a LossScaler) "
                         "or None")


def policy_call(model: torch.nn.Module, inputs, policy: Policy):
    """`model(*inputs)` with every floating parameter and floating input cast to the policy's compute dtype
    (the parameters themselves are left as they are: their gradients come back in their own dtype).

    >>> policy_call(model, (torch.ones(3, 4),), resolve_policy("bf16")).shape
    torch.Size([3, 2])
    """
    dtype = policy.compute_dtype
    params = {name: p.to(dtype) if p.is_floating_point() else p
              for name, p in model.named_parameters(remove_duplicate=False)}
    cast = pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                           tuple(inputs))
    return functional_call(model, params, cast, tie_weights=False, strict=False)


def cast_parameter(node):
    """The parameter placeholder `node` casts to a lower-precision float (the policy's per-use cast), or
    None. Its gradient comes back through the cast, so a gradient partial at the cast's output is reduced
    like the parameter's own: after backward, on the float32 master (insert_comm defers it there; solve
    prices it as the parameter's sync at the master's bytes).

    >>> import autoshard
    >>> prog = autoshard.parallelize(model, (2,), (torch.ones(4, 4),), axis_names=("dp",),
    ...                              hints={"input:0": {"dp": "S(0)"}}, mixed_precision="bf16")
    >>> [cast_parameter(n).name for n in prog.state.gm.graph.nodes if cast_parameter(n) is not None]
    ['p_model_weight', 'p_model_bias']
    """
    if downcast_dtype(node) is None:
        return None
    source = node.args[0]
    return source if source.op == "placeholder" and source.meta.get(meta.KIND) == "param" else None


def downcast_dtype(node):
    """The dtype `node` casts its input to when it is a cast to a lower-precision float, else None.

    >>> import autoshard
    >>> prog = autoshard.parallelize(model, (1,), (torch.ones(4, 4),), mixed_precision="bf16")
    >>> {downcast_dtype(n) for n in prog.state.gm.graph.nodes} - {None}
    {torch.bfloat16}
    """
    if getattr(node, "op", None) != "call_function" or node.target not in _CASTS or not node.args:
        return None
    source = node.args[0]
    src, out = getattr(source, "meta", {}).get("val"), node.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return None
    return out.dtype if out.element_size() < src.element_size() else None
