"""Small ResNet image classifier (3x3 stem, two stages of BasicBlocks).

>>> model, inputs, loss_fn = resnet()
>>> loss = loss_fn(model(*inputs), *inputs)
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ResNetConfig:
    """Sizes of the ResNet: input channels, width, BasicBlocks per stage, classes.

    >>> ResNet(ResNetConfig(width=8)).fc  # stage 2 doubles the width
    Linear(in_features=16, out_features=8, bias=True)
    """

    in_channels: int = 3
    width: int = 16  # stem / stage-1 channels; stage 2 uses 2 * width
    blocks_per_stage: int = 1
    num_classes: int = 8


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a residual (a 1x1 projection when the shape changes).

    >>> BasicBlock(16, 16).downsample is None, BasicBlock(16, 32, stride=2).downsample is not None
    (True, True)
    """

    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x):
        """x ``[B, c_in, H, W]`` -> ``[B, c_out, H / stride, W / stride]``.

        >>> BasicBlock(16, 32, stride=2)(torch.randn(2, 16, 8, 8)).shape
        torch.Size([2, 32, 4, 4])
        """
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class ResNet(nn.Module):
    """Images ``[B, C, H, W]`` -> logits ``[B, num_classes]``; ``labels`` is ignored.

    >>> [name for name, _ in ResNet(ResNetConfig()).named_children()]
    ['stem', 'stage1', 'stage2', 'fc']
    """

    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.stem = nn.Sequential(
            nn.Conv2d(cfg.in_channels, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()
        )
        n = cfg.blocks_per_stage
        self.stage1 = nn.Sequential(*[BasicBlock(w, w) for _ in range(n)])
        self.stage2 = nn.Sequential(
            BasicBlock(w, 2 * w, stride=2), *[BasicBlock(2 * w, 2 * w) for _ in range(n - 1)]
        )
        self.fc = nn.Linear(2 * w, cfg.num_classes)

    def forward(self, images, labels=None):
        """images ``[B, C, H, W]`` -> logits ``[B, num_classes]`` (global average pooling).

        >>> ResNet(ResNetConfig())(torch.randn(2, 3, 16, 16)).shape
        torch.Size([2, 8])
        """
        x = self.stage2(self.stage1(self.stem(images)))
        return self.fc(x.mean((2, 3)))


def resnet_loss(logits, images, labels):
    """Cross-entropy of the logits against `labels` (`images` is unused).

    >>> resnet_loss(torch.zeros(2, 8), None, torch.tensor([1, 2])).item() == torch.log(torch.tensor(8.0)).item()
    True
    """
    return F.cross_entropy(logits, labels)


def resnet(batch=8, image_size=16, in_channels=3, width=16, blocks_per_stage=1, num_classes=8,
           device="cpu"):
    """Build a tiny ResNet; returns ``(model, (images, labels), loss_fn)``.

    >>> model, inputs, loss_fn = resnet()
    >>> model(*inputs).shape
    torch.Size([8, 8])
    """
    torch.manual_seed(0)
    cfg = ResNetConfig(in_channels, width, blocks_per_stage, num_classes)
    with torch.device(device):
        model = ResNet(cfg)
    images = torch.randn(batch, in_channels, image_size, image_size, device=device)
    labels = torch.randint(0, num_classes, (batch,), device=device)
    return model, (images, labels), resnet_loss
