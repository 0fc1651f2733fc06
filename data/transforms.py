"""Decoding and augmentation of one sample (torchvision v2 transforms on PIL images).

- train: ``RandomResizedCrop(img_size, scale=(0.05, 1.0))`` (the "inception crop" of the ViT
  paper's pre-training) and a horizontal flip;
- eval: the shorter side resized to ``round(img_size / 0.875)`` then a central ``img_size`` crop
  (256 -> 224, the usual ImageNet evaluation); images whose shorter side is at most ``img_size``
  (CIFAR, digits) are simply resized to ``img_size x img_size``, since cropping a small image
  would only lose content;
- both: RGB (grayscale and palette images are converted); the transforms give uint8 tensors and
  :func:`to_model_range` maps a stacked batch of them to float32 in ``[-1, 1]``.
  :func:`train_augment` and :func:`eval_resize` are the same transforms without the final
  conversion to a tensor: the loaders copy their PIL output plane by plane straight into the
  batch, which costs less than ``PILToTensor`` followed by a stack.

Training randomness comes from a seed per sample (see :func:`vitray.data.plan.augment_seed`), so
a resumed run crops and flips every sample exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image
from torchvision.transforms import v2

from .layout import LabelKind

EVAL_CROP_FRACTION = 0.875
TRAIN_CROP_SCALE = (0.05, 1.0)
IMAGE_FIELDS = ("jpg", "jpeg", "png")
UNLABELLED = -1  # the label of every sample of an unlabelled dataset

Transform = Callable[[Image.Image], torch.Tensor]
Augment = Callable[[Image.Image], Image.Image]


class CorruptSample(Exception):
    """A sample that cannot be decoded; the loaders skip it and count it."""


def train_augment(img_size: int, *, min_crop_area: float = TRAIN_CROP_SCALE[0], flip: bool = True) -> Augment:
    """PIL image -> PIL image ``img_size x img_size``: inception crop and flip.

    ``min_crop_area`` is the smallest crop as a fraction of the image (the paper's 5%; tiny images
    such as the 8x8 digits need larger crops to keep their label).
    """
    return v2.Compose(
        [
            v2.RandomResizedCrop(img_size, scale=(min_crop_area, 1.0), antialias=True),
            *([v2.RandomHorizontalFlip()] if flip else []),
        ]
    )


def train_transform(img_size: int, *, min_crop_area: float = TRAIN_CROP_SCALE[0], flip: bool = True) -> Transform:
    """PIL image -> uint8 tensor ``(3, img_size, img_size)``: :func:`train_augment`, then to a tensor."""
    return v2.Compose([train_augment(img_size, min_crop_area=min_crop_area, flip=flip), v2.PILToTensor()])


def eval_resize(img_size: int) -> Augment:
    """PIL image -> PIL image ``img_size x img_size``: resize (and central crop)."""
    small = v2.Resize((img_size, img_size), antialias=True)
    large = v2.Compose([v2.Resize(round(img_size / EVAL_CROP_FRACTION), antialias=True), v2.CenterCrop(img_size)])

    def resize(image: Image.Image) -> Image.Image:
        return small(image) if min(image.size) <= img_size else large(image)

    return resize


def eval_transform(img_size: int) -> Transform:
    """PIL image -> uint8 tensor ``(3, img_size, img_size)``: :func:`eval_resize`, then to a tensor."""
    resize, to_tensor = eval_resize(img_size), v2.PILToTensor()

    def transform(image: Image.Image) -> torch.Tensor:
        return to_tensor(resize(image))

    return transform


def to_model_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 images -> float32 in ``[-1, 1]`` (``x / 127.5 - 1``), for a whole batch at once:
    one vectorised op instead of a per-image ``ToDtype`` + ``Normalize``, which cost more than the
    crop itself."""
    return images.to(torch.float32).mul_(2.0 / 255.0).sub_(1.0)


def decode_image(data: bytes) -> Image.Image:
    """Decode encoded bytes into an RGB image; CorruptSample if they are not a readable image."""
    try:
        image = Image.open(io.BytesIO(data))
        if image.mode == "P" and "transparency" in image.info:
            image = image.convert("RGBA")  # converting straight to RGB warns about the palette alpha
        image.load()  # the full decode, so that truncated data fails here
        return image if image.mode == "RGB" else image.convert("RGB")  # RGB already: no copy
    except Exception as error:  # noqa: BLE001 - Pillow raises many kinds for bad data
        raise CorruptSample(f"undecodable image: {type(error).__name__}: {error}") from None


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
