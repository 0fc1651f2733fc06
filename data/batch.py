"""Batches, the per-worker chunks they are assembled from, and the skipped-sample report."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import get_worker_info

from .device_decode import EncodedCrops
from .layout import LabelKind
from .reader import Corrupt, RawSample
from .shared_memory import BatchMemory, uint8_images
from .transforms import CorruptSample, apply_seeded, decode_image, decode_label, image_bytes

log = logging.getLogger(__name__)

WARN_INTERVAL_S = 60.0
CONVERT_BLOCK_BYTES = 1 << 20  # float bytes converted per step: stays in the L2 cache
_SCALE, _ONE = np.float32(2.0 / 255.0), np.float32(1.0)  # to_model_range's arithmetic, in float32


class UnreadableData(RuntimeError):
    """Every sample of a batch was skipped as unreadable: there is nothing to train on."""


@dataclass
class Batch:
    """Decoded samples: ``images`` float32 ``(B, 3, H, W)`` in ``[-1, 1]`` (uint8 in ``[0, 255]``
    from loaders made with ``float_images=False``: channels-last in memory for training batches,
    see :func:`decode_chunk`); ``labels`` int64 ``(B,)`` (all -1 for unlabelled
    data) or float32 multi-hot ``(B, K)``; ``keys`` the sample keys. Corrupt samples are left out,
    so B is the requested batch size minus ``num_skipped``.

    From a loader made with ``device_decode=True``, ``encoded`` holds the JPEGs still to be decoded
    and cropped (on the accelerator, :func:`vitray.data.device_decode.decode_batch`) and ``images``
    only the other samples' crops, in sample order."""

    images: torch.Tensor
    labels: torch.Tensor
    keys: list[str]
    num_skipped: int = 0
    epoch: int = 0
    step: int = 0  # index of this batch within its epoch (training) or pass (evaluation)
    skipped_shards: tuple[str, ...] = ()  # the shards of the skipped samples, each once
    encoded: tuple[EncodedCrops, ...] = ()  # JPEGs for the accelerator to decode (device_decode)

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class Chunk:
    """What one worker decodes for one batch (its slots' share, or one evaluation batch).

    Images stay uint8 until the batch is put together: a quarter of the bytes to pass between
    processes. In a DataLoader worker they are decoded straight into shared memory, which the
    main process maps instead of receiving a copy."""

    images: torch.Tensor  # uint8 (n, 3, H, W); empty while ``ring`` is set
    labels: torch.Tensor
    keys: list[str] = field(default_factory=list)
    num_skipped: int = 0
    ring: tuple[int, int] | None = None  # (worker, slot): the images are in that worker's ChunkRing
    skipped_shards: tuple[str, ...] = ()  # the shards of the skipped samples, each once
    encoded: EncodedCrops | None = None  # samples left encoded for the accelerator; not in ``images``

    @property
    def num_images(self) -> int:
        """The samples decoded here (in ``images``, or in the ring slot)."""
        return len(self.keys) - (len(self.encoded) if self.encoded is not None else 0)

    # From a DataLoader worker to the main process the labels travel by value, as a numpy array: a
    # tensor sent as a tensor gets a shared-memory segment and a file-descriptor hand-over of its own
    # (a socket connection with an authentication challenge), ~0.6 ms of CPU per chunk over the two
    # processes, where the chunk's other bookkeeping costs ~0.2 ms. Images stay tensors: in shared
    # memory (or a ChunkRing slot) is how they should cross.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "labels": self.labels.numpy()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, labels=torch.from_numpy(state["labels"]))


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
    transform: Callable[[Image.Image], Image.Image | torch.Tensor],
    img_size: int,
    label_kind: LabelKind,
    num_classes: int,
    reporter: SkipReporter,
    where: str,
    out: torch.Tensor | None = None,
    device_decode: bool = False,
) -> Chunk:
    """Decode raw samples (``RawSample`` or ``Corrupt``) into a chunk, skipping corrupt ones.

    ``transform`` maps the decoded RGB image to an ``img_size`` square, as a PIL image (e.g.
    :func:`~vitray.data.transforms.train_augment`; copied plane by plane, the cheapest) or a uint8
    ``(3, img_size, img_size)`` tensor (e.g. :func:`~vitray.data.transforms.train_transform`). A
    transform with a ``from_bytes(data, seed)`` method (:class:`~vitray.data.transforms.TrainCrop`)
    gets the encoded bytes instead, so that it can decode at a reduced scale.
    ``out``: uint8 memory for at least ``len(raws)`` images to decode into (e.g. a ChunkRing slot).

    Images decoded by ``from_bytes`` go into channels-last memory (``(n, H, W, 3)`` seen as
    ``(n, 3, H, W)``, unless ``out`` says otherwise): the crop comes out of its resize
    channels-last, and copying it into planar memory (a transpose) would cost a sixth as much
    as decoding it; the device feed makes the batch planar on the accelerator, where it is free.

    ``device_decode`` (with a ``TrainCrop`` transform): JPEGs the accelerator can decode are not
    decoded here; their bytes and crop boxes go into the chunk's ``encoded`` and ``images`` holds
    only the other samples' crops (see :mod:`vitray.data.device_decode`).
    """
    from_bytes = getattr(transform, "from_bytes", None)  # e.g. TrainCrop: decode + crop in one step
    if out is None:
        # in shared memory in a DataLoader worker, where passing a tensor to the main process would
        # otherwise copy it there (as default_collate does)
        out = uint8_images(
            (len(raws),), img_size, channels_last=from_bytes is not None, shared=get_worker_info() is not None
        )
    images = out[: len(raws)]
    planes = images.numpy()  # writable view of the same memory
    labels, keys, skipped, skipped_shards = [], [], 0, {}
    device_box = getattr(transform, "device_box", None) if device_decode else None
    if device_decode and device_box is None:
        raise ValueError("device_decode needs a transform with a device_box method (TrainCrop)")
    jpegs, boxes, positions, decoded = [], [], [], 0
    for raw, seed in zip(raws, seeds, strict=True):
        try:
            if isinstance(raw, Corrupt):
                raise CorruptSample("unreadable tar data (truncated or damaged shard)")
            assert isinstance(raw, RawSample)
            label = decode_label(raw.fields, label_kind, num_classes)
            box = device_box(image_bytes(raw.fields), seed) if device_box is not None else None
            if box is not None:  # decoded on the accelerator: the bytes and the box travel
                jpegs.append(image_bytes(raw.fields))
                boxes.append(box)
                positions.append(len(keys))
                labels.append(label)
                keys.append(raw.key)
                continue
            if from_bytes is not None:  # decodes only as much of the image as the crop needs
                image = from_bytes(image_bytes(raw.fields), seed)
            else:
                image = apply_seeded(transform, decode_image(image_bytes(raw.fields)), seed)
        except CorruptSample as error:
            skipped += 1
            skipped_shards[raw.shard or where] = None
            reporter.skipped(raw.key if isinstance(raw, RawSample) else raw.shard or where, str(error))
            continue
        _put_image(planes[decoded], image)
        decoded += 1
        labels.append(label)
        keys.append(raw.key)
    return Chunk(
        images[:decoded],
        _stack_labels(labels, label_kind, num_classes),
        keys,
        skipped,
        skipped_shards=tuple(skipped_shards),
        encoded=EncodedCrops.of(jpegs, boxes, positions, img_size) if device_decode else None,
    )


