"""``cifar10:PATH`` / ``cifar100:PATH``: the CIFAR archives from the CIFAR site, binary or python version.

Binary version (read without unpickling anything; preferred): PATH is the archive itself
(``cifar-10-binary.tar.gz`` / ``cifar-100-binary.tar.gz``), the extracted folder
(``cifar-10-batches-bin`` / ``cifar-100-binary``) or its parent. Records have a fixed size: one
label byte (CIFAR-100: a coarse then a fine label byte) and 3072 pixel bytes. CIFAR-10:
``data_batch_1..5.bin`` -> split ``train``, ``test_batch.bin`` -> ``test``, class names from
``batches.meta.txt``; CIFAR-100: ``train.bin`` / ``test.bin`` with the 100 fine labels, names from
``fine_label_names.txt``.

Python version: the extracted folder (``cifar-10-batches-py`` / ``cifar-100-python``) or its parent;
CIFAR-10 ``data_batch_1..5`` / ``test_batch`` and ``batches.meta``, CIFAR-100 ``train`` / ``test``
and ``meta``. These batches are Python pickles, as distributed: only open files from a trusted source.

Each 32x32 image is encoded once as PNG (lossless, so the pixels are the original ones).
"""

from __future__ import annotations

import functools
import io
import pickle
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from .base import Sample, SampleChunk, Source

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


class _BatchFilesChunk(SampleChunk):
    """Samples by index across batch files holding consecutive rows (``offsets[i]``: the index of
    ``files[i]``'s first row); subclasses read one row of one file (:meth:`_sample`)."""

    def __init__(self, files: list[str], offsets: list[int], indices: list[int]) -> None:
        self.files, self.offsets, self.indices = files, offsets, indices

    def __iter__(self) -> Iterator[Sample]:
        for index in self.indices:
            file_no = int(np.searchsorted(self.offsets, index, side="right")) - 1
            yield self._sample(self.files[file_no], index - self.offsets[file_no])

    def _sample(self, file: str, row: int) -> Sample:
        raise NotImplementedError


class CifarChunk(_BatchFilesChunk):
    def __init__(self, files: list[str], offsets: list[int], label_key: str, indices: list[int]) -> None:
        super().__init__(files, offsets, indices)
        self.label_key = label_key

    def _sample(self, file: str, row: int) -> Sample:
        batch = _load_batch(file)
        return Sample(_encode_png(np.asarray(batch["data"][row])), "png", int(batch[self.label_key][row]))


# -- binary version ---------------------------------------------------------------------------------
IMAGE_BYTES = 3072
ARCHIVE_SEPARATOR = "::"  # "archive.tar.gz::member": a file inside the (unextracted) archive


def _read_file(ref: str) -> bytes:
    path, sep, member = ref.partition(ARCHIVE_SEPARATOR)
    if not sep:
        return Path(path).read_bytes()
    with tarfile.open(path, "r:*") as archive:
        handle = archive.extractfile(member)  # KeyError when absent
        if handle is None:
            raise FileNotFoundError(f"{path}: {member} is not a file")
        return handle.read()


