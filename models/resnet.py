"""The BiT-style ResNet stem of the hybrid ViTs (paper section 3.1, "Hybrid Architecture").

As in the authors' ``models_resnet.py``: post-activation bottleneck units whose convolutions use
weight standardisation, GroupNorm (32 groups) instead of BatchNorm, TensorFlow "SAME" padding,
and the stride on the 3x3 convolution. The stem's feature map is then cut into 1x1 "patches".
Module names follow the original parameter names (``conv_root``, ``gn_root``, ``block1/unit1``
-> ``stages[0][0]``, ``conv1``/``gn1``...), which keeps the .npz mapping one line per tensor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .initializers import lecun_normal_

# Flax's GroupNorm defaults, which the released hybrid checkpoints were trained with.
GROUPNORM_GROUPS = 32
GROUPNORM_EPS = 1e-6
# Added to the kernel's standard deviation (not its variance) as in the authors' StdConv.
WEIGHT_STANDARDIZATION_EPS = 1e-5


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow "SAME" padding (before, after) for one spatial dimension: the extra pixel goes after."""
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def pad_same(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:
    """Pads an NCHW tensor so that a ``kernel``/``stride`` window gives TensorFlow "SAME" output."""
    top, bottom = same_padding(x.shape[-2], kernel, stride)
    left, right = same_padding(x.shape[-1], kernel, stride)
    if top == bottom == left == right == 0:
        return x
    return F.pad(x, (left, right, top, bottom), value=value)


class StdConv2d(nn.Conv2d):
    """Bias-free convolution whose kernel is standardised per output channel at every call."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0, bias=False)
        lecun_normal_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std, mean = torch.std_mean(self.weight, dim=(1, 2, 3), correction=0, keepdim=True)
        weight = (self.weight - mean) / (std + WEIGHT_STANDARDIZATION_EPS)
        x = pad_same(x, self.kernel_size[0], self.stride[0])
        return F.conv2d(x, weight, None, self.stride)


def _group_norm(channels: int, zero_scale: bool = False) -> nn.GroupNorm:
    norm = nn.GroupNorm(GROUPNORM_GROUPS, channels, eps=GROUPNORM_EPS)
    if zero_scale:
        # The last norm of each residual branch starts at zero so every unit starts as identity.
        nn.init.zeros_(norm.weight)
    return norm


class BottleneckUnit(nn.Module):
    """Post-activation bottleneck: 1x1 -> 3x3 (strided) -> 1x1 (x4 channels), projected shortcut."""

    def __init__(self, in_channels: int, features: int, stride: int) -> None:
        super().__init__()
        out_channels = features * 4
        self.conv1 = StdConv2d(in_channels, features, 1)
        self.gn1 = _group_norm(features)
        self.conv2 = StdConv2d(features, features, 3, stride=stride)
        self.gn2 = _group_norm(features)
        self.conv3 = StdConv2d(features, out_channels, 1)
        self.gn3 = _group_norm(out_channels, zero_scale=True)
        needs_projection = in_channels != out_channels or stride != 1
        self.conv_proj = StdConv2d(in_channels, out_channels, 1, stride=stride) if needs_projection else None
        self.gn_proj = _group_norm(out_channels) if needs_projection else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.conv_proj is None else self.gn_proj(self.conv_proj(x))
        y = F.relu(self.gn1(self.conv1(x)))
        y = F.relu(self.gn2(self.conv2(y)))
        y = self.gn3(self.conv3(y))
        return F.relu(shortcut + y)


class ResNetStem(nn.Module):
    """Root (7x7/2 conv, GroupNorm, ReLU, 3x3/2 max-pool) followed by bottleneck stages.

    ``stage_units`` gives the units per stage, e.g. ``(3, 4, 9)`` for the R50 of R50+ViT-B/16:
    the root reduces 4x, every stage after the first 2x, so the total stride is
    ``4 * 2 ** (len(stage_units) - 1)``.
    """

    def __init__(self, stage_units: tuple[int, ...], width: int = 64, in_channels: int = 3) -> None:
        super().__init__()
        if not stage_units or any(units < 1 for units in stage_units):
            raise ValueError(f"stage_units must be a non-empty tuple of positive unit counts, got {stage_units}")
        self.stage_units = tuple(stage_units)
        self.conv_root = StdConv2d(in_channels, width, 7, stride=2)
        self.gn_root = _group_norm(width)
        stages = []
        channels = width
        for index, units in enumerate(self.stage_units):
            features = width * 2**index
            stage = []
            for unit in range(units):
                stride = 2 if index > 0 and unit == 0 else 1
                stage.append(BottleneckUnit(channels, features, stride))
                channels = features * 4
            stages.append(nn.ModuleList(stage))
        self.stages = nn.ModuleList(stages)
        self.out_channels = channels
        self.stride = 4 * 2 ** (len(self.stage_units) - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.gn_root(self.conv_root(x)))
        x = F.max_pool2d(pad_same(x, 3, 2, value=float("-inf")), kernel_size=3, stride=2)
        for stage in self.stages:
            for unit in stage:
                x = unit(x)
        return x
