"""The epoch plan: which sample each rank reads at each position, as a pure function.

For one epoch, given (seed, epoch, the extents to read -- per shard of the manifest, all of its
samples or a split slice's part of them, see :mod:`vitray.data.splits` -- and a fixed number of
canonical slots):

1. the extents are permuted with ``numpy.random.default_rng([seed, epoch])``;
2. the stream of their samples, in that order, is cut into ``num_slots`` contiguous slots of
   ``floor(total / num_slots)`` samples each. The ``total % num_slots`` samples at the end of the
   stream are **dropped for this epoch**; since the shard order changes every epoch, different
   samples are dropped each time, and none systematically;
3. within a slot, consecutive windows of ``shuffle_buffer`` samples are permuted with
   ``default_rng([seed, epoch, slot, window])``, so the sample at any position of a slot is known
   without reading anything before its window (resuming needs no history). Window boundaries are
   staggered: slot ``s``'s windows start ``window_offset(s)`` positions early (its first window is
   that much shorter), so that the slots a reader holds switch windows at different steps and the
   reading of their next windows spreads over the steps instead of landing on one
   (:func:`window_bounds`; runs saved before staggering keep unstaggered windows);
4. rank ``r`` of ``W`` owns slots ``r, r + W, r + 2W, ...`` (``num_slots`` must be divisible by
   ``W``), and all slots advance in lock-step.

A reader builds only the slots it reads (``epoch_plan(..., slots=...)``): the shard order and the
stream offsets are numpy arrays over all shards (milliseconds and a few MiB at 300k shards), and
only the wanted slots become shard ranges. The whole plan is never materialised per process,
so planning costs the same per process on 8 ranks or 8,192 (``benchmarks/scale.py``).

The training progress is therefore one number per epoch: the samples consumed per slot. It means
the same thing for any number of ranks or loader workers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

AUGMENT_TAG = 0x5EED  # keeps per-sample augmentation seeds apart from the shuffle seeds


@dataclass(frozen=True, slots=True)
class ShardRange:
    """Samples ``[start, stop)`` of shard number ``shard`` (its index in the manifest)."""

    shard: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, eq=False)
class ExtentTable:
    """Extents as three int64 arrays (shard, start, stop), in manifest order: 24 bytes a shard and
    no Python object per shard, so a loader's forked workers share its pages instead of copying
    them as reference counts change (300k ``ShardRange`` objects would take ~40 MiB per process)."""

    shard: np.ndarray
    start: np.ndarray
    stop: np.ndarray

    @classmethod
    def of(cls, extents: Sequence[ShardRange] | Sequence[int] | ExtentTable) -> ExtentTable:
        """From extents, or plain integers (whole shards of those sizes)."""
        if isinstance(extents, ExtentTable):
            return extents
        if all(isinstance(e, ShardRange) for e in extents):
            rows = np.array([(e.shard, e.start, e.stop) for e in extents], dtype=np.int64).reshape(-1, 3)
            return cls(rows[:, 0].copy(), rows[:, 1].copy(), rows[:, 2].copy())
        sizes = np.asarray([int(e) for e in extents], dtype=np.int64)
        return cls(np.arange(len(sizes), dtype=np.int64), np.zeros(len(sizes), dtype=np.int64), sizes)

    def __len__(self) -> int:
        return len(self.shard)

    @property
    def total(self) -> int:
        return int((self.stop - self.start).sum())

    def ranges(self) -> tuple[ShardRange, ...]:
        """The extents as :class:`ShardRange` objects (one Python object each: for small splits)."""
        return tuple(ShardRange(*row) for row in zip(self.shard.tolist(), self.start.tolist(), self.stop.tolist()))


@dataclass(frozen=True)
class EpochPlan:
    seed: int
    epoch: int
    slot_size: int  # samples per slot this epoch
    slots: tuple[tuple[ShardRange, ...] | None, ...]  # None: a slot this plan was not asked for
    dropped: int  # samples left out of this epoch (fewer than num_slots)

    @property
    def num_slots(self) -> int:
        return len(self.slots)


def _check_seed(seed: int, epoch: int) -> None:
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be non-negative integers, got seed={seed}, epoch={epoch}")


def whole_shards(shard_sizes: Sequence[int]) -> tuple[ShardRange, ...]:
    """The extents of an unsliced split: every shard, all of its samples."""
    return tuple(ShardRange(i, 0, int(size)) for i, size in enumerate(shard_sizes))


def epoch_plan(
    seed: int,
    epoch: int,
    extents: Sequence[ShardRange] | Sequence[int] | ExtentTable,
    num_slots: int,
    slots: Iterable[int] | None = None,
) -> EpochPlan:
    """The slots of ``epoch``: each a list of shard ranges, together ``slot_size`` samples long.

    ``extents`` are the samples to plan over, per shard (:class:`ShardRange`, e.g. from
    :func:`vitray.data.splits.split_extents`, or an :class:`ExtentTable`); plain integers are
    whole shards of those sizes. ``slots``: build only these (the others are None in the plan);
    default all. A slot's ranges do not depend on which others are built.
    """
    _check_seed(seed, epoch)
    if num_slots < 1:
        raise ValueError(f"num_slots must be at least 1, got {num_slots}")
    table = ExtentTable.of(extents)
    total = table.total
    slot_size = total // num_slots
    if slot_size == 0:
        raise ValueError(f"the split has {total} samples, fewer than num_slots={num_slots}; use fewer slots")
    wanted = range(num_slots) if slots is None else sorted(set(slots))
    if wanted and not 0 <= wanted[0] <= wanted[-1] < num_slots:
        raise ValueError(f"slots must be in [0, {num_slots}), got {list(wanted)}")
    order = np.random.default_rng([seed, epoch]).permutation(len(table))
    lengths = (table.stop - table.start)[order]
    ends = np.cumsum(lengths)  # stream offset just after each extent, in plan order
    built: list[tuple[ShardRange, ...] | None] = [None] * num_slots
    for slot in wanted:
        at, slot_end = slot * slot_size, (slot + 1) * slot_size
        i = int(np.searchsorted(ends, at, side="right"))  # the extent holding stream offset `at`
        ranges = []
        while at < slot_end:
            end = int(ends[i])
            if end > at:  # (empty extents hold nothing)
                index = int(order[i])
                first = int(table.start[index]) + at - (end - int(lengths[i]))
                take = min(slot_end, end) - at
                ranges.append(ShardRange(int(table.shard[index]), first, first + take))
                at += take
            i += 1
        built[slot] = tuple(ranges)
    return EpochPlan(seed, epoch, slot_size, tuple(built), total - slot_size * num_slots)


def rank_slots(rank: int, world_size: int, num_slots: int) -> list[int]:
    """The slots rank ``rank`` of ``world_size`` owns: ``rank, rank + world_size, ...``."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    if num_slots % world_size:
        divisors = [d for d in range(1, num_slots + 1) if num_slots % d == 0]
        raise ValueError(
            f"num_slots={num_slots} is not divisible by world_size={world_size}; ranks own whole slots, "
            f"so world_size must be one of {divisors} (or choose num_slots as a multiple of the world size)"
        )
    return list(range(rank, num_slots, world_size))