def _load_binary(ref: str, label_bytes: int) -> np.ndarray:
    """The (records, label bytes + 3072) array of a binary batch (cached while the file is unchanged)."""
    stat = Path(ref.partition(ARCHIVE_SEPARATOR)[0]).stat()
    return _load_binary_cached(ref, label_bytes, (stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _load_binary_cached(ref: str, label_bytes: int, _stamp: tuple[int, int]) -> np.ndarray:
    data = _read_file(ref)
    record = label_bytes + IMAGE_BYTES
    if not data or len(data) % record:
        raise ValueError(
            f"{ref} is {len(data)} bytes, not a whole number of {record}-byte records: truncated, or not a "
            f"CIFAR-{'100' if label_bytes == 2 else '10'} binary batch"
        )
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, record)


class CifarBinaryChunk(_BatchFilesChunk):
    def __init__(self, files: list[str], offsets: list[int], label_bytes: int, indices: list[int]) -> None:
        super().__init__(files, offsets, indices)
        self.label_bytes = label_bytes

    def _sample(self, file: str, row: int) -> Sample:
        record = _load_binary(file, self.label_bytes)[row]
        # The fine label is the last label byte (CIFAR-100 stores the coarse one first).
        return Sample(_encode_png(record[self.label_bytes :]), "png", int(record[self.label_bytes - 1]))


class _CifarSource(Source):
    folder_name: ClassVar[str]
    split_files: ClassVar[dict[str, list[str]]]
    meta_file: ClassVar[str]
    names_key: ClassVar[str]
    label_key: ClassVar[str]

    binary_folder: ClassVar[str]
    archive_example: ClassVar[str]  # the binary archive as downloaded, for messages
    binary_files: ClassVar[dict[str, list[str]]]
    binary_names: ClassVar[str]
    label_bytes: ClassVar[int]

    def __init__(
        self,
        folder: Path,
        classes: list[str],
        files: dict[str, list[str]],
        sizes: dict[str, list[int]],
        binary: bool = False,
    ):
        super().__init__(f"{self.kind}:{folder}", self.kind, classes, "single")
        self.files, self.binary = files, binary
        self.offsets = {split: [0, *np.cumsum(n).tolist()[:-1]] for split, n in sizes.items()}
        self.sizes = {split: sum(n) for split, n in sizes.items()}

    @classmethod
    def open(cls, location: str) -> _CifarSource:
        folder = Path(location).expanduser().resolve()
        if not folder.exists():
            raise FileNotFoundError(
                f"{cls.kind} source {folder} does not exist: give the {cls.kind} archive as downloaded "
                f"(its binary version, e.g. {cls.kind}:/path/to/{cls.archive_example}) or its extracted folder"
            )
        if folder.is_file() and tarfile.is_tarfile(folder):
            return cls._open_binary(folder, f"{folder}{ARCHIVE_SEPARATOR}{cls.binary_folder}/")
        if (folder / cls.binary_folder).is_dir():
            folder = folder / cls.binary_folder
        if (folder / cls.binary_names).is_file():
            return cls._open_binary(folder, f"{folder}/")
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

    @classmethod
    def _open_binary(cls, location: Path, prefix: str) -> _CifarSource:
        """The binary version under ``prefix`` (a folder, or ``archive::folder/`` inside the archive)."""
        try:
            names = _read_file(prefix + cls.binary_names).decode().split()
            files = {split: [prefix + name for name in batch] for split, batch in cls.binary_files.items()}
            sizes = {split: [len(_load_binary(f, cls.label_bytes)) for f in refs] for split, refs in files.items()}
        except (FileNotFoundError, KeyError) as error:
            expected = [cls.binary_names, *(f for batch in cls.binary_files.values() for f in batch)]
            raise FileNotFoundError(
                f"{cls.kind} source {location}: {error}; expected the binary version ({cls.binary_folder}/ with "
                f"{expected}), as the archive or extracted"
            ) from None
        return cls(location, names, files, sizes, binary=True)

    def split_sizes(self) -> dict[str, int]:
        return dict(self.sizes)

    def sample_nbytes(self, split: str) -> np.ndarray:
        return np.full(self.sizes[split], PNG_BYTES_ESTIMATE, dtype=np.int64)

    def chunk(self, split: str, indices: Sequence[int]) -> CifarChunk | CifarBinaryChunk:
        if self.binary:
            return CifarBinaryChunk(self.files[split], self.offsets[split], self.label_bytes, [int(i) for i in indices])
        return CifarChunk(self.files[split], self.offsets[split], self.label_key, [int(i) for i in indices])


class Cifar10Source(_CifarSource):
    kind = "cifar10"
    folder_name = "cifar-10-batches-py"
    split_files = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
    meta_file = "batches.meta"
    names_key = "label_names"
    label_key = "labels"
    binary_folder = "cifar-10-batches-bin"
    archive_example = "cifar-10-binary.tar.gz"
    binary_files = {"train": [f"data_batch_{i}.bin" for i in range(1, 6)], "test": ["test_batch.bin"]}
    binary_names = "batches.meta.txt"
    label_bytes = 1


class Cifar100Source(_CifarSource):
    kind = "cifar100"
    folder_name = "cifar-100-python"
    split_files = {"train": ["train"], "test": ["test"]}
    meta_file = "meta"
    names_key = "fine_label_names"
    label_key = "fine_labels"
    binary_folder = "cifar-100-binary"
    archive_example = "cifar-100-binary.tar.gz"
    binary_files = {"train": ["train.bin"], "test": ["test.bin"]}
    binary_names = "fine_label_names.txt"
    label_bytes = 2
