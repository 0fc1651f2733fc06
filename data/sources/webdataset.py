"""``webdataset:PATH``: webdataset shards made elsewhere (timm's and Hugging Face's ``*-wds``
datasets, img2dataset's output), read as they are stored.

PATH is a ``.tar`` shard or a folder searched recursively for them (uncompressed tar: a member is
found by its header and read where it lies). Members belong to samples by webdataset's rule: the
key is a member's path up to the first ``.`` of its file name, the rest its extension, and a
sample's members are adjacent. A sample's image is its first member with an image extension
(``jpg``, ``jpeg``, ``png``; ``?image=EXT`` names another, e.g. ``webp`` is refused as the other
sources refuse it: shards hold PNG and JPEG only); its label the ``cls`` member (the class index as
text, as webdataset's writers and timm's datasets have it; ``?label=EXT`` names another). Other
members (``json``, ``txt``) are left out of the shards. A dataset with no label member at all is
unlabelled (for masked patch prediction); one where only some samples have one is refused, naming a
sample without.

The split is the one split word among the file name's ``-``/``_``/``.``-separated parts
(``imagenet1k-train-0001.tar`` -> ``train``, ``...-validation-0000.tar`` -> ``validation``; the
words: train, validation, val, test), ``train`` for names without one (img2dataset's
``00000.tar``); ``?split=validation:val`` renames one. Classes are numbered, ``"0" .. "K-1"``
with K one more than the largest label: a webdataset has no class names.

Opening reads every shard's headers and labels once (no image), so the samples are then read in any
order: shards are written shuffled, as from an image folder.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

import numpy as np

from ..layout import check_split_name
from .base import IMAGE_SUFFIXES, LabelColumnMissing, Sample, SampleChunk, Source, image_ext, split_renames

SPLIT_WORDS = ("train", "validation", "val", "test")
DEFAULT_IMAGE_EXTS = tuple(ext.lstrip(".") for ext in IMAGE_SUFFIXES)  # jpg, jpeg, png
DEFAULT_LABEL_EXT = "cls"
# webdataset's `base_plus_ext`: the key up to the first dot of the file name, the extension after it
_MEMBER = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


@dataclass(frozen=True, slots=True)
class _Located:
    """Where one sample's image lies: its shard, the byte offset and size of its data, its label."""

    path: str
    offset: int
    size: int
    name: str  # the image member's name, for the extension and errors
    label: int | None


class WebDatasetChunk(SampleChunk):
    def __init__(self, samples: list[_Located]) -> None:
        self.samples = samples

    def __iter__(self) -> Iterator[Sample]:
        opened: dict[str, object] = {}
        try:
            for s in self.samples:
                f = opened.get(s.path) or opened.setdefault(s.path, open(s.path, "rb"))
                f.seek(s.offset)
                data = f.read(s.size)
                origin = f"{s.path}:{s.name}"
                if len(data) != s.size:
                    raise ValueError(f"{origin}: the shard ends inside this member (cut short since it was opened)")
                yield Sample(data, image_ext(data, s.name), s.label, origin=origin)
        finally:
            for f in opened.values():
                f.close()


