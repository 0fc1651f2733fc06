"""storage.DirectFile: a checkpoint file written past the page cache (O_DIRECT) in aligned buffers,
its last partial buffer through the page cache, fsynced on close; the page cache where the file
system refuses O_DIRECT (tmpfs) or a write with it."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import google_crc32c
import pytest

from vitray.storage import direct_file
from vitray.storage.direct_file import DirectFile

CHUNK = 64 * 2**10  # small buffers (a multiple of any block size): many hand-overs in a small file


@pytest.fixture(autouse=True)
def small_buffers(monkeypatch):
    monkeypatch.setattr(direct_file, "CHUNK_BYTES", CHUNK)


def _write(path: Path, pieces: list[bytes]) -> tuple[DirectFile, bytes]:
    seen = bytearray()
    with DirectFile(path, on_bytes=lambda view: seen.extend(view)) as f:
        for piece in pieces:
            assert f.write(memoryview(piece)) == len(piece)
    return f, bytes(seen)


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 7 * CHUNK + 12345])
def test_the_file_holds_every_byte_in_order(tmp_path, size):
    """Written in uneven pieces, whole buffers, a partial last one: the file is the bytes, of their
    length, and `on_bytes` saw each once, in order (the checksum a completion record lists)."""
    rng = random.Random(size)
    data = rng.randbytes(size)
    cuts = sorted(rng.sample(range(size + 1), min(size, 9)))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, size])]
    f, seen = _write(tmp_path / "shard.bin", pieces)
    assert (tmp_path / "shard.bin").read_bytes() == data
    assert seen == data and google_crc32c.value(seen) == google_crc32c.value(data)
    assert f.size == size and f.closed


def test_o_direct_is_used_where_the_file_system_takes_it(tmp_path):
    """On ext4 and xfs (this machine's and CI's temp folders) the whole buffers go past the page
    cache; the file is still whole."""
    kind = _file_system(tmp_path)
    if kind not in ("ext4", "xfs"):
        pytest.skip(f"the temp folder is on {kind}, whose O_DIRECT support varies")
    data = random.Random(0).randbytes(5 * CHUNK + 7)
    with DirectFile(tmp_path / "f") as f:
        f.write(data)
        assert f.direct
    assert (tmp_path / "f").read_bytes() == data


def test_a_file_system_without_o_direct_gets_the_page_cache(tmp_path):
    """tmpfs refuses O_DIRECT at the open (EINVAL): the file is written through the page cache."""
    shm = Path("/dev/shm")
    if _file_system(shm) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    path = shm / f"vitray-direct-{os.getpid()}"
    try:
        data = random.Random(1).randbytes(3 * CHUNK + 5)
        f, seen = _write(path, [data])
        assert not f.direct
        assert path.read_bytes() == data == seen
    finally:
        path.unlink(missing_ok=True)


def test_a_write_refused_with_o_direct_goes_through_the_page_cache(tmp_path, monkeypatch):
    """Some file systems take the flag at the open and refuse the writes (EINVAL): the file turns
    to the page cache at the first refusal and is written whole."""
    real_pwrite, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        if _flags(fd) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct_file.os, "pwrite", pwrite)
    data = random.Random(2).randbytes(4 * CHUNK + 99)
    f, _ = _write(tmp_path / "f", [data])
    assert refused and not f.direct
    assert (tmp_path / "f").read_bytes() == data


def test_an_error_in_the_with_block_closes_without_finishing(tmp_path):
    """The caller's error leaves the block at once: threads stopped, descriptor closed, nothing
    more written (a file without its completion record is never taken for whole)."""
    with pytest.raises(RuntimeError, match="serialisation failed"), DirectFile(tmp_path / "f") as f:
        f.write(b"x" * (CHUNK + 10))
        raise RuntimeError("serialisation failed")
    assert f.closed
    assert (tmp_path / "f").stat().st_size <= CHUNK


def test_a_writer_error_reaches_the_caller(tmp_path, monkeypatch):
    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_file.os, "pwrite", pwrite)
    with pytest.raises(OSError, match="No space left"), DirectFile(tmp_path / "f") as f:
        f.write(b"y" * (5 * CHUNK))
    assert f.closed


def _flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def _file_system(path: Path) -> str:
    """The type of the file system holding `path`, from /proc/mounts (the longest mount point)."""
    best, kind = "", "unknown"
    resolved = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fs_type, *_ = line.split()
        if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
            best, kind = mount, fs_type
    return kind


@pytest.mark.parametrize("source_on_a_page", [True, False])
def test_bytes_on_pages_of_memory_are_written_from_where_they_lie(tmp_path, source_on_a_page):
    """A large piece whose memory starts on a page, written at a page of the file (a checkpoint's
    tensor from page-aligned host buffers, after a header padded to a page), goes to the disk from
    where it lies: only its tail (under a page) and the pieces around it pass through the file's own
    buffers. A piece not on a page is copied, as any other. The file and `on_bytes` are the same."""
    import mmap

    import numpy as np

    if _file_system(tmp_path) not in ("ext4", "xfs"):
        pytest.skip("needs O_DIRECT")
    rng = random.Random(1)
    header, tail = rng.randbytes(mmap.PAGESIZE * 3), rng.randbytes(777)
    body = mmap.mmap(-1, 5 * CHUNK + mmap.PAGESIZE + 5)  # on a page of memory, as an anonymous mapping is
    body[:] = rng.randbytes(len(body))
    piece = memoryview(body) if source_on_a_page else memoryview(body)[1:]
    copied, seen = [], bytearray()
    with DirectFile(tmp_path / "f", on_bytes=lambda view: seen.extend(view)) as f:
        f.write(header)
        real_arrays = f._arrays
        f._arrays = [_CountingArray(a, copied) for a in real_arrays]
        f.write(piece)
        f._arrays = real_arrays
        f.write(tail)
    assert (tmp_path / "f").read_bytes() == header + bytes(piece) + tail == bytes(seen)
    assert np.frombuffer(piece, dtype=np.uint8).ctypes.data % mmap.PAGESIZE == (0 if source_on_a_page else 1)
    if source_on_a_page:
        assert sum(copied) == len(piece) % mmap.PAGESIZE  # the tail alone
    else:
        assert sum(copied) == len(piece)
    del piece
    body.close()


class _CountingArray:
    """A DirectFile buffer that counts the bytes copied into it."""

    def __init__(self, array, counts: list[int]):
        self.array, self.counts = array, counts

    def __setitem__(self, where, value):
        self.array[where] = value
        self.counts.append(len(value))

    def __getitem__(self, where):
        return self.array[where]
