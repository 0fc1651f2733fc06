"""The on-storage layout of a prepared dataset: ``dataset.json``, shards and manifests.

A prepared dataset is a folder (local or ``s3://``)::

    dataset.json                  written last: its presence means the dataset is complete
    train-000000.tar ...          webdataset shards, keys like ``train_00000123``
    train.manifest.parquet        one row per shard: name, num_samples, bytes, sha256 (and, in its
                                  schema metadata, the samples the source listed)
    test-000000.tar ...
    test.manifest.parquet

Readers take a split string that may slice a split, ``train[:98%]`` or ``train[800:1000]``
(:mod:`vitray.data.splits`); :func:`read_split` resolves it against the manifest.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from vitray import storage

from .plan import ExtentTable, ShardRange
from .splits import parse_split, split_table

FORMAT_VERSION = 1
DATASET_JSON = "dataset.json"
SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]+$")  # split names become part of keys, which have no dots

LabelKind = Literal["single", "multi", "none"]  # "none": unlabelled (num_classes 0), see sources.unlabelled


class SplitInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_samples: int = Field(ge=0)
    num_shards: int = Field(ge=0)


class DatasetInfo(BaseModel):
    """The content of ``dataset.json``."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = FORMAT_VERSION
    name: str
    source: str
    classes: list[str]
    num_classes: int
    label_kind: LabelKind
    splits: dict[str, SplitInfo]

    def split(self, name: str) -> SplitInfo:
        """The split called ``name`` (a plain name, no slice), or an error listing the splits there are."""
        if name not in self.splits:
            raise KeyError(f"dataset {self.name!r} has no split {name!r}; it has {sorted(self.splits)}")
        return self.splits[name]


@dataclass(frozen=True)
class ManifestRow:
    """One shard of a split, as listed in ``SPLIT.manifest.parquet``."""

    name: str
    num_samples: int
    bytes: int
    sha256: str


MANIFEST_SCHEMA = pa.schema(
    [("name", pa.string()), ("num_samples", pa.int64()), ("bytes", pa.int64()), ("sha256", pa.string())]
)


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def manifest_name(split: str) -> str:
    return f"{split}.manifest.parquet"


def sample_key(split: str, index: int, width: int) -> str:
    """``train_00000123``: split name and the sample's index in the split, zero-padded."""
    return f"{split}_{index:0{width}d}"


def key_width(num_samples: int) -> int:
    """Digits of the index in keys: at least 8, more for very large splits, fixed per split."""
    return max(8, len(str(max(num_samples - 1, 0))))


def check_split_name(name: str, where: str) -> str:
    if not SPLIT_NAME.match(name):
        raise ValueError(f"split name {name!r} from {where} is not allowed: use letters, digits and _ only")
    return name


# The manifest's schema metadata: how many samples the source listed for the split when it was
# prepared (more than the manifest's rows hold when bad images were left out), so that a re-run can
# tell a source that changed since from one whose bad images were skipped. Readers ignore it.
SOURCE_SAMPLES_KEY = b"vitray.source_samples"


def write_manifest(
    path: str,
    rows: list[ManifestRow],
    storage_options: dict[str, Any] | None = None,
    *,
    source_samples: int | None = None,
) -> None:
    schema = MANIFEST_SCHEMA
    if source_samples is not None:
        schema = schema.with_metadata({SOURCE_SAMPLES_KEY: str(source_samples).encode()})
    table = pa.Table.from_pylist([vars(r) for r in rows], schema=schema)
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    storage.write_bytes_atomic(path, buffer.getvalue(), storage_options)


def read_manifest(dataset: str, split: str, storage_options: dict[str, Any] | None = None) -> list[ManifestRow]:
    """The shards of ``split`` in their canonical order."""
    table = read_manifest_table(dataset, split, storage_options)
    return [ManifestRow(**row) for row in table.to_pylist()]


def source_samples(table: pa.Table) -> int | None:
    """What a manifest table says the source listed for its split (:data:`SOURCE_SAMPLES_KEY`); None
    for a manifest written before vitray recorded it."""
    value = (table.schema.metadata or {}).get(SOURCE_SAMPLES_KEY)
    return int(value) if value is not None and value.isdigit() else None


def read_manifest_table(dataset: str, split: str, storage_options: dict[str, Any] | None = None) -> pa.Table:
    """The manifest of ``split`` as an Arrow table (columns, not a Python object per shard)."""
    path = storage.join(dataset, manifest_name(split))
    try:
        data = storage.read_bytes(path, storage_options)
    except FileNotFoundError:
        raise FileNotFoundError(f"no manifest {path}: split {split!r} was not prepared") from None
    return pq.read_table(io.BytesIO(data))


