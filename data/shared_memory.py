"""Shared and recycled memory for the loader's images: the rings that DataLoader workers decode
into, and the pool that large batches live in. Split from `batch.py`, which assembles batches
from what these hold."""

from __future__ import annotations

import math
import mmap
import multiprocessing
import os
import sys
import threading

import torch

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and arm64 (4 KiB base pages)


def shared_uint8(shape: tuple[int, ...]) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared(math.prod(shape))  # no copy, unlike share_memory_()
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


def uint8_images(leading: tuple[int, ...], img_size: int, *, channels_last: bool, shared: bool) -> torch.Tensor:
    """Uninitialised uint8 images ``(*leading, 3, img_size, img_size)``, planar or channels-last in
    memory (``(*leading, img_size, img_size, 3)`` seen as the former); ``shared``: in shared memory."""
    pixels = (img_size, img_size, 3) if channels_last else (3, img_size, img_size)
    shape = (*leading, *pixels)
    buffer = shared_uint8(shape) if shared else torch.empty(shape, dtype=torch.uint8)
    return buffer.movedim(-1, -3) if channels_last else buffer


class ChunkRing:
    """Shared-memory chunk buffers that one DataLoader worker decodes into and the main process
    reads back, taken in turn; chunks then travel between the processes as slot numbers.

    A fresh shared-memory segment per chunk (what a tensor sent by a worker gets) costs the
    kernel more than copying the images: ~5 ms to zero and map 32 images of 224 px on each side.
    The ring is made in the main process before the workers start, so both map it once. The
    worker takes slot ``j % slots`` for its ``j``-th chunk after waiting for a free one; the main
    process releases each chunk when it has copied it out, in the order they were written.
    """

    WAIT_S = 5.0  # between checks that the main process is still there

    def __init__(self, slots: int, capacity: int, img_size: int, *, channels_last: bool = False) -> None:
        self.buffers = uint8_images((slots, capacity), img_size, channels_last=channels_last, shared=True)
        self._free = multiprocessing.Semaphore(slots)
        self._written = 0  # worker side: chunks written so far
        self._parent = os.getpid()

    def take(self) -> int:
        """Worker side: the next slot, once the main process has released its previous chunk."""
        while not self._free.acquire(timeout=self.WAIT_S):
            if os.getppid() != self._parent:  # the main process is gone; nobody will release
                raise SystemExit(f"DataLoader worker {os.getpid()}: the main process exited")
        slot = self._written % len(self.buffers)
        self._written += 1
        return slot

    def images(self, slot: int, count: int) -> torch.Tensor:
        return self.buffers[slot, :count]

    def release(self, count: int = 1) -> None:
        """Main process side: ``count`` chunks (the oldest held) are copied out; their slots are free."""
        for _ in range(count):
            self._free.release()


class BatchMemory:
    """Memory for large batches, recycled once the caller holds no tensor of an earlier batch.

    Each batch is handed to the caller, who keeps it as long as it likes, so each needs its own
    memory; but fresh memory is expensive at this size: glibc maps allocations over 32 MiB afresh
    every time, and the kernel then zeroes and faults in every page (~9,400 page faults of 4 KiB
    for a float batch of 64 at 224 px, more CPU time than converting it). So large batches live in
    private anonymous mappings, advised for transparent huge pages, that are reused when no tensor
    uses them any more: every tensor viewing a mapping (views and numpy arrays included) holds a
    buffer export of it, which holds a reference, so a mapping referenced only by this pool is
    free. At most ``max_regions`` mappings are kept; beyond that, batches get fresh ones.
    Thread-safe; small batches use ``torch.empty``.
    """

    MIN_BYTES = 4 * HUGE_PAGE

    def __init__(self, max_regions: int = 4) -> None:
        self.max_regions = max_regions
        self._regions: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``dtype``."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(self._region(nbytes + HUGE_PAGE), dtype=torch.uint8)  # holds the region
        offset = -raw.data_ptr() % HUGE_PAGE  # huge pages need 2 MiB-aligned addresses
        return raw[offset : offset + nbytes].view(dtype).view(shape)

    def _region(self, size: int) -> mmap.mmap:
        with self._lock:
            for index in range(len(self._regions)):
                # 2: the list's reference and getrefcount's argument; any tensor adds its own.
                if len(self._regions[index]) == size and sys.getrefcount(self._regions[index]) == 2:
                    return self._regions[index]
            region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            region.madvise(mmap.MADV_HUGEPAGE)
            if len(self._regions) >= self.max_regions:  # make room: forget one no tensor uses
                idle = [i for i in range(len(self._regions)) if sys.getrefcount(self._regions[i]) == 2]
                if idle:
                    del self._regions[idle[0]]
            if len(self._regions) < self.max_regions:
                self._regions.append(region)
            return region
