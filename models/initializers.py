"""Weight initialisers matching the authors' Flax defaults.

The original ViT code (google-research/vision_transformer) relies on Flax's defaults, which are
not PyTorch's: Dense/Conv kernels use LeCun-normal (a *truncated* normal), attention and MLP
kernels use Xavier-uniform, MLP biases a tiny normal. Reproducing them keeps training from
scratch comparable with the paper.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Standard deviation of a unit normal truncated to [-2, 2]; Flax divides by it so that the
# truncated samples keep the requested variance.
_TRUNCATED_NORMAL_STD = 0.87962566103423978


def lecun_normal_(weight: torch.Tensor) -> torch.Tensor:
    """Flax ``lecun_normal``: truncated normal (at 2 std) with variance ``1 / fan_in``.

    Works for Linear ``(out, in)`` and Conv ``(out, in, kh, kw)`` weights alike.
    """
    fan_in = weight[0].numel()
    std = math.sqrt(1.0 / fan_in) / _TRUNCATED_NORMAL_STD
    return nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-2.0 * std, b=2.0 * std)


def xavier_uniform_square_blocks_(weight: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Xavier-uniform on each of ``num_blocks`` equal row blocks of a Linear weight.

    A fused query/key/value projection is three separate ``D x D`` Dense layers in the original
    code; initialising the fused ``3D x D`` matrix at once would use the wrong fan-out.
    """
    with torch.no_grad():
        for block in weight.chunk(num_blocks, dim=0):
            nn.init.xavier_uniform_(block)
    return weight
