"""Dataset sources that ``vitray data prepare`` turns into shards.

A source spec is ``KIND:PATH`` (``imagefolder:/data/pets``, ``cifar10:/data/cifar-10-binary.tar.gz``,
``cifar100:PATH``, ``parquet:PATH``, ``hf:PATH``, ``tfds:DATA_DIR/NAME/VERSION``,
``vtab:TASK:DATA_DIR/NAME/VERSION``, the original archives ``pets:DIR`` and ``flowers102:DIR``)
or ``builtin:NAME`` (``builtin:digits``); ``unlabelled:SPEC``
is any of them without its labels (see :mod:`vitray.data.source_unlabelled`). A :class:`Source`
knows its splits, classes and label kind, and hands out picklable :class:`SampleChunk` objects for
any list of sample indices, so that shards can be written in other processes or on other machines.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .layout import LabelKind

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JPEG_SIGNATURE = b"\xff\xd8\xff"
# Formats Pillow reads but standard webdataset decoders do not: rejected rather than re-encoded,
# since shards keep the original bytes.
OTHER_IMAGE_SIGNATURES = {b"GIF87a": "GIF", b"GIF89a": "GIF", b"BM": "BMP", b"II*\x00": "TIFF", b"MM\x00*": "TIFF"}
IMAGE_SUFFIXES = {".png": "png", ".jpg": "jpg", ".jpeg": "jpg"}
UNSUPPORTED_IMAGE_SUFFIXES = {".gif", ".bmp", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".heic", ".avif"}


@dataclass(frozen=True)
class Sample:
    """One image as stored: its original encoded bytes, the format extension and the label."""

    image: bytes
    ext: str  # "png" or "jpg"
    label: int | tuple[int, ...] | None  # a class index, class indices (multi-label), None (unlabelled)
    origin: str = ""  # where it came from (a file path, an archive member), to name it in errors


class SampleChunk(abc.ABC):
    """A picklable recipe for some samples of one split; iterating it reads them, in order."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Sample]: ...


class Source(abc.ABC):
    """A dataset in some original format."""

    kind: ClassVar[str]
    # Sources that read any sample cheaply are written in a shuffled order (so a shard mixes
    # classes); sources that must be read sequentially (Parquet) keep their stored order.
    random_access: ClassVar[bool] = True

    def __init__(self, spec: str, name: str, classes: list[str], label_kind: LabelKind) -> None:
        self.spec = spec
        self.name = name
        self.classes = classes
        self.label_kind: LabelKind = label_kind

    @classmethod
    @abc.abstractmethod
    def open(cls, location: str) -> Source:
        """Open the source from the part of its spec after ``KIND:``."""

    @abc.abstractmethod
    def split_sizes(self) -> dict[str, int]:
        """Number of samples of each split."""

    @abc.abstractmethod
    def sample_nbytes(self, split: str) -> np.ndarray:
        """Encoded size of each sample of ``split`` (exact or estimated), to cap shard sizes."""

    @abc.abstractmethod
    def chunk(self, split: str, indices: Sequence[int]) -> SampleChunk:
        """The samples of ``split`` at ``indices`` (contiguous and ascending for sequential sources)."""


def image_ext(data: bytes, name: str = "") -> str:
    """``"png"`` or ``"jpg"`` from the image bytes, else from the file name.

    Bytes of another image format raise ValueError (shards hold only PNG/JPEG, never re-encoded).
    Unrecognisable bytes (a corrupt file) are kept under the name's extension, defaulting to jpg;
    the reader skips them as corrupt.
    """
    if data.startswith(PNG_SIGNATURE):
        return "png"
    if data.startswith(JPEG_SIGNATURE):
        return "jpg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        raise ValueError(f"{name or 'image'} is WEBP; only PNG and JPEG images are supported")
    for signature, fmt in OTHER_IMAGE_SIGNATURES.items():
        if data.startswith(signature):
            raise ValueError(f"{name or 'image'} is {fmt}; only PNG and JPEG images are supported")
    suffix = "." + name.rsplit(".", 1)[-1].lower() if "." in name else ""
    return IMAGE_SUFFIXES.get(suffix, "jpg")


def source_kinds() -> dict[str, type[Source]]:
    """Source kinds by spec prefix."""
    from .source_archives import Flowers102Source, PetsSource
    from .source_builtin import BuiltinSource
    from .source_cifar import Cifar10Source, Cifar100Source
    from .source_hf import HfSource
    from .source_imagefolder import ImageFolderSource
    from .source_parquet import ParquetSource
    from .source_tfds import TfdsSource
    from .source_unlabelled import UnlabelledSource
    from .source_vtab import VtabSource

    kinds: list[type[Source]] = [
        ImageFolderSource,
        Cifar10Source,
        Cifar100Source,
        ParquetSource,
        HfSource,
        TfdsSource,
        VtabSource,
        PetsSource,
        Flowers102Source,
        BuiltinSource,
        UnlabelledSource,
    ]
    return {k.kind: k for k in kinds}


def open_source(spec: str) -> Source:
    """Open a source from its spec ``KIND:PATH`` (e.g. ``imagefolder:/data/pets``, ``builtin:digits``)."""
    kinds = source_kinds()
    kind, sep, location = str(spec).partition(":")
    if not sep or kind not in kinds or not location:
        raise ValueError(
            f"source {spec!r} is not KIND:PATH; KIND is one of {sorted(kinds)} "
            "(e.g. imagefolder:/data/pets, cifar10:/data/cifar-10-batches-py, tfds:~/tensorflow_datasets/dtd/3.0.1, "
            "vtab:dtd:~/tensorflow_datasets/dtd/3.0.1, builtin:digits, unlabelled:builtin:digits)"
        )
    return kinds[kind].open(location)
