"""``tfds:PATH``: a TensorFlow Datasets build on disk, read without TensorFlow and without download.

PATH is a version folder of a TFDS data dir, ``DATA_DIR/NAME/VERSION`` (or
``DATA_DIR/NAME/CONFIG/VERSION``), as ``tfds.load(..., data_dir=DATA_DIR)`` leaves it::

    dataset_info.json                               name, file format, splits and their shard lengths
    features.json                                   the features (which one is the image, the label)
    label.labels.txt                                class names of a ClassLabel feature, one per line
    NAME-SPLIT.tfrecord-00000-of-00004 ...          tf.train.Example records

Every TFDS split becomes a split of the same name (``train``, ``validation``, ``test``), in TFDS's
own order (shard by shard, record by record), so the slices of :mod:`vitray.data.splits` select the
same examples as TFDS's ``train[:800]``. Images are kept as stored (the encoded PNG/JPEG bytes of the
``image`` feature); the label is the ``label`` ClassLabel feature, or a Sequence of ClassLabel
(multi-label, e.g. ImageNet-ReaL's ``real_label``). Options, after ``?`` and joined by ``&``:
``image=KEY`` and ``label=KEY`` name other features; ``split=TFDS_NAME:NAME`` renames a split
(``split=validation:val``: ImageNet's validation set as the benchmark's ``val``). Builds in the
``array_record`` format are refused: no reader for it is installed here (rebuild with
``file_format="tfrecord"``). For VTAB-1k's tasks, with their 800/200
splits and derived labels, see ``vtab:TASK:PATH`` (:mod:`vitray.data.sources.vtab`).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import numpy as np

from ..layout import check_split_name
from .base import Sample, SampleChunk, Source, image_ext, split_renames
from .tfrecord import CorruptRecord, iter_records, parse_example

Example = dict[str, list[Any]]


@dataclass(frozen=True)
class TfdsSplit:
    """One split of a build: its shard files and their record counts, in TFDS order."""

    name: str
    files: tuple[str, ...]
    lengths: tuple[int, ...]
    num_bytes: int

    @property
    def size(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class TfdsBuild:
    """What ``dataset_info.json`` and ``features.json`` say about a build folder."""

    folder: Path
    name: str
    splits: dict[str, TfdsSplit]
    features: dict[str, dict[str, Any]]  # top-level feature name -> its features.json entry
    config: str | None = None  # the builder config (dataset_info.json's configName), if any

    @classmethod
    def open(cls, folder: Path) -> TfdsBuild:
        info_path = folder / "dataset_info.json"
        if not info_path.is_file():
            raise FileNotFoundError(
                f"tfds source {folder}: no dataset_info.json; give a TFDS build's version folder, "
                "DATA_DIR/NAME/VERSION (e.g. ~/tensorflow_datasets/oxford_iiit_pet/4.0.0)"
            )
        info = json.loads(info_path.read_text())
        name = info.get("name") or folder.parent.name
        file_format = info.get("fileFormat", "tfrecord")
        if file_format != "tfrecord":
            raise ValueError(
                f"tfds source {folder} is stored as {file_format!r}; only 'tfrecord' builds can be read here "
                "(no array_record reader is installed): rebuild it with tfds's file_format='tfrecord'"
            )
        splits = {}
        for entry in info.get("splits", []):
            split = check_split_name(str(entry["name"]), str(info_path))
            lengths = tuple(int(n) for n in entry.get("shardLengths", []))
            files = tuple(
                str(folder / f"{name}-{split}.tfrecord-{i:05d}-of-{len(lengths):05d}") for i in range(len(lengths))
            )
            missing = [Path(f).name for f in files if not Path(f).is_file()]
            if missing:
                raise FileNotFoundError(f"tfds source {folder}: split {split!r} lacks shard files {missing[:3]}")
            splits[split] = TfdsSplit(split, files, lengths, int(entry.get("numBytes", 0) or 0))
        if not splits:
            raise ValueError(f"tfds source {folder}: dataset_info.json lists no splits with shardLengths")
        return cls(folder, name, splits, _read_features(folder), info.get("configName") or None)

    def class_names(self, label: str) -> list[str] | None:
        """Names of the ClassLabel feature ``label`` (its ``LABEL.labels.txt``), or numbered ones."""
        names_file = self.folder / f"{label}.labels.txt"
        if names_file.is_file():
            return [line for line in names_file.read_text().splitlines() if line]
        spec = _class_label_spec(self.features.get(label, {}))
        count = spec.get("classLabel", {}).get("numClasses") or spec.get("content", {}).get("num_classes")
        return [str(i) for i in range(int(count))] if count else None

    def is_sequence(self, label: str) -> bool:
        """True when ``label`` is a Sequence of ClassLabel (several labels per example)."""
        return _type_of(self.features.get(label, {})).endswith("Sequence")

    def image_feature(self) -> str:
        images = [name for name, spec in self.features.items() if _type_of(spec).endswith("Image")]
        return "image" if "image" in images or not images else images[0]


def _read_features(folder: Path) -> dict[str, dict[str, Any]]:
    path = folder / "features.json"
    if not path.is_file():
        return {}
    spec = json.loads(path.read_text())
    # Newer TFDS: {"featuresDict": {"features": {...}}}; older: {"type": ..., "content": {...}}.
    return spec.get("featuresDict", {}).get("features") or spec.get("content") or {}


def _type_of(spec: dict[str, Any]) -> str:
    return str(spec.get("pythonClassName") or spec.get("type") or "")


def _class_label_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The ClassLabel inside a Sequence feature (newer ``sequence.feature``, older ``content.feature``)."""
    if _type_of(spec).endswith("Sequence"):
        return spec.get("sequence", {}).get("feature") or spec.get("content", {}).get("feature") or {}
    return spec


