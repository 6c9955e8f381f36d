"""One causal self-attention block (fused q/k/v projection, scaled_dot_product_attention, output projection) on
float inputs: the context-parallel benchmark's model, where every collective on the cp axis is the attention's.

>>> model, (x,), loss_fn = attention_block(seq=16, dim=32, heads=4)
>>> loss_fn(model(x), x).dim()
0
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class AttentionBlock(torch.nn.Module):
    """x [B, L, D] -> x + out(attention(qkv(x))), causal, `heads` heads."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


def block_loss(out, x):
    """Mean square of the block's output."""
    return (out * out).mean()


def attention_block(batch: int = 1, seq: int = 1024, dim: int = 128, heads: int = 4, dtype=torch.float32):
    """A seeded block and its input; `(model, (x,), loss_fn)`."""
    torch.manual_seed(0)
    model = AttentionBlock(dim, heads).to(dtype)
    return model, (torch.randn(batch, seq, dim, dtype=dtype),), block_loss
