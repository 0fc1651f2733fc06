"""JPEG decoding on the accelerator (``data.decode=gpu``): the loader's crops, made where the model runs.

With ``ShardLoader(..., device_decode=True)`` the loader workers read the shards and draw every
sample's crop box and flip exactly as the CPU path does (:meth:`TrainCrop.device_box`: the same
seeded generator, the same draws), but hand over the JPEG's bytes and the box instead of the
decoded crop: an :class:`EncodedCrops` per chunk, travelling with the chunk. Samples nvjpeg does
not decode as libjpeg does (PNGs, CMYK, lossless or arithmetic-coded JPEGs, cut-short data) are
decoded on the CPU as before and travel as pixels. The batch's keys, labels and the loader's
position are those of the CPU path, so exact resume and the sample-key audit do not change.

:func:`decode_batch` then decodes the JPEGs with torchvision's ``decode_jpeg`` on a list (nvjpeg
on CUDA, libjpeg-turbo on the CPU) and makes the crops a chunk of up to 64 at a time, with a
constant number of operators per chunk (the feed that runs it shares the GIL with the training
step, whose kernel launches need most of the host): the boxes copied into one zero-padded tensor,
resized antialiased (bilinear, with ``F.interpolate``'s weights) and flipped by two batched
matmuls with per-sample weight matrices. It writes them and the CPU crops into the batch in
sample order: uint8 ``(B, 3, S, S)``, the values of the CPU path's crops to within resampling
(the CPU path decodes large crops at a reduced DCT scale and resizes in uint8 arithmetic). The same code runs with ``device="cpu"``, which the tests
use. Only torch and torchvision: no Ray, no CUDA needed to import it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

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
    skipped = set(failed)
    kept = [p for p in range(count) if p not in skipped]  # the positions of the batch's rows
    row = {p: r for r, p in enumerate(kept)}
    # Every crop is written straight into its row: no stacking or reordering afterwards.
    batch = torch.empty((len(kept), 3, size, size), dtype=torch.uint8, device=device)
    if good:
        _resize_into(batch, [row[positions[i]] for i in good], [images[i] for i in good], [boxes[i] for i in good])
    if len(cpu_crops):
        here = {positions[i] for i in good}
        batch.index_copy_(0, _on([r for r, p in enumerate(kept) if p not in here], device), cpu_crops)
    return batch, failed


# Crops resized in one go: up to this many, padded to the largest box among them (taken in order
# of area, so that few pad much). Bounds the chunk's float copy (64 boxes of 500x400: 77 MB in
# float16, on CUDA) and keeps the operators per batch few (4 chunks of a batch of 256).
CHUNK = 64


def _resize_into(
    batch: torch.Tensor,
    rows: list[int],
    images: list[torch.Tensor],
    boxes: list[tuple[int, int, int, int, bool]],
    dtype: torch.dtype | None = None,
) -> None:
    """Writes ``images``' ``boxes``, resized to ``batch``'s side (bilinear, antialiased, as
    ``F.interpolate(..., antialias=True)`` does) and flipped where asked, into ``batch``'s ``rows``.

    Two views per image and otherwise a constant number of operators per chunk of up to
    :data:`CHUNK` boxes: the feed runs this on a thread that shares the GIL with the training
    step's, and a resize per image (five operators and ~50 us of Python each) starved the step.
    A chunk: one copy of every box into a zero-padded ``(n, H, 3, W)`` tensor (``_foreach_copy_``:
    one call, the loop in C++), one conversion to float, the resize weights of all its boxes at
    once (:func:`_weights`; a flip is the horizontal weights' rows reversed) and two batched
    matmuls, ``Wy @ x @ Wx^T``. In ``dtype``: by default float16 on CUDA (the pixels are exact in
    it, the weights keep 11 bits, cuBLAS sums the products in float32: within a level of float32,
    see the tests), float32 elsewhere."""
    size, device = batch.shape[-1], batch.device
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    # Clipped to the image as slicing would (the boxes come from the JPEG's header): a view past
    # the edge would read the next row's pixels.
    boxes = [_inside(box, image) for box, image in zip(boxes, images)]
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][2] * boxes[i][3])
    for start in range(0, len(order), CHUNK):
        chunk = order[start : start + CHUNK]
        n = len(chunk)
        hs, ws = [boxes[i][2] for i in chunk], [boxes[i][3] for i in chunk]
        height, width = max(hs), max(ws)
        # Channels between rows and columns: both matmuls are then plain batched ones over the
        # samples, the channels folded into the other operand (no broadcast copies of weights).
        padded = torch.zeros((n, height, 3, width), dtype=torch.uint8, device=device)
        strides = (width, 3 * width, 1)
        into = [padded.as_strided((3, h, w), strides, k * height * 3 * width) for k, (h, w) in enumerate(zip(hs, ws))]
        torch._foreach_copy_(into, [_box(images[i], boxes[i]) for i in chunk])
        x = padded.to(dtype)
        # One small copy to the device for the chunk: box sides (heights, then widths), flips, rows.
        meta = _on([hs + ws, [0] * n + [int(boxes[i][4]) for i in chunk], [rows[i] for i in chunk] * 2], device)
        weights = _weights(meta[0], meta[1].bool(), size, max(height, width)).to(dtype)
        wy, wx_t = weights[:n, :, :height], weights[n:, :, :width].transpose(1, 2)
        if height >= width:  # the longer side first: fewer multiplications
            out = wy @ x.view(n, height, 3 * width)
            out = (out.view(n, size * 3, width) @ wx_t).view(n, size, 3, size)
        else:
            out = (x.view(n, height * 3, width) @ wx_t).view(n, height, 3 * size)
            out = (wy @ out).view(n, size, 3, size)
        out = out.round_().clamp_(0, 255).to(torch.uint8)
        batch.index_copy_(0, meta[2, :n], out.permute(0, 2, 1, 3))


def _inside(box: tuple[int, int, int, int, bool], image: torch.Tensor) -> tuple[int, int, int, int, bool]:
    top, left, h, w, flip = box
    height, width = image.shape[-2:]
    return top, left, min(h, height - top), min(w, width - left), flip


def _box(image: torch.Tensor, box: tuple[int, int, int, int, bool]) -> torch.Tensor:
    """The view of ``box`` in the (3, H, W) ``image``: one operator (slicing would take two)."""
    top, left, h, w, _ = box
    stride = image.stride()
    return image.as_strided((3, h, w), stride, image.storage_offset() + top * stride[1] + left * stride[2])


def _weights(lengths: torch.Tensor, flips: torch.Tensor, size: int, span: int) -> torch.Tensor:
    """float32 ``(k, size, span)``: row ``i`` of sample ``s`` weighs the input pixels of output
    pixel ``i`` when resizing ``lengths[s]`` pixels to ``size`` (zero from ``lengths[s]`` on), the
    rows in reverse order where ``flips[s]``.

    aten's weights of the antialiased bilinear resize (``_compute_indices_min_size_weights_aa``),
    in float32 as it computes them for float input: scale = in / out; output pixel ``i`` centred
    at ``scale * (i + 0.5)`` in the input; a triangle filter of half-width ``support`` =
    max(scale, 1) (widened by the scale when shrinking, so that every input pixel counts); the
    inputs ``j`` in ``[trunc(center - support + 0.5), trunc(center + support + 0.5))`` clipped to
    the input, weighed ``1 - |j + 0.5 - center| / support`` and normalised to sum to one. That
    window holds every ``j`` the triangle weighs above zero, so only the clipping to the input
    needs a mask."""
    length = lengths.to(torch.float32)[:, None, None]
    scale = length / size
    support = scale.clamp(min=1.0)
    out = torch.arange(size, device=lengths.device, dtype=torch.float32)[:, None]
    center = scale * (torch.where(flips[:, None, None], size - 1 - out, out) + 0.5)  # (k, size, 1)
    j = torch.arange(span, device=lengths.device, dtype=torch.float32)
    # In place from the first (k, size, span) tensor on: these are the largest of the chunk's.
    weights = (j + 0.5 - center).abs_().mul_(-1 / support).add_(1).clamp_(min=0).mul_(j < length)
    return weights.div_(weights.sum(-1, keepdim=True).clamp_(min=1e-12))


def _on(values: list, device: torch.device) -> torch.Tensor:
    """int64 ``values`` on ``device``, without waiting for the device (a copy from pageable
    memory is staged at once)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _decode_jpegs(jpegs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """RGB uint8 ``(3, H, W)`` images on ``device``, None for a JPEG neither the device's decoder
    nor the CPU's decodes. One call for the whole list (nvjpeg batches it; a refusal of any image
    fails the call, so then each is tried alone)."""
    # Imported here, not at the top: every training worker imports this module (through the loader's
    # batch types), and torchvision's import takes its models and ops along (~0.3 CPU-s a process,
    # ~1.5 before torch._dynamo is imported), which only device decoding needs.
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return list(decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device))
    except RuntimeError as error:
        log.warning("decoding %d JPEGs on %s failed (%s); decoding them one by one", len(jpegs), device, error)
    return [_decode_one(jpeg, device) for jpeg in jpegs]


def _decode_one(jpeg: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    from torchvision.io import ImageReadMode, decode_jpeg  # see _decode_jpegs

    for where in dict.fromkeys([device, torch.device("cpu")]):
        try:
            return decode_jpeg(jpeg, mode=ImageReadMode.RGB, device=where).to(device)
        except RuntimeError:
            continue
    return None
