"""CRC-32C of checkpoint files, as their completion records list them.

A file is checksummed in ranges read in parallel (`files_crc32c`): one thread reading a large
file in order leaves the disk at queue depth one (measured: a 1 GB shard read at about half the
disk's sequential speed), and the ranges' CRCs join into the file's (`crc32c_combine`, the same
algebra as zlib's `crc32_combine`: the first range's CRC is carried across the second's length by
multiplying it with x^(8*length) modulo the CRC's polynomial). google-crc32c's C extension
computes each range's (several GB/s a core, without the GIL).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import numpy as np

# Files are checked in ranges of this size, read in parallel.
SLICE_BYTES = 16 * 2**20

_POLYNOMIAL = 0x82F63B78  # CRC-32C (Castagnoli), bit-reversed as the CRC is computed


def crc32c_extend(crc: int, data) -> int:
    """`crc` extended over `data` (any contiguous buffer), read where it lies: google-crc32c takes
    bytes or a numpy array, not a memoryview, and a copy into bytes (a new allocation each time)
    ran the checksum at 1.3-4 GB/s instead of 7-9."""
    if not isinstance(data, bytes):
        data = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    return google_crc32c.extend(crc, data)


class RunningCrc32c:
    """The CRC-32C and size of bytes seen one buffer at a time, as they are written."""

    def __init__(self):
        self.value = 0
        self.size = 0

    def update(self, data) -> None:
        self.value = crc32c_extend(self.value, data)
        self.size += memoryview(data).nbytes


def _multiply(a: int, b: int) -> int:
    """a * b modulo the polynomial, both in the CRC's bit-reversed order (bit 31 is x^0)."""
    product, bit = 0, 1 << 31
    while True:
        if a & bit:
            product ^= b
            if not a & (bit - 1):
                return product
        bit >>= 1
        b = (b >> 1) ^ _POLYNOMIAL if b & 1 else b >> 1


# x^(2^k) modulo the polynomial, k = 0..31 (x^1 is bit 30), each the square of the one before.
_X_TO_2_TO_K = [1 << 30]
for _ in range(31):
    _X_TO_2_TO_K.append(_multiply(_X_TO_2_TO_K[-1], _X_TO_2_TO_K[-1]))


@functools.lru_cache(maxsize=64)
def _x_to_8n(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: what carries a CRC across nbytes more bytes."""
    power, k = 1 << 31, 3  # x^0; 8 * nbytes = nbytes * 2^3
    while nbytes:
        if nbytes & 1:
            power = _multiply(_X_TO_2_TO_K[k % 32], power)
        nbytes >>= 1
        k += 1
    return power


def crc32c_combine(first: int, second: int, second_nbytes: int) -> int:
    """The CRC-32C of A followed by B, from A's CRC, B's CRC and B's length."""
    return _multiply(_x_to_8n(second_nbytes), first) ^ second


def joined_crc32c(parts: Iterable[tuple[int, int]]) -> int:
    """The CRC-32C of consecutive pieces, from each piece's CRC-32C and length, in order."""
    crc = 0
    for part_crc, nbytes in parts:
        crc = crc32c_combine(crc, part_crc, nbytes)
    return crc


def byte_ranges(size: int, step: int) -> list[tuple[int, int]]:
    """(start, length) of the consecutive ranges of at most `step` bytes that cover `size` bytes."""
    return [(start, min(step, size - start)) for start in range(0, size, step)]


def _range_crc32c(path: Path, start: int, nbytes: int) -> int:
    crc = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while nbytes:
            data = os.pread(fd, nbytes, start)
            if not data:  # shorter than its size said: the caller compares sizes first
                break
            crc = google_crc32c.extend(crc, data)
            start, nbytes = start + len(data), nbytes - len(data)
    finally:
        os.close(fd)
    return crc


def files_crc32c(files: dict[str, tuple[Path, int]], threads: int = 8) -> dict[str, int]:
    """name -> the CRC-32C of the first `size` bytes of its `path`, for `files` (name -> path and
    size): every file's ranges are read and checksummed `threads` at a time."""
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vitray-crc32c") as pool:
        parts = {
            name: [(pool.submit(_range_crc32c, path, start, n), n) for start, n in byte_ranges(size, SLICE_BYTES)]
            for name, (path, size) in files.items()
        }
        return {name: joined_crc32c((part.result(), n) for part, n in ranges) for name, ranges in parts.items()}
