"""The model's input range, apart from the decoding and augmentation code (data/transforms.py)
so that what only needs this (the objectives, and through them the config the driver loads) does
not import torchvision."""

from __future__ import annotations

import torch


def to_model_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 images -> float32 in ``[-1, 1]`` (``x / 127.5 - 1``), for a whole batch at once:
    one vectorised op instead of a per-image ``ToDtype`` + ``Normalize``, which cost more than the
    crop itself."""
    return images.to(torch.float32).mul_(2.0 / 255.0).sub_(1.0)


def model_images(images: torch.Tensor) -> torch.Tensor:
    """Float32 images in ``[-1, 1]`` from the feed's uint8 pixels (float images pass unchanged),
    on the images' own device."""
    return to_model_range(images) if images.dtype == torch.uint8 else images.float()
