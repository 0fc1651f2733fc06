"""The numbers behind the paper's inspection figures (Dosovitskiy et al. 2021, section 4.5).

- :func:`patch_embedding_pcs`: principal components of the patch-embedding filters (Fig. 7 left);
- :func:`posemb_similarity`: cosine similarity between position embeddings (Fig. 7 center);
- :func:`mean_attention_distance`: attention-weighted distance between query and key patches,
  in pixels, per head (Fig. 7 right, Fig. 11; appendix D.7);
- :func:`attention_rollout`: attention from the output token to the patches through all layers
  (Abnar & Zuidema 2020; Fig. 6 and 14, appendix D.8).

Pure functions of tensors (torch in, numpy or torch out). :func:`attention_statistics` feeds
images through the model's own inspection path (``VisionTransformer.forward_with_attention``,
which returns the attention probabilities that the normal SDPA path never materialises) and
keeps only the per-batch reductions, so a set of images never holds every layer's full
attention matrices at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

PAPER_NUM_COMPONENTS = 28  # Fig. 7 (left) shows the top 28 components


# ---------------------------------------------------------------------------------------------
# Patch embedding and position embedding (weights only)
# ---------------------------------------------------------------------------------------------


def patch_embedding_pcs(
    weight: torch.Tensor | np.ndarray, k: int = PAPER_NUM_COMPONENTS
) -> tuple[np.ndarray, np.ndarray]:
    """The top ``k`` principal components of the patch-embedding filters.

    ``weight`` is the embedding convolution's kernel ``(width, 3, patch, patch)``: ``width``
    filters, each a vector over a patch's RGB pixels. The filters are centred and decomposed by
    SVD; returns ``(components, explained_variance_ratio)`` with components ``(k, 3, patch,
    patch)`` (unit norm, sign fixed so that each one's largest-magnitude entry is positive) and
    the fraction of the filters' variance each explains. ``k`` is capped at the rank bound
    ``min(width, 3 * patch**2)``.
    """
    w = _as_numpy(weight).astype(np.float64)
    if w.ndim != 4 or w.shape[1] != 3 or w.shape[2] != w.shape[3]:
        raise ValueError(
            f"expected a patch-embedding kernel of shape (width, 3, patch, patch), got {tuple(w.shape)}; "
            "hybrid models embed ResNet features, not RGB patches"
        )
    if k < 1:
        raise ValueError(f"k must be a positive number of components, got {k}")
    filters = w.reshape(w.shape[0], -1)
    centred = filters - filters.mean(axis=0, keepdims=True)
    _, singular, vt = np.linalg.svd(centred, full_matrices=False)
    k = min(k, vt.shape[0])
    components = vt[:k]
    # SVD's signs are arbitrary; fix them so results are comparable between runs and libraries.
    peak = components[np.arange(k), np.abs(components).argmax(axis=1)]
    components = components * np.where(peak < 0, -1.0, 1.0)[:, None]
    variance = singular**2
    ratio = variance[:k] / variance.sum() if variance.sum() > 0 else np.zeros(k)
    return components.reshape(k, *w.shape[1:]), ratio


def posemb_similarity(posemb: torch.Tensor | np.ndarray, grid: int) -> np.ndarray:
    """Cosine similarity between the position embeddings of every pair of patches.

    ``posemb`` is ``([1,] tokens, width)`` with ``grid * grid`` patch tokens, optionally after one
    class token (recognised by the token count and left out). Returns ``(grid, grid, grid, grid)``
    where ``[r, c]`` is the tile of patch (row r, column c) against every patch, as in Fig. 7.
    """
    pe = _as_numpy(posemb).astype(np.float64)
    if pe.ndim == 3 and pe.shape[0] == 1:
        pe = pe[0]
    if pe.ndim != 2:
        raise ValueError(f"expected a position embedding of shape ([1,] tokens, width), got {tuple(pe.shape)}")
    prefix = pe.shape[0] - grid * grid
    if prefix not in (0, 1):
        raise ValueError(
            f"a {grid}x{grid} grid needs {grid * grid} patch embeddings (+1 class token), got {pe.shape[0]} tokens"
        )
    patches = pe[prefix:]
    norms = np.linalg.norm(patches, axis=1, keepdims=True)
    unit = patches / np.maximum(norms, 1e-12)
    return (unit @ unit.T).reshape(grid, grid, grid, grid)


# ---------------------------------------------------------------------------------------------
# Attention (probabilities from the inspection path)
# ---------------------------------------------------------------------------------------------


def patch_distances(grid_size: int, patch_size: int) -> torch.Tensor:
    """Pixel distance between the centres of every pair of patches, ``(grid**2, grid**2)``,
    patches in raster order (the order of the token sequence)."""
    rows, cols = torch.meshgrid(torch.arange(grid_size), torch.arange(grid_size), indexing="ij")
    centres = torch.stack([rows.flatten(), cols.flatten()], dim=1).to(torch.float64) * patch_size
    return torch.cdist(centres, centres)


def _prefix_tokens(num_tokens: int, grid_size: int) -> int:
    prefix = num_tokens - grid_size * grid_size
    if prefix < 0:
        raise ValueError(f"attention over {num_tokens} tokens cannot cover a {grid_size}x{grid_size} patch grid")
    return prefix


def mean_attention_distance(attn_probs: torch.Tensor, grid_size: int, patch_size: int) -> torch.Tensor:
    """Mean attention distance in pixels per head, ``(heads,)``, for one layer.

    ``attn_probs`` is ``(batch, heads, tokens, tokens)`` (rows: queries, summing to 1); tokens
    before the ``grid_size**2`` patch tokens (the class token) are left out as queries and keys,
    since they have no place in the image. Per query patch, the distance to each key patch is
    weighted by the attention it gets, renormalised over the patches; the result is averaged over
    query patches and images. Attention kept on the query itself gives 0; uniform attention gives
    the mean distance between two patches of the grid.
    """
    if attn_probs.ndim != 4 or attn_probs.shape[-1] != attn_probs.shape[-2]:
        raise ValueError(
            f"expected attention probabilities (batch, heads, tokens, tokens), got {tuple(attn_probs.shape)}"
        )
    prefix = _prefix_tokens(attn_probs.shape[-1], grid_size)
    patches = attn_probs[:, :, prefix:, prefix:].to(torch.float64)
    weights = patches / patches.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    distance = patch_distances(grid_size, patch_size).to(weights.device)
    per_query = (weights * distance).sum(dim=-1)  # (batch, heads, queries)
    return per_query.mean(dim=(0, 2))


def attention_rollout(attn_probs_per_layer: Sequence[torch.Tensor], has_class_token: bool) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020) from the output token(s) to the patches.

    Each layer's attention ``(batch, heads, tokens, tokens)`` is averaged over heads; the
    identity is added for the residual connection and rows are renormalised, ``(A + I) / 2``;
    the layers are multiplied through, ``R = A_L ... A_1``. With a class token the map is the
    class token's row of ``R``; a GAP model (no class token) reads the mean of the patch
    tokens, so the map is the mean of the patch rows. Returns ``(batch, grid, grid)`` over the
    patch tokens (the class token's share of itself is left out).
    """
    if not attn_probs_per_layer:
        raise ValueError("attention_rollout needs the attention of at least one layer")
    prefix = 1 if has_class_token else 0
    rollout = None
    for probs in attn_probs_per_layer:
        if probs.ndim != 4 or probs.shape[-1] != probs.shape[-2]:
            raise ValueError(
                f"expected attention probabilities (batch, heads, tokens, tokens), got {tuple(probs.shape)}"
            )
        mixed = probs.to(torch.float64).mean(dim=1)
        mixed = mixed + torch.eye(mixed.shape[-1], dtype=mixed.dtype, device=mixed.device)
        mixed = mixed / mixed.sum(dim=-1, keepdim=True)
        rollout = mixed if rollout is None else mixed @ rollout
    num_patches = rollout.shape[-1] - prefix
    grid = math.isqrt(num_patches)
    if grid * grid != num_patches:
        raise ValueError(
            f"{rollout.shape[-1]} tokens with has_class_token={has_class_token} leave {num_patches} patches, "
            "not a square grid"
        )
    readout = rollout[:, 0] if has_class_token else rollout[:, prefix:].mean(dim=1)
    return readout[:, prefix:].reshape(-1, grid, grid)


# ---------------------------------------------------------------------------------------------
# Running a model
# ---------------------------------------------------------------------------------------------


@dataclass
class AttentionStatistics:
    """What :func:`attention_statistics` measured over a set of images.

    ``mean_distance``: ``(layers, heads)`` pixels, averaged over the images; ``rollout``:
    ``(images, grid, grid)``; ``predictions`` / ``confidences``: the model's top class and its
    softmax probability per image (-1 and NaN for a model without a classification head).
    """

    mean_distance: np.ndarray
    rollout: np.ndarray
    predictions: np.ndarray
    confidences: np.ndarray
    num_images: int


@torch.no_grad()
def attention_statistics(model: torch.nn.Module, images: torch.Tensor, *, batch_size: int = 32) -> AttentionStatistics:
    """Mean attention distance per (layer, head) and the rollout map of each image.

    ``images`` are model inputs ``(n, 3, img_size, img_size)`` in the model's value range; the
    model runs in eval mode on its own inspection path, batch by batch.
    """
    if images.ndim != 4 or images.shape[0] == 0:
        raise ValueError(f"expected a non-empty batch of images (n, 3, H, W), got {tuple(images.shape)}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    distance_sum, rollouts, predictions, confidences = None, [], [], []
    try:
        for start in range(0, images.shape[0], batch_size):
            batch = images[start : start + batch_size].to(device)
            logits, attentions = model.forward_with_attention(batch)
            per_layer = torch.stack([mean_attention_distance(a, model.grid_size, model.patch_size) for a in attentions])
            weighted = per_layer * batch.shape[0]
            distance_sum = weighted if distance_sum is None else distance_sum + weighted
            rollouts.append(attention_rollout(attentions, has_class_token=model.cls_token is not None).cpu())
            if getattr(model, "num_classes", 1):
                confidence, prediction = torch.softmax(logits.float(), dim=-1).max(dim=-1)
            else:  # no classification head (e.g. after masked patch prediction): nothing to predict
                prediction = torch.full((batch.shape[0],), -1)
                confidence = torch.full((batch.shape[0],), float("nan"))
            predictions.append(prediction.cpu())
            confidences.append(confidence.cpu())
    finally:
        model.train(was_training)
    return AttentionStatistics(
        mean_distance=(distance_sum / images.shape[0]).cpu().numpy(),
        rollout=torch.cat(rollouts).numpy(),
        predictions=torch.cat(predictions).numpy(),
        confidences=torch.cat(confidences).numpy(),
        num_images=int(images.shape[0]),
    )


def _as_numpy(value: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float64).numpy()
    return np.asarray(value)
