"""`vitray data verify`: a prepared dataset checked against its manifests, shard by shard.

A copy cut short (`aws s3 sync`, `rsync`, `gsutil cp` stopped part-way), a shard changed or
deleted since, or a shard left over from another preparation is otherwise noticed only as samples
skipped at training time, if at all. For each split: every shard its manifest lists is there, with
the manifest's size and sha256 (read as a stream, :data:`HASH_THREADS` shards at a time), and no
shard of the split is there that the manifest does not list. Nothing is changed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from vitray import storage

from .layout import ManifestRow, manifest_name, read_dataset_info, read_manifest
from .shard_progress import ShardProgress

# Shards read and hashed at once: hashlib and the reads release the GIL, so threads keep several
# disks or S3 connections busy; few enough that a huge dataset does not open thousands of streams.
HASH_THREADS = 8
HASH_BLOCK = 8 * 1024 * 1024
SHARD = re.compile(r"^(?P<split>[A-Za-z0-9_]+)-\d{6,}\.tar$")
SHA_SHOWN = 12  # hex digits of a sha256 a problem line shows


@dataclass(frozen=True)
class ShardProblem:
    """What is wrong with one file of the dataset: ``name`` (a shard, a manifest) and how."""

    name: str
    problem: str

    def __str__(self) -> str:
        return f"{self.name}: {self.problem}"


@dataclass(frozen=True)
class Verified:
    """What :func:`verify_dataset` found: the splits checked, their shards (as the manifests list
    them), the bytes read and hashed, and the problems, in split and shard order."""

    dest: str
    shards: dict[str, int]  # split -> shards its manifest lists
    bytes_read: int
    problems: list[ShardProblem] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return not self.problems


def verify_dataset(
    dest: str,
    splits: Sequence[str] = (),
    *,
    storage_options: dict[str, Any] | None = None,
    threads: int = HASH_THREADS,
    show_progress: bool = False,
) -> Verified:
    """Check the prepared dataset at ``dest`` (local or ``s3://``) against its manifests: every split
    of its ``dataset.json``, or ``splits``. Raises FileNotFoundError / ValueError when ``dest`` is
    not a prepared dataset (no or no valid ``dataset.json``) and ValueError for a split it does not
    have; anything else found is a :class:`ShardProblem` of the result."""
    info = read_dataset_info(dest, storage_options)
    for split in splits:
        if split not in info.splits:
            raise ValueError(f"{dest} has no split {split!r}; it has {', '.join(sorted(info.splits))}")
    checked = list(dict.fromkeys(splits)) or list(info.splits)
    sizes = storage.file_sizes(dest, storage_options)
    problems: dict[str, list[ShardProblem]] = {split: [] for split in checked}
    listed: dict[str, list[ManifestRow]] = {}
    for split in checked:
        try:
            listed[split] = read_manifest(dest, split, storage_options)
        except FileNotFoundError:
            problems[split].append(ShardProblem(manifest_name(split), "missing (dataset.json lists the split)"))
        except Exception as error:  # not Parquet, or not vitray's columns
            problems[split].append(ShardProblem(manifest_name(split), f"unreadable ({_cause(error)})"))
    known = {row.name for rows in listed.values() for row in rows}
    for name in sizes:
        match = SHARD.match(name)
        if match is None or name in known:
            continue
        split = match["split"]
        if split in problems and split in listed:
            problems[split].append(ShardProblem(name, f"not in {manifest_name(split)} (a shard it does not list)"))
        elif not splits and split not in info.splits:
            problems.setdefault(split, []).append(
                ShardProblem(name, f"not in any manifest (dataset.json has no split {split!r})")
            )

    to_hash = []
    for split, rows in listed.items():
        for row in rows:
            size = sizes.get(row.name)
            if size is None:
                problems[split].append(ShardProblem(row.name, f"missing (listed in {manifest_name(split)})"))
            elif size != row.bytes:
                how = "cut short" if size < row.bytes else "longer"
                problems[split].append(
                    ShardProblem(row.name, f"{size:,} bytes, the manifest says {row.bytes:,} ({how})")
                )
            else:
                to_hash.append((split, row))
    total = sum(len(rows) for rows in listed.values())
    read = 0
    with ShardProgress(f"verifying {dest}", total, unit="shards", show=show_progress) as bar:
        bar.advance(total - len(to_hash))  # missing or of the wrong size: known without reading
        pool = ThreadPoolExecutor(max_workers=max(1, threads))
        try:
            futures = {
                pool.submit(_sha256, storage.join(dest, row.name), storage_options): (split, row)
                for split, row in to_hash
            }
            for future in as_completed(futures):
                split, row = futures[future]
                try:
                    digest = future.result()
                except Exception as error:  # a read that failed after storage's retries
                    problems[split].append(ShardProblem(row.name, f"unreadable ({_cause(error)})"))
                else:
                    read += row.bytes
                    if digest != row.sha256:
                        problems[split].append(
                            ShardProblem(
                                row.name,
                                f"content differs: sha256 {digest[:SHA_SHOWN]}..., the manifest says "
                                f"{row.sha256[:SHA_SHOWN]}...",
                            )
                        )
                bar.advance(1)
        finally:  # Ctrl-C, or an error: the shards not started yet are not read
            pool.shutdown(wait=True, cancel_futures=True)
    found = [problem for split in problems for problem in sorted(problems[split], key=lambda p: p.name)]
    return Verified(dest, {split: len(listed.get(split, [])) for split in checked}, read, found)


def _sha256(path: str, storage_options: dict[str, Any] | None) -> str:
    def digest() -> str:
        sha = hashlib.sha256()
        with storage.open_file(path, "rb", storage_options) as f:
            while block := f.read(HASH_BLOCK):
                sha.update(block)
        return sha.hexdigest()

    return storage.with_retries(digest, what=f"reading {path}")


def _cause(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