def is_channels_last(images: torch.Tensor) -> bool:
    """Whether a ``(B, 3, H, W)`` tensor lies channels-last in memory (as training batches do)."""
    return images.dim() == 4 and not images.is_contiguous() and images.is_contiguous(memory_format=torch.channels_last)


def _put_image(dest: np.ndarray, image: Image.Image | torch.Tensor) -> None:
    """Copy one transformed image into ``dest`` (uint8 ``(3, H, W)``)."""
    if isinstance(image, Image.Image):
        if image.mode != "RGB" or image.size != dest.shape[:0:-1]:
            raise ValueError(f"the transform gave a {image.mode} {image.size} image; expected RGB {dest.shape[:0:-1]}")
        if not dest.flags.c_contiguous:  # channels-last memory: PIL's own layout
            dest.transpose(1, 2, 0)[...] = np.asarray(image)
            return
        # PIL keeps pixels interleaved (H, W, 3); its raw packer extracts one band at a time in C,
        # a third of the cost of PILToTensor's (H, W, 3) array and transposing copy.
        for plane, band in zip(dest, "RGB"):
            plane.reshape(-1)[:] = np.frombuffer(image.tobytes("raw", band), dtype=np.uint8)
        return
    if image.dtype != torch.uint8 or tuple(image.shape) != dest.shape:
        raise ValueError(f"the transform gave a {image.dtype} {tuple(image.shape)} tensor; expected uint8 {dest.shape}")
    torch.from_numpy(dest).copy_(image)


