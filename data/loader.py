"""The training reader: endless, exactly resumable, the same number of batches on every rank.

Each rank owns whole slots of the epoch plan (see :mod:`vitray.data.plan`); every batch takes
``batch_size / slots_per_rank`` consecutive positions from each of the rank's slots. Reading and
decoding happen in ``torch.utils.data.DataLoader`` worker processes; the work is split so that
worker ``w`` of ``N`` decodes

- a contiguous block of the rank's slots when ``N <= slots_per_rank``, every batch;
- otherwise one slot, for every ``g``-th batch (``g = N // slots_per_rank``; workers beyond
  ``g * slots_per_rank`` stay idle). Each of the ``g`` workers of a slot then reads the slot's
  bytes but decodes only its batches, so choose ``num_slots >= world_size * num_workers`` when
  reading from remote storage.

The main process puts each batch together in slot order from the workers' chunks, so the batches
do not depend on ``N``. Workers decode into shared-memory rings the main process made for them
(:class:`~vitray.data.shared_memory.ChunkRing`), so a chunk crosses between processes as a slot number
and is copied once, into the batch. Progress is counted on that consumer side, as ``(epoch,
positions consumed per slot)``: :meth:`ShardLoader.state_dict` never includes what workers
prefetched but did not hand over, and :meth:`ShardLoader.load_state_dict` continues the exact
sample sequence with any world size (keep the global batch ``batch_size * world_size`` to keep
the same batches) and any number of workers.

Positions at the end of a slot that do not fill a whole batch are not used in that epoch
(fewer than ``batch_size / slots_per_rank`` per slot).
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vitray.storage import ShardCache

from .batch import Batch, Chunk, SkipReporter, concat_chunks, decode_chunk, in_order
from .config import RESIZE_RATIO, TRAIN_CROPS, TrainCropKind
from .layout import LabelKind, read_split
from .plan import ExtentTable, augment_seed, epoch_plan, rank_slots, window_offset
from .processes import workers_generator
from .shared_memory import BatchMemory, ChunkRing
from .slots import READ_AHEAD, SlotReader
from .transforms import TRAIN_CROP_SCALE, eval_resize, train_augment

log = logging.getLogger(__name__)

STATE_VERSION = 2  # 2: staggered shuffle windows (a version-1 state resumes with unstaggered ones)
DEFAULT_SHARD_CACHE_GB = 100.0


def _cache_gb(given: float | None) -> float:
    """The shard cache's bound: the given one (0 included, refused as not positive), else
    VITRAY_SHARD_CACHE_GB, else 100 GiB."""
    if given is not None:
        return float(given)
    return float(os.environ.get("VITRAY_SHARD_CACHE_GB") or DEFAULT_SHARD_CACHE_GB)


PREFETCH = 2  # chunks each worker prepares ahead (DataLoader's prefetch_factor)


@dataclass(frozen=True)
class _Spec:
    """Everything a worker needs; plain data, so it pickles into worker processes."""

    shard_urls: Sequence[str]  # layout.ShardUrls: one Arrow array, not a string per shard
    extents: ExtentTable  # the split (or its slice) per shard, in manifest order
    slots: tuple[int, ...]  # the rank's slots, in batch order
    per_slot: int  # positions taken from each slot per batch
    micro_batches: int  # batches a training step takes (gradient accumulation): an epoch ends between steps
    num_slots: int
    seed: int
    shuffle_buffer: int
    img_size: int
    train: bool
    crop: TrainCropKind
    min_crop_area: float
    resize_ratio: float
    flip: bool
    label_kind: LabelKind
    num_classes: int
    num_workers: int
    storage_options: dict[str, Any] | None
    staggered: bool = True  # shuffle windows staggered across slots (see plan.window_offset)
    shard_cache: str | None = None  # local folder for whole remote shards (storage.ShardCache)
    shard_cache_bytes: int = 0
    device_decode: bool = False  # JPEGs handed over encoded, with their crop boxes (device_decode.py)
    outage_s: float | None = None  # how long opening a shard rides out an outage of its store


# Objects counted frozen before this module was imported: the interpreter's own (Python 3.12 starts
# with a few hundred of its tuples counted there; 3.11 and 3.13 with none). More than these, and the
# application froze objects itself.
FROZEN_BEFORE_VITRAY = gc.get_freeze_count()


def _epoch_end(slot_size: int, spec: _Spec) -> int:
    """The position in every slot at which an epoch ends: after the last whole training *step*
    that fits (`micro_batches` batches of `per_slot` positions), not the last batch. A step takes
    batch_size / num_slots positions of each slot however its batch is split into ranks and
    micro-batches, so the epoch ends, and the next begins, at the same step whatever the split: a
    run with gradient accumulation, or resumed on fewer workers that accumulate more, trains on the
    samples the same global batch took without it (ending per batch, a step straddled the epoch
    end and every later one took other samples)."""
    per_step = spec.per_slot * spec.micro_batches
    return slot_size // per_step * per_step


def _start_workers(loader: DataLoader) -> Iterable[Any]:
    """``iter(loader)``, its worker processes forked while the garbage collector's objects are frozen.

    A forked worker otherwise inherits every object of the training process as its own to collect:
    its first full collections walk them all (and copy the memory pages they touch), several
    hundred milliseconds of CPU per worker. Frozen, they stay out of the workers' collections; the
    main process unfreezes them at once (unless the application froze them itself).
    """
    if loader.num_workers == 0 or gc.get_freeze_count() > FROZEN_BEFORE_VITRAY:
        return iter(loader)
    gc.freeze()
    try:
        return iter(loader)  # starts (forks) the workers
    finally:
        gc.unfreeze()


def _share(worker: int, workers: int, m: int) -> tuple[list[int], int, int]:
    """(local slots worker ``worker`` of ``workers`` decodes, batch stride, batch phase) for ``m`` slots."""
    if workers <= m:  # a contiguous block of slots, so that blocks concatenate in slot order
        return list(range(worker * m // workers, (worker + 1) * m // workers)), 1, 0
    stride = workers // m
    if worker >= stride * m:
        return [], stride, 0
    return [worker % m], stride, worker // m


class _TrainStream(IterableDataset):
    """Yields ``(batch_number, {first_local_slot: Chunk})`` for this worker's share, forever.

    With ``rings`` (one per worker, made by the main process), chunks are decoded into the
    worker's ring and carry its slot number instead of their images."""

    def __init__(self, spec: _Spec, epoch: int, position: int, rings: list[ChunkRing | None] | None = None) -> None:
        self.spec, self.epoch, self.position, self.rings = spec, epoch, position, rings

    def __iter__(self) -> Iterator[tuple[int, dict[int, Chunk]]]:
        spec = self.spec
        info = get_worker_info()
        worker = info.id if info else 0
        local_slots, stride, phase = _share(worker, info.num_workers if info else 1, len(spec.slots))
        ring = self.rings[worker] if self.rings else None
        if not local_slots:
            return
        transform = (  # PIL in, PIL out: decode_chunk copies the result straight into the chunk
            train_augment(
                spec.img_size,
                crop=spec.crop,
                min_crop_area=spec.min_crop_area,
                resize_ratio=spec.resize_ratio,
                flip=spec.flip,
            )
            if spec.train
            else eval_resize(spec.img_size)
        )
        reporter = SkipReporter()
        epoch, position, batch_number = self.epoch, self.position, 0
        # One thread reads the next shuffle windows of this worker's slots while it decodes.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitray-windows") as background:
            yield from self._chunks(
                spec,
                epoch,
                position,
                batch_number,
                local_slots,
                stride,
                phase,
                background,
                transform,
                reporter,
                ring,
                worker,
            )

    def _chunks(
        self,
        spec: _Spec,
        epoch: int,
        position: int,
        batch_number: int,
        local_slots: list[int],
        stride: int,
        phase: int,
        background: ThreadPoolExecutor,
        transform: Any,
        reporter: SkipReporter,
        ring: ChunkRing | None,
        worker: int,
    ) -> Iterator[tuple[int, dict[int, Chunk]]]:
        readers, batches = self._open_epoch(spec, epoch, position, batch_number, local_slots, stride, phase, background)
        # The next epoch's readers start reading their first windows as the last READ_AHEAD of a
        # window before this epoch ends, so that the epoch boundary does not stall either.
        lead = -(-max(1, int(spec.shuffle_buffer * READ_AHEAD)) // spec.per_slot)
        upcoming: tuple[list[SlotReader], int] | None = None
        try:
            while True:
                for b in range(batches):
                    if b >= batches - lead and upcoming is None:
                        upcoming = self._open_epoch(
                            spec, epoch + 1, 0, batch_number + batches, local_slots, stride, phase, background
                        )
                    if (batch_number + b) % stride == phase:
                        positions = range(position + b * spec.per_slot, position + (b + 1) * spec.per_slot)
                        chunk = self._decode(readers, epoch, positions, transform, reporter, ring, worker)
                        yield batch_number + b, {local_slots[0]: chunk}
                for reader in readers:
                    reader.close()
                if upcoming is None:  # an epoch of no batches from here
                    upcoming = self._open_epoch(
                        spec, epoch + 1, 0, batch_number + batches, local_slots, stride, phase, background
                    )
                (readers, next_batches), upcoming = upcoming, None
                batch_number += batches
                epoch, position, batches = epoch + 1, 0, next_batches
        finally:
            for reader in readers + (upcoming[0] if upcoming else []):
                reader.close()

    @staticmethod
    def _open_epoch(
        spec: _Spec,
        epoch: int,
        start: int,
        first_batch: int,
        local_slots: list[int],
        stride: int,
        phase: int,
        background: ThreadPoolExecutor,
    ) -> tuple[list[SlotReader], int]:
        """Readers of this worker's slots of ``epoch`` from position ``start`` on, their first windows
        already being read in the background; and the number of batches left in the epoch."""
        plan = epoch_plan(spec.seed, epoch, spec.extents, spec.num_slots, slots=[spec.slots[i] for i in local_slots])
        batches = max(0, _epoch_end(plan.slot_size, spec) - start) // spec.per_slot
        cache = ShardCache(spec.shard_cache, spec.shard_cache_bytes) if spec.shard_cache else None

        def wanted(p: int) -> bool:
            return (first_batch + (p - start) // spec.per_slot) % stride == phase

        readers = [
            SlotReader(
                spec.shard_urls,
                plan,
                spec.slots[i],
                shuffle_buffer=spec.shuffle_buffer,
                start=start,
                stop=start + batches * spec.per_slot,
                wanted=wanted,
                storage_options=spec.storage_options,
                window_offset=window_offset(spec.slots[i], spec.num_slots, spec.shuffle_buffer, spec.staggered),
                executor=background,
                cache=cache,
                outage_s=spec.outage_s,
            )
            for i in local_slots
        ]
        for reader in readers:
            reader.read_ahead()
        return readers, batches

    def _decode(
        self,
        readers: list[SlotReader],
        epoch: int,
        positions: range,
        transform: Any,
        reporter: SkipReporter,
        ring: ChunkRing | None,
        worker: int,
    ) -> Chunk:
        """The samples at ``positions`` of each of the readers' slots, slot after slot."""
        spec = self.spec
        raws = [reader.take(p) for reader in readers for p in positions]
        seeds = [augment_seed(spec.seed, epoch, r.slot, p) if spec.train else None for r in readers for p in positions]
        slot = ring.take() if ring is not None else None
        chunk = decode_chunk(
            raws,
            seeds,
            transform=transform,
            img_size=spec.img_size,
            label_kind=spec.label_kind,
            num_classes=spec.num_classes,
            reporter=reporter,
            where=f"epoch {epoch}",
            out=ring.buffers[slot] if ring is not None else None,
            device_decode=spec.device_decode,
        )
        if ring is None:
            return chunk
        return replace(chunk, images=torch.empty(0, dtype=torch.uint8), ring=(worker, slot))


class ShardLoader:
    """Endless, resumable training batches from a prepared dataset split, for one rank.

    Args:
        path: the prepared dataset (local folder or ``s3://...``).
        split: the split to read (e.g. ``"train"``), or a slice of it (``"train[:98%]"``, see
            :mod:`vitray.data.splits`).
        rank, world_size: this rank among the data-parallel ranks; ``num_slots % world_size == 0``.
        batch_size: samples per batch on this rank; a multiple of ``num_slots // world_size``.
        micro_batches: the batches one training step takes (its gradient accumulation): an epoch
            ends after the last whole step, so the samples of each step are those of the same
            global batch split any other way.
        img_size: output resolution.
        train: random crop + flip (True) or resize + central crop (False).
        crop, min_crop_area, resize_ratio, flip: the training crop and flip
            (:class:`vitray.data.transforms.TrainCrop`; the inception crop by default).
        seed: the data seed (shard order, shuffle windows, augmentation).
        num_slots: canonical slots; fixed for a run (it bounds the world sizes usable on resume).
        num_workers: DataLoader worker processes reading and decoding (0: in this process).
        shuffle_buffer: samples per shuffle window within a slot.
        storage_options: fsspec options for remote paths.
        outage_s: where set, (re)opening a shard waits up to this long for a store that stopped
            answering (a run's ``run.storage_outage_s``), instead of failing after a few retries.
        shard_cache: a local folder (one per node, shared by its processes) into which whole remote
            shards are fetched with parallel range reads before they are read; default: the
            ``VITRAY_SHARD_CACHE`` environment variable, else none (shards are streamed).
        shard_cache_gb: the cache's size bound in GiB (least recently used shards are evicted);
            default: ``VITRAY_SHARD_CACHE_GB``, else 100.
        float_images: float32 images in [-1, 1]; False gives uint8 images in [0, 255], a quarter
            of the bytes to copy, for converting later with :func:`vitray.data.to_model_range`
            (e.g. on the accelerator, which spares the training process the conversion).
        device_decode: training JPEGs are handed over undecoded, with the crop box and flip the
            CPU path draws for them (the same samples, keys and positions): batches carry them in
            ``encoded`` for :func:`vitray.data.device_decode.decode_batch` (the device feed runs it
            on the accelerator); needs ``train`` and ``float_images=False``.
    """

    def __init__(
        self,
        path: str,
        split: str,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        img_size: int,
        train: bool,
        seed: int,
        micro_batches: int = 1,
        num_slots: int = 8,
        num_workers: int = 1,
        shuffle_buffer: int = 512,
        storage_options: dict[str, Any] | None = None,
        float_images: bool = True,
        crop: TrainCropKind = "inception_crop",
        min_crop_area: float = TRAIN_CROP_SCALE[0],
        resize_ratio: float = RESIZE_RATIO,
        flip: bool = True,
        shard_cache: str | None = None,
        shard_cache_gb: float | None = None,
        device_decode: bool = False,
        outage_s: float | None = None,
    ) -> None:
        slots = rank_slots(rank, world_size, num_slots)
        if device_decode and (float_images or not train):
            raise ValueError(
                "device_decode hands training JPEGs to the accelerator undecoded: it needs train=True and "
                f"float_images=False (got train={train}, float_images={float_images})"
            )
        if not 0 < min_crop_area <= 1:
            raise ValueError(f"min_crop_area must be in (0, 1], got {min_crop_area}")
        if crop not in TRAIN_CROPS or resize_ratio < 1:
            raise ValueError(
                f"crop must be one of {', '.join(TRAIN_CROPS)} and resize_ratio at least 1; got {crop!r} and {resize_ratio}"
            )
        if batch_size < 1 or batch_size % len(slots):
            raise ValueError(
                f"batch_size={batch_size} must be a positive multiple of the rank's {len(slots)} slots "
                f"(num_slots={num_slots} / world_size={world_size}): every batch takes the same number of "
                "samples from each slot"
            )
        for name, value in (
            ("img_size", img_size),
            ("shuffle_buffer", shuffle_buffer),
            ("micro_batches", micro_batches),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if num_workers < 0 or seed < 0:
            raise ValueError(f"num_workers and seed must be non-negative, got {num_workers} and {seed}")
        source = read_split(path, split, storage_options)
        self.info, self.num_samples = source.info, source.num_samples
        self.path, self.split, self.rank, self.world_size = path, split, rank, world_size
        self.batch_size, self.float_images = batch_size, float_images
        self._spec = _Spec(
            shard_urls=source.shard_urls,
            extents=source.extent_table,
            slots=tuple(slots),
            per_slot=batch_size // len(slots),
            micro_batches=micro_batches,
            num_slots=num_slots,
            seed=seed,
            shuffle_buffer=shuffle_buffer,
            img_size=img_size,
            train=train,
            crop=crop,
            min_crop_area=min_crop_area,
            resize_ratio=resize_ratio,
            flip=flip,
            label_kind=self.info.label_kind,
            num_classes=self.info.num_classes,
            num_workers=num_workers,
            storage_options=storage_options,
            shard_cache=shard_cache or os.environ.get("VITRAY_SHARD_CACHE") or None,
            shard_cache_bytes=int(_cache_gb(shard_cache_gb) * 2**30),
            device_decode=device_decode,
            outage_s=outage_s,
        )
        if self._spec.shard_cache and self._spec.shard_cache_bytes < 1:
            raise ValueError(f"shard_cache_gb must be positive, got {shard_cache_gb}")
        if num_workers > len(slots):
            log.warning(
                "num_workers=%d exceeds this rank's %d slot(s) (num_slots=%d / world_size=%d): several workers "
                "read the same slot and each decodes a share of it; num_slots=%d would give every worker its own",
                num_workers,
                len(slots),
                num_slots,
                world_size,
                world_size * num_workers,
            )
        self.slot_size = epoch_plan(seed, 0, self._spec.extents, num_slots, slots=()).slot_size
        self._end = _epoch_end(self.slot_size, self._spec)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"split {split!r} has {self.num_samples} samples: too few for {num_slots} slots of "
                f"{self._spec.per_slot * micro_batches} samples per step; use a smaller batch_size or num_slots"
            )
        self._epoch, self._position = 0, 0
        self._yielded, self._skipped = 0, 0
        self._generation = 0  # identifies the live iterator

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch (the same on every rank; `micro_batches` of them a training step)."""
        return self._end // self._spec.per_slot

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def stats(self) -> dict[str, int]:
        """Counts since this loader was created: samples yielded and corrupt samples skipped."""
        return {"samples": self._yielded, "skipped": self._skipped}

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed to the caller."""
        spec = self._spec
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "consumed_per_slot": self._position,
            "seed": spec.seed,
            "num_slots": spec.num_slots,
            "shuffle_buffer": spec.shuffle_buffer,
            "staggered_windows": spec.staggered,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter(loader)`` (a running iterator stops).

        The seed, slot count, shuffle buffer and dataset must be those of the saved run: they define
        which sample sits at which position. World size, batch size and workers may differ.
        """
        spec = self._spec
        if int(state.get("version", 1)) > STATE_VERSION:
            raise ValueError(
                f"cannot resume the data stream: its state is of version {state['version']}, written by a newer "
                f"vitray than this one (which reads up to {STATE_VERSION}); resume with that version"
            )
        mine = {
            "seed": spec.seed,
            "num_slots": spec.num_slots,
            "shuffle_buffer": spec.shuffle_buffer,
            "num_samples": self.num_samples,
        }
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(
                    f"cannot resume the data stream: saved {key}={state.get(key)!r} but this loader has "
                    f"{key}={value!r}; seed, num_slots, shuffle_buffer and the dataset must stay the same"
                )
        epoch, position = int(state["epoch"]), int(state["consumed_per_slot"])
        if epoch < 0 or not 0 <= position <= self.slot_size:
            raise ValueError(f"bad loader state: epoch={epoch}, consumed_per_slot={position}")
        self._epoch, self._position = epoch, position
        # States saved before windows were staggered (version 1) continue with their own windows.
        self._spec = replace(spec, staggered=bool(state.get("staggered_windows", False)))
        self._generation += 1

    def __iter__(self) -> Iterator[Batch]:
        """Batches from the current state on, forever. One iterator at a time: starting a new one
        (or loading a state) ends the previous one."""
        self._generation += 1
        return self._batches(self._generation)

    def _batches(self, generation: int) -> Iterator[Batch]:
        if self._position + self._spec.per_slot > self._end:  # the epoch has no whole batch left
            self._epoch, self._position = self._epoch + 1, 0
        spec, workers = self._spec, self._spec.num_workers
        rings = self._rings() if workers else None
        loader = DataLoader(
            _TrainStream(spec, self._epoch, self._position, rings),
            batch_size=None,
            num_workers=workers,
            prefetch_factor=PREFETCH if workers else None,
            persistent_workers=False,
            generator=workers_generator(),  # not torch's global one: see there
        )
        # Every batch comes in one part per working worker (each a block of slots), or one per slot.
        parts = min(max(workers, 1), len(spec.slots))
        memory = BatchMemory()  # the memory of batches the caller has dropped, for the next ones
        try:
            for _, chunks in in_order(_start_workers(loader), parts_per_item=parts):
                if generation != self._generation:
                    return  # superseded by a newer iterator or a loaded state; its workers stop with it
                in_rings = [c.ring for c in chunks if c.ring is not None]
                if rings is not None:
                    chunks = [replace(c, images=rings[c.ring[0]].images(c.ring[1], c.num_images)) for c in chunks]
                step = self._position // spec.per_slot
                batch = concat_chunks(
                    chunks,
                    epoch=self._epoch,
                    step=step,
                    float_images=self.float_images,
                    memory=memory,
                    copy=rings is not None,
                )
                for worker, _ in in_rings:
                    rings[worker].release()
                self._position += spec.per_slot
                if self._position + spec.per_slot > self._end:
                    self._epoch, self._position = self._epoch + 1, 0
                self._yielded += len(batch)
                self._skipped += batch.num_skipped
                yield batch
        finally:
            for ring in rings or []:
                if ring is not None:
                    ring.release(len(ring.buffers))  # a worker waiting for a slot can run on to its end

    def _rings(self) -> list[ChunkRing | None]:
        """A ChunkRing per worker (None for idle workers) of PREFETCH + 2 slots: the chunks a worker
        may have sent or be decoding, one waiting here for the other parts of its batch, one spare."""
        spec, workers = self._spec, self._spec.num_workers
        rings: list[ChunkRing | None] = []
        for worker in range(workers):
            local_slots = _share(worker, workers, len(spec.slots))[0]
            capacity = len(local_slots) * spec.per_slot
            # Training crops come out of their resize channels-last (see decode_chunk)
            ring = ChunkRing(PREFETCH + 2, capacity, spec.img_size, channels_last=spec.train) if capacity else None
            rings.append(ring)
        return rings
