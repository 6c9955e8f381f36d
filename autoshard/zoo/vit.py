"""Vision Transformer classifier (conv patch embedding, cls token, pre-LN blocks).

>>> model, inputs, loss_fn = vit()
>>> loss = loss_fn(model(*inputs), *inputs)
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ViTConfig:
    """Sizes of the ViT (defaults: tiny; 16 x 16 images in 4 x 4 patches).

    >>> ViTConfig().n_patches
    16
    """

    image_size: int = 16
    patch: int = 4
    in_channels: int = 3
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    num_classes: int = 8
    dropout: float = 0.0

    @property
    def n_patches(self):
        """Patches per image: (image_size / patch) ** 2.

        >>> ViTConfig(image_size=224, patch=16).n_patches
        196
        """
        return (self.image_size // self.patch) ** 2


class Attention(nn.Module):
    """Non-causal multi-head self-attention over the patch tokens.

    >>> Attention(ViTConfig())(torch.randn(2, 17, 32)).shape
    torch.Size([2, 17, 32])
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        """x ``[B, T, dim]`` -> ``[B, T, dim]``.

        >>> Attention(ViTConfig())(torch.randn(1, 5, 32)).shape
        torch.Size([1, 5, 32])
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

    >>> MLP(ViTConfig()).fc1.out_features
    128
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        """x ``[..., dim]`` -> ``[..., dim]``.

        >>> MLP(ViTConfig())(torch.randn(3, 32)).shape
        torch.Size([3, 32])
        """
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Pre-LN transformer block.

    >>> [name for name, _ in Block(ViTConfig()).named_children()]
    ['ln1', 'attn', 'ln2', 'mlp']
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x):
        """x ``[B, T, dim]`` -> ``[B, T, dim]``.

        >>> Block(ViTConfig())(torch.randn(2, 17, 32)).shape
        torch.Size([2, 17, 32])
        """
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    """Images ``[B, C, H, W]`` -> logits ``[B, num_classes]``; ``labels`` is ignored.

    >>> ViT(ViTConfig()).pos_embed.shape  # 16 patches and the class token
    torch.Size([1, 17, 32])
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.dim, cfg.patch, stride=cfg.patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, cfg.dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.n_patches + 1, cfg.dim) * 0.02)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def reset_parameters(self):
        """Draw the class token and position embeddings again, N(0, 0.02) (what weights="init" replays).

        >>> model = ViT(ViTConfig()); _ = model.cls_token.data.zero_(); model.reset_parameters()
        >>> bool(model.cls_token.abs().sum() > 0)
        True
        """
        with torch.no_grad():
            self.cls_token.normal_(0.0, 0.02)
            self.pos_embed.normal_(0.0, 0.02)

    def forward(self, images, labels=None):
        """images ``[B, C, H, W]`` -> logits ``[B, num_classes]`` (from the class token).

        >>> ViT(ViTConfig())(torch.randn(2, 3, 16, 16)).shape
        torch.Size([2, 8])
        """
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # [B, N, dim]
        B = x.shape[0]
        cls = self.cls_token.expand(B, -1, -1)
        x = self.drop(torch.cat((cls, x), dim=1) + self.pos_embed)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x)[:, 0])


def vit_loss(logits, images, labels):
    """Cross-entropy of the logits against `labels` (`images` is unused).

    >>> vit_loss(torch.zeros(2, 8), None, torch.tensor([1, 2])).item() == torch.log(torch.tensor(8.0)).item()
    True
    """
    return F.cross_entropy(logits, labels)


def vit(batch=8, image_size=16, patch=4, dim=32, n_heads=4, n_layers=2, num_classes=8,
        device="cpu"):
    """Build a tiny ViT; returns ``(model, (images, labels), loss_fn)``.

    >>> model, inputs, loss_fn = vit()
    >>> model(*inputs).shape
    torch.Size([8, 8])
    """
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=image_size, patch=patch, dim=dim, n_heads=n_heads,
                    n_layers=n_layers, num_classes=num_classes)
    with torch.device(device):
        model = ViT(cfg)
    images = torch.randn(batch, 3, image_size, image_size, device=device)
    labels = torch.randint(0, num_classes, (batch,), device=device)
    return model, (images, labels), vit_loss
