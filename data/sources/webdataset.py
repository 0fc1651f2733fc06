"""``webdataset:PATH``: webdataset shards made elsewhere (timm's and Hugging Face's ``*-wds``
datasets, img2dataset's output), read as they are stored.

PATH is a ``.tar`` shard, a folder searched recursively for them, or a pattern of them: a glob
(``/data/in21k/*-train-*.tar``) or webdataset's brace form (``/data/in21k-train-{0000..1023}.tar``).
Shards are uncompressed tar files, whose members are found by their headers and read where they
lie; a compressed one (``.tar.gz``) is refused, not skipped. A member belongs to a sample by
webdataset's rule: the key is its path up to the first ``.`` of its file name, the rest its
extension (``n01440764/n01440764_10026.JPEG`` -> ``n01440764/n01440764_10026``, ``jpeg``); members
of one key need not be adjacent (``tar cf x.tar *.JPEG *.cls`` orders them by extension), but a key
with two members of one extension is refused, as webdataset's readers refuse it.

A sample's image is its member with the first of the image extensions (``jpg``, ``jpeg``, ``png``;
``?image=EXT[,EXT]`` names others: shards hold PNG and JPEG only, so ``webp`` is refused); its label
the ``cls`` member (``?label=EXT``), the class index as text, as webdataset's writers and timm's
datasets store it; ``-1`` is no label. Other members (``json``, ``txt``) stay out of the shards. A
sample without an image member is left out, and said. Classes are numbered ``"0" .. "K-1"``, K one
more than the largest label (at most 1,000,000: a ``cls`` holding a WordNet id is refused): a
webdataset has no class names.

Labels: a dataset with no label anywhere is unlabelled (for masked patch prediction); a split none of
whose samples has a label (a test split published without them, ``-1``) is left out, and said;
a split where only some samples have one is refused, naming one without, as is a label that is no
class index (``unlabelled:webdataset:PATH`` reads all of them without their labels).

The split of a shard is the split word in its file name's ``-``/``_``/``.``-separated parts
(``imagenet1k-train-0001.tar`` -> ``train``), else in the nearest folder name that is one
(``data/validation/0001.tar``), of: train, training, validation, valid, val, dev, eval, evaluation,
test, testing; ``train`` when there is none (img2dataset's ``00000.tar``), which is said.
``?split=validation:val`` renames one.

Opening reads every shard's headers and labels once (no image; in processes of their own for many
shards), so the samples are then read in any order: shards are written shuffled, as from an image
folder.
"""

from __future__ import annotations

import glob
import os
import re
import tarfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from urllib.parse import parse_qs

import numpy as np

from ..layout import check_split_name
from ..processes import main_script_hidden
from .base import (
    PATTERN_CHARS,
    UNSUPPORTED_IMAGE_SUFFIXES,
    LabelColumnMissing,
    Sample,
    SampleChunk,
    Source,
    image_ext,
    split_renames,
)

SPLIT_WORDS = ("train", "training", "validation", "valid", "val", "dev", "eval", "evaluation", "test", "testing")
DEFAULT_IMAGE_EXTS = ("jpg", "jpeg", "png")
DEFAULT_LABEL_EXT = "cls"
COMPRESSED_TAR = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
MAX_CLASSES = 1_000_000
NO_LABEL = -1
# Shards indexed in the opening process below this many; above, in processes of their own.
SHARDS_PER_PROCESS_POOL = 16
# webdataset's `base_plus_ext`: the key up to the first dot of the file name, the extension after it
_MEMBER = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


class _BadLabel(ValueError):
    """A label member that holds no class index: the labels are unusable, the images are not."""


@dataclass
class _ShardIndex:
    """One shard's samples in stored order: where each image's bytes lie, and its label."""

    path: str
    offsets: np.ndarray  # int64: the image member's data offset in the shard
    sizes: np.ndarray  # int64
    labels: np.ndarray  # int64, NO_LABEL for none
    names: list[str]  # the image members' names (their extension, and errors)
    without_image: list[str] = field(default_factory=list)  # "KEY (its members' extensions)"
    label_members: int = 0  # samples that had a label member