def _stack_labels(labels: list[Any], label_kind: LabelKind, num_classes: int) -> torch.Tensor:
    if label_kind == "multi":
        return torch.stack(labels) if labels else torch.zeros((0, num_classes), dtype=torch.float32)
    return torch.tensor(labels, dtype=torch.int64)


def concat_chunks(
    chunks: Iterable[Chunk],
    *,
    epoch: int,
    step: int,
    float_images: bool = True,
    memory: BatchMemory | None = None,
    copy: bool = False,
) -> Batch:
    """One batch from chunks in order; uint8 images become float32 in ``[-1, 1]`` if ``float_images``,
    with the values of :func:`~vitray.data.model_range.to_model_range`. ``memory`` recycles the
    memory of earlier batches that nobody holds any more (fresh memory without it). ``copy``:
    the batch never shares memory with the chunks (whose memory will be reused). uint8 images keep
    the chunks' memory layout (planar or channels-last); float32 ones are planar."""
    parts = list(chunks)
    memory = memory if memory is not None else BatchMemory(max_regions=0)
    offsets = np.cumsum([0] + [len(c.keys) for c in parts[:-1]]).tolist()
    encoded = tuple(c.encoded.shifted(at) for c, at in zip(parts, offsets) if c.encoded is not None and len(c.encoded))
    if float_images and encoded:
        raise ValueError("chunks with encoded JPEGs (device_decode) give uint8 batches: use float_images=False")
    if float_images:
        images = _model_range_batch([c.images for c in parts], memory)
    elif len(parts) == 1 and not copy:
        images = parts[0].images  # a worker's shared memory, or this process's own buffer: no copy
    else:  # numpy: no intra-op threads for a copy; in memory order, so channels-last is not transposed
        last = any(is_channels_last(c.images) for c in parts)  # an empty part (device_decode) has no layout
        stored = [c.images.permute(0, 2, 3, 1) if last else c.images for c in parts]
        images = memory.empty((sum(len(s) for s in stored), *stored[0].shape[1:]), torch.uint8)
        np.concatenate([s.numpy() for s in stored], out=images.numpy())
        images = images.permute(0, 3, 1, 2) if last else images
    return Batch(
        images=images,
        labels=parts[0].labels if len(parts) == 1 else torch.cat([c.labels for c in parts]),
        keys=[k for c in parts for k in c.keys],
        num_skipped=sum(c.num_skipped for c in parts),
        epoch=epoch,
        step=step,
        skipped_shards=tuple(dict.fromkeys(s for c in parts for s in c.skipped_shards)),
        encoded=encoded,
    )


def _model_range_batch(parts: list[torch.Tensor], memory: BatchMemory) -> torch.Tensor:
    """The uint8 ``parts`` concatenated and converted to float32 in ``[-1, 1]`` in one pass.

    Done in small blocks with numpy, which never starts threads: the conversion is memory-bound,
    and torch's intra-op threads would only spin beside the training process's own work. The
    numbers are those of ``x.to(float32).mul_(2 / 255).sub_(1)``, bit for bit.
    """
    count = sum(len(p) for p in parts)
    out = memory.empty((count, *parts[0].shape[1:]), torch.float32)
    flat = out.numpy()
    per_image = flat[0].nbytes if count else 1
    block = max(1, CONVERT_BLOCK_BYTES // per_image)
    at = 0
    for part in parts:
        if part.dtype != torch.uint8:
            raise TypeError(f"chunk images must be uint8 to convert to the model range, got {part.dtype}")
        source = part.numpy()
        for first in range(0, len(source), block):
            block_source = source[first : first + block]
            dest = flat[at + first : at + first + len(block_source)]
            np.multiply(block_source, _SCALE, out=dest, dtype=np.float32)
            np.subtract(dest, _ONE, out=dest)
        at += len(source)
    return out


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
