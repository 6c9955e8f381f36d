"""LLaMA style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases.

>>> model, inputs, loss_fn = llama()
>>> loss = loss_fn(model(*inputs), *inputs)
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    """Sizes of a LLaMA (defaults: tiny; grouped-query attention with 8 heads on 4 kv heads).

    >>> LlamaConfig().head_dim
    4
    """

    vocab_size: int = 64
    max_seq: int = 16
    dim: int = 32
    n_heads: int = 8
    n_kv_heads: int = 4
    n_layers: int = 2
    ffn_dim: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0  # on the attention weights and both residual branches (0: no dropout ops at all)

    @property
    def head_dim(self):
        """dim / n_heads.

        >>> LlamaConfig(dim=4096, n_heads=32).head_dim
        128
        """
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no mean subtraction, no bias).

    >>> RMSNorm(4).weight
    Parameter containing:
    tensor([1., 1., 1., 1.], requires_grad=True)
    """

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self):
        """The scale back to ones (what weights="init" replays).

        >>> norm = RMSNorm(2); _ = norm.weight.data.zero_(); norm.reset_parameters(); norm.weight.tolist()
        [1.0, 1.0]
        """
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x):
        """x / rms(x) * weight over the last dim.

        >>> RMSNorm(2)(torch.tensor([[3.0, 4.0]]))  # rms = sqrt(12.5)
        tensor([[0.8485, 1.1314]], grad_fn=<MulBackward0>)
        """
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    """[x1, x2] -> [-x2, x1] on the last dim (RoPE's rotation by 90 degrees).

    >>> rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    tensor([-3., -4.,  1.,  2.])
    """
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def apply_rope(x, cos, sin):
    """x: [B, H, T, D]; cos/sin: [T, D] (broadcast over B and H), in x's dtype (bf16 compute keeps the
    float32 tables, as transformers' Llama does).

    >>> x = torch.randn(1, 1, 3, 4)
    >>> torch.allclose(apply_rope(x, torch.ones(3, 4), torch.zeros(3, 4)), x)  # angle 0: unchanged
    True
    """
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal grouped-query attention with rotary position embeddings.

    >>> attn = Attention(LlamaConfig())
    >>> attn.k.out_features, attn.q.out_features  # 4 kv heads serve 8 query heads
    (16, 32)
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x, cos, sin):
        """x ``[B, T, dim]``, RoPE tables cos/sin ``[T, head_dim]`` -> ``[B, T, dim]``.

        >>> model = Llama(LlamaConfig())
        >>> cos, sin = model.rope_cos[:16], model.rope_sin[:16]
        >>> Attention(LlamaConfig())(torch.randn(2, 16, 32), cos, sin).shape
        torch.Size([2, 16, 32])
        """
        B, T, _ = x.shape
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        n_rep = H // KV
        q = self.q(x).view(B, T, H, D).transpose(1, 2)
        k = self.k(x).view(B, T, KV, D).transpose(1, 2)
        v = self.v(x).view(B, T, KV, D).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Grouped-query attention: repeat each kv head n_rep times.
        k = k[:, :, None].expand(B, KV, n_rep, T, D).reshape(B, KV * n_rep, T, D)
        v = v[:, :, None].expand(B, KV, n_rep, T, D).reshape(B, KV * n_rep, T, D)
        drop = {"dropout_p": self.dropout} if self.training and self.dropout else {}
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **drop)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * D))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x).

    >>> FeedForward(LlamaConfig()).w1
    Linear(in_features=32, out_features=64, bias=False)
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x):
        """x ``[..., dim]`` -> ``[..., dim]``.

        >>> FeedForward(LlamaConfig())(torch.randn(3, 32)).shape
        torch.Size([3, 32])
        """
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then + mlp(ffn_norm(x)).

    >>> [name for name, _ in Block(LlamaConfig()).named_children()]
    ['attn_norm', 'attn', 'ffn_norm', 'mlp']
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)
        self.dropout = cfg.dropout

    def _drop(self, x):
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    def forward(self, x, cos, sin):
        """x ``[B, T, dim]`` and the RoPE tables -> ``[B, T, dim]``.

        >>> model = Llama(LlamaConfig())
        >>> Block(LlamaConfig())(torch.randn(2, 8, 32), model.rope_cos[:8], model.rope_sin[:8]).shape
        torch.Size([2, 8, 32])
        """
        x = x + self._drop(self.attn(self.attn_norm(x), cos, sin))
        return x + self._drop(self.mlp(self.ffn_norm(x)))


class Llama(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab]``.

    >>> Llama(LlamaConfig()).rope_cos.shape  # a buffer: [max_seq, head_dim]
    torch.Size([16, 4])
    """

    block_class = Block  # a variant's own block (the mixture-of-experts LLaMA's, autoshard/zoo/moe.py)

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(self.block_class(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # RoPE tables, [max_seq, head_dim], non-persistent (recomputable, not in state_dict).
        cos, sin = self._rope_tables()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _rope_tables(self):
        D = self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        freqs = torch.outer(torch.arange(self.cfg.max_seq, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def reset_parameters(self):
        """Recompute the RoPE tables (a model built on the meta device gets them from weights="init" or
        when loading a checkpoint, which does not hold them).

        >>> model = Llama(LlamaConfig()); cos = model.rope_cos.clone(); _ = model.rope_cos.zero_()
        >>> model.reset_parameters(); torch.equal(model.rope_cos, cos)
        True
        """
        cos, sin = self._rope_tables()
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, ids):
        """ids ``[B, T]`` (T <= max_seq) -> logits ``[B, T, vocab]``.

        >>> Llama(LlamaConfig())(torch.randint(0, 64, (2, 10))).shape
        torch.Size([2, 10, 64])
        """
        T = ids.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def llama_loss(logits, ids):
    """Next-token cross-entropy: position t predicts token t+1.

    >>> ids = torch.randint(0, 64, (2, 16))
    >>> round(llama_loss(torch.zeros(2, 16, 64), ids).item(), 4) == round(torch.log(torch.tensor(64.0)).item(), 4)
    True
    """
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


def llama(batch=8, seq=16, dim=32, n_heads=8, n_kv_heads=4, n_layers=2, ffn_dim=64,
          vocab_size=64, device="cpu", dropout=0.0):
    """Build a tiny LLaMA; returns ``(model, (ids,), loss_fn)``; `dropout` on the attention weights and
    both residual branches.

    >>> model, inputs, loss_fn = llama()
    >>> model(*inputs).shape
    torch.Size([8, 16, 64])
    """
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, max_seq=seq, dim=dim, n_heads=n_heads,
                      n_kv_heads=n_kv_heads, n_layers=n_layers, ffn_dim=ffn_dim, dropout=dropout)
    with torch.device(device):
        model = Llama(cfg)
    ids = torch.randint(0, vocab_size, (batch, seq), device=device)
    return model, (ids,), llama_loss
