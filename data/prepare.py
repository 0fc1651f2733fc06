"""``vitray data prepare``: source -> shards + manifests + ``dataset.json`` (serial version).

The steps are public so that an executor can run the shard writing elsewhere (``vitray.cluster``
runs them as Ray tasks)::

    source = opened(spec)                            # its notes (a split left out) printed
    started = start_preparation(source, dest, ...)   # a DatasetInfo when DEST is prepared already
    write = started.writer()                         # a shard and its record; it pickles
    results = [write(t) for t in started.remaining]  # any executor, any order
    info = started.finish(results)                   # bad images settled, manifests, dataset.json

``dataset.json`` is the commit marker: it is written only after every shard and manifest, so a
crashed or running preparation is never taken for a finished one. A hidden ``.vitray-preparing``
file marks a folder whose preparation began but did not finish: its shards are vitray's to
replace, or, when the same command runs again, to keep (:mod:`.prepare_resume`). Any other non-empty
folder holds someone else's files and is refused unless ``overwrite`` (:func:`check_destination`),
so that nothing vitray did not write is replaced.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vitray import storage

from .layout import (
    DATASET_JSON,
    PREPARING_MARKER,
    DatasetInfo,
    ManifestRow,
    SplitInfo,
    manifest_name,
    read_dataset_info,
    read_manifest_table,
    source_samples,
    write_dataset_info,
    write_manifest,
)
from .prepare_resume import finished_shards, plan_fingerprint, remove_records, write_shard_recorded
from .shards import (
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_SAMPLES_PER_SHARD,
    BadImages,
    BadImagesError,
    ShardResult,
    ShardTask,
    plan_shards,
)
from .sources import Source, open_source


def _our_files(splits: Iterable[str]) -> re.Pattern[str]:
    """The names vitray writes for `splits` -- their shards and manifests -- and the temporary files
    storage.atomic_write leaves when a process is killed. Only a split's own names: a folder's
    `shard-000001.tar` of another tool is not taken for a shard of split "shard" unless that split
    is being prepared."""
    names = "|".join(re.escape(split) for split in sorted(set(splits))) or "(?!)"
    shard = r"-\d{6,}\.tar(\.done)?"  # a shard, or a shard's record (prepare_resume)
    skipped = re.escape(SKIPPED_IMAGES)
    return re.compile(rf"^(\.?({names})({shard}|\.manifest\.parquet)|\.dataset\.json|{skipped})(\.[^/]*\.tmp)?$")


SHARD_NAME = re.compile(r"^[^.][^/]*-\d{6,}\.tar$")
# The lease of the command preparing the folder now (and, locally, its lock file beside it): a
# second preparation is refused while it is held (`vitray.cluster.prepare`).
PREPARING_LEASE = ".vitray-preparing.lease.json"
# How many of a foreign folder's names a refusal lists.
NAMES_SHOWN = 5
# Every image `--skip-bad` left out of the dataset, one "ORIGIN: why" a line (the message names a few).
SKIPPED_IMAGES = "skipped-images.txt"

MapFn = Callable[[Callable[[ShardTask], ShardResult], Iterable[ShardTask]], Iterator[ShardResult]]


class DestinationNotEmpty(ValueError):
    """The destination holds files that vitray did not write (and is not a vitray dataset)."""


class SourceChanged(ValueError):
    """The source lists other samples than when the dataset at the destination was prepared from it."""


def check_destination(
    dest: str, *, overwrite: bool = False, storage_options: dict[str, Any] | None = None
) -> DatasetInfo | None:
    """What is at ``dest``, changing nothing: the dataset already prepared there (None with
    ``overwrite``, or when there is none). Raises :class:`DestinationNotEmpty`, naming what is
    there, for a non-empty folder that is neither a vitray dataset nor an unfinished preparation,
    unless ``overwrite``, and for a file (whatever ``overwrite`` says: it is never replaced). Cheap:
    one listing and at most one small read."""
    if storage.is_local_file(dest):
        raise DestinationNotEmpty(f"{dest} is a file, not a folder: give a new or empty folder for the dataset")
    names = [name for name in storage.list_names(dest, storage_options) if not name.startswith(PREPARING_LEASE)]
    if DATASET_JSON in names:
        try:
            existing = read_dataset_info(dest, storage_options)
        except (ValueError, KeyError, TypeError):
            existing = None  # a dataset.json that vitray did not write
        if existing is not None:
            return None if overwrite else existing
    if overwrite or not names or PREPARING_MARKER in names:
        return None
    shown = ", ".join(names[:NAMES_SHOWN]) + (f", ... ({len(names)} entries)" if len(names) > NAMES_SHOWN else "")
    raise DestinationNotEmpty(
        f"{dest} is not empty and is not a vitray dataset (it holds {shown}): choose a new or empty folder, "
        "or pass --overwrite to write the dataset there (replacing same-named shards and manifests)"
    )


def begin_prepare(
    dest: str,
    tasks: Sequence[ShardTask],
    plan: str,
    *,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, ShardResult]:
    """Mark ``dest`` as being prepared by the plan ``tasks`` (whose fingerprint is ``plan``) and
    return, by name, the shards that an earlier, stopped run of the same plan finished there: they
    are kept, and only the others are to be written. Call it once :func:`check_destination` has
    passed (and found no dataset, or ``overwrite``).

    Any other unfinished preparation (another plan) or dataset there (``overwrite``) is cleared: the
    shards, records and manifests of the splits of ``tasks`` and of the vitray dataset there before,
    wherever a higher-numbered shard of an earlier, larger preparation would linger. Every other file
    is left alone, whatever its name. With ``overwrite``, ``dataset.json`` is deleted first so that
    the folder stops counting as prepared before any of its shards change.
    """
    sizes = storage.file_sizes(dest, storage_options)  # (the files: what a marker, a shard, a record is)
    names = sorted(sizes)
    marker = storage.join(dest, PREPARING_MARKER)
    splits = {task.split for task in tasks}
    recorded = _marker_plan(marker, storage_options) if PREPARING_MARKER in names else None
    if recorded == plan and DATASET_JSON not in names:
        done = finished_shards(dest, tasks, plan, sizes, storage_options)
        ours = _our_files(splits)
        left = [name for name in names if ours.match(name) and name.endswith(".tmp")]
        storage.remove_all([storage.join(dest, name) for name in left], storage_options)
        samples = sum(result.row.num_samples for result in done.values() if result.row is not None)
        print(
            f"{dest}: going on with the preparation stopped earlier: {len(done):,} of {len(tasks):,} "
            f"shard{'s' if len(tasks) != 1 else ''} ({samples:,} images) already written"
        )
        return done
    left = sum(1 for name in names if SHARD_NAME.match(name))
    if recorded is not None and left:  # (none written, as after a refusal: nothing to start over from)
        why = (
            "with other options or of the source as it was then"
            if recorded
            else "by an older vitray (its shards carry no records)"
        )
        print(
            f"{dest} holds an unfinished preparation ({left:,} shard{'s' if left != 1 else ''} written) {why}: starting over"
        )
    # (a dataset.json vitray did not write does not say: its splits are not vitray's to clear)
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
        splits |= set(read_dataset_info(dest, storage_options).splits)
    storage.write_bytes_atomic(marker, plan.encode(), storage_options)
    if storage.exists(storage.join(dest, DATASET_JSON), storage_options):
        storage.remove(storage.join(dest, DATASET_JSON), storage_options)
    ours = _our_files(splits)
    storage.remove_all(
        [storage.join(dest, name) for name in storage.list_names(dest, storage_options) if ours.match(name)],
        storage_options,
    )
    return {}


def _marker_plan(marker: str, storage_options: dict[str, Any] | None) -> str:
    """The fingerprint of the plan a marker was written for ("" for one of an older vitray, empty)."""
    try:
        return storage.read_bytes(marker, storage_options).decode(errors="replace").strip()
    except FileNotFoundError:
        return ""


def check_unchanged(
    existing: DatasetInfo, source: Source, dest: str, storage_options: dict[str, Any] | None = None
) -> None:
    """Raise :class:`SourceChanged` when ``source`` (as listed now) holds another number of samples in
    any split than when ``existing``, the dataset at ``dest``, was prepared from it: images added or
    removed since, which a re-run would otherwise report as "already prepared", with the old counts.
    "Then" is what the source listed (each manifest records it: more than the shards hold when bad
    images were skipped), or for a dataset prepared before manifests recorded it, the samples of
    ``dataset.json``. Costs one manifest read per split."""
    then = {}
    for split, info in existing.splits.items():
        try:
            listed = source_samples(read_manifest_table(dest, split, storage_options))
        except FileNotFoundError:
            listed = None
        then[split] = info.num_samples if listed is None else listed
    now = source.split_sizes()
    changed = [split for split in sorted(set(then) | set(now)) if then.get(split) != now.get(split)]
    if changed:
        counts = "; ".join(
            f"{split}: {_count(then.get(split))} then, {_count(now.get(split))} now" for split in changed
        )
        raise SourceChanged(
            f"{source.spec} changed since {dest} was prepared from it (samples {counts}): pass --overwrite to "
            "prepare it again, or choose another DEST"
        )


def _count(samples: int | None) -> str:
    return "none" if samples is None else f"{samples:,}"


def opened(source: str | Source) -> Source:
    """``source`` opened (a spec) and what opening decided said (:attr:`Source.notes`), or the
    :class:`Source` given as it is (whoever opened it said it)."""
    if not isinstance(source, str):
        return source
    src = open_source(source)
    for note in src.notes:
        print(note)
    return src


def refuse_known_bad(source: Source, bad_images: BadImages) -> None:
    """Raise :class:`BadImagesError` for the images known to be bad from the listing alone (zero-byte
    files), before any shard is written, unless they are to be skipped or kept: a whole pass over
    the dataset would otherwise come first."""
    if source.known_bad and bad_images == "refuse":
        raise BadImagesError(source.known_bad)


def settle_bad_images(
    results: Iterable[ShardResult], bad_images: BadImages, dest: str, storage_options: dict[str, Any] | None = None
) -> list[ManifestRow]:
    """The manifest rows of the shards written; with "refuse", raises :class:`BadImagesError`
    naming every bad image met (the shards with none are written, but no ``dataset.json``); with
    "skip", says how many were left out and the first few, and lists them all in ``dest``'s
    :data:`SKIPPED_IMAGES` file."""
    results = list(results)
    bad = sorted(entry for result in results for entry in result.bad)
    if bad and bad_images == "refuse":
        raise BadImagesError(bad)
    if bad and bad_images == "skip":
        listed = storage.join(dest, SKIPPED_IMAGES)
        storage.write_bytes_atomic(listed, "".join(f"{entry}\n" for entry in bad).encode(), storage_options)
        more = f" and {len(bad) - NAMES_SHOWN} more" if len(bad) > NAMES_SHOWN else ""
        n = len(bad)
        print(
            f"skipped {n} bad image{'s' if n != 1 else ''}: "
            + "; ".join(bad[:NAMES_SHOWN])
            + more
            + f" (all in {listed})"
        )
    return [result.row for result in results if result.row is not None]


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
    sizes = source.split_sizes()
    for split in sizes:
        split_rows = [by_name[t.name] for t in sorted(tasks, key=lambda t: t.index) if t.split == split]
        write_manifest(
            storage.join(dest, manifest_name(split)), split_rows, storage_options, source_samples=sizes[split]
        )
        splits[split] = SplitInfo(num_samples=sum(r.num_samples for r in split_rows), num_shards=len(split_rows))
    info = DatasetInfo(
        name=source.name,
        source=source.spec,
        classes=source.classes,
        num_classes=len(source.classes),
        label_kind=source.label_kind,
        splits=splits,
    )
    empty = sorted(name for name, split in splits.items() if split.num_samples == 0)
    if empty:
        raise ValueError(f"{dest}: no readable image left in the splits {empty}; nothing to train or evaluate on")
    write_dataset_info(dest, info, storage_options)
    remove_records(dest, tasks, storage_options)  # (left by a kill here: hidden, and cleared by --overwrite)
    storage.remove(storage.join(dest, PREPARING_MARKER), storage_options)
    return info


@dataclass(frozen=True)
class Preparation:
    """A preparation under way (:func:`start_preparation`): its plan, and what is left to write."""

    source: Source
    dest: str
    tasks: list[ShardTask]
    plan: str  # the plan's fingerprint (prepare_resume.plan_fingerprint)
    done: dict[str, ShardResult]  # shards an earlier, stopped run of the same plan wrote, by name
    bad_images: BadImages
    storage_options: dict[str, Any] | None

    @property
    def remaining(self) -> list[ShardTask]:
        return [task for task in self.tasks if task.name not in self.done]

    def writer(self) -> Callable[[ShardTask], ShardResult]:
        """Writes one shard and its record; a partial of a module-level function, so that process
        pools can run it too."""
        return functools.partial(
            write_shard_recorded,
            dest=self.dest,
            storage_options=self.storage_options,
            bad_images=self.bad_images,
            plan=self.plan,
        )

    def finish(self, results: Iterable[ShardResult]) -> DatasetInfo:
        """Bad images settled (:func:`settle_bad_images`) over the shards kept and ``results``, the
        shards of :attr:`remaining` written; then the manifests and, last, ``dataset.json``."""
        rows = settle_bad_images([*self.done.values(), *results], self.bad_images, self.dest, self.storage_options)
        return finalize(self.source, self.tasks, rows, self.dest, self.storage_options)


def start_preparation(
    source: Source,
    dest: str,
    *,
    samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    bad_images: BadImages = "refuse",
    storage_options: dict[str, Any] | None = None,
) -> DatasetInfo | Preparation:
    """The dataset at ``dest`` when it is prepared already (and not to be overwritten; said so), else
    the preparation begun: planned, ``dest`` marked, and what a stopped run of the same plan wrote
    kept (:func:`begin_prepare`). Refuses (before any shard) a ``dest`` that is not ours
    (:class:`DestinationNotEmpty`), a source changed since ``dest`` was prepared from it
    (:class:`SourceChanged`), and images known to be bad from the listing (:func:`refuse_known_bad`)."""
    existing = check_destination(dest, overwrite=overwrite, storage_options=storage_options)
    if existing is not None:
        if existing.source == source.spec:
            check_unchanged(existing, source, dest, storage_options)
        print(f"{dest} is already prepared from {existing.source}; nothing to do (use overwrite to redo it)")
        return existing
    refuse_known_bad(source, bad_images)
    tasks = plan_shards(source, samples_per_shard=samples_per_shard, max_shard_bytes=max_shard_bytes)
    plan = plan_fingerprint(source, tasks, bad_images)
    done = begin_prepare(dest, tasks, plan, overwrite=overwrite, storage_options=storage_options)
    return Preparation(source, dest, tasks, plan, done, bad_images, storage_options)


def prepare_dataset(
    source: str | Source,
    dest: str,
    *,
    samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    bad_images: BadImages = "refuse",
    map_fn: MapFn = map,
    progress: Callable[[ManifestRow], None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> DatasetInfo:
    """Prepare ``source`` (a spec like ``imagefolder:PATH`` or a :class:`Source`) into ``dest``.

    ``map_fn`` runs the shard writes (``map`` by default; e.g. ``ProcessPoolExecutor().map``);
    ``progress`` is called with each finished shard's manifest row. Returns the dataset description.
    A ``dest`` that is already prepared is left as it is (and its description returned) unless
    ``overwrite`` is true; a non-empty folder that is not a vitray dataset is refused unless
    ``overwrite`` (:class:`DestinationNotEmpty`). A ``dest`` where a run of the same plan was stopped
    keeps the shards that run finished (:mod:`.prepare_resume`). Zero-byte and undecodable images are refused
    (:class:`BadImagesError`, listing them), left out (``bad_images="skip"``) or stored as they
    are (``"keep"``: the readers skip them).
    """
    started = start_preparation(
        opened(source),
        dest,
        samples_per_shard=samples_per_shard,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        bad_images=bad_images,
        storage_options=storage_options,
    )
    if isinstance(started, DatasetInfo):
        return started
    results = []
    for result in map_fn(started.writer(), started.remaining):
        results.append(result)
        if progress is not None and result.row is not None:
            progress(result.row)
    return started.finish(results)