@dataclass(frozen=True)
class _Located:
    path: str
    offset: int
    size: int
    name: str
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

    def __init__(self, spec: str, name: str, classes: list[str], splits: dict[str, list[_ShardIndex]]):
        super().__init__(spec, name, classes, "single" if classes else "none")
        self.splits = splits
        self._starts = {s: np.cumsum([0, *(len(i.sizes) for i in shards)]) for s, shards in splits.items()}

    @classmethod
    def open(cls, location: str, *, labels: bool = True) -> WebDatasetSource:
        """`labels=False` (`unlabelled:`, which drops them): no label member is read."""
        path, _, query = location.partition("?")
        image_exts, label_ext, label_given, renames_given = _options(query, path)
        root, shards = _shards(path)
        # (a pattern as an absolute one: the same shards given from elsewhere are the same source)
        where = os.path.abspath(os.path.expanduser(path)) if _is_pattern(path) else root
        spec = f"{cls.kind}:{where}" + (f"?{query}" if query else "")
        splits, named = _splits_of(root, shards)
        renames = split_renames(renames_given, sorted(set(splits.values())), cls.kind, "SPLIT")

        def reopen() -> WebDatasetSource:
            return cls.open(location, labels=False)

        try:  # a label that is no class index: refused, but `unlabelled:` reads the images (`reopen`)
            indexes = _index_all(shards, image_exts, label_ext if labels else None)
            by_split: dict[str, list[_ShardIndex]] = {}
            for shard, index in zip(shards, indexes):
                by_split.setdefault(renames.get(splits[shard], splits[shard]), []).append(index)
            notes = _check_samples(by_split, image_exts)
            classes, left = _classes(by_split, label_ext, label_given) if labels else ([], [])
        except _BadLabel as bad:
            raise LabelColumnMissing(f"{bad}; or prepare unlabelled:{spec} to use the images alone", reopen) from None
        if not named:
            notes.append(f"no split word in the shards' names: all {len(shards):,} are the train split")
        for split in left:
            count = sum(len(i.sizes) for i in by_split.pop(split))
            notes.append(
                f"leaving out split {split!r} ({count:,} samples): none has a label (-1 or no .{label_ext} member), "
                f"as a test split published without its labels; unlabelled:{spec} keeps it"
            )
        source = cls(spec, (root.stem if root.is_file() else root.name) or "webdataset", classes, by_split)
        source.notes = notes
        source.reopen_unlabelled = reopen if left else None
        return source

    def split_sizes(self) -> dict[str, int]:
        return {split: int(starts[-1]) for split, starts in self._starts.items()}

    def sample_nbytes(self, split: str) -> np.ndarray:
        return np.concatenate([i.sizes for i in self.splits[split]])

    def chunk(self, split: str, indices: Sequence[int]) -> WebDatasetChunk:
        shards, starts = self.splits[split], self._starts[split]
        located = []
        for i in indices:
            n = int(np.searchsorted(starts, int(i), side="right")) - 1
            index, at = shards[n], int(i) - int(starts[n])
            label = int(index.labels[at])
            located.append(
                _Located(
                    index.path,
                    int(index.offsets[at]),
                    int(index.sizes[at]),
                    index.names[at],
                    None if label < 0 or not self.classes else label,
                )
            )
        return WebDatasetChunk(located)


def _options(query: str, path: str) -> tuple[tuple[str, ...], str, bool, list[str]]:
    """(the image extensions, the label's, whether `label=` was given, the split renames)."""
    values = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(values) - {"image", "label", "split"})
    if unknown or (query and not values):
        # A glob's `?` (one character) reads as the start of the options
        glob_hint = "; a `?` starts the options: match one character of a glob with [0-9] or [a-z]"
        raise ValueError(
            f"webdataset source options {unknown or [query]} are not known; allowed: image=EXT, label=EXT, "
            f"split=SPLIT:NAME{glob_hint if _is_pattern(path) or '.tar' in query else ''}"
        )
    for option in ("image", "label"):
        if len(values.get(option, [])) > 1:
            raise ValueError(f"webdataset source option {option}= is given {len(values[option])} times: give it once")
    image_exts = (
        tuple(e.strip().lstrip(".").lower() for e in values["image"][0].split(","))
        if "image" in values
        else DEFAULT_IMAGE_EXTS
    )
    label_ext = values["label"][0].strip().lstrip(".").lower() if "label" in values else DEFAULT_LABEL_EXT
    if not all(image_exts) or not label_ext:
        raise ValueError(
            "webdataset source options image= and label= take member extensions, e.g. image=jpg,png&label=cls"
        )
    unsupported = [e for e in image_exts if f".{e}" in UNSUPPORTED_IMAGE_SUFFIXES]
    if unsupported:
        raise ValueError(
            f"webdataset source option image={','.join(image_exts)}: {', '.join(unsupported)} images are not read "
            "(shards hold PNG and JPEG only, never re-encoded): convert them to JPEG or PNG first"
        )
    return image_exts, label_ext, "label" in values, values.get("split", [])


