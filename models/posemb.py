"""Position-embedding resampling for a change of resolution (paper section 3.2)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def split_posemb(posemb: torch.Tensor, num_prefix_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Splits ``(1, [cls] + g*g, D)`` into the class-token part, the ``(g, g, D)`` grid and ``g``.

    ``num_prefix_tokens`` (0 or 1) is inferred when None: a square token count means no class
    token, a square plus one means one (both can only hold for a single token).
    """
    if posemb.ndim != 3 or posemb.shape[0] != 1:
        raise ValueError(f"posemb must have shape (1, tokens, dim), got {tuple(posemb.shape)}")
    num_tokens = posemb.shape[1]
    if num_prefix_tokens is None:
        if math.isqrt(num_tokens) ** 2 == num_tokens:
            num_prefix_tokens = 0
        elif num_tokens > 1 and math.isqrt(num_tokens - 1) ** 2 == num_tokens - 1:
            num_prefix_tokens = 1
        else:
            raise ValueError(
                f"posemb has {num_tokens} tokens, which is neither a square grid nor a class token plus a square grid"
            )
    grid_tokens = num_tokens - num_prefix_tokens
    side = math.isqrt(grid_tokens)
    if side * side != grid_tokens or grid_tokens == 0:
        raise ValueError(
            f"posemb has {grid_tokens} grid tokens after {num_prefix_tokens} prefix token(s); not a square"
        )
    prefix = posemb[:, :num_prefix_tokens]
    grid = posemb[0, num_prefix_tokens:].reshape(side, side, posemb.shape[2])
    return prefix, grid, side


def resample_posemb(
    posemb: torch.Tensor,
    new_grid: int | tuple[int, int],
    *,
    num_prefix_tokens: int | None = None,
) -> torch.Tensor:
    """Resamples a learnt position embedding to another patch grid, keeping the class token.

    ``posemb`` is ``(1, [cls] + g*g, D)``; the result is ``(1, [cls] + H*W, D)`` for
    ``new_grid = H`` (square) or ``(H, W)``. The grid is zoomed bilinearly with exactly the
    semantics of ``scipy.ndimage.zoom(grid, (H/g, W/g, 1), order=1)`` as in the authors' code:
    zoom maps output index ``o`` to input coordinate ``o * (g-1)/(H-1)``, i.e. corners aligned,
    which is torch's ``align_corners=True`` (not the default ``False``). Computed in float64 and
    returned in the input's dtype.
    """
    new_h, new_w = (new_grid, new_grid) if isinstance(new_grid, int) else tuple(new_grid)
    if new_h < 1 or new_w < 1:
        raise ValueError(f"new_grid must be positive, got {new_grid}")
    prefix, grid, _ = split_posemb(posemb, num_prefix_tokens)
    as_image = grid.permute(2, 0, 1).unsqueeze(0).to(torch.float64)  # (1, D, g, g)
    zoomed = F.interpolate(as_image, size=(new_h, new_w), mode="bilinear", align_corners=True)
    new_grid_tokens = zoomed[0].permute(1, 2, 0).reshape(1, new_h * new_w, posemb.shape[2])
    return torch.cat([prefix, new_grid_tokens.to(posemb.dtype)], dim=1)
