"""The evaluation reader: one pass over a split, every sample exactly once across ranks.

The split -- or a slice of it, ``test[:1000]`` (see :mod:`vitray.data.splits`) -- is read in its
stored order (shards in manifest order). Rank ``r`` of ``W`` reads the contiguous samples
``[r * N // W, (r + 1) * N // W)`` of its ``N``, so ranks differ by at most one sample and
nothing is dropped; batches are consecutive runs of ``batch_size`` samples of that range (the last
one may be shorter). Worker ``w`` of ``n`` decodes batches ``w, w + n, ...``; batches come out in
order. Given ``indices``, only those positions of the split are read and decoded (the others are
passed over without reading their bytes), e.g. the few-shot examples drawn from a train split
whose labels :func:`read_labels` read. Images get the evaluation transform (resize + central
crop, see :mod:`vitray.data.transforms`).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import multiprocessing.forkserver
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vitray import storage

from .batch import Batch, Chunk, SkipReporter, concat_chunks, decode_chunk, in_order
from .layout import LabelKind, ResolvedSplit, read_split
from .plan import ShardRange
from .processes import main_script_hidden, workers_generator
from .reader import RawSample, SampleStream
from .transforms import EVAL_RESIZE_RATIO, CorruptSample, EvalResize, decode_label, eval_transform

# Evaluation workers start from a forkserver, not as forks of this process: evaluations run inside
# training processes, whose other threads (the device feed's, Ray's, the metrics uploader's) may
# hold a lock (the allocator's, say) at the moment of a fork, and the child then waits for it for
# ever (seen once in the suite: a rank's evaluation worker stuck in `os.fork`, the other rank
# waiting in its all_reduce). The forkserver is a single-threaded process started once per process,
# with this module imported (preloaded), so each evaluation's workers start in milliseconds. As
# with any workers started this way (Python 3.14's default on Linux), a script that evaluates must
# guard its top level with `if __name__ == "__main__":`.
WORKER_START = "forkserver"
# A batch that takes longer than this fails the evaluation (and the attempt, which Ray Train
# restarts under cluster.max_failures) instead of hanging it: a worker that stopped answering.
BATCH_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class _EvalSpec:
    shard_urls: tuple[str, ...]
    ranges: tuple[ShardRange, ...]  # the split or its slice, in stored order
    first: int  # this rank's samples: [first, stop)
    stop: int
    positions: tuple[int, ...] | None  # or only these positions, ascending (``indices``)
    batch_size: int
    img_size: int
    resize: EvalResize
    resize_ratio: float
    label_kind: LabelKind
    num_classes: int
    storage_options: dict[str, Any] | None
    outage_s: float | None  # EvalLoader's


class _EvalStream(IterableDataset):
    """Yields ``(batch_number, {0: Chunk})`` for this worker's batches."""

    def __init__(self, spec: _EvalSpec) -> None:
        self.spec = spec

    def __iter__(self) -> Iterator[tuple[int, dict[int, Chunk]]]:
        spec = self.spec
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        positions = range(spec.first, spec.stop) if spec.positions is None else spec.positions
        num_batches = -(-len(positions) // spec.batch_size)
        mine = range(worker, num_batches, workers)
        if not mine:
            return
        transform, reporter = eval_transform(spec.img_size, spec.resize, spec.resize_ratio), SkipReporter()
        at = positions[mine[0] * spec.batch_size]
        stream = SampleStream(spec.shard_urls, spec.ranges, spec.storage_options, start=at, outage_s=spec.outage_s)
        try:
            for b in mine:
                raws = []
                for position in positions[b * spec.batch_size : (b + 1) * spec.batch_size]:
                    stream.skip(position - at)  # within a shard: passes over headers, reads no data
                    raws.append(stream.read(want=True))
                    at = position + 1
                chunk = decode_chunk(
                    raws,
                    [None] * len(raws),
                    transform=transform,
                    img_size=spec.img_size,
                    label_kind=spec.label_kind,
                    num_classes=spec.num_classes,
                    reporter=reporter,
                    where=f"evaluation batch {b}",
                )
                yield b, {0: chunk}
        finally:
            stream.close()


class EvalLoader:
    """One deterministic pass over ``split`` for rank ``rank`` of ``world_size``.

    ``split`` is a name or a slice of one (``"train[98%:]"``, see :mod:`vitray.data.splits`).
    Iterating it again starts a new pass. ``len(loader)`` is this rank's number of batches.
    ``float_images=False`` gives uint8 images, as for :class:`vitray.data.ShardLoader`.
    ``resize``: how images reach ``img_size`` (:data:`vitray.data.transforms.EvalResize`;
    ``"square"`` is the authors' few-shot pre-processing), from ``round(img_size x resize_ratio)``.
    ``indices``: read only these positions of the split (or slice), in ascending order; ranks
    share them out as they share the whole split.
    ``outage_s``: a training run's evaluation (its ``run.storage_outage_s``): listing the split and
    opening its shards wait this long for a store that stopped answering, instead of failing after
    the bounded retries (`vitray.storage.ride_out`).
    """

    def __init__(
        self,
        path: str,
        split: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        batch_size: int,
        img_size: int,
        resize: EvalResize = "aspect",
        resize_ratio: float = EVAL_RESIZE_RATIO,
        num_workers: int = 1,
        storage_options: dict[str, Any] | None = None,
        float_images: bool = True,
        indices: Sequence[int] | None = None,
        outage_s: float | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        if batch_size < 1 or img_size < 1 or num_workers < 0:
            raise ValueError(
                f"batch_size and img_size must be positive and num_workers non-negative; got {batch_size}, "
                f"{img_size}, {num_workers}"
            )
        eval_transform(img_size, resize, resize_ratio)  # a bad resize fails here, not in a worker
        source = _listed(path, split, storage_options, outage_s)
        self.info, total = source.info, source.num_samples
        self.num_workers, self.float_images = num_workers, float_images
        self._yielded, self._skipped = 0, 0
        positions = None
        if indices is not None:
            positions = _checked_indices(indices, total, split)
            total = len(positions)
        first, stop = rank * total // world_size, (rank + 1) * total // world_size
        self._spec = _EvalSpec(
            shard_urls=source.shard_urls,
            ranges=source.extents,
            first=first,
            stop=stop,
            positions=None if positions is None else positions[first:stop],
            batch_size=batch_size,
            img_size=img_size,
            resize=resize,
            resize_ratio=resize_ratio,
            label_kind=self.info.label_kind,
            num_classes=self.info.num_classes,
            storage_options=storage_options,
            outage_s=outage_s,
        )

    @property
    def num_samples(self) -> int:
        """Samples this rank reads (corrupt ones included)."""
        return self._spec.stop - self._spec.first

    def __len__(self) -> int:
        return -(-self.num_samples // self._spec.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        workers = self.num_workers
        loader = DataLoader(
            _EvalStream(self._spec),
            batch_size=None,
            generator=workers_generator(),  # not torch's global one: see there
            num_workers=workers,
            prefetch_factor=2 if workers else None,
            multiprocessing_context=_worker_context() if workers else None,
            timeout=BATCH_TIMEOUT_S if workers else 0,
        )
        # A worker would run the caller's script again, every pass (1.3 s a pass instead of 0.36 for a
        # script importing webdataset and torchvision; Ray's worker script in a run)
        with main_script_hidden() if workers else contextlib.nullcontext():
            items = iter(loader)  # (the workers start here)
        for number, chunks in in_order(items, parts_per_item=1):
            batch = concat_chunks(chunks, epoch=0, step=number, float_images=self.float_images)
            self._yielded += len(batch)
            self._skipped += batch.num_skipped
            yield batch

    @property
    def stats(self) -> dict[str, int]:
        """Counts since this loader was created: samples yielded and corrupt samples skipped."""
        return {"samples": self._yielded, "skipped": self._skipped}


# Evaluation workers pay off only on a share of some size: their forkserver imports torch (about
# 3 CPU-seconds a rank) and each worker is a process of its own, which is what decoding a few
# hundred images costs. A smaller share is decoded in the evaluating process.
MIN_SAMPLES_PER_WORKER = 512


def worker_count(num_samples: int, num_workers: int) -> int:
    """Evaluation workers worth starting for ``num_samples`` (a rank's share), at most
    ``num_workers``: one for every :data:`MIN_SAMPLES_PER_WORKER` samples, none below that."""
    return min(num_workers, num_samples // MIN_SAMPLES_PER_WORKER)


def start_worker_server() -> None:
    """Starts the evaluation workers' forkserver now: it imports its modules (a few seconds) while
    the caller goes on (building its model, say) instead of at the first evaluation."""
    _worker_context()
    multiprocessing.forkserver.ensure_running()


def _worker_context():
    context = multiprocessing.get_context(WORKER_START)
    # Effective until the forkserver first starts. (The evaluation transforms are PIL's alone: no
    # torchvision to preload. The main module is not preloaded: see `vitray.data.processes`.)
    context.set_forkserver_preload([__name__])
    return context


def top1_hits(predicted: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(correct, scored) for class predictions against a batch's labels.

    Single-label rows count one each. Multi-label rows (ImageNet-ReaL style, multi-hot) count a
    prediction as correct when it is one of the image's labels, and rows without any label are
    left out, as ReaL is scored.
    """
    predicted = predicted.cpu()
    if labels.ndim == 2:
        labelled = labels.sum(1) > 0
        return int(labels[labelled].gather(1, predicted[labelled, None]).sum()), int(labelled.sum())
    return int((predicted == labels).sum()), len(labels)


def _checked_indices(indices: Sequence[int], total: int, split: str) -> tuple[int, ...]:
    positions = tuple(int(i) for i in indices)
    if any(b <= a for a, b in itertools.pairwise(positions)):
        raise ValueError("indices must be strictly increasing positions of the split (sorted, no repeats)")
    if positions and not 0 <= positions[0] <= positions[-1] < total:
        raise ValueError(f"indices must lie in [0, {total}) for split {split!r}, got {positions[0]}..{positions[-1]}")
    return positions


def load_split(
    path: str,
    split: str,
    *,
    img_size: int,
    batch_size: int = 256,
    num_workers: int = 0,
    storage_options: dict[str, Any] | None = None,
) -> Batch:
    """A whole (small) split or slice decoded into memory with the evaluation transform, in stored order.

    Meant for few-shot probes and small benchmarks; corrupt samples are left out and counted in
    ``num_skipped``.
    """
    loader = EvalLoader(
        path,
        split,
        batch_size=batch_size,
        img_size=img_size,
        num_workers=num_workers,
        storage_options=storage_options,
        float_images=False,
    )
    batches = list(loader)
    if not batches:
        multi = loader.info.label_kind == "multi"
        labels = torch.zeros((0, loader.info.num_classes)) if multi else torch.zeros(0, dtype=torch.int64)
        return Batch(torch.zeros((0, 3, img_size, img_size)), labels, [], 0)
    return concat_chunks([Chunk(b.images, b.labels, b.keys, b.num_skipped) for b in batches], epoch=0, step=0)


def read_labels(
    path: str,
    split: str,
    *,
    storage_options: dict[str, Any] | None = None,
    threads: int = 8,
    outage_s: float | None = None,
) -> tuple[list[str], np.ndarray]:
    """Keys and class ids of every sample of a single-label split (or slice), in stored order.

    No image is decoded: the samples' bytes are read (shards in parallel threads, for remote
    storage) and only the ``.cls`` member is parsed. A sample whose label cannot be read (damaged
    data) gets class id -1 and, when its key is unreadable too, the key ``""``. ``outage_s`` as
    :class:`EvalLoader` takes it.
    """
    source = _listed(path, split, storage_options, outage_s)
    info = source.info
    if info.label_kind != "single":
        raise ValueError(f"read_labels reads single-label splits; {path} holds {info.label_kind}-label data")

    def one_extent(extent: ShardRange) -> list[tuple[str, int]]:
        stream = SampleStream(source.shard_urls, [extent], storage_options, outage_s=outage_s)
        try:
            return [_key_and_label(stream.read(want=True), info.num_classes) for _ in range(len(extent))]
        finally:
            stream.close()

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(source.extents)))) as pool:
        pairs = [pair for part in pool.map(one_extent, source.extents) for pair in part]
    return [k for k, _ in pairs], np.array([label for _, label in pairs], dtype=np.int64)


def _listed(path: str, split: str, storage_options: dict[str, Any] | None, outage_s: float | None) -> ResolvedSplit:
    """The split's shards and extents from the dataset's manifest; with ``outage_s``, read the way
    a run's storage calls are: riding out an outage of the store."""
    if outage_s is None:
        return read_split(path, split, storage_options)
    return storage.ride_out(
        lambda: read_split(path, split, storage_options), what=f"listing {path} ({split})", within_s=outage_s
    )


def _key_and_label(raw: Any, num_classes: int) -> tuple[str, int]:
    if not isinstance(raw, RawSample):
        return "", -1
    try:
        return raw.key, int(decode_label(raw.fields, "single", num_classes))
    except CorruptSample:
        return raw.key, -1