class WebDatasetSource(Source):
    kind = "webdataset"

    def __init__(self, spec: str, name: str, classes: list[str], labelled: bool, samples: dict[str, list[_Located]]):
        super().__init__(spec, name, classes, "single" if labelled else "none")
        self.samples = samples

    @classmethod
    def open(cls, location: str, *, labels: bool = True) -> WebDatasetSource:
        """`labels=False` (`unlabelled:`, which drops them): the samples' label members are not read."""
        path, _, query = location.partition("?")
        values = parse_qs(query)
        unknown = sorted(set(values) - {"image", "label", "split"})
        if unknown:
            raise ValueError(
                f"webdataset source options {unknown} are not known; allowed: image=EXT, label=EXT, split=SPLIT:NAME"
            )
        image_exts = tuple(values["image"][-1].lower().split(",")) if "image" in values else DEFAULT_IMAGE_EXTS
        label_ext = values["label"][-1].lower() if "label" in values else DEFAULT_LABEL_EXT
        root = Path(path).expanduser().resolve()
        spec = f"{cls.kind}:{root}" + (f"?{query}" if query else "")
        shards = [root] if root.is_file() else sorted(root.rglob("*.tar")) if root.is_dir() else []
        if not shards:
            raise FileNotFoundError(
                f"webdataset source {root}: {'no .tar shards there' if root.exists() else 'does not exist'}"
                " (compressed shards, .tar.gz, are not read: a member is read where it lies)"
            )
        by_split: dict[str, list[Path]] = {}
        for shard in shards:
            by_split.setdefault(check_split_name(_split_of(shard), str(shard)), []).append(shard)
        renames = split_renames(values.get("split", []), list(by_split), cls.kind, "SPLIT")
        samples: dict[str, list[_Located]] = {}
        without_image: list[str] = []
        for split, paths in by_split.items():
            found = samples.setdefault(renames.get(split, split), [])
            for shard in paths:
                found += _index(shard, image_exts, label_ext if labels else None, without_image)
        every = [s for found in samples.values() for s in found]
        labels = [s.label for s in every if s.label is not None]
        unlabelled = next((s for s in every if s.label is None), None) if labels else None
        if unlabelled is not None:
            raise LabelColumnMissing(
                f"webdataset source {root}: {unlabelled.path}:{unlabelled.name} has no .{label_ext} member, while "
                f"{len(labels):,} samples have one; give every sample its label, or prepare unlabelled:{spec} to use "
                "the images alone",
                lambda: cls.open(location, labels=False),
            )
        classes = [str(k) for k in range(1 + max(labels))] if labels else []
        source = cls(spec, root.stem if root.is_file() else root.name, classes, bool(labels), samples)
        source.left_out = without_image
        source.known_bad = [
            f"{s.path}:{s.name}: empty image" for split in samples.values() for s in split if not s.size
        ]
        return source

    def split_sizes(self) -> dict[str, int]:
        return {split: len(found) for split, found in self.samples.items()}

    def sample_nbytes(self, split: str) -> np.ndarray:
        return np.array([s.size for s in self.samples[split]], dtype=np.int64)

    def chunk(self, split: str, indices: Sequence[int]) -> WebDatasetChunk:
        found = self.samples[split]
        return WebDatasetChunk([found[int(i)] for i in indices])


def _split_of(shard: Path) -> str:
    words = [part for part in re.split(r"[-_.]", shard.name.removesuffix(".tar")) if part in SPLIT_WORDS]
    if len(set(words)) > 1:
        raise ValueError(
            f"webdataset shard {shard}: its name holds several split words ({', '.join(words)}); rename it to hold one"
        )
    return words[0] if words else "train"


def _index(shard: Path, image_exts: tuple[str, ...], label_ext: str | None, without_image: list[str]) -> list[_Located]:
    """The samples of one shard in stored order, from its headers and label members (none read
    when `label_ext` is None); a sample without an image member is left out (named in `without_image`)."""
    path, located = str(shard), []  # (one path string for all of the shard's samples)

    def add(tar: tarfile.TarFile, key: str, members: dict[str, tarfile.TarInfo]) -> None:
        image = next((members[ext] for ext in image_exts if ext in members), None)
        if image is None:
            without_image.append(f"{path}:{key}")
            return
        label = None
        if label_ext in members:
            text = tar.extractfile(members[label_ext]).read().decode("utf-8", "replace").strip()
            if not re.fullmatch(r"\d+", text):
                raise ValueError(f"{path}:{members[label_ext].name} holds {text[:40]!r}, not a class index")
            label = int(text)
        located.append(_Located(path, image.offset_data, image.size, image.name, label))

    try:
        with tarfile.open(shard, "r:") as tar:
            key, members = None, {}
            for member in tar:
                match = _MEMBER.match(member.name) if member.isfile() else None
                if match is None:
                    continue  # a folder entry, or a file without an extension: no sample's member
                if match.group(1) != key:
                    if key is not None:
                        add(tar, key, members)
                    key, members = match.group(1), {}
                members.setdefault(match.group(2).lower(), member)
            if key is not None:
                add(tar, key, members)
    except tarfile.TarError as error:
        raise ValueError(f"webdataset shard {shard} is not a readable tar file ({error})") from None
    return located
