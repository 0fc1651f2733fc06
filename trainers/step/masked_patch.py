"""Masked patch prediction: the self-supervised objective of the paper's section 4.6 (appendix B.1.2).

Per image, ``K = round(corrupt_rate * N)`` of its ``N`` patches are corrupted (the paper: 50%);
each corrupted patch independently gets the learnable ``[mask]`` embedding (80%), the embedding
of another random patch of the same image (10%) or keeps its own (10%), as BERT does with words.
The model then predicts, from the output token of every corrupted patch, one of three targets
computed from the original pixels (colours in ``[0, 1]``, un-normalised from the model's
``[-1, 1]`` input):

- ``mean_color``: the patch's mean colour quantised to ``color_bits`` per channel, one class of
  ``2 ** (3 * color_bits)`` (the paper's choice: 3 bits, 512 classes), softmax cross-entropy;
- ``downsized_4x4``: the patch average-pooled to 4x4, each cell such a colour class (16
  predictions of 512 classes for 3 bits), cross-entropy averaged over the cells;
- ``patch_l2``: the patch's pixels (``3 * P * P`` values, channel-major), mean squared error.

A colour class is ``(r << 2b) | (g << b) | blue`` with each channel's level
``min(floor(c * 2**b), 2**b - 1)`` of its mean ``c`` in ``[0, 1]``: for a single 8-bit pixel and b=3
that is ``pixel >> 5``; a patch's mean ``m`` (in 0..255) falls in level k from ``31.875 k`` on, not
``32 k`` (the paper does not say where its bins lie).

Shapes are fixed -- K per image never changes and the corruption is three dense tensors -- so a
compiled graph (XLA) is reused every step. The corruption is drawn from the loop's generator,
seeded by (seed, step, rank), so a resumed run corrupts exactly as the uninterrupted one. Labels
are never read: unlabelled datasets (``label_kind`` "none") train with this objective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch
import torch.nn.functional as F

from vitray.data.model_range import model_images

MaskedPatchTarget = Literal["mean_color", "downsized_4x4", "patch_l2"]
TARGETS: tuple[str, ...] = get_args(MaskedPatchTarget)
DOWNSIZED_GRID = 4  # the paper's 4x4 downsized patch

# What happened to each corrupted patch (`Corruption.kind`).
MASK, RANDOM, KEEP = 0, 1, 2


def color_classes_count(color_bits: int) -> int:
    return 2 ** (3 * color_bits)


def target_outputs(target: str, color_bits: int, patch_size: int) -> int:
    """Predictions per patch the model's predictor must make for ``target``."""
    if target == "mean_color":
        return color_classes_count(color_bits)
    if target == "downsized_4x4":
        return DOWNSIZED_GRID**2 * color_classes_count(color_bits)
    if target == "patch_l2":
        return 3 * patch_size * patch_size
    raise ValueError(f"masked patch target {target!r}: expected one of {', '.join(TARGETS)}")


def num_corrupted(num_patches: int, corrupt_rate: float) -> int:
    """``corrupt_rate * num_patches`` rounded half up, at least 1."""
    return min(num_patches, max(1, math.floor(corrupt_rate * num_patches + 0.5)))


@dataclass(frozen=True)
class Corruption:
    """One micro-batch's corruption, in the form the model takes (see
    :mod:`vitray.models.masked_patch`), plus what happened to each predicted patch."""

    patch_source: torch.Tensor  # (B, N) int64: the patch of the same image each position takes
    patch_mask: torch.Tensor  # (B, N) bool: given the [mask] embedding
    predict_at: torch.Tensor  # (B, K) int64 positions of the corrupted patches, ascending
    kind: torch.Tensor  # (B, K) int64: MASK, RANDOM or KEEP for each corrupted patch

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model's forward pass, on ``device``."""
        return {
            "patch_source": _to_device(self.patch_source, device),
            "patch_mask": _to_device(self.patch_mask, device),
            "predict_at": _to_device(self.predict_at, device),
        }


