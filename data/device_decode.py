"""JPEG decoding on the accelerator (``data.decode=gpu``): the loader's crops, made where the model runs.

With ``ShardLoader(..., device_decode=True)`` the loader workers read the shards and draw every
sample's crop box and flip exactly as the CPU path does (:meth:`TrainCrop.device_box`: the same
seeded generator, the same draws), but hand over the JPEG's bytes and the box instead of the
decoded crop: an :class:`EncodedCrops` per chunk, travelling with the chunk. Samples nvjpeg does
not decode as libjpeg does (PNGs, CMYK, lossless or arithmetic-coded JPEGs, cut-short data) are
decoded on the CPU as before and travel as pixels. The batch's keys, labels and the loader's
position are those of the CPU path, so exact resume and the sample-key audit do not change.

:func:`decode_batch` then decodes the JPEGs with torchvision's ``decode_jpeg`` on a list (nvjpeg
on CUDA, libjpeg-turbo on the CPU), crops each box, resizes it antialiased (bilinear), flips it and
puts the batch together in sample order with the CPU crops: uint8 ``(B, 3, S, S)``, the values
of the CPU path's crops to within resampling (the CPU path decodes large crops at a reduced DCT
scale and resizes in uint8 arithmetic). The same code runs with ``device="cpu"``, which the tests
use. Only torch and torchvision: no Ray, no CUDA needed to import it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torchvision.io import ImageReadMode, decode_jpeg

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncodedCrops:
    """JPEGs to be decoded and cropped on the accelerator, for one chunk (or batch) of samples.

    ``data`` holds the JPEGs back to back (one ``bytearray``: it pickles as one piece between
    processes and is read in place, without copies, as tensors); ``ends`` each JPEG's end offset;
    ``boxes`` its crop ``(top, left, height, width, flip)`` in full-image pixels; ``positions``
    its sample's index in the chunk (in the batch once chunks are joined, see :meth:`shifted`);
    ``size`` the output side."""

    data: bytearray
    ends: tuple[int, ...]
    boxes: tuple[tuple[int, int, int, int, bool], ...]
    positions: tuple[int, ...]
    size: int

    def __len__(self) -> int:
        return len(self.positions)

    @classmethod
    def of(cls, jpegs: Sequence[bytes], boxes: Sequence[tuple[int, int, int, int, bool]], positions, size: int):
        data, ends = bytearray(sum(len(j) for j in jpegs)), []
        at = 0
        for jpeg in jpegs:
            data[at : at + len(jpeg)] = jpeg
            at += len(jpeg)
            ends.append(at)
        return cls(data, tuple(ends), tuple(tuple(b) for b in boxes), tuple(positions), size)

    def shifted(self, offset: int) -> EncodedCrops:
        """The same crops with positions ``offset`` further on (a chunk's place in its batch)."""
        return replace(self, positions=tuple(p + offset for p in self.positions)) if offset else self

    def jpegs(self) -> list[torch.Tensor]:
        """The JPEGs as uint8 tensors viewing ``data`` (no copy)."""
        whole = torch.frombuffer(self.data, dtype=torch.uint8) if self.data else torch.empty(0, dtype=torch.uint8)
        starts = (0, *self.ends[:-1])
        return [whole[start:end] for start, end in zip(starts, self.ends)]


def decode_batch(
    cpu_crops: torch.Tensor, encoded: Sequence[EncodedCrops], count: int
) -> tuple[torch.Tensor, list[int]]:
    """The batch of ``count`` samples as uint8 ``(count, 3, S, S)`` on ``cpu_crops``' device, and
    the positions of samples that could not be decoded (left out of the batch, in order).

    ``cpu_crops``: the crops the CPU made (the batch's ``images``), in sample order, of the
    positions no entry of ``encoded`` names; ``encoded``: the batch's :class:`EncodedCrops`.
    A JPEG the device's decoder refuses is decoded on the CPU instead; one the CPU cannot decode
    either is a corrupt sample, as the CPU path would have found.
    """
    parts = [e for e in encoded if len(e)]
    if not parts:
        return cpu_crops, []
    device, size = cpu_crops.device, parts[0].size
    jpegs = [j for e in parts for j in e.jpegs()]
    boxes = [b for e in parts for b in e.boxes]
    positions = [p for e in parts for p in e.positions]
    images = _decode_jpegs(jpegs, device)
    good = [i for i, image in enumerate(images) if image is not None]
    failed = sorted(positions[i] for i, image in enumerate(images) if image is None)
    if good:
        resized = torch.stack([_crop(images[i], boxes[i], size) for i in good])
        crops = resized.round_().clamp_(0, 255).to(torch.uint8)
    else:
        crops = torch.empty((0, 3, size, size), dtype=torch.uint8, device=device)
    by_position = dict(zip((positions[i] for i in good), crops.unbind(0)))
    if len(cpu_crops) == 0 and list(by_position) == list(range(count)):
        return crops, failed  # every sample decoded here, in order: no reassembly
    from_cpu = iter(cpu_crops.unbind(0))
    skipped = set(failed)
    ordered = [by_position[p] if p in by_position else next(from_cpu) for p in range(count) if p not in skipped]
    return torch.stack(ordered) if ordered else crops, failed


def _crop(image: torch.Tensor, box: tuple[int, int, int, int, bool], size: int) -> torch.Tensor:
    """float32 ``(3, size, size)``: ``image``'s box resized (bilinear, antialiased) and flipped."""
    top, left, h, w, flip = box
    crop = image[:, top : top + h, left : left + w].unsqueeze(0).float()
    if (h, w) != (size, size):
        crop = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return crop[0].flip(-1) if flip else crop[0]


def _decode_jpegs(jpegs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """RGB uint8 ``(3, H, W)`` images on ``device``, None for a JPEG neither the device's decoder
    nor the CPU's decodes. One call for the whole list (nvjpeg batches it; a refusal of any image
    fails the call, so then each is tried alone)."""
    try:
        return list(decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device))
    except RuntimeError as error:
        log.warning("decoding %d JPEGs on %s failed (%s); decoding them one by one", len(jpegs), device, error)
    return [_decode_one(jpeg, device) for jpeg in jpegs]


def _decode_one(jpeg: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    for where in dict.fromkeys([device, torch.device("cpu")]):
        try:
            return decode_jpeg(jpeg, mode=ImageReadMode.RGB, device=where).to(device)
        except RuntimeError:
            continue
    return None
