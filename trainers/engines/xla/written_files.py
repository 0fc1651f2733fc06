"""The files a `torch.distributed.checkpoint` save writes, with the size and CRC-32C of each taken as
its bytes go out -- what the rank's completion record lists -- instead of reading them back.

A read-back costs a second pass over every checkpoint: from the disk, or, on an object store, a
download of everything just uploaded. DCP's writers (`FileSystemWriter`, `FsspecWriter`) open each
file through their `fs.create_stream` and move the metadata file into place with `fs.rename`; both
are wrapped here on the one writer given, so that every stream opened for writing counts and
checksums what passes through it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vitray.trainers.checkpoint.checksums import RunningCrc32c


class _ChecksummedStream:
    """A write stream that keeps the size and CRC-32C of what is written through it; everything
    else (`tell`, `fileno` for DCP's fsync, `flush`) is the stream's own."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.written = RunningCrc32c()

    def write(self, data: Any) -> int | None:
        returned = self._stream.write(data)
        view = memoryview(data).cast("B")
        self.written.update(view if returned is None else view[:returned])  # (fsspec's streams return None)
        return returned

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class WrittenFiles:
    """Records each file that `writer` (a DCP storage writer, before its save) writes, by the path it
    ends up at: `files()` gives path -> (size, CRC-32C) once the save has returned."""

    def __init__(self, writer: Any):
        self._lock = threading.Lock()  # DCP writes files from several threads
        self._files: dict[str, tuple[int, int]] = {}
        fs = writer.fs
        create_stream, rename = fs.create_stream, fs.rename

        @contextmanager
        def checksummed_stream(path: Any, mode: str) -> Iterator[Any]:
            with create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                counted = _ChecksummedStream(stream)
                yield counted
                with self._lock:
                    self._files[os.fspath(path)] = (counted.written.size, counted.written.value)

        def renamed(path: Any, new_path: Any) -> None:
            rename(path, new_path)
            with self._lock:
                if (entry := self._files.pop(os.fspath(path), None)) is not None:
                    self._files[os.fspath(new_path)] = entry

        fs.create_stream, fs.rename = checksummed_stream, renamed

    def files(self) -> dict[str, tuple[int, int]]:
        with self._lock:
            return dict(self._files)
