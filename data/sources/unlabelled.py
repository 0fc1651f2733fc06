"""``unlabelled:SPEC``: any source without its labels, for self-supervised pre-training.

``unlabelled:imagefolder:/data/photos``, ``unlabelled:parquet:/data/table``,
``unlabelled:builtin:digits``: the images, splits and sample order of the wrapped source, with
``label_kind`` "none", no classes (``num_classes`` 0) and image-only samples (no ``.cls`` /
``.json`` member). Readers yield label -1 for every sample. Only objectives that need no labels
(``train.objective=masked_patch``) train on such a dataset; the supervised ones refuse it.

An image folder without class folders (``PATH/IMAGE.jpg``) is unlabelled by itself, without
this prefix (see :mod:`vitray.data.sources.imagefolder`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from .base import LabelColumnMissing, Sample, SampleChunk, Source


class UnlabelledChunk(SampleChunk):
    def __init__(self, inner: SampleChunk) -> None:
        self.inner = inner

    def __iter__(self) -> Iterator[Sample]:
        for sample in self.inner:
            yield Sample(sample.image, sample.ext, None, sample.origin)


class UnlabelledSource(Source):
    kind = "unlabelled"

    def __init__(self, inner: Source) -> None:
        super().__init__(f"{self.kind}:{inner.spec}", inner.name, [], "none")
        self.inner = inner
        self.random_access = inner.random_access  # the wrapped source's sample order
        self.notes, self.known_bad = inner.notes, inner.known_bad

    @classmethod
    def open(cls, location: str) -> Source:
        raise TypeError(f"{cls.kind}:{location} wraps another source: open it with vitray.data.sources.open_source")

    @classmethod
    def open_spec(cls, location: str, open_source: Callable[[str], Source]) -> Source:
        try:
            inner = open_source(location)
        except LabelColumnMissing as missing:  # a table of images alone (or labels unusable): what this is for
            inner = missing.reopen()
        if inner.reopen_unlabelled is not None:  # its splits without labels too
            inner = inner.reopen_unlabelled()
        return inner if inner.label_kind == "none" else cls(inner)

    def split_sizes(self) -> dict[str, int]:
        return self.inner.split_sizes()

    def sample_nbytes(self, split: str) -> np.ndarray:
        return self.inner.sample_nbytes(split)

    def chunk(self, split: str, indices: Sequence[int]) -> UnlabelledChunk:
        return UnlabelledChunk(self.inner.chunk(split, indices))