# ---------------------------------------------------------------------------------------------
# Reading ranges of examples
# ---------------------------------------------------------------------------------------------


def iter_examples(split: TfdsSplit, start: int, stop: int) -> Iterator[tuple[int, Example]]:
    """(index in split, parsed example) for examples ``[start, stop)`` of ``split``."""
    offset = 0
    for path, length in zip(split.files, split.lengths):
        lo, hi = max(start - offset, 0), min(stop - offset, length)
        if lo < hi:
            for i, record in enumerate(iter_records(path, lo, hi)):
                yield offset + lo + i, parse_example(record, f"{path} record {lo + i}")
        offset += length


def example_image(example: Example, key: str, where: str) -> bytes:
    values = example.get(key)
    if not values or not isinstance(values[0], bytes):
        raise CorruptRecord(f"{where} has no encoded image under {key!r} (features: {sorted(example)})")
    return values[0]


def example_int(example: Example, key: str, where: str) -> int:
    values = example.get(key)
    if not values or not isinstance(values[0], int):
        raise CorruptRecord(f"{where} has no integer {key!r} (features: {sorted(example)})")
    return int(values[0])


@dataclass(frozen=True)
class Segment:
    """Examples ``[start, stop)`` of one TFDS split; a vitray split is one or more of them."""

    split: TfdsSplit
    start: int
    stop: int


ToSample = Callable[[Example, str], Sample]


class TfdsChunk(SampleChunk):
    """Positions ``[start, stop)`` of a split made of ``segments``, turned into samples by ``to_sample``."""

    def __init__(self, segments: Sequence[Segment], start: int, stop: int, to_sample: ToSample) -> None:
        self.segments, self.start, self.stop, self.to_sample = list(segments), start, stop, to_sample

    def __iter__(self) -> Iterator[Sample]:
        offset = 0
        for seg in self.segments:
            length = seg.stop - seg.start
            lo, hi = max(self.start - offset, 0), min(self.stop - offset, length)
            if lo < hi:
                for index, example in iter_examples(seg.split, seg.start + lo, seg.start + hi):
                    yield self.to_sample(example, f"{seg.split.name}[{index}]")
            offset += length


