"""Make the zoo's attention work on a tensor-parallel rank's local heads, for torch's parallelize_module.

ColwiseParallel hands the attention local q/k/v with n_heads / tp heads, so a hand-written Megatron
plan needs attention code that reads head counts per rank (torchtitan's models do this). The zoo's
Llama reads them from attributes; the zoo's GPT-2 derives the head size from the global width, so its
attention gets a local-shape forward here. autoshard needs neither change.
"""
from __future__ import annotations

import types

import torch.nn.functional as F


def _gpt2_local_forward(self, x):
    B, T, _ = x.shape
    q, k, v = self.q(x), self.k(x), self.v(x)
    width = q.shape[-1]  # this rank's share of the model width
    H = self.n_heads
    q, k, v = (t.view(B, T, H, width // H).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, width)))


def use_local_heads(model_name: str, model, tp: int) -> None:
    """Divide every attention's head counts by `tp` (in place)."""
    for block in model.layers:
        attn = block.attn
        attn.n_heads //= tp
        if model_name == "llama":
            attn.n_kv_heads //= tp
        else:
            attn.forward = types.MethodType(_gpt2_local_forward, attn)