def _is_pattern(path: str) -> bool:
    return any(c in path for c in PATTERN_CHARS)


def _shards(path: str) -> tuple[Path, list[Path]]:
    """(the folder the shards' splits are named under, the shards in name order)."""
    if _is_pattern(path):
        from braceexpand import braceexpand  # webdataset's own dependency, for its `{0000..1023}` form

        expanded = list(dict.fromkeys(os.path.expanduser(p) for p in braceexpand(path)))
        found = sorted({Path(m).resolve() for p in expanded for m in glob.glob(p, recursive=True)})
        if not found:
            raise FileNotFoundError(f"webdataset source {path}: no file matches it")
        missing = next((p for p in expanded if not _is_pattern(p) and not Path(p).exists()), None)
        if missing is not None:  # a shard a brace pattern names, not there
            raise FileNotFoundError(f"webdataset source {path}: {missing} does not exist")
        root = Path(os.path.commonpath([str(p.parent) for p in found]))
    else:
        root = Path(path).expanduser().resolve()
        if not root.exists():
            raise FileNotFoundError(f"webdataset source {root} does not exist")
        found = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    compressed = [p for p in found if p.name.lower().endswith(COMPRESSED_TAR)]
    if compressed:
        raise ValueError(
            f"webdataset source {path}: {compressed[0]} is a compressed tar, which is not read (a member is read "
            f"where it lies); decompress the {len(compressed):,} compressed shard(s) first"
        )
    shards = [p for p in found if p.name.lower().endswith(".tar")]
    if not shards:
        raise FileNotFoundError(f"webdataset source {path}: no .tar shards there")
    return root, shards


def _splits_of(root: Path, shards: list[Path]) -> tuple[dict[Path, str], bool]:
    """Each shard's split, and whether any shard's name gave one (else all are train)."""
    splits, named = {}, False
    for shard in shards:
        words = sorted({part.lower() for part in re.split(r"[-_.]", shard.name[: -len(".tar")])} & set(SPLIT_WORDS))
        if len(words) > 1:
            raise ValueError(
                f"webdataset shard {shard}: its name holds several split words ({', '.join(words)}); rename it to "
                "hold one"
            )
        if not words:  # the nearest folder, up to the root itself, that is named as a split
            folders = (root.name, *shard.parent.relative_to(root).parts) if root in shard.parents else (root.name,)
            words = [f.lower() for f in reversed(folders) if f.lower() in SPLIT_WORDS][:1]
        named = named or bool(words)
        splits[shard] = check_split_name(words[0] if words else "train", str(shard))
    return splits, named


def _index_all(shards: list[Path], image_exts: tuple[str, ...], label_ext: str | None) -> list[_ShardIndex]:
    if len(shards) < SHARDS_PER_PROCESS_POOL:
        return [_index(s, image_exts, label_ext) for s in shards]
    # Reading tar headers is Python-bound: one process a core this process may use, each on whole
    # shards; they do not run the caller's script again (`main_script_hidden`)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with main_script_hidden():
        pool = ProcessPoolExecutor(min(len(shards), cores), mp_context=get_context("spawn"))
        indexes = pool.map(_index, shards, [image_exts] * len(shards), [label_ext] * len(shards), chunksize=4)
    with pool:
        return list(indexes)


