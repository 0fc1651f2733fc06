"""Reading raw samples out of shards, by position, without decoding what is skipped.

A :class:`SampleStream` reads the concatenation of some shard ranges in order. Every position of the
stream yields exactly one result, so positions stay exact even when the data is damaged:

- a sample that was read: :class:`RawSample` (its key and member bytes, still encoded);
- a sample that was not asked for: ``None`` (its bytes were not read: tar members are passed over
  with a seek, and whole shards are never opened when a range starts past them);
- a sample that could not be read (truncated shard, missing member): :data:`CORRUPT`.

Transient I/O errors (network) are retried by reopening the shard and seeking back to the same
sample; a missing shard is an error naming it. A shard that is not damaged but hostile -- a member
name that tries to leave the shard (``../x``, ``/etc/x``) or a member too large to hold in memory --
is rejected with :class:`UnsafeShardError`, never skipped quietly.
"""

from __future__ import annotations

import logging
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from . import storage
from .plan import ShardRange

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RawSample:
    key: str
    fields: dict[str, bytes]  # extension ("png", "cls", ...) -> member bytes


class _Corrupt:
    def __repr__(self) -> str:
        return "CORRUPT"


CORRUPT: Any = _Corrupt()

_UNREADABLE = (tarfile.TarError, EOFError, ValueError)  # damaged data: deterministic, not retried

# One member (one field of one sample) is read into memory whole; nothing in an image dataset
# comes near this, so a larger one is an attack or a mistake, not data.
MAX_MEMBER_BYTES = 1 << 30


class UnsafeShardError(ValueError):
    """A shard whose content would escape its folder or exhaust memory if used; never skipped."""


def check_member(url: str, member: tarfile.TarInfo) -> tarfile.TarInfo:
    """``member`` if it is safe to read, else :class:`UnsafeShardError` naming the shard and why."""
    name = member.name
    if name.startswith("/") or "\\" in name or ".." in name.split("/"):
        raise UnsafeShardError(
            f"shard {url}: member {name!r} escapes the shard (absolute, '..' or '\\' in its path); "
            "webdataset member names are relative KEY.EXT paths"
        )
    if member.size > MAX_MEMBER_BYTES:
        raise UnsafeShardError(
            f"shard {url}: member {name!r} claims {member.size:,} bytes; at most {MAX_MEMBER_BYTES:,} are read per member"
        )
    return member


