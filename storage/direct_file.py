"""A local file written once, past the page cache (O_DIRECT), and durable when closed.

What a checkpoint needs: gigabytes written once and read back only at a resume, at the disk's
speed. Written through the page cache, each byte is copied into it, then written back by the
kernel, and a large file meets the dirty-page limit, where the writer waits on writeback: on this
project's 2-core VM, 1 GiB reached 0.25-0.73x and 3 GiB 0.34-0.38x `dd oflag=direct`'s write. With
O_DIRECT the bytes are copied once into page-aligned buffers that the disk reads from: 0.64-1.28x
`dd`, the buffers written on threads while the caller fills the next (BENCHMARKS.md). Bytes that
already lie on pages of memory and go to a page of the file (a checkpoint's tensors, from
page-aligned host buffers, into a file whose storages start on pages) are written from where they
lie, with no copy.

Where the file system does not take O_DIRECT (tmpfs, some FUSE and network mounts: the open or
the first write fails with EINVAL), the file is written through the page cache as usual. Linux
only; elsewhere the page cache is used.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import mmap
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

# Bytes a buffer holds: a multiple of any file system's block size, large enough that the disk
# sees long sequential writes (dd's `bs=16M`); buffers written at once, each by a thread of its own
# (the caller fills one more meanwhile).
CHUNK_BYTES = 16 * 2**20
WRITES_IN_FLIGHT = 2
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class DirectFile(io.RawIOBase):
    """A write-only file at `path`, created or emptied. `on_bytes`, if given, sees every byte
    written, in order, once: a buffer at a time, on the caller's thread while the writer thread
    writes the buffer before (a checksum there overlaps the disk's work).
    `close` writes the rest and fsyncs the file; leaving a `with` block on an exception closes
    the file without that (what was written stays: callers keep such a file from being taken
    for a whole one)."""

    def __init__(self, path: str | os.PathLike, on_bytes: Callable[[memoryview], None] | None = None):
        super().__init__()
        self._on_bytes = on_bytes
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags | _O_DIRECT, 0o644)
            self.direct = bool(_O_DIRECT)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o644)
            self.direct = False
        self.size = 0  # bytes taken so far
        self._buffers = [mmap.mmap(-1, CHUNK_BYTES) for _ in range(WRITES_IN_FLIGHT + 1)]
        # Copied into through numpy, which lets go of the GIL while it copies: a memoryview's copy
        # holds it, and the writer thread, its write returned, could not start the next one.
        self._arrays = [np.frombuffer(buffer, dtype=np.uint8) for buffer in self._buffers]
        self._free = list(range(len(self._buffers)))
        self._filling, self._filled = self._free.pop(), 0  # which buffer the caller fills, and how far
        self._offset = 0  # where the next buffer goes in the file
        self._writers = ThreadPoolExecutor(max_workers=WRITES_IN_FLIGHT, thread_name_prefix="vitray-direct-write")
        self._in_flight: deque[tuple[Future, int | None]] = deque()  # writes and their buffers, oldest first

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        source = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        taken = self._write_in_place(source) if source.size >= CHUNK_BYTES else 0
        while taken < source.size:
            n = min(CHUNK_BYTES - self._filled, source.size - taken)
            self._arrays[self._filling][self._filled : self._filled + n] = source[taken : taken + n]
            self._filled += n
            taken += n
            if self._filled == CHUNK_BYTES:
                self._hand_over()
        self.size += source.size
        return source.size

    def _write_in_place(self, source: np.ndarray) -> int:
        """Write the whole pages at the start of `source` to the disk from where they lie, with no
        copy, when both `source` and the file's position start on a page (a tensor's bytes in a
        checkpoint written with page-aligned storages, from page-aligned host buffers); returns the
        bytes written (0 when they do not). The writes are waited for before this returns: the
        caller may reuse `source` after `write`."""
        position = self._offset + self._filled
        if not self.direct or position % mmap.PAGESIZE or source.ctypes.data % mmap.PAGESIZE:
            return 0
        if self._filled:  # the buffer filled so far: whole pages, as the position is on one
            self._hand_over()
        body = source.size - source.size % mmap.PAGESIZE
        view = memoryview(source)
        for start in range(0, body, CHUNK_BYTES):
            part = view[start : min(start + CHUNK_BYTES, body)]
            if self._on_bytes is not None:
                self._on_bytes(part)
            while len(self._in_flight) >= WRITES_IN_FLIGHT:
                self._wait_oldest()
            self._in_flight.append((self._writers.submit(self._write_out, part, self._offset), None))
            self._offset += part.nbytes
        while self._in_flight:
            self._wait_oldest()
        return body

    def _hand_over(self) -> None:
        """The full buffer goes to a writer thread; the caller fills a free one (when none is,
        once the oldest write is done)."""
        buffer = memoryview(self._buffers[self._filling])[: self._filled]
        if self._on_bytes is not None:
            self._on_bytes(buffer)
        self._in_flight.append((self._writers.submit(self._write_out, buffer, self._offset), self._filling))
        self._offset += self._filled
        while not self._free:
            self._wait_oldest()
        self._filling, self._filled = self._free.pop(), 0

    def _wait_oldest(self) -> None:
        write, buffer = self._in_flight.popleft()
        write.result()  # the writer's error, if any, is the caller's
        if buffer is not None:  # (None: a write from the caller's own bytes)
            self._free.append(buffer)

    def _write_out(self, buffer: memoryview, offset: int) -> None:
        done = 0
        while done < buffer.nbytes:
            try:
                done += os.pwrite(self._fd, buffer[done:], offset + done)
            except OSError as err:
                if err.errno != errno.EINVAL or not self.direct:
                    raise
                self._through_page_cache()  # the file system took the flag but not the write

    def _through_page_cache(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
        self.direct = False

    def close(self) -> None:
        """Write what is left (a last, partial buffer goes through the page cache: O_DIRECT writes
        whole blocks) and fsync the file."""
        if self.closed:
            return
        try:
            while self._in_flight:
                self._wait_oldest()
            if self._filled:
                tail = memoryview(self._buffers[self._filling])[: self._filled]
                if self._on_bytes is not None:
                    self._on_bytes(tail)
                if self.direct:
                    self._through_page_cache()
                self._write_out(tail, self._offset)
                del tail
            os.fsync(self._fd)
        finally:
            self._release()

    def __exit__(self, kind, error, traceback) -> None:
        if error is None:
            self.close()
        else:
            self._release()

    def _release(self) -> None:
        if self.closed:
            return
        try:
            self._writers.shutdown(wait=True)
            os.close(self._fd)
            del self._arrays  # (a buffer cannot be unmapped while an array holds it)
            for buffer in self._buffers:
                # A buffer an error's traceback still views (a failed write's) is unmapped with it.
                with contextlib.suppress(BufferError):
                    buffer.close()
        finally:
            super().close()
