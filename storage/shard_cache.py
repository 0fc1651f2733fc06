"""Whole remote shards copied into a node-local folder, bounded in size, least recently used first out."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import posixpath
import tempfile
from typing import IO, Any

import fsspec

from .files import filesystem, is_remote, open_file
from .retries import with_retries

log = logging.getLogger(__name__)

# Whole-shard downloads into the local cache: ranges of this size, this many requested at once.
CACHE_PART_BYTES = 8 * 1024 * 1024
CACHE_PARALLEL_PARTS = 8


class ShardCache:
    """Whole shards copied from object storage into a local folder shared by the processes of a
    node, at most ``max_bytes`` in all; the least recently used shards are evicted first.

    A shard is fetched as parallel range GETs of :data:`CACHE_PART_BYTES` (:data:`CACHE_PARALLEL_PARTS`
    at a time, each part retried on transient errors, S3's 503 SlowDown included), written to a
    hidden temporary file and renamed into place once its size matches the store's, so a reader
    never opens a partial copy. Two processes that miss the same shard both fetch it; the second
    rename replaces the first, identical, copy. Eviction unlinks files that other processes may
    still read (they keep their open file). Local paths pass through unchanged.
    """

    def __init__(self, folder: str, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"the shard cache needs a positive size bound, got {max_bytes} bytes")
        self.folder, self.max_bytes = str(folder), int(max_bytes)
        os.makedirs(self.folder, exist_ok=True)

    def path_for(self, url: str) -> str:
        digest = hashlib.sha256(url.encode()).hexdigest()[:16]
        return os.path.join(self.folder, f"{digest}-{posixpath.basename(url)}")

    def open(self, url: str, storage_options: dict[str, Any] | None = None) -> IO[bytes]:
        """``url`` opened for reading: from the cache (fetched into it first if missing), or straight
        from storage when it is local or larger than the whole cache."""
        if not is_remote(url):
            return open_file(url, "rb", storage_options)
        path = self.path_for(url)
        try:
            cached = open(path, "rb")
        except FileNotFoundError:
            pass
        else:
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)  # recently used: evicted last
            return cached
        fs, fs_path = filesystem(url, storage_options)
        try:
            size = with_retries(lambda: fs.info(fs_path)["size"], what=f"asking the size of {url}")
        except FileNotFoundError:
            raise FileNotFoundError(f"{url} does not exist") from None
        if size > self.max_bytes:
            log.warning(
                "shard %s (%d bytes) is larger than the shard cache (%d bytes); reading it directly",
                url,
                size,
                self.max_bytes,
            )
            return open_file(url, "rb", storage_options)
        self._make_room(size)
        fetched = self._fetch(fs, fs_path, url, size, path)
        # Processes that missed shards at the same time each made room for their own only.
        self._make_room(0)
        return fetched

    def _fetch(self, fs: fsspec.AbstractFileSystem, fs_path: str, url: str, size: int, path: str) -> IO[bytes]:
        """The shard fetched into ``path``, opened before it is renamed there (so that eviction by
        another process cannot take it away between the two)."""
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".part", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as out:
                starts = list(range(0, size, CACHE_PART_BYTES))
                for group in range(0, len(starts), CACHE_PARALLEL_PARTS):
                    first = starts[group : group + CACHE_PARALLEL_PARTS]
                    ends = [min(s + CACHE_PART_BYTES, size) for s in first]

                    def fetch_parts(first: list[int] = first, ends: list[int] = ends) -> list[bytes]:
                        parts = fs.cat_ranges([fs_path] * len(first), first, ends)
                        for part in parts:
                            if isinstance(part, BaseException):  # cat_ranges returns errors in place
                                raise part
                        return parts

                    for part in with_retries(fetch_parts, what=f"fetching {url} into the shard cache"):
                        out.write(part)
            if os.path.getsize(tmp) != size:
                raise OSError(f"fetched {os.path.getsize(tmp)} bytes of {url}, expected {size}")
            fetched = open(tmp, "rb")
            os.replace(tmp, path)
            return fetched
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _make_room(self, incoming: int) -> None:
        entries = []
        with os.scandir(self.folder) as listing:
            for entry in listing:
                if entry.is_file() and not entry.name.startswith("."):
                    with contextlib.suppress(FileNotFoundError):  # another process may evict it meanwhile
                        stat = entry.stat()
                        entries.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total + incoming <= self.max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            total -= size
