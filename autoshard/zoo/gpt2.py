"""GPT-2 style decoder-only transformer (pre-LN, learned positions, tied head).

>>> model, inputs, loss_fn = gpt2()
>>> loss = loss_fn(model(*inputs), *inputs)
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPT2Config:
    """Sizes of a GPT-2 (defaults: tiny).

    >>> GPT2Config(n_layers=12, dim=768, n_heads=12).mlp_ratio * 768  # the MLP's hidden width
    3072
    """

    vocab_size: int = 64
    max_seq: int = 16
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.0


class Attention(nn.Module):
    """Causal multi-head self-attention: q, k, v projections, attention, output projection.

    >>> Attention(GPT2Config())(torch.randn(2, 16, 32)).shape
    torch.Size([2, 16, 32])
    """

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        """x ``[B, T, dim]`` -> ``[B, T, dim]``; position t sees positions up to t only.

        >>> attn, x = Attention(GPT2Config()), torch.randn(1, 4, 32)
        >>> later = x.clone()
        >>> later[0, 3] += 1.0  # change the last position: the earlier ones do not see it
        >>> torch.allclose(attn(later)[0, :3], attn(x)[0, :3])
        True
        """
        B, T, C = x.shape
        H = self.n_heads
        D = C // H
        q = self.q(x).view(B, T, H, D).transpose(1, 2)
        k = self.k(x).view(B, T, H, D).transpose(1, 2)
        v = self.v(x).view(B, T, H, D).transpose(1, 2)
        drop = {"dropout_p": self.resid_drop.p} if self.training and self.resid_drop.p else {}
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **drop)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """fc1, tanh-approximated GELU, fc2 (hidden width `mlp_ratio` x dim).

    >>> MLP(GPT2Config()).fc1
    Linear(in_features=32, out_features=128, bias=True)
    """

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        """x ``[..., dim]`` -> ``[..., dim]``, position by position.

        >>> MLP(GPT2Config())(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
        """
        return self.drop(self.fc2(F.gelu(self.fc1(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(x)).

    >>> [name for name, _ in Block(GPT2Config()).named_children()]
    ['ln1', 'attn', 'ln2', 'mlp']
    """

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x):
        """x ``[B, T, dim]`` -> ``[B, T, dim]``.

        >>> Block(GPT2Config())(torch.randn(2, 16, 32)).shape
        torch.Size([2, 16, 32])
        """
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab]``.

    >>> model = GPT2(GPT2Config())
    >>> model.lm_head.weight is model.wte.weight  # tied
    True
    """

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
        """ids ``[B, T]`` (T <= max_seq) -> logits ``[B, T, vocab]``.

        >>> GPT2(GPT2Config())(torch.randint(0, 64, (2, 10))).shape
        torch.Size([2, 10, 64])
        """
        T = ids.shape[1]
        pos = torch.arange(T, device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(pos))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


def gpt2_loss(logits, ids):
    """Next-token cross-entropy: position t predicts token t+1.

    >>> ids = torch.randint(0, 64, (2, 16))
    >>> logits = torch.zeros(2, 16, 64)  # uniform predictions
    >>> round(gpt2_loss(logits, ids).item(), 4) == round(torch.log(torch.tensor(64.0)).item(), 4)
    True
    """
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


def gpt2(batch=8, seq=16, dim=32, n_heads=4, n_layers=2, vocab_size=64, device="cpu", dropout=0.0):
    """Build a tiny GPT-2; returns ``(model, (ids,), loss_fn)``. `dropout` applies to the embeddings, the
    attention weights and both residual branches (GPT-2 trains with 0.1).

    >>> model, inputs, loss_fn = gpt2()
    >>> model(*inputs).shape
    torch.Size([8, 16, 64])
    """
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab_size, max_seq=seq, dim=dim, n_heads=n_heads, n_layers=n_layers, dropout=dropout)
    with torch.device(device):  # build directly on device (keeps weight tying on meta)
        model = GPT2(cfg)
    ids = torch.randint(0, vocab_size, (batch, seq), device=device)
    return model, (ids,), gpt2_loss