def _to_device(tensor: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """A host-drawn tensor on ``device``; to CUDA from pinned memory, so the host does not wait."""
    if device is not None and torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def draw_corruption(
    rng: np.random.Generator,
    batch_size: int,
    num_patches: int,
    *,
    corrupt_rate: float = 0.5,
    mask_rate: float = 0.8,
    random_rate: float = 0.1,
) -> Corruption:
    """Draw which patches of each image are corrupted and how (the rest of 1 is kept).

    The same number of values is drawn from ``rng`` whatever the outcome, so a generator seeded
    alike gives the same corruption.
    """
    b, n = batch_size, num_patches
    k = num_corrupted(n, corrupt_rate)
    predict_at = np.sort(rng.random((b, n)).argsort(axis=1)[:, :k], axis=1)
    choice = rng.random((b, k))
    kind = np.where(choice < mask_rate, MASK, np.where(choice < mask_rate + random_rate, RANDOM, KEEP))
    # Another patch of the same image for each random replacement: a uniform draw over its other
    # N - 1 patches (positions at or after the patch itself shift by one to skip it).
    other = rng.integers(0, max(n - 1, 1), size=(b, k))
    other = other + (other >= predict_at)
    if n == 1:  # no other patch exists: a random replacement keeps the patch
        kind = np.where(kind == RANDOM, KEEP, kind)
    source = np.tile(np.arange(n), (b, 1))
    rows = np.broadcast_to(np.arange(b)[:, None], (b, k))
    randomised = kind == RANDOM
    source[rows[randomised], predict_at[randomised]] = other[randomised]
    mask = np.zeros((b, n), dtype=bool)
    mask[rows[kind == MASK], predict_at[kind == MASK]] = True
    return Corruption(
        patch_source=torch.from_numpy(source).long(),
        patch_mask=torch.from_numpy(mask),
        predict_at=torch.from_numpy(predict_at).long(),
        kind=torch.from_numpy(kind).long(),
    )


def to_colors(images: torch.Tensor) -> torch.Tensor:
    """Model inputs (float in ``[-1, 1]``, or uint8 pixels) as float32 colours in ``[0, 1]``."""
    if images.dtype == torch.uint8:
        return images.float() / 255.0
    return ((images.float() + 1.0) / 2.0).clamp_(0.0, 1.0)


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``(B, C, H, W)`` -> ``(B, N, C, P, P)``, patches in the model's token order (row-major grid)."""
    b, c, h, w = images.shape
    if h % patch_size or w % patch_size:
        raise ValueError(f"images of {h}x{w} pixels do not divide into {patch_size}x{patch_size} patches")
    rows, cols = h // patch_size, w // patch_size
    grid = images.reshape(b, c, rows, patch_size, cols, patch_size).permute(0, 2, 4, 1, 3, 5)
    return grid.reshape(b, rows * cols, c, patch_size, patch_size)


def color_classes(colors: torch.Tensor, color_bits: int = 3) -> torch.Tensor:
    """Colours ``(..., 3)`` in ``[0, 1]`` -> class indices ``(...)`` in ``[0, 2 ** (3 * bits))``."""
    levels = 2**color_bits
    q = (colors * levels).floor_().clamp_(0, levels - 1).long()
    return (q[..., 0] * levels + q[..., 1]) * levels + q[..., 2]  # (r << 2b) | (g << b) | blue


def patch_targets(images: torch.Tensor, patch_size: int, target: str, color_bits: int = 3) -> torch.Tensor:
    """Every patch's target: ``(B, N)`` classes (mean_color), ``(B, N, 16)`` classes
    (downsized_4x4) or ``(B, N, 3 * P * P)`` colours (patch_l2)."""
    patches = patchify(to_colors(images), patch_size)  # (B, N, 3, P, P)
    if target == "mean_color":
        return color_classes(patches.mean(dim=(-2, -1)), color_bits)
    if target == "downsized_4x4":
        b, n = patches.shape[:2]
        small = F.adaptive_avg_pool2d(patches.flatten(0, 1), DOWNSIZED_GRID)  # (B*N, 3, 4, 4)
        cells = small.reshape(b, n, 3, DOWNSIZED_GRID**2).transpose(-1, -2)  # (B, N, 16, 3), row-major cells
        return color_classes(cells, color_bits)
    if target == "patch_l2":
        return patches.flatten(2)
    raise ValueError(f"masked patch target {target!r}: expected one of {', '.join(TARGETS)}")


class MaskedPatchObjective:
    """The training objective: corrupt, predict every corrupted patch's target, average the loss.

    ``loss(model, batch, rng)`` has the shape of
    :class:`vitray.trainers.step.objectives.SupervisedObjective`'s: ``model`` is the training backend
    (callable, with ``.device``, ``.dtype`` and ``.module``), ``batch`` a
    :class:`vitray.data.Batch` (its labels are not read).
    """

    def __init__(
        self,
        target: str = "mean_color",
        *,
        corrupt_rate: float = 0.5,
        mask_rate: float = 0.8,
        random_rate: float = 0.1,
        color_bits: int = 3,
    ) -> None:
        target_outputs(target, color_bits, 1)  # rejects an unknown target
        if not 0 < corrupt_rate <= 1 or min(mask_rate, random_rate) < 0 or mask_rate + random_rate > 1 + 1e-9:
            raise ValueError(
                f"need 0 < corrupt_rate <= 1 and mask_rate, random_rate >= 0 with a sum <= 1; got "
                f"corrupt_rate={corrupt_rate}, mask_rate={mask_rate}, random_rate={random_rate}"
            )
        self.target, self.color_bits = target, color_bits
        self.corrupt_rate, self.mask_rate, self.random_rate = corrupt_rate, mask_rate, random_rate

    @classmethod
    def from_config(cls, section: Any) -> MaskedPatchObjective:
        """From the ``train.masked_patch`` config section."""
        return cls(
            section.target,
            corrupt_rate=section.corrupt_rate,
            mask_rate=section.mask_rate,
            random_rate=section.random_rate,
            color_bits=section.color_bits,
        )

    def corrupt(self, rng: np.random.Generator, batch_size: int, num_patches: int) -> Corruption:
        return draw_corruption(
            rng,
            batch_size,
            num_patches,
            corrupt_rate=self.corrupt_rate,
            mask_rate=self.mask_rate,
            random_rate=self.random_rate,
        )

    def loss(self, model, batch, rng: np.random.Generator) -> torch.Tensor:
        module = model.module
        expected = target_outputs(self.target, self.color_bits, module.patch_size)
        if module.masked_patch_outputs != expected:
            raise ValueError(
                f"the model's masked patch predictor has {module.masked_patch_outputs} outputs per patch but target "
                f"{self.target!r} needs {expected}: build it with masked_patch_outputs={expected} (a run config does "
                "so when train.objective=masked_patch; continuing from init.checkpoint also needs init.reset_head=false)"
            )
        images = batch.images.to(model.device)  # already there from the feed: a no-op
        corruption = self.corrupt(rng, images.shape[0], module.grid_size**2)
        inputs = corruption.model_inputs(model.device)
        # Targets from the pixels on the device (uint8 from the feed: exact colours, no round trip via [-1, 1]).
        targets = _take(patch_targets(images, module.patch_size, self.target, self.color_bits), inputs["predict_at"])
        predictions = model(model_images(images).to(model.dtype), **inputs)
        return self.prediction_loss(predictions, targets)

    def prediction_loss(self, predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Loss of predictions ``(B, K, outputs)`` against the targets of the same patches."""
        predictions = predictions.float()
        if self.target == "patch_l2":
            return F.mse_loss(predictions, targets.float())
        classes = color_classes_count(self.color_bits)
        return F.cross_entropy(predictions.reshape(-1, classes), targets.reshape(-1))


def _take(per_patch: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``per_patch[b, positions[b, k], ...]`` -> ``(B, K, ...)``, on ``per_patch``'s device."""
    index = positions.to(per_patch.device)
    index = index.view(*index.shape, *([1] * (per_patch.ndim - 2))).expand(-1, -1, *per_patch.shape[2:])
    return per_patch.gather(1, index)
