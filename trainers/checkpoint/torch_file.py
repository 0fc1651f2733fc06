"""Reading a `torch.save` file straight into fresh tensors, past the page cache, checked as it is read.

`torch.load` copies each storage out of the file, or maps the file (`mmap=True`): then each page is
faulted in on first touch and the tensors stay mappings of the file. A restore reads every byte of
a checkpoint once anyway, for its CRC-32C; here that one read is the load. This is PyTorch's own
pattern for direct storage I/O (its GPUDirect Storage tutorial): the file's pickled structure is
loaded with fake tensors, which carry each storage's offset in the file (`_checkpoint_offset`) and
no data; each storage's bytes are then read into a fresh page-aligned buffer with O_DIRECT, several
ranges in flight, and the file's CRC-32C is joined from the ranges' (and the bytes between the
storages) as they arrive. No page-cache copy, no second pass.

Storages at an offset of the file aligned to `STORAGE_ALIGNMENT` -- what vitray writes its
checkpoint files with -- are read directly; others (files written before, or on a file system
that refuses O_DIRECT, as some network and FUSE mounts do) through the page cache, into the same
buffers, as is a file just downloaded (`direct=False`: its bytes are in the page cache already).
Anything the fake load cannot account for (a storage it did not reach, a tensor saved on a device)
is read with `torch.load` instead.
"""

from __future__ import annotations

import collections
import contextlib
import os
import struct
import zipfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from vitray.trainers.checkpoint.checksums import crc32c_extend, files_crc32c, joined_crc32c
from vitray.trainers.checkpoint.host_buffers import page_aligned_empty

# torch.save's alignment of each storage in the file for vitray's checkpoint files: a page, as
# O_DIRECT needs (torch's default is 64 bytes). It costs at most a page of padding a tensor.
STORAGE_ALIGNMENT = 4096
# Each storage is read in ranges of this size, this many at a time: one read at a time leaves a
# disk at queue depth one (measured on this project's virtual disk: 4 in flight read an L/16's shards
# 5-10% slower than 8, 16 no faster than 8).
READ_BYTES = 16 * 2**20
READ_THREADS = 8


class FileCheck:
    """What a whole file must be: its size and, when known, its CRC-32C; `fail(problem)` raises the
    error that says the file is not what its checkpoint listed."""

    def __init__(self, size: int, crc32c: int | None, fail: Callable[[str], None]):
        self.size, self.crc32c, self.fail = size, crc32c, fail


def load(
    path: str,
    *,
    check: FileCheck | None = None,
    direct: bool = True,
    into: Callable[[Any], Iterable[tuple[torch.Tensor, torch.Tensor]]] | None = None,
    map_location=None,
) -> Any:
    """`torch.load(path, weights_only=True)` of a local file, read directly into fresh CPU tensors
    (see the module's docstring). `check`: the file's listed size (checked first) and CRC-32C
    (computed from the bytes as they are read; also when the load fails, so that a corrupt file is
    named as one); `check.fail` is called on a mismatch, before anything is returned. `direct`:
    read past the page cache where the file allows it. `into(structure)`: pairs of a tensor of the
    file's structure (a fake one) and a CPU tensor of the caller's that it is to be read into
    (the same dtype and shape, each the whole of its storage; others are read into fresh memory):
    a restore reads its largest tensors straight into the buffers they are loaded into, with no
    copy and no fresh memory. `map_location`: None or the CPU, or a device the tensors are moved
    to."""
    if check is not None and (size := os.path.getsize(path)) != check.size:
        check.fail(f"has {size} bytes, its record lists {check.size}")
    corrupt = "does not have the CRC-32C its record lists (corrupt)"
    try:
        structure, buffers, crc = _load_into_buffers(path, direct, into)
    except Exception:
        if check is not None and check.crc32c is not None and _file_crc32c(path) != check.crc32c:
            check.fail(corrupt)
        raise
    if check is not None and check.crc32c is not None:
        crc = _file_crc32c(path) if crc is None else crc  # (torch.load read it: one more pass)
        if crc != check.crc32c:
            check.fail(corrupt)
    if buffers is not None:
        structure = _walk(structure, lambda fake: _real(fake, buffers[fake.untyped_storage()._checkpoint_offset]))
    device = None if map_location is None or callable(map_location) else torch.device(map_location)
    if device is not None and device.type != "cpu":
        structure = _walk(structure, lambda tensor: tensor.to(device))
    return structure


def _load_into_buffers(path: str, direct: bool, into) -> tuple[Any, dict[int, torch.Tensor] | None, int | None]:
    """The file's structure with fake tensors, each storage's bytes (offset -> buffer) and the
    file's CRC-32C; or, where the fake load does not account for every storage, what `torch.load`
    gives, None and None."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        structure = torch.load(path, weights_only=True)
    fakes: list[torch.Tensor] = []
    _walk(structure, lambda t: fakes.append(t) or t)
    records = _storage_records(path)
    offsets = {getattr(t.untyped_storage(), "_checkpoint_offset", None) for t in fakes}
    if None in offsets or offsets != set(records) or any(t.device.type != "cpu" for t in fakes):
        return torch.load(path, map_location="cpu", weights_only=True), None, None
    crc, buffers = _read(path, records, direct, _targets(into(structure) if into else (), fakes, records))
    return structure, buffers, crc


def _targets(pairs, fakes: list[torch.Tensor], records: dict[int, int]) -> dict[int, torch.Tensor]:
    """Storage offset -> the caller's tensor (as bytes) to read it into, for the pairs of `into`
    where the file's tensor is the whole of a storage no other tensor of the file uses, and the
    caller's is a contiguous CPU tensor of the same dtype and shape."""
    users = collections.Counter(fake.untyped_storage()._checkpoint_offset for fake in fakes)
    targets = {}
    for fake, target in pairs:
        offset = fake.untyped_storage()._checkpoint_offset
        if (
            users[offset] == 1
            and (fake.dtype, fake.shape, fake.storage_offset()) == (target.dtype, target.shape, 0)
            and fake.is_contiguous()
            and records[offset] == target.numel() * target.element_size()
            and target.device.type == "cpu"
            and target.is_contiguous()
        ):
            targets[offset] = target.detach().view(-1).view(torch.uint8)
    return targets