class ShardUrls(Sequence[str]):
    """The URLs of a split's shards, ``folder/`` + each manifest name, kept as one Arrow string
    array: about 20 bytes a shard instead of a Python string each (300k shards: 6 MiB, not 35)."""

    def __init__(self, folder: str, names: pa.Array):
        self._prefix = storage.join(folder, "")
        self._names = names

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self._prefix + name for name in self._names[index].to_pylist()]
        if not -len(self) <= index < len(self):
            raise IndexError(f"shard {index} of {len(self)}")
        return self._prefix + self._names[index].as_py()


def write_dataset_info(dataset: str, info: DatasetInfo, storage_options: dict[str, Any] | None = None) -> None:
    text = json.dumps(info.model_dump(), indent=2, sort_keys=True) + "\n"
    storage.write_bytes_atomic(storage.join(dataset, DATASET_JSON), text.encode(), storage_options)


def is_prepared_dataset(path: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether `path` holds a prepared dataset (its dataset.json): a folder no run or output belongs in."""
    return storage.exists(storage.join(path, DATASET_JSON), storage_options)


# Written before the first shard, removed after dataset.json: "a vitray preparation began here"
# (`vitray.data.prepare`).
PREPARING_MARKER = ".vitray-preparing"


def read_dataset_info(path: str, storage_options: dict[str, Any] | None = None) -> DatasetInfo:
    """Read ``dataset.json`` of the prepared dataset at ``path`` (local folder or URL).

    Raises FileNotFoundError when the dataset was not prepared or is still being written (the file
    is written last), and ValueError when the file is not a vitray dataset description.
    """
    json_path = storage.join(path, DATASET_JSON)
    try:
        data = storage.read_bytes(json_path, storage_options)
    except FileNotFoundError:
        if storage.exists(storage.join(path, PREPARING_MARKER), storage_options):
            raise FileNotFoundError(
                f"no {DATASET_JSON} at {path}: a preparation began there and has not finished (it stopped, or is "
                "still writing); run the same `vitray data prepare` command again to go on from its shards"
            ) from None
        raise FileNotFoundError(
            f"no {DATASET_JSON} at {path}: not prepared or still being written; run `vitray data prepare SOURCE {path}`"
        ) from None
    if not data.strip():
        raise ValueError(f"{json_path} is empty (a copy cut short?): copy it again from where the dataset was prepared")
    try:
        info = DatasetInfo.model_validate_json(data)
    except ValueError as error:
        raise ValueError(f"{json_path} is not a valid vitray dataset description: {error}") from None
    if info.format_version != FORMAT_VERSION:
        raise ValueError(
            f"{json_path} has format_version {info.format_version}; this vitray reads version {FORMAT_VERSION}"
        )
    return info


def dataset_digest(path: str, storage_options: dict[str, Any] | None = None) -> str:
    """A short digest of what the prepared dataset at ``path`` holds: its ``dataset.json`` and the
    sha256 of every shard of every split, in manifest order. Preparing the data again (another
    source, order or content) changes it; it costs the description and one manifest per split,
    never a shard. Raises what :func:`read_dataset_info` and :func:`read_manifest_table` raise for
    data that is not (wholly) prepared."""
    info = read_dataset_info(path, storage_options)
    shards = {
        name: read_manifest_table(path, name, storage_options).column("sha256").to_pylist() for name in info.splits
    }
    content = json.dumps({"dataset": info.model_dump(mode="json"), "shards": shards}, sort_keys=True)
    return hashlib.sha256(content.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ResolvedSplit:
    """A split string resolved against a prepared dataset: what the readers read, shard by shard."""

    info: DatasetInfo
    split: str  # as given, e.g. "train[:98%]"
    shard_urls: Sequence[str]  # every shard of the named split, in manifest order
    extent_table: ExtentTable  # the samples to read (shard index into shard_urls)
    shard_bytes: Sequence[int] = ()  # each shard's size as the manifest records it (shard_urls' order)

    @property
    def extents(self) -> tuple[ShardRange, ...]:
        """The extents as :class:`ShardRange` objects."""
        return self.extent_table.ranges()

    @property
    def num_samples(self) -> int:
        return self.extent_table.total


def read_split(path: str, split: str, storage_options: dict[str, Any] | None = None) -> ResolvedSplit:
    """Resolves ``split`` -- ``NAME`` or ``NAME[start:stop]``, see :mod:`vitray.data.splits` -- on
    the prepared dataset at ``path``.

    Raises ValueError for a malformed or out-of-range slice (before any I/O when malformed) and
    KeyError naming the splits there are when the dataset has no such split.
    """
    spec = parse_split(split)
    info = read_dataset_info(path, storage_options)
    info.split(spec.name)
    table = read_manifest_table(path, spec.name, storage_options)
    extents = split_table(spec, table.column("num_samples").to_numpy())
    names, sizes = table.column("name").combine_chunks(), table.column("bytes").to_numpy()
    return ResolvedSplit(info, split, ShardUrls(path, names), extents, sizes)
