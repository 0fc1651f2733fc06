"""Reading one slot of an epoch plan, position by position, through its shuffle windows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .plan import EpochPlan, window_order
from .reader import SampleStream


class SlotReader:
    """The samples at positions ``[start, stop)`` of one slot, in the plan's shuffled order.

    The stream is read window by window: for window ``w`` the raw bytes of the positions in it that
    ``wanted`` selects are read (others are passed over undecoded and unread), then handed out in
    the window's permuted order. Resuming at a position inside a window re-reads that window from
    its start, which is all the history a position needs.
    """

    def __init__(
        self,
        shard_urls: Sequence[str],
        plan: EpochPlan,
        slot: int,
        *,
        shuffle_buffer: int,
        start: int,
        stop: int,
        wanted: Callable[[int], bool] = lambda position: True,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be at least 1, got {shuffle_buffer}")
        self.plan, self.slot, self.buffer_size = plan, slot, shuffle_buffer
        self.start, self.stop, self.wanted = start, min(stop, plan.slot_size), wanted
        self._stream_at = (start // shuffle_buffer) * shuffle_buffer
        self._stream = SampleStream(shard_urls, plan.slots[slot], storage_options, start=self._stream_at)
        self._window = -1
        self._raw: dict[int, Any] = {}  # stream offset -> raw sample, for the current window
        self._order: Any = None

    def take(self, position: int) -> Any:
        """The raw sample (or CORRUPT) at ``position``, which must be one that ``wanted`` selects."""
        if not self.start <= position < self.stop:
            raise IndexError(f"position {position} is outside [{self.start}, {self.stop}) of slot {self.slot}")
        window = position // self.buffer_size
        if window != self._window:
            self._load(window)
        window_start = window * self.buffer_size
        return self._raw.pop(window_start + int(self._order[position - window_start]))

    def _load(self, window: int) -> None:
        first = window * self.buffer_size
        last = min(first + self.buffer_size, self.plan.slot_size)
        if first < self._stream_at:
            raise ValueError(f"slot {self.slot}: window {window} was already passed; positions are read in order")
        self._stream.skip(first - self._stream_at)
        self._order = window_order(self.plan.seed, self.plan.epoch, self.slot, window, last - first)
        needed = sorted(
            first + int(self._order[p - first])
            for p in range(max(first, self.start), min(last, self.stop))
            if self.wanted(p)
        )
        self._raw, at = {}, first
        for offset in needed:
            self._stream.skip(offset - at)
            self._raw[offset] = self._stream.read(want=True)
            at = offset + 1
        # Never read past the last position used: the stream may end there (the epoch's last window).
        self._stream_at = at
        self._window = window

    def close(self) -> None:
        self._stream.close()