def _file_crc32c(path: str) -> int:
    return files_crc32c({"": (path, os.path.getsize(path))})[""]


def _walk(value: Any, visit: Callable[[torch.Tensor], Any], seen: set[int] | None = None) -> Any:
    """`value` with every tensor in it replaced by `visit(tensor)`: in its dicts and lists (changed
    in place), tuples, and the attributes of the plain objects `torch.load` rebuilt."""
    if isinstance(value, torch.Tensor):
        return visit(value)
    seen = set() if seen is None else seen
    if id(value) in seen:
        return value
    seen.add(id(value))
    if isinstance(value, (dict, list)):
        for key, item in list(value.items() if isinstance(value, dict) else enumerate(value)):
            if (new := _walk(item, visit, seen)) is not item:
                value[key] = new
        return value
    if isinstance(value, tuple):
        items = [_walk(v, visit, seen) for v in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if hasattr(value, "__dict__") and not isinstance(value, type):
        for key, item in list(vars(value).items()):
            if (new := _walk(item, visit, seen)) is not item:
                setattr(value, key, new)
    return value


def _storage_records(path: str) -> dict[int, int]:
    """Offset in the file -> size of each storage's bytes (the zip's `.../data/N` records, stored
    uncompressed: a record's bytes follow its local header, 30 bytes plus its name and extra field)."""
    records = {}
    with open(path, "rb") as f:
        for info in zipfile.ZipFile(f).infolist():
            parent = info.filename.rsplit("/", 2)
            if len(parent) < 2 or parent[-2] != "data" or info.compress_type != zipfile.ZIP_STORED:
                continue
            f.seek(info.header_offset + 26)
            name_length, extra_length = struct.unpack("<HH", f.read(4))
            records[info.header_offset + 30 + name_length + extra_length] = info.file_size
    return records


def _read(
    path: str, records: dict[int, int], direct: bool, targets: dict[int, torch.Tensor]
) -> tuple[int, dict[int, torch.Tensor]]:
    """The file's CRC-32C and each record's bytes (offset -> its uint8 tensor in `targets`, or a
    fresh page-aligned one), every byte of the file read once."""
    buffers = {
        offset: targets[offset] if offset in targets else page_aligned_empty(n, torch.uint8)
        for offset, n in records.items()
    }
    buffered = os.open(path, os.O_RDONLY)
    unbuffered = None
    if direct and hasattr(os, "O_DIRECT"):
        with contextlib.suppress(OSError):  # a file system that refuses O_DIRECT: through the page cache
            unbuffered = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        size = os.fstat(buffered).st_size
        pieces, position = [], 0  # (start, length, target or None for the bytes between storages)
        for offset in sorted(records):
            if offset > position:
                pieces.append((position, offset - position, None))
            for start in range(0, records[offset], READ_BYTES):
                length = min(READ_BYTES, records[offset] - start)
                pieces.append((offset + start, length, buffers[offset][start : start + length]))
            position = offset + records[offset]
        if position < size:
            pieces.append((position, size - position, None))

        def read(piece: tuple[int, int, torch.Tensor | None]) -> tuple[int, int]:
            start, length, target = piece
            if target is None:  # the bytes between storages: headers and the pickle, small
                between = memoryview(bytearray(length))
                got = _readinto(buffered, between, start)
                return crc32c_extend(0, between[:got]), got
            view = memoryview(target.numpy())
            aligned = unbuffered is not None and start % STORAGE_ALIGNMENT == 0 == target.data_ptr() % STORAGE_ALIGNMENT
            whole = length - length % STORAGE_ALIGNMENT if aligned else 0  # (the tail: through the page cache)
            got = _readinto(unbuffered, view[:whole], start) if whole else 0
            got += _readinto(buffered, view[got:], start + got)
            return crc32c_extend(0, view[:got]), got

        with ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="vitray-ckpt-read") as pool:
            parts = list(pool.map(read, pieces))
        if sum(n for _, n in parts) != size:  # (the zip's structure lies inside the file)
            raise EOFError(f"{path} ended while it was read")
        return joined_crc32c(parts), buffers
    finally:
        os.close(buffered)
        if unbuffered is not None:
            os.close(unbuffered)


def _readinto(fd: int, view: memoryview, start: int) -> int:
    """Read into all of `view` from `start`; returns the bytes read (fewer only at the file's end)."""
    got = 0
    while got < view.nbytes:
        n = os.preadv(fd, [view[got:]], start + got)
        if n == 0:
            break
        got += n
    return got


def _real(fake: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """The tensor `fake` stands for, on its storage's bytes in `buffer`."""
    flat = buffer.view(fake.dtype)
    tensor = flat.as_strided(fake.shape, fake.stride(), flat.storage_offset() + fake.storage_offset())
    if isinstance(fake, torch.nn.Parameter):
        tensor = torch.nn.Parameter(tensor, requires_grad=fake.requires_grad)
    return tensor
