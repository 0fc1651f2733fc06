"""Training objectives: softmax cross-entropy (single-label) and sigmoid cross-entropy (multi-label).

Labels arrive as class indices (single-label) or multi-hot float rows (multi-label); both are
turned into target distributions so label smoothing and mixup act on one representation.

Batches arrive on the device with uint8 images (`trainers/step/feed.py`): the conversion to the
model's range, the targets and mixup all run there, after the copy, and nothing here reads a
device value back to the host (the loss stays a tensor until the loop logs it).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from vitray.data.model_range import model_images
from vitray.trainers.step.masked_patch import MaskedPatchObjective


def resolve_objective(objective: str, label_kind: str) -> str:
    if label_kind == "none" and objective != "masked_patch":
        raise ValueError(
            f"train.objective={objective} needs labelled data, but the training dataset has no labels "
            "(label_kind 'none'): use train.objective=masked_patch, or prepare the data with its labels"
        )
    if objective == "auto":
        return "sigmoid" if label_kind == "multi" else "softmax"
    if objective == "softmax" and label_kind == "multi":
        raise ValueError("train.objective=softmax needs single-label data; this dataset is multi-label (use sigmoid)")
    return objective


def targets_from_labels(labels: torch.Tensor, num_classes: int, label_smoothing: float = 0.0) -> torch.Tensor:
    """Target distributions on the labels' device. With ``num_classes`` given, ``one_hot`` checks
    the label range on the CPU only; on CUDA it reads nothing back (a bad label fails in a kernel)."""
    if labels.dtype in (torch.int64, torch.int32):
        targets = F.one_hot(labels.long(), num_classes).float()
    else:
        targets = labels.float()
    if label_smoothing:
        targets = targets * (1.0 - label_smoothing) + label_smoothing / num_classes
    return targets


def mixup(images: torch.Tensor, targets: torch.Tensor, alpha: float, rng: np.random.Generator):
    """Mix each example with its neighbour, the batch rolled by one (big_vision's `get_mixup`: every
    example mixed, with a partner of its own), at one ratio r = max(b, 1 - b), b ~ Beta(alpha, alpha),
    for the micro-batch (big_vision draws one for the global batch; here each worker's micro-batch
    draws its own).

    The ratio comes from the caller's seeded generator, so a resumed run mixes identically.
    """
    if alpha <= 0:
        return images, targets
    ratio = float(rng.beta(alpha, alpha))
    ratio = max(ratio, 1.0 - ratio)
    return (
        ratio * images + (1 - ratio) * images.roll(1, dims=0),
        ratio * targets + (1 - ratio) * targets.roll(1, dims=0),
    )


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, objective: str) -> torch.Tensor:
    logits = logits.float()
    if objective == "softmax":
        return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()
    if objective == "sigmoid":
        # Summed over classes, averaged over the batch (as big_vision's sigmoid_xent).
        return F.binary_cross_entropy_with_logits(logits, targets, reduction="none").sum(-1).mean()
    raise ValueError(f"objective={objective!r}: expected 'softmax' or 'sigmoid'")


class SupervisedObjective:
    """Classification from labels: softmax or sigmoid cross-entropy, label smoothing, mixup.

    An objective turns one micro-batch into a loss through the backend's forward pass; the
    masked patch prediction objective has the same shape and needs no labels.
    """

    def __init__(self, kind: str, num_classes: int, *, label_smoothing: float = 0.0, mixup_alpha: float = 0.0):
        self.kind, self.num_classes = kind, num_classes
        self.label_smoothing, self.mixup_alpha = label_smoothing, mixup_alpha

    def loss(self, model, batch, rng: np.random.Generator) -> torch.Tensor:
        """`model` is the training backend (callable, with `.device` and `.dtype`)."""
        labels = batch.labels.to(model.device)  # already there from the feed: a no-op
        targets = targets_from_labels(labels, self.num_classes, self.label_smoothing)
        images = model_images(batch.images.to(model.device))
        images, targets = mixup(images, targets, self.mixup_alpha, rng)
        logits = model(images.to(model.dtype))
        return loss_fn(logits, targets, self.kind)


def build_objective(train_cfg, label_kind: str, num_classes: int):
    """The objective named by `train.objective` for data with labels of `label_kind`."""
    kind = resolve_objective(train_cfg.objective, label_kind)
    if kind == "masked_patch":
        return MaskedPatchObjective.from_config(train_cfg.masked_patch)
    return SupervisedObjective(
        kind, num_classes, label_smoothing=train_cfg.label_smoothing, mixup_alpha=train_cfg.mixup_alpha
    )
