"""Batches, the per-worker chunks they are assembled from, and the skipped-sample report."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .layout import LabelKind
from .reader import CORRUPT, RawSample
from .transforms import CorruptSample, Transform, apply_seeded, decode_image, decode_label, image_bytes, to_model_range

log = logging.getLogger(__name__)

WARN_INTERVAL_S = 60.0


@dataclass
class Batch:
    """Decoded samples: ``images`` float32 ``(B, 3, H, W)`` in ``[-1, 1]`` (uint8 in ``[0, 255]``
    from loaders made with ``float_images=False``); ``labels`` int64 ``(B,)`` (all -1 for unlabelled
    data) or float32 multi-hot ``(B, K)``; ``keys`` the sample keys. Corrupt samples are left out,
    so B is the requested batch size minus ``num_skipped``."""

    images: torch.Tensor
    labels: torch.Tensor
    keys: list[str]
    num_skipped: int = 0
    epoch: int = 0
    step: int = 0  # index of this batch within its epoch (training) or pass (evaluation)

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class Chunk:
    """What one worker decodes for one batch (its slots' share, or one evaluation batch).

    Images stay uint8 until the batch is put together: a quarter of the bytes to pass between
    processes, which costs more than the float conversion done once per batch."""

    images: torch.Tensor  # uint8 (n, 3, H, W)
    labels: torch.Tensor
    keys: list[str] = field(default_factory=list)
    num_skipped: int = 0


class SkipReporter:
    """Warns about corrupt samples at a limited rate: the first at once, then a summary per minute."""

    def __init__(self, interval_s: float = WARN_INTERVAL_S) -> None:
        self.interval_s, self.total, self.unreported = interval_s, 0, 0
        self.last_warning = -float("inf")

    def skipped(self, where: str, reason: str) -> None:
        self.total += 1
        self.unreported += 1
        now = time.monotonic()
        if now - self.last_warning >= self.interval_s:
            log.warning(
                "skipped %d corrupt sample(s) (%d in total), e.g. %s: %s", self.unreported, self.total, where, reason
            )
            self.unreported, self.last_warning = 0, now


def decode_chunk(
    raws: Sequence[Any],
    seeds: Sequence[int | None],
    *,
    transform: Transform,
    img_size: int,
    label_kind: LabelKind,
    num_classes: int,
    reporter: SkipReporter,
    where: str,
) -> Chunk:
    """Decode raw samples (``RawSample`` or ``CORRUPT``) into a chunk, skipping corrupt ones."""
    images, labels, keys, skipped = [], [], [], 0
    for raw, seed in zip(raws, seeds, strict=True):
        try:
            if raw is CORRUPT:
                raise CorruptSample("unreadable tar data (truncated or damaged shard)")
            assert isinstance(raw, RawSample)
            label = decode_label(raw.fields, label_kind, num_classes)
            image = apply_seeded(transform, decode_image(image_bytes(raw.fields)), seed)
        except CorruptSample as error:
            skipped += 1
            reporter.skipped(raw.key if isinstance(raw, RawSample) else where, str(error))
            continue
        images.append(image)
        labels.append(label)
        keys.append(raw.key)
    return Chunk(_stack_images(images, img_size), _stack_labels(labels, label_kind, num_classes), keys, skipped)


def _stack_images(images: list[torch.Tensor], img_size: int) -> torch.Tensor:
    return torch.stack(images) if images else torch.zeros((0, 3, img_size, img_size), dtype=torch.uint8)


def _stack_labels(labels: list[Any], label_kind: LabelKind, num_classes: int) -> torch.Tensor:
    if label_kind == "multi":
        return torch.stack(labels) if labels else torch.zeros((0, num_classes), dtype=torch.float32)
    return torch.tensor(labels, dtype=torch.int64)


def concat_chunks(chunks: Iterable[Chunk], *, epoch: int, step: int, float_images: bool = True) -> Batch:
    """One batch from chunks in order; uint8 images become float32 in ``[-1, 1]`` if ``float_images``."""
    parts = list(chunks)
    images = parts[0].images if len(parts) == 1 else torch.cat([c.images for c in parts])
    return Batch(
        images=to_model_range(images) if float_images else images,
        labels=parts[0].labels if len(parts) == 1 else torch.cat([c.labels for c in parts]),
        keys=[k for c in parts for k in c.keys],
        num_skipped=sum(c.num_skipped for c in parts),
        epoch=epoch,
        step=step,
    )


def in_order(
    items: Iterable[tuple[int, dict[int, Chunk]]], parts_per_item: int, first_index: int = 0
) -> Iterator[tuple[int, list[Chunk]]]:
    """Reassemble ``(index, {part: chunk})`` messages from several workers into complete items,
    in index order. Parts are concatenated in part order, whatever order they arrived in, so the
    result does not depend on how the work was spread over workers."""
    pending: dict[int, dict[int, Chunk]] = {}
    next_index = first_index
    for index, parts in items:
        pending.setdefault(index, {}).update(parts)
        while next_index in pending and len(pending[next_index]) == parts_per_item:
            done = pending.pop(next_index)
            yield next_index, [done[p] for p in sorted(done)]
            next_index += 1
