"""``cifar10:PATH`` / ``cifar100:PATH``: the "python version" pickle batches from the CIFAR site.

PATH is the extracted folder (``cifar-10-batches-py`` / ``cifar-100-python``) or its parent.
CIFAR-10: ``data_batch_1..5`` -> split ``train``, ``test_batch`` -> ``test``, class names from
``batches.meta``. CIFAR-100: ``train`` / ``test`` with the 100 fine labels, names from ``meta``.
Each 32x32 image is encoded once as PNG (lossless, so the pixels are the original ones).

The batches are Python pickles, as distributed; only open files from a trusted source.
"""

from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from .sources import Sample, SampleChunk, Source

PNG_BYTES_ESTIMATE = 2600  # a 32x32 RGB photo as PNG; only used to cap shard sizes


@functools.lru_cache(maxsize=8)
def _load_batch(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a CIFAR batch (expected a pickled dict)")
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}


def _encode_png(row: np.ndarray) -> bytes:
    # CIFAR rows are 3072 bytes: the red plane, then green, then blue, each 32x32 row-major.
    image = Image.fromarray(np.ascontiguousarray(row.reshape(3, 32, 32).transpose(1, 2, 0), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=6)
    return buffer.getvalue()


class CifarChunk(SampleChunk):
    def __init__(self, files: list[str], offsets: list[int], label_key: str, indices: list[int]) -> None:
        self.files, self.offsets, self.label_key, self.indices = files, offsets, label_key, indices

    def __iter__(self) -> Iterator[Sample]:
        for index in self.indices:
            file_no = int(np.searchsorted(self.offsets, index, side="right")) - 1
            batch = _load_batch(self.files[file_no])
            row = index - self.offsets[file_no]
            yield Sample(_encode_png(np.asarray(batch["data"][row])), "png", int(batch[self.label_key][row]))


class _CifarSource(Source):
    folder_name: ClassVar[str]
    split_files: ClassVar[dict[str, list[str]]]
    meta_file: ClassVar[str]
    names_key: ClassVar[str]
    label_key: ClassVar[str]

    def __init__(self, folder: Path, classes: list[str], files: dict[str, list[str]], sizes: dict[str, list[int]]):
        super().__init__(f"{self.kind}:{folder}", self.kind, classes, "single")
        self.files = files
        self.offsets = {split: [0, *np.cumsum(n).tolist()[:-1]] for split, n in sizes.items()}
        self.sizes = {split: sum(n) for split, n in sizes.items()}

    @classmethod
    def open(cls, location: str) -> _CifarSource:
        folder = Path(location).expanduser().resolve()
        if (folder / cls.folder_name).is_dir():
            folder = folder / cls.folder_name
        expected = [cls.meta_file, *(f for files in cls.split_files.values() for f in files)]
        missing = [name for name in expected if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{cls.kind} source {folder} lacks {missing}; expected the extracted python-version "
                f"archive ({cls.folder_name}/ with {expected})"
            )
        meta = _load_batch(str(folder / cls.meta_file))
        classes = [n.decode() if isinstance(n, bytes) else str(n) for n in meta[cls.names_key]]
        files = {split: [str(folder / f) for f in names] for split, names in cls.split_files.items()}
        sizes = {}
        for split, paths in files.items():
            sizes[split] = []
            for path in paths:
                batch = _load_batch(path)
                if "data" not in batch or cls.label_key not in batch:
                    raise ValueError(f"{path} lacks 'data' or {cls.label_key!r}: not a {cls.kind} batch")
                sizes[split].append(len(batch[cls.label_key]))
        return cls(folder, classes, files, sizes)

    def split_sizes(self) -> dict[str, int]:
        return dict(self.sizes)

    def sample_nbytes(self, split: str) -> np.ndarray:
        return np.full(self.sizes[split], PNG_BYTES_ESTIMATE, dtype=np.int64)

    def chunk(self, split: str, indices: Sequence[int]) -> CifarChunk:
        return CifarChunk(self.files[split], self.offsets[split], self.label_key, [int(i) for i in indices])


class Cifar10Source(_CifarSource):
    kind = "cifar10"
    folder_name = "cifar-10-batches-py"
    split_files = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
    meta_file = "batches.meta"
    names_key = "label_names"
    label_key = "labels"


class Cifar100Source(_CifarSource):
    kind = "cifar100"
    folder_name = "cifar-100-python"
    split_files = {"train": ["train"], "test": ["test"]}
    meta_file = "meta"
    names_key = "fine_label_names"
    label_key = "fine_labels"
