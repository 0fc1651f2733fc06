"""``builtin:NAME``: small real datasets that ship inside installed packages (no download).

``builtin:digits`` is scikit-learn's copy of the UCI handwritten digits: 1,797 grayscale 8x8 images
of the digits 0-9, pixel values 0-16. Each image is scaled to 0-255 and stored as an 8x8 PNG. The
split is fixed: a permutation of the images by ``numpy.random.default_rng(0)``, the first 1,437
(80 %) are ``train`` and the remaining 360 are ``test``.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Iterator, Sequence

import numpy as np
from PIL import Image

from .base import Sample, SampleChunk, Source

DIGITS_TEST_SIZE = 360


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    from sklearn.datasets import load_digits  # imported here: only this source needs scikit-learn

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(images))
    n_train = len(images) - DIGITS_TEST_SIZE
    return images, digits.target.astype(np.int64), {"train": order[:n_train], "test": order[n_train:]}


def _png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=6)
    return buffer.getvalue()


class DigitsChunk(SampleChunk):
    def __init__(self, split: str, indices: list[int]) -> None:
        self.split, self.indices = split, indices

    def __iter__(self) -> Iterator[Sample]:
        images, targets, splits = _digits()
        for i in self.indices:
            original = int(splits[self.split][i])
            yield Sample(_png(images[original]), "png", int(targets[original]))


class BuiltinSource(Source):
    kind = "builtin"
    names = ("digits",)

    @classmethod
    def open(cls, location: str) -> BuiltinSource:
        if location not in cls.names:
            raise ValueError(f"no built-in dataset {location!r}; built-in datasets: {list(cls.names)}")
        return cls(f"{cls.kind}:{location}", location, [str(d) for d in range(10)], "single")

    def split_sizes(self) -> dict[str, int]:
        return {split: len(order) for split, order in _digits()[2].items()}

    def sample_nbytes(self, split: str) -> np.ndarray:
        return np.full(self.split_sizes()[split], 120, dtype=np.int64)  # an 8x8 grayscale PNG

    def chunk(self, split: str, indices: Sequence[int]) -> DigitsChunk:
        return DigitsChunk(split, [int(i) for i in indices])
