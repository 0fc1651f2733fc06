"""Weight initialisers matching the authors' Flax defaults.

The original ViT code (google-research/vision_transformer) relies on Flax's defaults, which are
not PyTorch's: Dense/Conv kernels use LeCun-normal (a *truncated* normal), attention and MLP
kernels use Xavier-uniform, MLP biases a tiny normal. Reproducing them keeps training from
scratch comparable with the paper.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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


@contextmanager
def on_meta_device() -> Iterator[None]:
    """Modules built inside have their parameters on the meta device (shapes only, nothing
    allocated) and their initialisers skipped: what checking a configuration, counting parameters
    or counting FLOPs needs.

    A meta tensor holds no values, yet torch runs random fills and the arithmetic of truncated
    normals on it through its Python reference kernels, which import ``torch._dynamo`` and sympy:
    0.7 CPU-s for the first model a process builds, more than the build itself."""
    with torch.device("meta"), _SkipValueFills():
        yield


_aten = torch.ops.aten


class _SkipValueFills(TorchDispatchMode):
    """Returns the tensor unchanged for the in-place ops initialisers use to set values (never
    shapes); every other op runs as usual."""

    VALUE_FILLS = frozenset(
        {
            _aten.uniform_.default,
            _aten.normal_.default,
            _aten.erfinv_.default,
            _aten.clamp_.default,
            _aten.mul_.Tensor,
            _aten.mul_.Scalar,
            _aten.add_.Tensor,
            _aten.add_.Scalar,
            _aten.fill_.Scalar,
            _aten.zero_.default,
        }
    )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.VALUE_FILLS and args[0].is_meta:
            return args[0]
        return func(*args, **(kwargs or {}))
