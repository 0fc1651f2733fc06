"""Writing webdataset shards: the unit of work of ``vitray data prepare``.

:func:`plan_shards` cuts every split of a source into :class:`ShardTask` objects (picklable, small)
and :func:`write_shard` turns one into ``SPLIT-NNNNNN.tar``, returning its manifest row. Tasks are
independent, so any executor can run them (``map``, a process pool, Ray tasks).

Shards are byte-for-byte reproducible: members are written in sample order, image then label, with
fixed metadata (mtime 0, uid/gid 0, no user names, mode 0444) in the POSIX ustar format.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from typing import IO, Any, Literal

import numpy as np

from vitray import storage

from .image_check import OTHER_FORMAT, TOO_LARGE, image_problem
from .layout import LabelKind, ManifestRow, check_split_name, key_width, sample_key, shard_name
from .sources.base import SampleChunk, Source

DEFAULT_SAMPLES_PER_SHARD = 1000
DEFAULT_MAX_SHARD_BYTES = 256 * 1024 * 1024
TAR_MEMBER_OVERHEAD = 3 * 512  # two member headers and padding, per sample
PREPARE_SHUFFLE_SEED = 0

# What to do with a zero-byte or undecodable image: refuse the dataset (the default: the user
# decides), leave the sample out, or store it as it is (the readers then skip it at every epoch).
BadImages = Literal["refuse", "skip", "keep"]


@dataclass(frozen=True)
class ShardResult:
    """What writing one shard gave: its manifest row (None when bad images were refused, and the
    shard was therefore not published) and the bad images met, as "ORIGIN: why"."""

    row: ManifestRow | None
    bad: tuple[str, ...] = ()


class BadImagesError(ValueError):
    """Images that cannot be read, found while preparing; ``bad`` holds "ORIGIN: why" for each,
    sorted: the message is the same whichever order the shards were written in (Ray's tasks finish
    in any order)."""

    def __init__(self, bad: list[str], *, shown: int = 5) -> None:
        bad = sorted(bad)
        self.bad = bad
        more = f"; {len(bad) - shown} more" if len(bad) > shown else ""
        n = len(bad)
        them = "them" if n != 1 else "it"
        # An image over Pillow's pixel limit is not damaged: its fix is to resize it; one of another
        # format (a WEBP named .jpg, a GIF) is to be converted.
        too_large = sum(f": {TOO_LARGE}: " in entry for entry in bad)
        other_format = sum(f": {OTHER_FORMAT} (" in entry for entry in bad)
        damaged = n - too_large - other_format
        kinds = ["zero-byte", "undecodable"] * bool(damaged) + ["not PNG/JPEG"] * bool(other_format)
        kinds += [TOO_LARGE] * bool(too_large)
        why = f" ({', '.join(kinds[:-1])} or {kinds[-1]})" if len(kinds) > 1 else ""  # one kind: each entry says it
        if too_large == n:
            fix = f"resize {them} below the limit"
        elif other_format == n:
            fix = f"convert {them} to PNG or JPEG"
        else:
            ways = ["convert the ones of other formats to PNG or JPEG"] * bool(other_format)
            ways += ["resize the ones too large"] * bool(too_large)
            fix = f"fix or remove {them}" + (f" ({'; '.join(ways)})" if ways else "")
        fix += f", or pass --skip-bad to leave {them} out"
        super().__init__(
            f"{n} image{'s' if n != 1 else ''} cannot be read{why}: " + "; ".join(bad[:shown]) + more + f": {fix}"
        )


class _Refused(Exception):
    """Raised inside the shard's atomic write so that a shard with bad images is never published."""


@dataclass(frozen=True)
class ShardTask:
    """Everything needed to write one shard, without access to the source object."""

    split: str
    index: int  # shard number within the split
    first_sample: int  # position of the shard's first sample in the split's stored order
    num_samples: int
    key_width: int
    num_classes: int
    label_kind: LabelKind
    chunk: SampleChunk
    # The samples' sizes as listed, summed: a resumed preparation tells a source whose images were
    # replaced since by it (see prepare_resume.plan_fingerprint).
    planned_bytes: int = 0

    @property
    def name(self) -> str:
        return shard_name(self.split, self.index)


