"""Dataset sources that ``vitray data prepare`` turns into shards: the registry of source kinds.

A source spec is ``KIND:PATH`` (``imagefolder:/data/pets``, ``cifar10:/data/cifar-10-binary.tar.gz``,
``cifar100:PATH``, ``parquet:PATH``, ``hf:PATH``, ``tfds:DATA_DIR/NAME/VERSION``,
``vtab:TASK:DATA_DIR/NAME/VERSION``, ``webdataset:PATH``, the original archives ``pets:DIR`` and
``flowers102:DIR``)
or ``builtin:NAME`` (``builtin:digits``); ``unlabelled:SPEC`` is any of them without its labels.

One module per format (:mod:`.imagefolder`, :mod:`.cifar`, :mod:`.parquet`, :mod:`.hf`, :mod:`.tfds`
with its TFRecord reader :mod:`.tfrecord`, :mod:`.vtab`, :mod:`.archives`, :mod:`.builtin`,
:mod:`.unlabelled`, :mod:`.webdataset`), each a :class:`Source` of :mod:`.base`, the types they share. The adapters are
imported when a source is opened, so that reading shards never imports them.
"""

from __future__ import annotations

from pathlib import Path

from .base import PATTERN_CHARS, Sample, SampleChunk, Source, image_ext

__all__ = [
    "Sample",
    "SampleChunk",
    "Source",
    "image_ext",
    "open_source",
    "source_folder",
    "source_kind",
    "source_kinds",
]


def source_kinds() -> dict[str, type[Source]]:
    """Source kinds by spec prefix."""
    from .archives import Flowers102Source, PetsSource
    from .builtin import BuiltinSource
    from .cifar import Cifar10Source, Cifar100Source
    from .hf import HfSource
    from .imagefolder import ImageFolderSource
    from .parquet import ParquetSource
    from .tfds import TfdsSource
    from .unlabelled import UnlabelledSource
    from .vtab import VtabSource
    from .webdataset import WebDatasetSource

    kinds: list[type[Source]] = [
        ImageFolderSource,
        Cifar10Source,
        Cifar100Source,
        ParquetSource,
        HfSource,
        TfdsSource,
        VtabSource,
        WebDatasetSource,
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
    return kinds[kind].open_spec(location, open_source)


def source_kind(spec: str) -> tuple[str, str]:
    """(kind, location) of the source that ``spec`` reads, under any ``unlabelled:`` wrappers;
    location "" for a spec without one."""
    kind, _, location = str(spec).partition(":")
    while kind == "unlabelled" and location:
        kind, _, location = location.partition(":")
    return kind, location


def source_folder(spec: str) -> Path | None:
    """The local folder (or file) that ``spec`` reads, resolved, without opening or listing it; None
    for a built-in dataset or a spec that does not parse (opening it says why)."""
    kind, location = source_kind(spec)
    if kind == "builtin" or not location:
        return None
    if kind == "vtab":
        location = location.partition(":")[2]
    path = location.partition("?")[0]
    if any(c in path for c in PATTERN_CHARS):  # a pattern of files (webdataset:): the folder its literal part names
        path = path[: min(path.index(c) for c in PATTERN_CHARS if c in path)].rpartition("/")[0] or "."
    return Path(path).expanduser().resolve() if path else None
