"""GPT-2 style decoder-only transformer (pre-LN, learned positions, tied head).

>>> model, inputs, loss_fn = gpt2()
>>> loss = loss_fn(model(*inputs), *inputs)
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPT2Config:
    vocab_size: int = 64
    max_seq: int = 16
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.0


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        H = self.n_heads
        D = C // H
        q = self.q(x).view(B, T, H, D).transpose(1, 2)
        k = self.k(x).view(B, T, H, D).transpose(1, 2)
        v = self.v(x).view(B, T, H, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.fc2(F.gelu(self.fc1(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab]``."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, ids):
        T = ids.shape[1]
        pos = torch.arange(T, device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(pos))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


def gpt2_loss(logits, ids):
    """Next-token cross-entropy: position t predicts token t+1."""
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


def gpt2(batch=8, seq=16, dim=32, n_heads=4, n_layers=2, vocab_size=64, device="cpu"):
    """Build a tiny GPT-2; returns ``(model, (ids,), loss_fn)``.

    >>> model, inputs, loss_fn = gpt2()
    >>> model(*inputs).shape
    torch.Size([8, 16, 64])
    """
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab_size, max_seq=seq, dim=dim, n_heads=n_heads, n_layers=n_layers)
    with torch.device(device):  # build directly on device (keeps weight tying on meta)
        model = GPT2(cfg)
    ids = torch.randint(0, vocab_size, (batch, seq), device=device)
    return model, (ids,), gpt2_loss
