"""Decoding and augmentation of one sample (on PIL images, as torchvision's v2 transforms do them).

- train: ``RandomResizedCrop(img_size, scale=(0.05, 1.0))`` (the "inception crop" of the ViT
  paper's pre-training) and a horizontal flip, as :class:`TrainCrop`: the same random draws and
  the same crops as torchvision's ``v2.RandomResizedCrop`` + ``v2.RandomHorizontalFlip``. The
  other training crops of the authors' transfer configs (big_vision ``configs/transfer.py``) are
  crop kinds of the same class (:data:`TRAIN_CROPS`): ``resmall_crop`` (``resize_small(448) |
  random_crop(384)``), ``resize_crop`` (``resize(448) | random_crop(384)``) and ``resize`` (the
  whole image, no crop: for tasks whose label a crop would change). Every kind is a box of the
  source image resized to ``img_size``, so all of them take the same decode paths. From
  encoded bytes (:meth:`TrainCrop.from_bytes`, what the training loader runs) a JPEG is decoded
  at the smallest DCT scale (1/2, 1/4, 1/8: ``Image.draft``) at which the crop is still at least
  ``img_size`` pixels in each direction, so that large photos are not decoded whole only to be
  shrunk; otherwise only the crop's region is decoded (``_jpeg_region``, libjpeg-turbo's skipped
  rows and cropped scanlines: the pixels of a full decode at ~2/3 of its cost), or the whole
  image by torchvision's ``decode_jpeg`` where that extension is not built; the crop is resized
  by torch's uint8 antialiased bilinear kernel (within one level of PIL's, at under half its cost);
- eval (:data:`EvalResize`), in big_vision's spelling: ``"aspect"``, ``resize_small(R)|central_crop(S)``,
  the shorter side resized to ``R = round(S x ratio)`` whatever the image's size (smaller ones
  are enlarged), then the central crop (256 -> 224 by default: the authors' ImageNet evaluation;
  448 -> 384 in the fine-tune recipes: big_vision ``configs/transfer.py``); ``"square"``, the
  authors' few-shot protocol (big_vision ``configs/common_fewshot.py``: ``resize(256)|central_crop(224)``):
  every image squashed to ``R x R``, then the central crop; ``"whole"``, ``resize(S)``: the whole
  image squashed to ``S x S`` (vit_jax's evaluation, and BiT's for the VTAB tasks, whose training
  crops are squares of the squashed image too);
- both: RGB (grayscale and palette images are converted); the transforms give uint8 tensors and
  :func:`~vitray.data.model_range.to_model_range` maps a stacked batch of them to float32 in ``[-1, 1]``.
  :func:`train_augment` and :func:`eval_resize` are the same transforms without the final
  conversion to a tensor: the loaders copy their PIL output plane by plane straight into the
  batch, which costs less than ``PILToTensor`` followed by a stack.

Training randomness comes from a seed per sample (see :func:`vitray.data.plan.augment_seed`), so
a resumed run crops and flips every sample exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

# torchvision (v2, decode_jpeg) is imported in the functions that use it, not here: every training
# worker imports this module, and torchvision's import takes its models and ops along (~0.3 CPU-s
# a process; ~1.5 where torch._dynamo is not yet imported), which training crops (TrainCrop, the
# region decoder) and the evaluation transforms (PIL's own resampling) never use.
from .config import EVAL_RESIZE_RATIO, RESIZE_RATIO, TRAIN_CROPS, TrainCropKind
from .layout import LabelKind

try:  # the compiled region decoder (setup.py); optional: without it whole images are decoded
    from . import _jpeg_region
except ImportError:  # pragma: no cover - built wherever libjpeg's headers are installed
    _jpeg_region = None
# Whether training crops of JPEGs are decoded by region (set False to compare the two paths).
REGION_DECODE = _jpeg_region is not None
# What a run says where the region decoder is missing: a slower loader, and how to mend it.
WHOLE_DECODE_NOTE = (
    "JPEGs are decoded whole before each crop (about 1.2x the loader's CPU time per sample): vitray's "
    "region decoder was not built with this install; install libjpeg's headers (apt install libjpeg-dev) "
    "and reinstall vitray"
)

EVAL_CROP_FRACTION = 1 / EVAL_RESIZE_RATIO  # 0.875: the central crop of the resized image
TRAIN_CROP_SCALE = (0.05, 1.0)
IMAGE_FIELDS = ("jpg", "jpeg", "png")
# How evaluation images reach img_size (the module's docstring): "aspect" keeps the aspect ratio
# (shorter side, then a central crop), "square" squashes first (the few-shot protocol), "whole"
# squashes the whole image to img_size (no crop).
EvalResize = Literal["aspect", "square", "whole"]
EVAL_RESIZES = ("aspect", "square", "whole")
UNLABELLED = -1  # the label of every sample of an unlabelled dataset

Transform = Callable[[Image.Image], torch.Tensor]
Augment = Callable[[Image.Image], Image.Image]


class CorruptSample(Exception):
    """A sample that cannot be decoded; the loaders skip it and count it."""


class TrainCrop:
    """A training crop and flip: PIL image (or encoded bytes) -> ``img_size`` square.

    ``crop`` says which crop (:data:`TRAIN_CROPS`):

    - ``inception_crop``: called on a PIL image, it draws from torch's default generator exactly as
      torchvision's ``Compose([RandomResizedCrop(img_size, scale=(min_crop_area, 1)),
      RandomHorizontalFlip()])`` does and gives the same PIL image;
    - ``resmall_crop``: big_vision's ``resize_small(r * img_size) | random_crop(img_size)`` with
      ``r = resize_ratio``, made as the square box of side ``min(width, height) / r`` of the source
      image at a uniformly drawn offset, resized to ``img_size`` (the same pixels up to the order of
      resampling; offsets are whole source pixels);
    - ``resize_crop``: ``resize(r * img_size) | random_crop(img_size)``: the box of ``width / r x
      height / r`` at a uniformly drawn offset, squashed to the square;
    - ``resize``: the whole image squashed to the square, no crop.

    The flip's coin comes last, after the box's draws. :meth:`from_bytes`, what the loaders use,
    draws the same numbers from a generator seeded with the sample's seed (the same crop and flip),
    takes the image size from the header, and decodes a JPEG at the smallest DCT scale that keeps
    the crop at least ``img_size`` wide and high, mapping the crop box into the reduced image; where
    no reduction applies it decodes only the crop's region. Its pixels are within one level of the
    PIL path when no reduction applies (every crop smaller than twice ``img_size``) and close to it
    otherwise.
    """

    RATIO = (3.0 / 4.0, 4.0 / 3.0)
    DRAFT_SCALES = (8, 4, 2)  # the reductions libjpeg decodes to directly

    def __init__(
        self,
        img_size: int,
        *,
        crop: TrainCropKind = "inception_crop",
        min_crop_area: float = TRAIN_CROP_SCALE[0],
        resize_ratio: float = RESIZE_RATIO,
        flip: bool = True,
    ) -> None:
        if crop not in TRAIN_CROPS:
            raise ValueError(f"crop must be one of {', '.join(TRAIN_CROPS)}; got {crop!r}")
        if resize_ratio < 1:
            raise ValueError(
                f"resize_ratio must be at least 1 (the crop is taken from a larger image), got {resize_ratio}"
            )
        self.size, self.crop, self.area_scale, self.flip = img_size, crop, (min_crop_area, 1.0), flip
        self.resize_ratio = resize_ratio
        # float32, as torchvision keeps them: the draws below then see the very same bounds
        self._log_ratio = [float(v) for v in torch.log(torch.tensor(self.RATIO))]

    def params(
        self, width: int, height: int, generator: torch.Generator | None = None
    ) -> tuple[int, int, int, int, bool]:
        """(top, left, crop height, crop width, flip) for a ``width x height`` image: for the
        inception crop torchvision's ``RandomResizedCrop.make_params`` and the flip's coin, drawn in
        the same order."""
        if self.crop == "inception_crop":
            top, left, h, w = self._inception_box(width, height, generator)
        else:
            top, left, h, w = self._resized_crop_box(width, height, generator)
        flip = self.flip and bool(torch.rand(1, generator=generator).item() < 0.5)
        return top, left, h, w, flip

    def _inception_box(self, width: int, height: int, generator: torch.Generator | None) -> tuple[int, int, int, int]:
        area = height * width
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(*self.area_scale, generator=generator).item()
            aspect_ratio = torch.exp(torch.empty(1).uniform_(*self._log_ratio, generator=generator)).item()
            w = round(math.sqrt(target_area * aspect_ratio))
            h = round(math.sqrt(target_area / aspect_ratio))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
                left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
                return top, left, h, w
        # torchvision's fallback: a central crop at the nearest allowed aspect ratio
        in_ratio = float(width) / float(height)
        if in_ratio < min(self.RATIO):
            w, h = width, round(width / min(self.RATIO))
        elif in_ratio > max(self.RATIO):
            w, h = round(height * max(self.RATIO)), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def _resized_crop_box(
        self, width: int, height: int, generator: torch.Generator | None
    ) -> tuple[int, int, int, int]:
        """The box of the source image that the ``img_size`` crop of the resized image covers."""
        if self.crop == "resize":
            return 0, 0, height, width
        if self.crop == "resmall_crop":  # the shorter side to r * img_size: the crop is a square of the source
            h = w = min(width, height) / self.resize_ratio
        else:  # resize_crop: both sides to r * img_size
            h, w = height / self.resize_ratio, width / self.resize_ratio
        h, w = max(1, min(height, round(h))), max(1, min(width, round(w)))
        top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
        left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
        return top, left, h, w

    def device_box(self, data: bytes, seed: int | None) -> tuple[int, int, int, int, bool] | None:
        """The crop (top, left, height, width, flip) that :meth:`from_bytes` takes from ``data``,
        drawn from the same seeded generator, for the accelerator to decode and crop
        (``data.decode=gpu``, :mod:`vitray.data.device_decode`); None where ``data`` must take
        the CPU path (not a JPEG nvjpeg decodes as libjpeg does: see :func:`jpeg_device_size`)."""
        size = jpeg_device_size(data)
        if size is None:
            return None
        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        return self.params(*size, generator)

    def draft_scale(self, crop_width: int, crop_height: int) -> int:
        """The largest DCT reduction that keeps a ``crop_width x crop_height`` crop at least
        ``img_size`` pixels in each direction (so the final resize still only shrinks)."""
        return next((s for s in self.DRAFT_SCALES if min(crop_width, crop_height) >= s * self.size), 1)

    def __call__(self, image: Image.Image) -> Image.Image:
        top, left, h, w, flip = self.params(*image.size)
        return self._finish(image.crop((left, top, left + w, top + h)), flip)

    def from_bytes(self, data: bytes, seed: int | None) -> torch.Tensor:
        """Decode and crop encoded image bytes into a uint8 ``(3, img_size, img_size)`` tensor;
        CorruptSample if they are not a readable image.

        The crop is resized by torch's antialiased bilinear kernel for uint8 images, which gives
        PIL's pixels within one level at under half PIL's cost. JPEGs whose crop allows no DCT
        reduction are decoded by region (only the crop's rows and iMCU columns), or whole by
        torchvision (libjpeg-turbo, ~15% faster than through PIL) without the extension.
        """
        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        try:
            size = jpeg_size(data)  # a few markers: cheaper than PIL's parse of the whole header
            image = Image.open(io.BytesIO(data)) if size is None else None
            width, height = size or image.size  # type: ignore[union-attr]
            top, left, h, w, flip = self.params(width, height, generator)
            pixels, scale = None, 1.0
            reduce = self.draft_scale(w, h) if size or image.format == "JPEG" else 1  # type: ignore[union-attr]
            if reduce > 1:
                image = image or Image.open(io.BytesIO(data))
                drafted = image.draft("RGB", (width // reduce, height // reduce))
                scale = width / drafted[1][2] if drafted else 1.0
            elif size is not None:
                pixels = _decode_jpeg_region(data, top, left, h, w)
                if pixels is None:
                    pixels = _decode_jpeg(data)[:, top : top + h, left : left + w]
            if pixels is None:
                image = _loaded_rgb(image)
                if scale == 1:
                    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[:, top : top + h, left : left + w]
        except Exception as error:
            raise CorruptSample(f"undecodable image: {type(error).__name__}: {error}") from None
        if pixels is None:  # a reduced decode: the crop box in its pixels, to sub-pixel precision
            crop = _resized_box(image, (top / scale, left / scale, h / scale, w / scale), self.size)
        else:
            crop = pixels
            if (h, w) != (self.size, self.size):
                # Dense (h, w, 3) memory seen as (1, 3, h, w) (no copy for a region decode's crop):
                # the kernel's vectorised uint8 path needs channels-last input. Made this way, not by
                # `crop[None].contiguous(memory_format=channels_last)`, whose batch stride of 3
                # leaves torch unsure of the layout: it then writes planar output, ~50% slower and
                # a transpose more for the copy into the (channels-last) chunk.
                dense = crop.permute(1, 2, 0).contiguous()[None].permute(0, 3, 1, 2)
                crop = F.interpolate(
                    dense, size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False
                )[0]
        return crop.flip(-1) if flip else crop

    def _finish(self, crop: Image.Image, flip: bool) -> Image.Image:
        if crop.size != (self.size, self.size):
            crop = crop.resize((self.size, self.size), Image.Resampling.BILINEAR)
        return crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else crop


def train_augment(
    img_size: int,
    *,
    crop: TrainCropKind = "inception_crop",
    min_crop_area: float = TRAIN_CROP_SCALE[0],
    resize_ratio: float = RESIZE_RATIO,
    flip: bool = True,
) -> TrainCrop:
    """PIL image -> PIL image ``img_size x img_size``: the training crop and flip (:class:`TrainCrop`;
    its ``from_bytes`` decodes and crops in one, which the loaders use).

    ``min_crop_area`` is the inception crop's smallest crop as a fraction of the image (the paper's
    5%; tiny images such as the 8x8 digits need larger crops to keep their label); ``resize_ratio``
    how much larger than ``img_size`` the image is resized before a ``resmall_crop`` or ``resize_crop``.
    """
    return TrainCrop(img_size, crop=crop, min_crop_area=min_crop_area, resize_ratio=resize_ratio, flip=flip)


def train_transform(img_size: int, **augment: Any) -> Transform:
    """PIL image -> uint8 tensor ``(3, img_size, img_size)``: :func:`train_augment` (its keyword
    arguments: crop, min_crop_area, resize_ratio, flip), then to a tensor."""
    from torchvision.transforms import v2  # imported here: see the note at the imports

    return v2.Compose([train_augment(img_size, **augment), v2.PILToTensor()])


def eval_resize(img_size: int, resize: EvalResize = "aspect", ratio: float = EVAL_RESIZE_RATIO) -> Augment:
    """PIL image -> PIL image ``img_size x img_size``: resize and central crop, as ``resize`` says,
    from ``round(img_size x ratio)`` (see the module's docstring). The geometry of torchvision's
    ``v2.Resize`` (bilinear; on a PIL image PIL's own resampling) and ``v2.CenterCrop``, done with
    PIL directly: the val evaluator runs this in every training worker, where importing torchvision
    would cost ~0.1-0.3 CPU-s. Only the part of the image that the crop keeps is resampled (PIL's
    ``box``): the whole resize was the largest cost of an evaluation image, 43% of it cropped away
    at the default ratio; the pixels are torchvision's within one level (tests/test_data_loader.py)."""
    if resize not in EVAL_RESIZES:
        raise ValueError(f"resize must be one of {EVAL_RESIZES}, got {resize!r}")
    if ratio < 1:
        raise ValueError(f"the resize ratio must be at least 1 (the crop is the central part), got {ratio}")
    enlarged = round(img_size * ratio)
    if resize == "whole":
        return lambda image: _resized(image, (img_size, img_size))
    if resize == "square":
        return lambda image: _center_of_resized(image, (enlarged, enlarged), img_size)

    def keep_aspect(image: Image.Image) -> Image.Image:
        width, height = image.size
        short, long = min(width, height), max(width, height)
        # The shorter side to `enlarged`, the longer in proportion, rounded down (torchvision's rule).
        scaled = enlarged, int(enlarged * long / short)
        return _center_of_resized(image, scaled if width <= height else scaled[::-1], img_size)

    return keep_aspect


def _resized(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """`image` at `size` (width, height), bilinear; the image itself when it already has that size."""
    return image if image.size == size else image.resize(size, resample=Image.BILINEAR)


def _center_of_resized(image: Image.Image, scaled: tuple[int, int], size: int) -> Image.Image:
    """The central `size` square of `image` resized to `scaled` (at least `size` each way), its
    corner rounded as torchvision's: the part of `image` under that square, resampled alone."""
    left, top = (round((side - size) / 2.0) for side in scaled)
    if image.size == scaled:
        return image.crop((left, top, left + size, top + size))
    x, y = image.width / scaled[0], image.height / scaled[1]
    box = (left * x, top * y, (left + size) * x, (top + size) * y)
    return image.resize((size, size), resample=Image.BILINEAR, box=box)


def eval_transform(img_size: int, resize: EvalResize = "aspect", ratio: float = EVAL_RESIZE_RATIO) -> Transform:
    """PIL image -> uint8 tensor ``(3, img_size, img_size)``: as RGB (a gray, palette or RGBA image
    converted as the loaders convert it), :func:`eval_resize`, then to a tensor."""
    resized = eval_resize(img_size, resize, ratio)

    def transform(image: Image.Image) -> torch.Tensor:
        out = resized(_loaded_rgb(image))
        pixels = torch.from_numpy(np.array(out, copy=True))
        return pixels.view(out.height, out.width, len(out.getbands())).permute(2, 0, 1)

    return transform


_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # start-of-frame: they hold the size
_STANDALONE_MARKERS = frozenset([0x01, *range(0xD0, 0xD9)])  # markers without a length field


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG's start-of-frame marker; None if ``data`` is not a JPEG whose
    frame header comes before any image data (then PIL reads the header)."""
    frame = _jpeg_frame(data)
    return frame[:2] if frame is not None else None


# Start-of-frame markers of the codings nvjpeg decodes: baseline, extended sequential, progressive
# (all Huffman-coded); lossless, hierarchical and arithmetic-coded JPEGs go to the CPU.
_DEVICE_SOF_MARKERS = frozenset([0xC0, 0xC1, 0xC2])


def jpeg_device_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a JPEG that torchvision's ``decode_jpeg(..., device="cuda")`` (nvjpeg)
    decodes to the pixels libjpeg gives: 8-bit, grayscale or YCbCr (no CMYK / YCCK, no Adobe RGB),
    a coding nvjpeg supports, ending with the end-of-image marker (a cut-short JPEG is left to the
    CPU, whose decoder decides whether it is corrupt). None for anything else (PNGs included)."""
    frame = _jpeg_frame(data)
    if frame is None or data[-2:] != b"\xff\xd9":
        return None
    width, height, marker, precision, components, adobe_transform = frame
    if marker not in _DEVICE_SOF_MARKERS or precision != 8 or components not in (1, 3):
        return None
    if components == 3 and adobe_transform not in (None, 1):  # 0: RGB stored as is (no YCbCr)
        return None
    return width, height


def _jpeg_frame(data: bytes) -> tuple[int, int, int, int, int, int | None] | None:
    """(width, height, start-of-frame marker, sample precision, components, Adobe colour transform
    or None) from the markers before the frame header; None if ``data`` is not such a JPEG."""
    if data[:2] != b"\xff\xd8":
        return None
    at, end = 2, len(data) - 9
    adobe_transform = None
    while at < end:
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
        elif marker in _SOF_MARKERS:
            height, width = int.from_bytes(data[at + 5 : at + 7], "big"), int.from_bytes(data[at + 7 : at + 9], "big")
            if not (width and height):
                return None
            return width, height, marker, data[at + 4], data[at + 9], adobe_transform
        elif marker in _STANDALONE_MARKERS:
            at += 2
        elif marker == 0xDA:  # start of scan before any frame header: not a JPEG to trust
            return None
        else:
            if marker == 0xEE and data[at + 4 : at + 9] == b"Adobe" and at + 15 < len(data):  # APP14
                adobe_transform = data[at + 15]
            at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return None


def _decode_jpeg_region(data: bytes, top: int, left: int, height: int, width: int) -> torch.Tensor | None:
    """The crop of a JPEG as RGB uint8 ``(3, height, width)`` (a channels-last view), decoding
    only the rows and iMCU columns it needs (``_jpeg_region``); the same pixels as cropping a full
    decode. None where this path does not apply: the extension is not built, a CMYK JPEG, or a
    damaged one -- data that does not end with the end-of-image marker, or whose entropy-coded data
    libjpeg warns about in the rows the crop decodes. A crop reads only the data of its own rows and
    those above, so whether a damaged JPEG is refused (or decoded, as Pillow and torchvision decode
    it, warnings and all) must not depend on where its crop falls: the full decode decides, as it
    does for the reduced decode's and the evaluation's crops. CorruptSample's cause raised as
    ValueError for data libjpeg cannot decode at all."""
    if _jpeg_region is None or not REGION_DECODE or data[-2:] != b"\xff\xd9":
        return None
    try:
        pixels = _jpeg_region.decode_region(data, top, left, height, width)
    except (_jpeg_region.UnsupportedJPEG, _jpeg_region.DamagedJPEG):
        return None
    return torch.frombuffer(pixels, dtype=torch.uint8).view(height, width, 3).permute(2, 0, 1)


def _decode_jpeg(data: bytes) -> torch.Tensor:
    """RGB uint8 ``(3, H, W)`` (a channels-last view) by torchvision, or PIL's decode where
    torchvision refuses (e.g. a JPEG coding it does not support); errors come from PIL's attempt."""
    from torchvision.io import ImageReadMode, decode_jpeg  # imported here: see the note at the imports

    try:
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError:
        return torch.from_numpy(np.array(_loaded_rgb(Image.open(io.BytesIO(data))))).permute(2, 0, 1)


def _resized_box(image: Image.Image, box: tuple[float, float, float, float], size: int) -> torch.Tensor:
    """The fractional ``(top, left, height, width)`` box of ``image`` resized to ``size`` square,
    as uint8 ``(3, size, size)``. PIL resamples a fractional box exactly (torch only takes whole
    pixels, and a reduced decode's box is rarely whole)."""
    top, left, h, w = box
    crop = image.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    return torch.from_numpy(np.array(crop)).permute(2, 0, 1)


def decode_image(data: bytes) -> Image.Image:
    """Decode encoded bytes into an RGB image; CorruptSample if they are not a readable image."""
    try:
        return _loaded_rgb(Image.open(io.BytesIO(data)))
    except Exception as error:
        raise CorruptSample(f"undecodable image: {type(error).__name__}: {error}") from None


# Pillow's modes of a 16-bit grayscale PNG: its convert("RGB") clips them to 255 instead of scaling.
_WIDE_GRAY_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def _loaded_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")  # converting straight to RGB warns about the palette alpha
    image.load()  # the full decode, so that truncated data fails here
    if image.mode in _WIDE_GRAY_MODES:  # 16-bit gray: the high byte of each value, as 8-bit decoders do
        image = Image.fromarray((np.asarray(image).astype(np.int64).clip(0, 65535) >> 8).astype(np.uint8), "L")
    return image if image.mode == "RGB" else image.convert("RGB")  # RGB already: no copy


def image_bytes(fields: dict[str, bytes]) -> bytes:
    for ext in IMAGE_FIELDS:
        if ext in fields:
            return fields[ext]
    raise CorruptSample(f"no image member (expected one of {IMAGE_FIELDS}); members: {sorted(fields)}")


def decode_label(fields: dict[str, bytes], label_kind: LabelKind, num_classes: int) -> int | torch.Tensor:
    """The class index (``.cls``), or a float multi-hot vector of ``num_classes`` (``.json``);
    ``-1`` for unlabelled data (``label_kind`` "none")."""
    if label_kind == "none":
        return UNLABELLED
    try:
        if label_kind == "single":
            label = int(fields["cls"])
            if not 0 <= label < num_classes:
                raise ValueError(f"label {label} outside 0..{num_classes - 1}")
            return label
        labels: Any = [int(v) for v in json.loads(fields["json"])["labels"]]
        if any(not 0 <= v < num_classes for v in labels):
            raise ValueError(f"labels {labels} outside 0..{num_classes - 1}")
        multi_hot = torch.zeros(num_classes, dtype=torch.float32)
        multi_hot[torch.as_tensor(labels, dtype=torch.int64)] = 1.0
        return multi_hot
    except (KeyError, ValueError, TypeError, IndexError) as error:
        raise CorruptSample(f"bad label: {type(error).__name__}: {error}") from None


def apply_seeded(transform: Callable[[Image.Image], Any], image: Image.Image, seed: int | None) -> Any:
    """Run ``transform`` with torch's RNG seeded by ``seed``, leaving the caller's RNG untouched."""
    if seed is None:
        return transform(image)
    # Only the CPU generator, which the transforms draw from: torch.manual_seed would also queue
    # CUDA seeding (milliseconds per call on CUDA builds) and fork_rng is slower still.
    generator = torch.default_generator
    saved = generator.get_state()
    generator.manual_seed(seed)
    try:
        return transform(image)
    finally:
        generator.set_state(saved)