def default_num_slots(world_size: int, micro_batch_size: int, streams_per_rank: int) -> int:
    """The canonical slots of a new run that does not name its own: ``world_size`` ranks, each owning as
    many slots as it reads streams in parallel (``streams_per_rank``, at least one) while dividing its
    micro batch (their gcd): every slot advances in lock-step, giving each batch the same samples."""
    return world_size * math.gcd(micro_batch_size, max(1, streams_per_rank))


def window_offset(slot: int, num_slots: int, shuffle_buffer: int, staggered: bool = True) -> int:
    """How many positions early slot ``slot``'s windows start: slots spread evenly over one window."""
    return slot * shuffle_buffer // num_slots if staggered else 0


def window_of(position: int, offset: int, shuffle_buffer: int) -> int:
    """The window that holds ``position`` of a slot whose windows start ``offset`` early."""
    return (position + offset) // shuffle_buffer


def window_bounds(window: int, offset: int, shuffle_buffer: int, slot_size: int) -> tuple[int, int]:
    """Positions ``[first, last)`` of ``window`` (see :func:`window_offset`)."""
    first = max(0, window * shuffle_buffer - offset)
    return first, max(first, min(slot_size, (window + 1) * shuffle_buffer - offset))


def window_order(seed: int, epoch: int, slot: int, window: int, length: int) -> np.ndarray:
    """Permutation of one shuffle window: position ``first + i`` reads stream offset
    ``first + window_order(...)[i]`` (``first`` from :func:`window_bounds`)."""
    return np.random.default_rng([seed, epoch, slot, window]).permutation(length)


def augment_seed(seed: int, epoch: int, slot: int, position: int) -> int:
    """Seed of the random augmentation of the sample at ``position`` of ``slot`` in ``epoch``."""
    return int(np.random.SeedSequence([seed, epoch, slot, position, AUGMENT_TAG]).generate_state(1)[0])
