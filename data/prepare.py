"""``vitray data prepare``: source -> shards + manifests + ``dataset.json`` (serial version).

The steps are public so that an executor can run the shard writing elsewhere (``vitray.cluster``
runs them as Ray tasks)::

    existing = begin_prepare(dest, overwrite=...)    # None unless already prepared
    tasks = plan_shards(source, samples_per_shard=...)
    rows = [write_shard(t, dest) for t in tasks]      # any executor, any order
    info = finalize(source, tasks, rows, dest)        # manifests, then dataset.json last

``dataset.json`` is the commit marker: it is written only after every shard and manifest, so a
crashed or running preparation is never taken for a finished one.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from . import storage
from .layout import (
    DATASET_JSON,
    DatasetInfo,
    ManifestRow,
    SplitInfo,
    manifest_name,
    read_dataset_info,
    write_dataset_info,
    write_manifest,
)
from .shards import DEFAULT_MAX_SHARD_BYTES, DEFAULT_SAMPLES_PER_SHARD, ShardTask, plan_shards, write_shard
from .sources import Source, open_source

# Shards, manifests and the temporary files storage.atomic_write leaves when a process is killed.
_OUR_FILES = re.compile(r"^(\.?[A-Za-z0-9_]+(-\d{6}\.tar|\.manifest\.parquet)|\.dataset\.json)(\.[^/]*\.tmp)?$")

MapFn = Callable[[Callable[[ShardTask], ManifestRow], Iterable[ShardTask]], Iterator[ManifestRow]]


def begin_prepare(
    dest: str, *, overwrite: bool = False, storage_options: dict[str, Any] | None = None
) -> DatasetInfo | None:
    """Check ``dest`` before writing: returns the existing dataset if it is already prepared (and
    ``overwrite`` is false), else clears what an earlier run left and returns None.

    With ``overwrite``, ``dataset.json`` is deleted first so that the folder stops counting as
    prepared before any of its shards change.
    """
    if storage.exists(storage.join(dest, DATASET_JSON), storage_options):
        if not overwrite:
            return read_dataset_info(dest, storage_options)
        storage.remove(storage.join(dest, DATASET_JSON), storage_options)
    # Shards and manifests of an earlier (unfinished or overwritten) run; other files are left alone.
    for name in storage.list_names(dest, storage_options):
        if _OUR_FILES.match(name):
            storage.remove(storage.join(dest, name), storage_options)
    return None


def finalize(
    source: Source,
    tasks: Sequence[ShardTask],
    rows: Sequence[ManifestRow],
    dest: str,
    storage_options: dict[str, Any] | None = None,
) -> DatasetInfo:
    """Write one manifest per split (shards in order), then ``dataset.json``; returns its content."""
    by_name = {row.name: row for row in rows}
    missing = [t.name for t in tasks if t.name not in by_name]
    if missing:
        raise RuntimeError(f"cannot finalize {dest}: shards {missing[:5]} were not written")
    splits = {}
    for split in source.split_sizes():
        split_rows = [by_name[t.name] for t in sorted(tasks, key=lambda t: t.index) if t.split == split]
        write_manifest(storage.join(dest, manifest_name(split)), split_rows, storage_options)
        splits[split] = SplitInfo(num_samples=sum(r.num_samples for r in split_rows), num_shards=len(split_rows))
    info = DatasetInfo(
        name=source.name,
        source=source.spec,
        classes=source.classes,
        num_classes=len(source.classes),
        label_kind=source.label_kind,
        splits=splits,
    )
    write_dataset_info(dest, info, storage_options)
    return info


def prepare_dataset(
    source: str | Source,
    dest: str,
    *,
    samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    map_fn: MapFn = map,
    progress: Callable[[ManifestRow], None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> DatasetInfo:
    """Prepare ``source`` (a spec like ``imagefolder:PATH`` or a :class:`Source`) into ``dest``.

    ``map_fn`` runs the shard writes (``map`` by default; e.g. ``ProcessPoolExecutor().map``);
    ``progress`` is called with each finished shard's manifest row. Returns the dataset description.
    A ``dest`` that is already prepared is left as it is (and its description returned) unless
    ``overwrite`` is true.
    """
    src = open_source(source) if isinstance(source, str) else source
    existing = begin_prepare(dest, overwrite=overwrite, storage_options=storage_options)
    if existing is not None:
        print(f"{dest} is already prepared from {existing.source}; nothing to do (use overwrite to redo it)")
        return existing
    tasks = plan_shards(src, samples_per_shard=samples_per_shard, max_shard_bytes=max_shard_bytes)
    # A partial of a module-level function pickles, so process pools can run it too.
    write = functools.partial(write_shard, dest=dest, storage_options=storage_options)
    rows = []
    for row in map_fn(write, tasks):
        rows.append(row)
        if progress is not None:
            progress(row)
    return finalize(src, tasks, rows, dest, storage_options)
