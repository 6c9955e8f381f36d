"""A plain multi-layer perceptron.

>>> model, inputs, loss_fn = mlp()
>>> loss = loss_fn(model(*inputs), *inputs)
"""
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MLPConfig:
    """Sizes of the MLP: input, hidden and output features, number of Linear layers.

    >>> MLP(MLPConfig(n_layers=2)).layers
    ModuleList(
      (0): Linear(in_features=32, out_features=128, bias=True)
      (1): Linear(in_features=128, out_features=32, bias=True)
    )
    """

    in_dim: int = 32
    hidden: int = 128
    out_dim: int = 32
    n_layers: int = 3  # number of nn.Linear layers


class MLP(nn.Module):
    """Stack of ``nn.Linear`` layers (in a ModuleList named ``layers``) with GELU between them.

    >>> len(MLP(MLPConfig()).layers)
    3
    """

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.cfg = cfg
        dims = [cfg.in_dim] + [cfg.hidden] * (cfg.n_layers - 1) + [cfg.out_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))

    def forward(self, x):
        """x ``[..., in_dim]`` -> ``[..., out_dim]``.

        >>> MLP(MLPConfig(out_dim=4))(torch.randn(8, 32)).shape
        torch.Size([8, 4])
        """
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


def mlp_loss(out, x):
    """mean(out ** 2) (`x` is unused).

    >>> mlp_loss(torch.tensor([1.0, 3.0]), None)
    tensor(5.)
    """
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