def _index(shard: Path, image_exts: tuple[str, ...], label_ext: str | None) -> _ShardIndex:
    """The samples of one shard in the order their keys first appear, from its headers and label
    members (none read when `label_ext` is None)."""
    path = str(shard)
    by_key: dict[str, dict[str, tarfile.TarInfo]] = {}
    try:
        with tarfile.open(shard, "r:") as tar:
            for member in tar:
                match = _MEMBER.match(member.name) if member.isfile() else None
                if match is None:
                    continue  # a folder entry, a hidden file, a file without an extension: no sample's member
                key, ext = match.group(1).removeprefix("./"), match.group(2).lower()
                members = by_key.setdefault(key, {})
                if ext in members:
                    raise ValueError(
                        f"webdataset shard {path}: sample {key!r} has two .{ext} members ({members[ext].name}, "
                        f"{member.name}), which webdataset's readers refuse too: keep one"
                    )
                members[ext] = member
            offsets, sizes, labels, names, without, labelled = [], [], [], [], [], 0
            for key, members in by_key.items():
                image = next((members[ext] for ext in image_exts if ext in members), None)
                if image is None:
                    without.append(f"{key} ({', '.join(sorted(members))})")
                    continue
                label = NO_LABEL
                if label_ext is not None and label_ext in members:
                    labelled += 1
                    text = tar.extractfile(members[label_ext]).read().decode("utf-8", "replace").strip()
                    if not re.fullmatch(r"-1|\d+", text):
                        raise _BadLabel(f"{path}:{members[label_ext].name} holds {text[:40]!r}, not a class index")
                    label = int(text)
                offsets.append(image.offset_data)
                sizes.append(image.size)
                labels.append(label)
                names.append(image.name)
    except tarfile.TarError as error:
        raise ValueError(f"webdataset shard {path} is not a readable tar file ({error})") from None
    return _ShardIndex(path, _int64(offsets), _int64(sizes), _int64(labels), names, without, labelled)


def _int64(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _check_samples(by_split: dict[str, list[_ShardIndex]], image_exts: tuple[str, ...]) -> list[str]:
    """Refuses a split without a sample (naming what its members are); the note on samples left out."""
    for split, indexes in by_split.items():
        if not any(len(i.sizes) for i in indexes):
            without = next((f"{i.path}:{w}" for i in indexes for w in i.without_image), None)
            raise ValueError(
                f"webdataset split {split!r} has no sample with a {'/'.join(image_exts)} member"
                + (
                    f" (e.g. {without}): name the image member with ?image=EXT, or convert the images to JPEG or PNG"
                    if without
                    else f": its shards ({indexes[0].path}, ...) hold no sample"
                )
            )
    left = [f"{i.path}:{w}" for indexes in by_split.values() for i in indexes for w in i.without_image]
    if not left:
        return []
    return [f"leaving out {len(left):,} sample(s) with no {'/'.join(image_exts)} member, e.g. {left[0]}"]


def _classes(by_split: dict[str, list[_ShardIndex]], label_ext: str, given: bool) -> tuple[list[str], list[str]]:
    """(the class names, the splits to leave out for having no label at all)."""
    if not any(i.label_members for indexes in by_split.values() for i in indexes):
        if given:
            raise ValueError(f"webdataset source option label={label_ext}: no sample has a .{label_ext} member")
        return [], []  # an unlabelled dataset (img2dataset's)
    unlabelled = [s for s, indexes in by_split.items() if all((i.labels < 0).all() for i in indexes)]
    if len(unlabelled) == len(by_split):
        raise _BadLabel(f"every label of the splits {sorted(by_split)} is -1 (no labels published)")
    for split, indexes in by_split.items():
        if split in unlabelled:
            continue
        for index in indexes:
            missing = np.flatnonzero(index.labels < 0)
            if len(missing):
                raise _BadLabel(
                    f"{index.path}:{index.names[missing[0]]} has no label (no .{label_ext} member, or -1), while other "
                    f"samples of split {split!r} have one; give every sample its label"
                )
    top = max(
        int(i.labels.max()) for s, indexes in by_split.items() if s not in unlabelled for i in indexes if len(i.labels)
    )
    if top >= MAX_CLASSES:
        raise _BadLabel(
            f"a .{label_ext} member holds the label {top:,}: labels are class indices 0 .. K-1 (K at most "
            f"{MAX_CLASSES:,}), not ids such as WordNet's; map them to indices first"
        )
    return [str(k) for k in range(top + 1)], unlabelled
