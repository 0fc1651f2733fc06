"""What a stopped ``vitray data prepare`` had finished, so that the same command goes on from there.

A preparation of ImageNet-21k or JFT takes hours; a stop (Ctrl-C, a lost node, a spot machine
taken back) used to start it over. Now each shard, once published, gets a small record beside it,
``.SPLIT-NNNNNN.tar.done`` (its manifest row and the bad images it met), written after the shard,
so that a record always stands for a whole shard. The ``.vitray-preparing`` marker holds the
fingerprint of the plan (:func:`plan_fingerprint`): a re-run whose plan has the same fingerprint
keeps every shard with a record of that plan and of the size the shard has; any other plan (other
shard sizes, ``--skip-bad`` given or not, images added, removed or replaced) starts over.

The shards are byte-for-byte what one uninterrupted run writes, and so are the manifests, which
are written from the records and the new shards' rows alike; the records are removed once
``dataset.json`` is written.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

from vitray import storage

from .layout import ManifestRow
from .shards import BadImages, ShardResult, ShardTask, write_shard_checked
from .sources import Source

# Part of every fingerprint: a change to what a shard holds (a new member, another key layout)
# changes it, so that shards of an older vitray are never resumed into a newer one's dataset.
PLAN_VERSION = 1
RECORD_SUFFIX = ".done"


def plan_fingerprint(source: Source, tasks: Sequence[ShardTask], bad_images: BadImages) -> str:
    """A digest of everything that decides the bytes of every shard: the source's spec, classes and
    label kind, what is done with bad images, and each shard's place, samples (which ones, from
    which files or rows: its pickled chunk) and their listed sizes. Two runs over an unchanged source
    with the same options agree on it, in any process; an image replaced by one of another size, or
    any change to the listing, changes it. (An image rewritten in place with the very same size is
    not seen: the listing is all that is read before the shards.)"""
    digest = hashlib.sha256()
    head = {
        "version": PLAN_VERSION,
        "spec": source.spec,
        "classes": source.classes,
        "label_kind": source.label_kind,
        "bad_images": bad_images,
    }
    digest.update(json.dumps(head, sort_keys=True).encode())
    for task in tasks:
        place = (task.name, task.first_sample, task.num_samples, task.key_width, task.num_classes, task.planned_bytes)
        digest.update(json.dumps(place).encode())
        digest.update(pickle.dumps(task.chunk, protocol=5))
    return digest.hexdigest()


def record_name(shard: str) -> str:
    return f".{shard}{RECORD_SUFFIX}"


def write_shard_recorded(
    task: ShardTask,
    dest: str,
    storage_options: dict[str, Any] | None = None,
    *,
    bad_images: BadImages = "refuse",
    plan: str,
) -> ShardResult:
    """:func:`~vitray.data.shards.write_shard_checked`, then the shard's record (when it was
    published: a shard refused for its bad images is written again by the next run)."""
    result = write_shard_checked(task, dest, storage_options, bad_images=bad_images)
    if result.row is not None:
        record = {"plan": plan, "row": vars(result.row), "bad": list(result.bad)}
        storage.write_bytes_atomic(
            storage.join(dest, record_name(task.name)), json.dumps(record).encode(), storage_options
        )
    return result


def finished_shards(
    dest: str,
    tasks: Sequence[ShardTask],
    plan: str,
    sizes: Mapping[str, int],
    storage_options: dict[str, Any] | None = None,
) -> dict[str, ShardResult]:
    """The shards of ``tasks`` that an earlier run of the plan ``plan`` wrote whole into ``dest``, by
    name: those with a record of that plan and of the size the shard has now (``sizes``: the files of
    ``dest`` and theirs, `storage.file_sizes`); the records are read concurrently."""
    wanted = [task.name for task in tasks if task.name in sizes and record_name(task.name) in sizes]
    records = storage.read_all([storage.join(dest, record_name(name)) for name in wanted], storage_options)
    done = {}
    for name in wanted:
        data = records.get(storage.join(dest, record_name(name)))
        result = _parsed(data, name, plan) if data is not None else None
        if result is not None and result.row is not None and result.row.bytes == sizes[name]:
            done[name] = result
    return done


def _parsed(data: bytes, name: str, plan: str) -> ShardResult | None:
    """A record's shard result, or None when it is not one of ``plan`` for the shard ``name`` (or not
    a record at all: cut short, another tool's file)."""
    try:
        record = json.loads(data)
        if record.get("plan") != plan:
            return None
        row = ManifestRow(**record["row"])
        bad = tuple(str(entry) for entry in record["bad"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return ShardResult(row, bad) if row.name == name else None


def remove_records(dest: str, tasks: Sequence[ShardTask], storage_options: dict[str, Any] | None = None) -> None:
    """Remove the records of ``tasks``' shards (once the dataset is whole, they say nothing more)."""
    names = set(storage.list_names(dest, storage_options))
    paths = [storage.join(dest, record_name(t.name)) for t in tasks if record_name(t.name) in names]
    storage.remove_all(paths, storage_options)
