"""A plain multi-layer perceptron.

>>> model, inputs, loss_fn = mlp()
>>> loss = loss_fn(model(*inputs), *inputs)
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MLPConfig:
    in_dim: int = 32
    hidden: int = 128
    out_dim: int = 32
    n_layers: int = 3  # number of nn.Linear layers


class MLP(nn.Module):
    """Stack of ``nn.Linear`` layers (in a ModuleList named ``layers``) with GELU between them."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.cfg = cfg
        dims = [cfg.in_dim] + [cfg.hidden] * (cfg.n_layers - 1) + [cfg.out_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


def mlp_loss(out, x):
    return out.pow(2).mean()


def mlp(batch=8, in_dim=32, hidden=128, out_dim=32, n_layers=3, device="cpu"):
    """Build a tiny MLP; returns ``(model, (x,), loss_fn)``.

    >>> model, inputs, loss_fn = mlp()
    >>> model(*inputs).shape
    torch.Size([8, 32])
    """
    torch.manual_seed(0)
    cfg = MLPConfig(in_dim, hidden, out_dim, n_layers)
    with torch.device(device):  # build directly on device (keeps weight tying on meta)
        model = MLP(cfg)
    x = torch.randn(batch, in_dim, device=device)
    return model, (x,), mlp_loss