def contiguous_range(indices: Sequence[int], kind: str) -> tuple[int, int]:
    start, stop = int(indices[0]), int(indices[-1]) + 1
    if stop - start != len(indices) or any(int(b) - int(a) != 1 for a, b in itertools.pairwise(indices)):
        raise ValueError(f"{kind} sources read contiguous ascending index ranges only")
    return start, stop


def segment_nbytes(segments: Sequence[Segment]) -> np.ndarray:
    """Estimated encoded size per example (the split's bytes over its examples), to cap shard sizes."""
    parts = [np.full(seg.stop - seg.start, max(seg.split.num_bytes // max(seg.split.size, 1), 1)) for seg in segments]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


# ---------------------------------------------------------------------------------------------
# The source
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _PlainSample:
    """Picklable example -> sample: the stored image bytes and an integer label feature (all of
    its values, as a tuple, for a multi-label Sequence)."""

    image: str
    label: str
    multi: bool = False

    def __call__(self, example: Example, where: str) -> Sample:
        data = example_image(example, self.image, where)
        if self.multi:
            return Sample(data, image_ext(data), tuple(int(v) for v in example.get(self.label, [])))
        return Sample(data, image_ext(data), example_int(example, self.label, where))


_OPTIONS = re.compile(r"^(?P<path>[^?]+)(?:\?(?P<query>.*))?$")


class TfdsSource(Source):
    kind = "tfds"
    random_access = False  # TFDS order is what its slices (train[:800]) refer to: keep it

    def __init__(
        self,
        build: TfdsBuild,
        image: str,
        label: str,
        classes: list[str],
        renames: dict[str, str] | None = None,
        spec: str | None = None,
    ) -> None:
        multi = build.is_sequence(label)
        super().__init__(spec or f"{self.kind}:{build.folder}", build.name, classes, "multi" if multi else "single")
        self.build, self.to_sample = build, _PlainSample(image, label, multi)
        self.names = {ours: tfds for tfds, ours in (renames or {}).items()}  # our split name -> TFDS's
        self.names.update({tfds: tfds for tfds in build.splits if tfds not in (renames or {})})

    @classmethod
    def open(cls, location: str) -> TfdsSource:
        match = _OPTIONS.match(location)
        if not match:
            raise ValueError(f"tfds source {location!r} is not PATH or PATH?image=KEY&label=KEY&split=FROM:TO")
        query = parse_qs(match["query"] or "")
        options = {k: v[-1] for k, v in query.items()}
        unknown = sorted(set(options) - {"image", "label", "split"})
        if unknown:
            raise ValueError(
                f"tfds source options {unknown} are not known; allowed: image=KEY, label=KEY, split=TFDS_NAME:NAME"
            )
        build = TfdsBuild.open(Path(match["path"]).expanduser().resolve())
        renames = split_renames(query.get("split", []), list(build.splits), cls.kind, "TFDS_NAME")
        label = options.get("label", "label")
        if build.features and label not in build.features:
            raise ValueError(f"tfds source {build.folder} has no feature {label!r}; features: {sorted(build.features)}")
        classes = build.class_names(label)
        if classes is None:
            raise ValueError(f"tfds source {build.folder}: feature {label!r} is not a ClassLabel (no class count)")
        image = options.get("image") or build.image_feature()
        query_text = location.partition("?")[2]
        spec = f"{cls.kind}:{build.folder}" + (f"?{query_text}" if query_text else "")  # the folder resolved
        return cls(build, image, label, classes, renames, spec)

    def _segments(self, split: str) -> list[Segment]:
        whole = self.build.splits[self.names[split]]
        return [Segment(whole, 0, whole.size)]

    def split_sizes(self) -> dict[str, int]:
        return {ours: self.build.splits[tfds].size for ours, tfds in self.names.items()}

    def sample_nbytes(self, split: str) -> np.ndarray:
        return segment_nbytes(self._segments(split))

    def chunk(self, split: str, indices: Sequence[int]) -> TfdsChunk:
        start, stop = contiguous_range(indices, self.kind)
        return TfdsChunk(self._segments(split), start, stop, self.to_sample)
