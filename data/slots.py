"""Reading one slot of an epoch plan, position by position, through its shuffle windows.

The raw bytes of a window are read before its first position is handed out. With an executor
(one thread per loader worker), the next window is read in the background once the last
:data:`READ_AHEAD` of the current one is being consumed, so a window switch costs no more than
any other step. Raw samples are dropped as they are handed out, so a slot holds on average about
``0.5 + READ_AHEAD`` windows of raw bytes (at most ``1 + READ_AHEAD``); slots switch at staggered
steps, so a worker's slots do not peak together. Reads of one slot stay in stream order: window
``w + 1`` is only requested once window ``w`` is in.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any

from vitray.storage import ShardCache

from .plan import EpochPlan, window_bounds, window_of, window_order
from .reader import SampleStream

# The fraction of a window left to consume when the next one starts being read: time enough to
# read it (a quarter window is many steps: each step takes only a few positions of each slot),
# memory little more than one window per slot.
READ_AHEAD = 0.25


class _Cancelled(Exception):
    """A background window read stopped because its reader was closed."""


class SlotReader:
    """The samples at positions ``[start, stop)`` of one slot, in the plan's shuffled order.

    The stream is read window by window: for window ``w`` the raw bytes of the positions in it that
    ``wanted`` selects are read (others are passed over undecoded and unread), then handed out in
    the window's permuted order. Resuming at a position inside a window re-reads that window from
    its start, which is all the history a position needs. Windows start ``window_offset`` positions
    early (see :func:`vitray.data.plan.window_offset`). With ``executor``, the next window is read
    there while this one is consumed.
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
        window_offset: int = 0,
        executor: Executor | None = None,
        cache: ShardCache | None = None,
        outage_s: float | None = None,
    ) -> None:
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be at least 1, got {shuffle_buffer}")
        if not 0 <= window_offset < shuffle_buffer:
            raise ValueError(f"window_offset must be in [0, shuffle_buffer), got {window_offset}")
        self.plan, self.slot, self.buffer_size, self.offset = plan, slot, shuffle_buffer, window_offset
        self.start, self.stop, self.wanted = start, min(stop, plan.slot_size), wanted
        self._executor = executor
        self._stream_at = self._bounds(window_of(start, window_offset, shuffle_buffer))[0]
        self._stream = SampleStream(
            shard_urls, plan.slots[slot], storage_options, start=self._stream_at, cache=cache, outage_s=outage_s
        )
        self._window = -1
        self._raw: dict[int, Any] = {}  # stream offset -> raw sample, for the current window
        self._order: Any = None
        self._first = 0  # the current window's first position
        self._next: tuple[int, Future] | None = None  # the window being read in the background
        self._read_ahead_at = 0  # the position from which the next window is read in the background
        self._closed = threading.Event()

    def _bounds(self, window: int) -> tuple[int, int]:
        return window_bounds(window, self.offset, self.buffer_size, self.plan.slot_size)

    def take(self, position: int) -> Any:
        """The raw sample (or CORRUPT) at ``position``, which must be one that ``wanted`` selects."""
        if not self.start <= position < self.stop:
            raise IndexError(f"position {position} is outside [{self.start}, {self.stop}) of slot {self.slot}")
        window = window_of(position, self.offset, self.buffer_size)
        if window != self._window:
            self._switch(window)
        if position >= self._read_ahead_at and self._next is None and self._executor is not None:
            following = window + 1
            if self._bounds(following)[0] < self.stop:
                self._next = (following, self._executor.submit(self._read, following))
            self._read_ahead_at = self.stop  # once per window
        return self._raw.pop(self._first + int(self._order[position - self._first]))

    def read_ahead(self) -> None:
        """Start reading the first window in the background (with an executor; else a no-op)."""
        if self._executor is not None and self._next is None and self._window < 0 and self.start < self.stop:
            first = window_of(self.start, self.offset, self.buffer_size)
            self._next = (first, self._executor.submit(self._read, first))

    def _switch(self, window: int) -> None:
        pending, self._next = self._next, None
        if pending is not None and pending[0] == window:
            self._raw, self._order = pending[1].result()
        else:
            if pending is not None:
                pending[1].result()  # let it finish with the stream first (positions go forward only)
            self._raw, self._order = self._read(window)
        self._window, (self._first, last) = window, self._bounds(window)
        self._read_ahead_at = last - max(1, int(self.buffer_size * READ_AHEAD))

    def _read(self, window: int) -> tuple[dict[int, Any], Any]:
        """The raw samples of ``window`` (by stream offset) and its permutation."""
        first, last = self._bounds(window)
        if first < self._stream_at:
            raise ValueError(f"slot {self.slot}: window {window} was already passed; positions are read in order")
        self._stream.skip(first - self._stream_at)
        order = window_order(self.plan.seed, self.plan.epoch, self.slot, window, last - first)
        needed = sorted(
            first + int(order[p - first]) for p in range(max(first, self.start), min(last, self.stop)) if self.wanted(p)
        )
        raw, at = {}, first
        for offset in needed:
            if self._closed.is_set():
                raise _Cancelled
            self._stream.skip(offset - at)
            raw[offset] = self._stream.read(want=True)
            at = offset + 1
        # Never read past the last position used: the stream may end there (the epoch's last window).
        self._stream_at = at
        return raw, order

    def close(self) -> None:
        self._closed.set()
        if self._next is not None:
            # stops at its next sample; the stream is then free to close
            with contextlib.suppress(Exception):
                self._next[1].result()
            self._next = None
        self._stream.close()
