"""The types every dataset source shares: :class:`Source`, :class:`SampleChunk`, :class:`Sample`.

A :class:`Source` knows its splits, classes and label kind, and hands out picklable
:class:`SampleChunk` objects for any list of sample indices, so that shards can be written in other
processes or on other machines. The adapters of this package (one module per format) import only
this module (and, where one wraps another, that one); the registry in :mod:`vitray.data.sources`
imports them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..layout import LabelKind, check_split_name

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JPEG_SIGNATURE = b"\xff\xd8\xff"
IMAGE_SUFFIXES = {".png": "png", ".jpg": "jpg", ".jpeg": "jpg"}
# A source path holding one of these is a pattern of files (a glob, webdataset's brace form), not a path.
PATTERN_CHARS = "*?[{"
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


class LabelColumnMissing(ValueError):
    """A source whose labels are missing or unusable (a table without its label column, shards
    where only some samples have one): refused, but `unlabelled:`, which drops the labels, reads it
    as it is (`reopen`)."""

    def __init__(self, message: str, reopen: Callable[[], Source]):
        super().__init__(message)
        self.reopen = reopen


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
        # Files found in the source that are not samples (an image folder's notes, CSVs, ...): left
        # out of the shards, and said so (`vitray data prepare` prints their count).
        self.left_out: list[str] = []
        # What opening decided that the user should hear before any shard is written (a split left
        # out, and why): one line each, printed by `vitray data prepare`.
        self.notes: list[str] = []
        # Images known to be bad from the listing alone (a zero-byte file), as "ORIGIN: why": refused
        # (or, with --skip-bad, left out) before any shard is written.
        self.known_bad: list[str] = []
        # Set where splits were left out for their labels: the same source with every split, labels
        # dropped, what `unlabelled:` reads.
        self.reopen_unlabelled: Callable[[], Source] | None = None

    @classmethod
    @abc.abstractmethod
    def open(cls, location: str) -> Source:
        """Open the source from the part of its spec after ``KIND:``."""

    @classmethod
    def open_spec(cls, location: str, open_source: Callable[[str], Source]) -> Source:
        """What the registry calls: `open`, unless the source wraps another one, whose spec
        `location` is and which it opens with the registry's `open_source` (handed in, so that an
        adapter never imports the registry that imports it)."""
        return cls.open(location)

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
    """``"png"`` or ``"jpg"`` from the image bytes, else from the file name (jpg by default).

    Bytes of neither are another format (a WEBP under a ``.jpg`` name, as web scrapes hold) or
    damaged: the image check as the shard is written refuses them as one more bad image, named by
    the sample's origin, or leaves them out with ``--skip-bad`` (shards hold only PNG/JPEG, never
    re-encoded); ``bad_images="keep"`` stores them under this extension.
    """
    if data.startswith(PNG_SIGNATURE):
        return "png"
    if data.startswith(JPEG_SIGNATURE):
        return "jpg"
    suffix = "." + name.rsplit(".", 1)[-1].lower() if "." in name else ""
    return IMAGE_SUFFIXES.get(suffix, "jpg")


def split_renames(values: list[str], splits: Sequence[str], kind: str, native: str) -> dict[str, str]:
    """A source's ``split=FROM:TO[,FROM:TO]`` options as {its split name: the name vitray writes}:
    ``split=validation:val`` makes ImageNet's validation set the benchmark's ``val``. ``native`` is
    what the source calls its own names in the error (``TFDS_NAME``, ``SPLIT``)."""
    renames: dict[str, str] = {}
    for rename in (r for value in values for r in value.split(",")):
        old, sep, new = rename.partition(":")
        if not sep or old not in splits:
            raise ValueError(
                f"{kind} source option split={rename!r} is not {native}:NAME with {native} one of {sorted(splits)}"
            )
        if new in splits and new not in {old, *renames}:
            raise ValueError(f"{kind} source option split={rename!r}: the source already has a split {new!r}")
        renames[old] = check_split_name(new, f"split={rename}")
    return renames
