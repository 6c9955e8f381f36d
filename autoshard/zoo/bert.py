"""BERT style encoder classifier (post-LN, non-causal attention, mean-pooled head).

>>> model, inputs, loss_fn = bert()
>>> loss = loss_fn(model(*inputs), *inputs)
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class BertConfig:
    """Sizes of a BERT classifier (defaults: tiny).

    >>> BertConfig(num_classes=2).num_classes
    2
    """

    vocab_size: int = 64
    max_seq: int = 16
    type_vocab_size: int = 2
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    num_classes: int = 8
    dropout: float = 0.0


class Attention(nn.Module):
    """Non-causal multi-head self-attention.

    >>> Attention(BertConfig())(torch.randn(2, 16, 32)).shape
    torch.Size([2, 16, 32])
    """

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        """x ``[B, T, dim]`` -> ``[B, T, dim]``; every position sees every position.

        >>> attn, x = Attention(BertConfig()), torch.randn(1, 4, 32)
        >>> later = x.clone()
        >>> later[0, 3] += 1.0  # unlike GPT-2, the first position sees the change
        >>> torch.allclose(attn(later)[0, 0], attn(x)[0, 0])
        False
        """
        B, T, C = x.shape
        H = self.n_heads
        D = C // H
        q = self.q(x).view(B, T, H, D).transpose(1, 2)
        k = self.k(x).view(B, T, H, D).transpose(1, 2)
        v = self.v(x).view(B, T, H, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    """fc1, GELU, fc2.

    >>> MLP(BertConfig()).fc2
    Linear(in_features=128, out_features=32, bias=True)
    """

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        """x ``[..., dim]`` -> ``[..., dim]``.

        >>> MLP(BertConfig())(torch.randn(3, 32)).shape
        torch.Size([3, 32])
        """
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Post-LN block, as in the original BERT.

    >>> [name for name, _ in Block(BertConfig()).named_children()]
    ['attn', 'ln1', 'mlp', 'ln2']
    """

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attn = Attention(cfg)
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)

    def forward(self, x):
        """x ``[B, T, dim]`` -> ``[B, T, dim]``, layer-normalised.

        >>> out = Block(BertConfig())(torch.randn(2, 16, 32))
        >>> out.shape, bool(out.mean(-1).abs().max() < 1e-5)
        (torch.Size([2, 16, 32]), True)
        """
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class Bert(nn.Module):
    """Token ids ``[B, T]`` -> class logits ``[B, num_classes]``; ``labels`` is ignored.

    >>> Bert(BertConfig()).classifier
    Linear(in_features=32, out_features=8, bias=True)
    """

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.position_embeddings = nn.Embedding(cfg.max_seq, cfg.dim)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.dim)
        self.emb_ln = nn.LayerNorm(cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.classifier = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, ids, labels=None):
        """ids ``[B, T]`` -> class logits ``[B, num_classes]`` (mean over positions).

        >>> Bert(BertConfig())(torch.randint(0, 64, (2, 16))).shape
        torch.Size([2, 8])
        """
        T = ids.shape[1]
        pos = torch.arange(T, device=ids.device)
        types = torch.zeros_like(ids)
        x = self.word_embeddings(ids) + self.position_embeddings(pos) + self.token_type_embeddings(types)
        x = self.drop(self.emb_ln(x))
        for layer in self.layers:
            x = layer(x)
        return self.classifier(x.mean(1))


def bert_loss(logits, ids, labels):
    """Cross-entropy of the class logits against `labels` (`ids` is unused).

    >>> bert_loss(torch.zeros(4, 8), None, torch.tensor([0, 1, 2, 3])).item() == torch.log(torch.tensor(8.0)).item()
    True
    """
    return F.cross_entropy(logits, labels)


def bert(batch=8, seq=16, dim=32, n_heads=4, n_layers=2, vocab_size=64, num_classes=8,
         device="cpu"):
    """Build a tiny BERT classifier; returns ``(model, (ids, labels), loss_fn)``.

    >>> model, inputs, loss_fn = bert()
    >>> model(*inputs).shape
    torch.Size([8, 8])
    """
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=vocab_size, max_seq=seq, dim=dim, n_heads=n_heads,
                     n_layers=n_layers, num_classes=num_classes)
    with torch.device(device):
        model = Bert(cfg)
    ids = torch.randint(0, vocab_size, (batch, seq), device=device)
    labels = torch.randint(0, num_classes, (batch,), device=device)
    return model, (ids, labels), bert_loss
