"""Split strings with slices, TFDS / big_vision style: ``train``, ``train[:800]``, ``train[98%:]``.

A split string names a prepared split, optionally followed by ``[start:stop]``:

- ``train``: the whole split;
- ``train[:800]``, ``train[800:1000]``, ``train[-200:]``: sample indices, as in a Python slice
  (negative values count from the end, either end may be left out);
- ``train[:98%]``, ``train[98%:]``, ``train[-2%:]``: percentages of the split (decimals allowed,
  ``train[:97.5%]``), rounded to the nearest sample index, ties to even, as TFDS rounds them.

Indices count samples in the split's natural order: shards in manifest order, samples in stored
order inside each shard. So ``train[:800]`` and ``train[800:1000]`` are disjoint and together are
``train[:1000]``; ``train[:98%]`` and ``train[98%:]`` split ``train`` in two. Unlike a Python
slice, a bound outside the split or a slice that selects nothing is an error, not an empty set.

A resolved slice is a tuple of per-shard extents (:class:`vitray.data.plan.ShardRange`: shard
index in the manifest, first and past-the-last sample in it), which is what the epoch plan and the
readers work on. The whole split resolves to every shard whole, so ``train`` and ``train[:]``
read exactly the same samples in the same order.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .plan import ExtentTable, ShardRange, whole_shards

SPLIT_SYNTAX = (
    "NAME (letters, digits, _) or NAME[start:stop] with sample indices (train[:800], train[800:1000], "
    "train[-200:]; negative counts from the end, either end optional) or percentages (train[:98%], train[98%:])"
)

_SPLIT = re.compile(r"^(?P<name>[A-Za-z0-9_]+)(?:\[(?P<start>[^\[\]:]*):(?P<stop>[^\[\]:]*)\])?$")
_BOUND = re.compile(r"^(?P<number>[+-]?\d+(?:\.\d+)?)(?P<percent>%?)$")


@dataclass(frozen=True)
class Bound:
    """One end of a slice: a sample index, or a percentage of the split (exact, as a Fraction)."""

    value: int | Fraction
    percent: bool

    def __str__(self) -> str:
        if not self.percent:
            return str(self.value)
        number = self.value.numerator if self.value.denominator == 1 else float(self.value)
        return f"{number}%"


@dataclass(frozen=True)
class SplitSpec:
    """A parsed split string: the split's name and the slice's bounds (None: that end is open)."""

    name: str
    start: Bound | None = None
    stop: Bound | None = None
    sliced: bool = False  # written with [...], even if both ends are open

    def __str__(self) -> str:
        if not self.sliced:
            return self.name
        return f"{self.name}[{self.start or ''}:{self.stop or ''}]"


def parse_split(text: str) -> SplitSpec:
    """Parses ``NAME`` or ``NAME[start:stop]`` (see the module docstring); ValueError when malformed."""
    if not isinstance(text, str):
        raise ValueError(f"a split must be a string, got {type(text).__name__} {text!r}; expected {SPLIT_SYNTAX}")
    match = _SPLIT.match(text.strip())
    if match is None:
        raise ValueError(f"split {text!r} is malformed; expected {SPLIT_SYNTAX}")
    start, stop = (_parse_bound(match.group(end), text) for end in ("start", "stop"))
    return SplitSpec(match.group("name"), start, stop, sliced=match.group("start") is not None)


def _parse_bound(part: str | None, text: str) -> Bound | None:
    if part is None or not part.strip():
        return None
    match = _BOUND.match(part.strip())
    if match is None:
        raise ValueError(
            f"split {text!r}: slice bound {part!r} is neither a sample index (800, -200) nor a percentage "
            f"(98%, 2.5%); expected {SPLIT_SYNTAX}"
        )
    number, percent = match.group("number"), bool(match.group("percent"))
    if percent:
        value = Fraction(number)
        if abs(value) > 100:
            raise ValueError(f"split {text!r}: percentage {part!r} is outside -100%..100%")
        return Bound(value, True)
    if "." in number:
        raise ValueError(f"split {text!r}: sample index {part!r} must be a whole number (use % for a fraction)")
    return Bound(int(number), False)


def _absolute(bound: Bound, num_samples: int, text: str) -> int:
    """The bound as a sample index in [0, num_samples]; negative values count from the end."""
    if bound.percent:
        index = round(bound.value * num_samples / 100)  # Fraction: exact, ties to even like TFDS
    else:
        index = int(bound.value)
        if abs(index) > num_samples:
            raise ValueError(
                f"split {text!r}: index {index} is out of range for a split of {num_samples} samples "
                f"(indices go from -{num_samples} to {num_samples})"
            )
    return index + num_samples if index < 0 else index


def slice_bounds(split: str | SplitSpec, num_samples: int) -> tuple[int, int]:
    """``(start, stop)`` sample indices of the slice in a split of ``num_samples`` samples.

    Raises ValueError when a bound is out of range or a slice selects no sample (an unsliced name
    is the whole split, however many samples it has).
    """
    spec = parse_split(split) if isinstance(split, str) else split
    if not spec.sliced:
        return 0, num_samples  # the whole split, even an empty one
    text = str(spec)
    start = 0 if spec.start is None else _absolute(spec.start, num_samples, text)
    stop = num_samples if spec.stop is None else _absolute(spec.stop, num_samples, text)
    if stop <= start:
        raise ValueError(
            f"split {text!r} selects no samples: it resolves to [{start}:{stop}] in a split of {num_samples} "
            "samples; the start must come before the stop"
        )
    return start, stop


def slice_extents(shard_sizes: Sequence[int], start: int, stop: int) -> tuple[ShardRange, ...]:
    """The samples ``[start, stop)`` of the concatenated shards, as per-shard extents in shard order.

    The whole split gives every shard whole (empty ones included), exactly what the unsliced split
    reads; otherwise shards outside the slice are left out.
    """
    total = int(sum(shard_sizes))
    if not 0 <= start <= stop <= total:
        raise ValueError(f"slice [{start}:{stop}] is outside the {total} samples of the shards")
    if (start, stop) == (0, total):
        return whole_shards(shard_sizes)
    extents, offset = [], 0
    for shard, size in enumerate(shard_sizes):
        first, last = max(start, offset), min(stop, offset + int(size))
        if first < last:
            extents.append(ShardRange(shard, first - offset, last - offset))
        offset += int(size)
    return tuple(extents)


def split_extents(split: str | SplitSpec, shard_sizes: Sequence[int]) -> tuple[ShardRange, ...]:
    """:func:`slice_extents` of the slice that ``split`` names, over a split of these shard sizes."""
    start, stop = slice_bounds(split, int(sum(shard_sizes)))
    return slice_extents(shard_sizes, start, stop)


def split_table(split: str | SplitSpec, shard_sizes: Sequence[int] | np.ndarray) -> ExtentTable:
    """:func:`split_extents` as an :class:`ExtentTable`, computed on arrays (300k shards in
    milliseconds, no object per shard): what the training loader plans over."""
    sizes = np.asarray(shard_sizes, dtype=np.int64).reshape(-1)
    ends = np.cumsum(sizes)
    begins = ends - sizes
    total = int(ends[-1]) if len(sizes) else 0
    start, stop = slice_bounds(split, total)
    if (start, stop) == (0, total):  # every shard whole, empty ones included (as slice_extents)
        return ExtentTable(np.arange(len(sizes), dtype=np.int64), np.zeros(len(sizes), dtype=np.int64), sizes)
    first, last = np.maximum(start, begins), np.minimum(stop, ends)
    keep = first < last
    return ExtentTable(np.nonzero(keep)[0].astype(np.int64), (first - begins)[keep], (last - begins)[keep])