def _split_name(name: str) -> tuple[str, str]:
    """webdataset convention: the key is the path up to the first dot of the file name."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext


class ShardCursor:
    """Sequential access to the samples of one shard, starting at any sample index."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url, self.storage_options = url, storage_options
        self.index = 0  # next sample index
        self.broken = False  # the rest of the shard is unreadable (truncated or damaged)
        self._file: IO[bytes] | None = None
        self._tar: tarfile.TarFile | None = None
        self._pending: tarfile.TarInfo | None = None  # first member of the next sample
        self._open()

    def _open(self) -> None:
        def open_tar() -> None:
            self.close()
            self.index, self.broken = 0, False
            self._file = storage.open_file(self.url, "rb", self.storage_options)
            try:
                self._tar = tarfile.open(fileobj=self._file, mode="r:")
                self._pending = self._next_member()
            except UnsafeShardError:
                raise
            except _UNREADABLE as error:
                log.warning("shard %s is unreadable from the start: %s", self.url, error)
                self.broken = True

        try:
            storage.with_retries(open_tar, what=f"opening shard {self.url}")
        except FileNotFoundError:
            raise FileNotFoundError(f"shard {self.url} is missing (listed in the manifest)") from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = self._tar = self._pending = None

    def read(self, want: bool) -> RawSample | None | Any:
        """The next sample: its bytes if ``want``, else None without reading them; CORRUPT if unreadable."""
        if self.broken:
            self.index += 1
            return CORRUPT
        start_index = self.index
        for attempt in range(1, storage.RETRY_ATTEMPTS + 1):
            try:
                return self._read(want)
            except UnsafeShardError:
                raise
            except _UNREADABLE as error:
                log.warning("shard %s is damaged at sample %d: %s", self.url, start_index, error)
                self.broken = True
                self.index = start_index + 1
                return CORRUPT
            except Exception as error:  # noqa: BLE001 - filtered by is_transient just below
                if not storage.is_transient(error) or attempt == storage.RETRY_ATTEMPTS:
                    raise
                delay = storage.backoff_delay(attempt)
                log.warning("reading %s failed (%s); reopening at sample %d in %.1fs", self.url, error, start_index, delay)
                time.sleep(delay)
                self._open()
                self.skip_to(start_index)
        raise AssertionError("unreachable")

    def skip_to(self, index: int) -> None:
        """Move to sample ``index`` without reading the data of the samples passed over."""
        if index < self.index:
            self._open()
        while self.index < index:
            self.read(want=False)

    def _next_member(self) -> tarfile.TarInfo | None:
        assert self._tar is not None
        member = self._tar.next()
        return None if member is None else check_member(self.url, member)

    def _read(self, want: bool) -> RawSample | None | Any:
        if self._pending is None:  # fewer samples in the shard than its manifest says
            self.index += 1
            return CORRUPT
        assert self._tar is not None
        key, _ = _split_name(self._pending.name)
        fields: dict[str, bytes] = {}
        member: tarfile.TarInfo | None = self._pending
        while member is not None and _split_name(member.name)[0] == key:
            if want and member.isfile():
                extracted = self._tar.extractfile(member)
                assert extracted is not None
                fields[_split_name(member.name)[1]] = extracted.read()
            member = self._next_member()
        self._pending = member
        self.index += 1
        return RawSample(key, fields) if want else None


class SampleStream:
    """Reads the concatenation of ``ranges`` (shard ranges) position by position."""

    def __init__(
        self,
        shard_urls: Sequence[str],
        ranges: Sequence[ShardRange],
        storage_options: dict[str, Any] | None = None,
        start: int = 0,
    ) -> None:
        self.shard_urls, self.ranges, self.storage_options = shard_urls, list(ranges), storage_options
        self._range_no, self._offset_in_range = 0, 0
        self._cursor: ShardCursor | None = None
        self._advance_ranges(start)

    def _advance_ranges(self, skip: int) -> None:
        # Whole ranges are skipped by their manifest counts: their shards are never opened.
        while self._range_no < len(self.ranges) and skip >= len(self.ranges[self._range_no]) - self._offset_in_range:
            skip -= len(self.ranges[self._range_no]) - self._offset_in_range
            self._range_no, self._offset_in_range = self._range_no + 1, 0
            self._close_cursor()
        self._offset_in_range += skip

    def _close_cursor(self) -> None:
        if self._cursor is not None:
            self._cursor.close()
            self._cursor = None

    def read(self, want: bool) -> RawSample | None | Any:
        """The next position's sample (see the module docstring for what comes back)."""
        if self._range_no >= len(self.ranges):
            raise IndexError("read past the end of the stream")
        shard_range = self.ranges[self._range_no]
        if self._cursor is None:
            self._cursor = ShardCursor(self.shard_urls[shard_range.shard], self.storage_options)
        self._cursor.skip_to(shard_range.start + self._offset_in_range)
        result = self._cursor.read(want)
        self._offset_in_range += 1
        if self._offset_in_range == len(shard_range):
            self._range_no, self._offset_in_range = self._range_no + 1, 0
            self._close_cursor()
        return result

    def skip(self, count: int) -> None:
        """Pass over ``count`` positions; whole ranges are skipped without opening their shards."""
        if self._cursor is not None and count >= len(self.ranges[self._range_no]) - self._offset_in_range:
            self._close_cursor()
        self._advance_ranges(count)

    def close(self) -> None:
        self._close_cursor()