def plan_shards(
    source: Source,
    *,
    samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[ShardTask]:
    """Cut every split of ``source`` into shards of at most ``samples_per_shard`` samples and about
    ``max_shard_bytes`` bytes (exact for files, estimated for Parquet/CIFAR; a single larger sample
    gets a shard of its own).

    Random-access sources are stored in a fixed shuffled order (``default_rng(0)``), so that every
    shard mixes classes; sequential sources (Parquet) keep their order.
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be at least 1, got {samples_per_shard}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be at least 1, got {max_shard_bytes}")
    tasks = []
    for split, size in source.split_sizes().items():
        check_split_name(split, source.spec)
        order = np.arange(size)
        if source.random_access:
            order = np.random.default_rng([PREPARE_SHUFFLE_SEED, _stable_id(split)]).permutation(size)
        sizes = source.sample_nbytes(split)[order] + TAR_MEMBER_OVERHEAD
        width = key_width(size)
        for index, (start, stop) in enumerate(_cut(sizes, samples_per_shard, max_shard_bytes)):
            tasks.append(
                ShardTask(
                    split=split,
                    index=index,
                    first_sample=start,
                    num_samples=stop - start,
                    key_width=width,
                    num_classes=len(source.classes),
                    label_kind=source.label_kind,
                    chunk=source.chunk(split, order[start:stop].tolist()),
                    planned_bytes=int(sizes[start:stop].sum()),
                )
            )
    return tasks


def _stable_id(text: str) -> int:
    # Python's hash() of a str changes between processes; the shuffle must not.
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _cut(sizes: np.ndarray, max_samples: int, max_bytes: int) -> list[tuple[int, int]]:
    ranges, start, n = [], 0, len(sizes)
    while start < n:
        stop = min(start + max_samples, n)
        over = np.nonzero(np.cumsum(sizes[start:stop]) > max_bytes)[0]
        if len(over):
            stop = start + max(int(over[0]), 1)
        ranges.append((start, stop))
        start = stop
    return ranges


class _HashingWriter:
    """Counts and hashes the bytes tarfile writes, on their way to the real file."""

    def __init__(self, target: IO[bytes]) -> None:
        self.target, self.sha256, self.size = target, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.target.write(data)

    def tell(self) -> int:
        return self.size


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, IO[bytes]]:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info, io.BytesIO(data)


def label_member(task: ShardTask, label: int | tuple[int, ...] | None, key: str) -> tuple[str, bytes] | None:
    """The label field of a sample: ``.cls`` (decimal text), ``.json`` ``{"labels": [...]}``, or
    None for unlabelled data (the sample is its image alone). ``key`` names the sample in errors (its
    origin in the source where it has one: a file, a table's row)."""
    if task.label_kind == "none":
        if label is not None:
            raise ValueError(f"{key}: unlabelled dataset but the sample has the label {label!r}")
        return None
    if label is None:
        raise ValueError(f"{key}: {task.label_kind}-label dataset but the sample has no label")
    labels = [label] if isinstance(label, int) else list(label)
    if task.label_kind == "single" and not isinstance(label, int):
        raise ValueError(f"{key}: single-label dataset but the label is {label!r}")
    bad = [v for v in labels if not 0 <= int(v) < task.num_classes]
    if bad:
        raise ValueError(f"{key}: label {bad[0]} is outside the classes 0..{task.num_classes - 1}")
    if task.label_kind == "single":
        return "cls", str(int(label)).encode()  # type: ignore[arg-type]
    return "json", json.dumps({"labels": sorted({int(v) for v in labels})}, separators=(",", ":")).encode()


def write_shard(
    task: ShardTask, dest: str, storage_options: dict[str, Any] | None = None, *, bad_images: BadImages = "refuse"
) -> ManifestRow:
    """Write the shard of ``task`` into the dataset folder ``dest``; returns its manifest row.
    Raises :class:`BadImagesError` when it meets bad images and ``bad_images`` is "refuse"."""
    result = write_shard_checked(task, dest, storage_options, bad_images=bad_images)
    if result.row is None:
        raise BadImagesError(list(result.bad))
    return result.row


def write_shard_checked(
    task: ShardTask, dest: str, storage_options: dict[str, Any] | None = None, *, bad_images: BadImages = "refuse"
) -> ShardResult:
    """Write the shard of ``task`` into the dataset folder ``dest``, checking every image (see
    :mod:`vitray.data.image_check`) unless ``bad_images`` is "keep".

    The shard appears under its final name only when complete (see :func:`storage.atomic_write`).
    With "refuse", a shard that holds a bad image is not published, but the rest of its samples
    are still checked, so that one error can count every bad image of the dataset. A skipped
    sample leaves a gap in the keys (keys stay the samples' planned positions).
    """
    path = storage.join(dest, task.name)
    bad: list[str] = []
    try:
        with storage.atomic_write(path, storage_options) as f:
            out = _HashingWriter(f)
            with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:  # type: ignore[call-overload]
                position = count = 0
                for sample in task.chunk:
                    key = sample_key(task.split, task.first_sample + position, task.key_width)
                    position += 1
                    problem = image_problem(sample.image) if bad_images != "keep" else None
                    if problem is not None:
                        bad.append(f"{sample.origin or key}: {problem}")
                    if bad and bad_images == "refuse":
                        continue  # this shard will not be published; only count what else is bad
                    if problem is not None:
                        continue
                    label = label_member(task, sample.label, sample.origin or key)  # named where the user finds it
                    tar.addfile(*_member(f"{key}.{sample.ext}", sample.image))
                    if label is not None:
                        tar.addfile(*_member(f"{key}.{label[0]}", label[1]))
                    count += 1
            if position != task.num_samples:
                raise RuntimeError(f"{task.name}: the source gave {position} samples, expected {task.num_samples}")
            if bad and bad_images == "refuse":
                raise _Refused
    except _Refused:
        return ShardResult(None, tuple(bad))
    row = ManifestRow(name=task.name, num_samples=count, bytes=out.size, sha256=out.sha256.hexdigest())
    return ShardResult(row, tuple(bad))
