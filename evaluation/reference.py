"""Reference numbers a reader already knows, fitted in the same run as the numbers they put in context.

:func:`pixel_linear_top1` is a linear classifier on the raw pixels of a prepared dataset: scikit-learn's
multinomial logistic regression on the standardised pixel values of every training image, scored on
the test split. Any learned representation worth its compute beats it; a pre-training or a
fine-tune that does not is shown for what it is (the digits demo's Ti/4 learns from 1,437 images
of 8x8 pixels, where the pixels alone are a strong baseline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vitray.data import load_split
from vitray.data.batch import Batch

PIXEL_LINEAR = "linear classifier on the raw pixels (scikit-learn LogisticRegression)"


@dataclass(frozen=True)
class Reference:
    """One reference number: what it is, its test top-1, and on what it was fitted and scored."""

    name: str
    top1: float
    dataset: str
    train_split: str
    test_split: str
    img_size: int


def pixel_linear_top1(
    path: str,
    *,
    train_split: str = "train",
    test_split: str = "test",
    img_size: int,
    storage_options: dict[str, Any] | None = None,
) -> Reference:
    """Fits a logistic regression on the pixels of `train_split` (images at `img_size`: their own
    size keeps them raw) and returns its top-1 on `test_split`. Single-label datasets only."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    train, test = (
        load_split(path, split, img_size=img_size, storage_options=storage_options)
        for split in (train_split, test_split)
    )
    if train.labels.ndim != 1:
        raise ValueError(f"{path} holds multi-label data: the pixel baseline fits single labels only")
    classifier = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    classifier.fit(_pixels(train), train.labels.numpy())
    top1 = float(classifier.score(_pixels(test), test.labels.numpy()))
    return Reference(PIXEL_LINEAR, top1, path, train_split, test_split, img_size)


def _pixels(batch: Batch) -> np.ndarray:
    """One row of pixel values per image (uint8 images from the loader, as floats)."""
    return batch.images.reshape(len(batch.images), -1).numpy().astype(np.float64)


def in_context(rows: list[tuple[str, float]], reference: Reference) -> str:
    """A Markdown section that puts `rows` ((what, test top-1) on the reference's test split) beside
    the reference, best first, so a reader sees at once what each number is worth."""
    lines = [
        f"## In context: test top-1 on {reference.test_split} of {reference.dataset}",
        "",
        f"The reference is fitted in the same run on `{reference.train_split}` at {reference.img_size} px "
        "(the images' own pixels).",
        "",
        "| model | test top-1 |",
        "| --- | ---: |",
    ]
    everything = [(f"reference: {reference.name}", reference.top1), *rows]
    for what, top1 in sorted(everything, key=lambda row: -row[1]):
        lines.append(f"| {what.replace('|', chr(92) + '|')} | {top1:.4f} |")
    return "\n".join(lines) + "\n"
