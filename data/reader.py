"""Reading raw samples out of shards, by position, without decoding what is skipped.

A :class:`SampleStream` reads the concatenation of some shard ranges in order. Every position of the
stream yields exactly one result, so positions stay exact even when the data is damaged:

- a sample that was read: :class:`RawSample` (its key and member bytes, still encoded);
- a sample that was not asked for: ``None`` (its bytes were not read: tar members are passed over
  with a seek, and whole shards are never opened when a range starts past them);
- a sample that could not be read (truncated shard, missing member): a :class:`Corrupt` naming its shard.

Transient I/O errors (network) are retried by reopening the shard and seeking back to the same
sample; a missing shard is an error naming it. A shard that is not damaged but hostile -- a member
name that tries to leave the shard (``../x``, ``/etc/x``) or a member too large to hold in memory --
is rejected with :class:`UnsafeShardError`, never skipped quietly.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from vitray import storage

from .plan import ShardRange

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RawSample:
    key: str
    fields: dict[str, bytes]  # extension ("png", "cls", ...) -> member bytes
    shard: str = ""  # the URL of the shard it came from (named when its image cannot be decoded)


@dataclass(frozen=True)
class Corrupt:
    """A sample that could not be read, and the shard it should have come from."""

    shard: str = ""

    def __repr__(self) -> str:
        return "CORRUPT"


CORRUPT: Any = Corrupt()  # where the shard is not known

_UNREADABLE = (EOFError, ValueError)  # damaged data (incl. _Damaged): deterministic, not retried

# One member (one field of one sample) is read into memory whole; nothing in an image dataset
# comes near this, so a larger one is an attack or a mistake, not data.
MAX_MEMBER_BYTES = 1 << 30


class ShardMissing(FileNotFoundError):
    """A shard the manifest lists is not in the storage (deleted after `data prepare`, or after
    the run's pre-flight listing): no retry or restart brings it back."""


class UnsafeShardError(ValueError):
    """A shard whose content would escape its folder or exhaust memory if used; never skipped."""


def check_member(url: str, member: Member) -> Member:
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


@dataclass(frozen=True)
class Member:
    """One tar member as its header describes it: where its data starts and how long it is."""

    name: str
    size: int
    offset: int  # of its first header block (a long name or pax record comes before its own header)
    offset_data: int
    regular: bool  # a file (not a folder, link or device)


BLOCK = 512  # tar headers and data are laid out in blocks of this size
_REGULAR = (b"0", b"\0", b"7")  # typeflags of regular files (7: contiguous file)


class _Damaged(ValueError):
    """Data that is not a tar archive where one should be (bad checksum, cut short)."""


def _octal(field: bytes) -> int:
    if field[:1] == b"\x80":  # GNU base-256 for numbers too large for octal digits
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip(b" ")
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise _Damaged(f"bad number field {field!r} in a tar header") from None


def _pax_records(data: bytes) -> dict[str, str]:
    """``LENGTH KEY=VALUE\n`` records of a POSIX pax extended header."""
    records, at = {}, 0
    while at < len(data) and data[at : at + 1] != b"\0":
        length_text, _, _ = data[at : at + 20].partition(b" ")
        length = int(length_text)
        key, _, value = data[at + len(length_text) + 1 : at + length - 1].partition(b"=")
        records[key.decode("utf-8")] = value.decode("utf-8", "surrogateescape")
        at += length
    return records


class ShardCursor:
    """Sequential access to the samples of one shard, starting at any sample index.

    Tar headers are parsed here (ustar, GNU long names and pax paths and sizes: what tarfile and
    webdataset's writers produce) instead of by :mod:`tarfile`, whose member objects cost more than
    decoding a small JPEG. The header offset of every sample met is kept (the shard's member index,
    built while reading), so that going back to a sample -- a retry after a network error, or a
    second pass -- seeks straight to it instead of walking the shard again.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        cache: storage.ShardCache | None = None,
        outage_s: float | None = None,
    ) -> None:
        self.url, self.storage_options, self.cache = url, storage_options, cache
        self.outage_s = outage_s  # set: (re)opening the shard rides out an outage of its store this long
        self.index = 0  # next sample index
        self.broken = False  # the rest of the shard is unreadable (truncated or damaged)
        self._file: IO[bytes] | None = None
        self._pending: Member | None = None  # first member of the next sample
        self._sample_offsets: list[int] = []  # header offset of sample i's first member
        self._end_offset: int | None = None  # where the members end, once met
        self._open()

    def _open(self, index: int = 0) -> None:
        """(Re)open the shard positioned at sample ``index``, which must be 0 or one already met."""

        def open_tar() -> None:
            self.close()
            self.index, self.broken = index, False
            if self.cache is not None:
                self._file = self.cache.open(self.url, self.storage_options)
            else:
                self._file = storage.open_file(self.url, "rb", self.storage_options)
            try:
                if index:
                    self._file.seek(self._sample_offsets[index])
                self._pending = self._next_member()
            except UnsafeShardError:
                raise
            except _UNREADABLE as error:
                log.warning("shard %s is unreadable from sample %d: %s", self.url, index, error)
                self.broken = True

        try:
            if self.outage_s is None:
                storage.with_retries(open_tar, what=f"opening shard {self.url}")
            else:  # a run's reader: a store that stopped answering is waited for, not a restart
                storage.ride_out(open_tar, what=f"opening shard {self.url}", within_s=self.outage_s)
        except FileNotFoundError:
            raise ShardMissing(f"shard {self.url} is missing (listed in the manifest)") from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = self._pending = None

    def read(self, want: bool) -> RawSample | Any | None:
        """The next sample: its bytes if ``want``, else None without reading them; CORRUPT if unreadable."""
        if self.broken:
            self.index += 1
            return Corrupt(self.url)
        start_index = self.index
        for attempt in range(1, storage.retries.RETRY_ATTEMPTS + 1):
            try:
                return self._read(want)
            except UnsafeShardError:
                raise
            except _UNREADABLE as error:
                log.warning("shard %s is damaged at sample %d: %s", self.url, start_index, error)
                self.broken = True
                self.index = start_index + 1
                return Corrupt(self.url)
            except Exception as error:
                if not storage.is_transient(error):
                    raise
                if attempt == storage.retries.RETRY_ATTEMPTS:
                    raise storage.gave_up(error, f"reading sample {start_index} of {self.url}", attempt) from error
                delay = storage.backoff_delay(attempt)
                log.warning(
                    "reading %s failed (%s); reopening at sample %d in %.1fs", self.url, error, start_index, delay
                )
                time.sleep(delay)
                self._open(start_index if start_index < len(self._sample_offsets) else 0)
                self.skip_to(start_index)
        raise AssertionError("unreachable")

    def skip_to(self, index: int) -> None:
        """Move to sample ``index`` without reading the data of the samples passed over: by the
        index where the sample was met before, else by walking the headers from the last one met."""
        if index != self.index and (index < self.index or index < len(self._sample_offsets)):
            known = min(index, len(self._sample_offsets) - 1) if self._sample_offsets else 0
            if self._file is None or self.broken or known == 0:
                self._open(known)
            else:
                try:
                    self._file.seek(self._sample_offsets[known])
                    self._pending, self.index = self._next_member(), known
                except UnsafeShardError:
                    raise
                except Exception:
                    self._open(known)
        while self.index < index:
            self.read(want=False)

    def _read_exactly(self, size: int) -> bytes:
        assert self._file is not None
        data = self._file.read(size)
        if len(data) != size:
            raise _Damaged(f"unexpected end of data: {len(data)} of {size} bytes")
        return data

    def _next_member(self) -> Member | None:
        """The next member's header (long names and pax records applied), None at the end."""
        assert self._file is not None
        name: str | None = None
        size: int | None = None
        first = self._file.tell()
        while True:
            offset = self._file.tell()
            header = self._file.read(BLOCK)
            if len(header) < BLOCK or header == bytes(BLOCK):  # end of the archive (or of the file)
                if header and len(header) < BLOCK:
                    raise _Damaged(f"a tar header cut short at byte {offset}")
                self._end_offset = offset
                return None
            stored = _octal(header[148:156])
            # The checksum field counts as 8 spaces; old writers summed the bytes as signed chars.
            unsigned = sum(header[:148]) + 8 * 32 + sum(header[156:])
            signed = sum(struct.unpack_from("148b", header)) + 8 * 32 + sum(struct.unpack_from("356b", header, 156))
            if stored not in (unsigned, signed):
                raise _Damaged(f"bad tar header checksum at byte {offset}")
            typeflag = header[156:157]
            member_size = _octal(header[124:136])
            if typeflag in (b"L", b"x", b"g"):  # metadata for the member that follows
                if member_size > MAX_MEMBER_BYTES:
                    raise UnsafeShardError(f"shard {self.url}: a tar metadata block of {member_size:,} bytes")
                data = self._read_exactly(member_size)
                self._file.seek(-member_size % BLOCK, 1)
                if typeflag == b"L":
                    name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                elif typeflag == b"x":
                    records = _pax_records(data)
                    name = records.get("path", name)
                    size = int(records["size"]) if "size" in records else size
                continue
            if name is None:
                name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                if header[257:263] == b"ustar\0" and header[345:346] != b"\0":  # POSIX: a path prefix
                    name = header[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape") + "/" + name
            member = Member(name, member_size if size is None else size, first, offset + BLOCK, typeflag in _REGULAR)
            return check_member(self.url, member)

    def _read(self, want: bool) -> RawSample | Any | None:
        if self._pending is None:  # fewer samples in the shard than its manifest says
            self.index += 1
            return Corrupt(self.url)
        assert self._file is not None
        if self.index == len(self._sample_offsets):
            self._sample_offsets.append(self._pending.offset)
        key, _ = _split_name(self._pending.name)
        fields: dict[str, bytes] = {}
        member: Member | None = self._pending
        while member is not None and _split_name(member.name)[0] == key:
            padded = member.size + (-member.size % BLOCK)
            if want and member.regular:
                fields[_split_name(member.name)[1]] = self._read_exactly(member.size)
                self._file.seek(padded - member.size, 1)
            else:
                self._file.seek(padded, 1)
            member = self._next_member()
        self._pending = member
        self.index += 1
        return RawSample(key, fields, self.url) if want else None


class SampleStream:
    """Reads the concatenation of ``ranges`` (shard ranges) position by position."""

    def __init__(
        self,
        shard_urls: Sequence[str],
        ranges: Sequence[ShardRange],
        storage_options: dict[str, Any] | None = None,
        start: int = 0,
        cache: storage.ShardCache | None = None,
        outage_s: float | None = None,
    ) -> None:
        self.shard_urls, self.ranges, self.storage_options = shard_urls, list(ranges), storage_options
        self.cache = cache  # whole remote shards are read through this local cache
        self.outage_s = outage_s  # ShardCursor's
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

    def read(self, want: bool) -> RawSample | Any | None:
        """The next position's sample (see the module docstring for what comes back)."""
        if self._range_no >= len(self.ranges):
            raise IndexError("read past the end of the stream")
        shard_range = self.ranges[self._range_no]
        if self._cursor is None:
            self._cursor = ShardCursor(
                self.shard_urls[shard_range.shard], self.storage_options, self.cache, outage_s=self.outage_s
            )
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
