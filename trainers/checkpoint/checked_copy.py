"""A rank's checked copy of the checkpoint it resumes from: the files it reads, each checked
against the size and CRC-32C its completion record lists (`vitray.trainers.checkpoint.rank_files`
wrote them).

A local checkpoint is read where it lies; a remote one's files come down in ranges, in parallel,
into a folder the ranks of a node share, checked as they arrive. Which checkpoint is restored, and
the restore's order, are `vitray.trainers.checkpoint.restore`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vitray import storage
from vitray.runfolder.checkpoint_folders import (
    STATE_FILE,
    IncompleteCheckpointError,
    completion_record,
    listed_crc32c,
    listed_size,
    read_state,
)
from vitray.trainers.checkpoint.checksums import byte_ranges, crc32c_extend, files_crc32c, joined_crc32c
from vitray.trainers.checkpoint.torch_file import FileCheck
from vitray.trainers.engines.seam import FileSelector

__all__ = ["LocalCheck", "file_check", "node_restore_dir", "rank_copy", "start_rank_copy"]


def rank_copy(path: str, select: FileSelector | None, node_dir: Path, rank: int) -> tuple[Path, dict[str, Any]]:
    """A local folder with what rank `rank` reads of the complete checkpoint `path` (local or
    s3://), and its trainer state; every file it reads checked against the size and CRC-32C its
    completion record lists (records of checkpoints written before CRCs were listed: sizes only).

    A local checkpoint is its own copy (its files are checked in place, in parallel). Of a remote
    one, only the files `select` picks (the engine's `restore_files`; all of them when it is None
    or picks None) are downloaded (concurrently, then checked) into `node_dir`, a folder the ranks
    of one node share (`node_restore_dir`): the files every rank reads (module states, EMA weights)
    come down once per node, each rank's own shards once, and no other rank's shards. The
    checkpoint must already be known complete (the driver or rank 0 verified it): this reads the
    trainer state and the records of rank 0 (the shared files) and of `rank` only, so a resume
    costs each rank a constant number of requests, not one per rank."""
    folder, state, checking = start_rank_copy(path, select, node_dir, rank)
    if checking is not None:
        checking.result()
    return folder, state


def start_rank_copy(
    path: str, select: FileSelector | None, node_dir: Path, rank: int
) -> tuple[Path, dict[str, Any], LocalCheck | None]:
    """`rank_copy`, but the CRC-32Cs of a local checkpoint's files (their sizes are checked at once)
    are left to whoever reads the files: a reader that reads a whole file checks it as it reads
    (`file_check`), so the disk is read once and the check does not come before everything else.
    The third value (None when nothing is left to check) checks the files no reader took when its
    `result()` is called, and raises IncompleteCheckpointError if a file is corrupt: the caller
    calls it once the files are loaded, before it trains on anything it loaded."""
    import fcntl

    fs, fs_path = storage.filesystem(path)
    root = fs_path.rstrip("/")
    state = read_state(root, fs)
    listed = _listed_files(fs, root, path, {0, rank} & set(range(state["world_size"])))
    wanted = select(state, sorted(listed)) if select is not None else None
    if wanted is None:  # the whole checkpoint: what every rank's record lists
        listed = _listed_files(fs, root, path, set(range(state["world_size"])))
        wanted = sorted(listed)
    names = sorted(set(wanted) - {STATE_FILE})
    if not storage.is_remote(path):
        files, records = {n: Path(path) / n for n in names}, {n: listed[n] for n in names}
        _check_sizes(path, files, records)
        return Path(path), state, LocalCheck(path, files, records)
    locks = node_dir / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    held = []
    try:
        for name in names:  # in sorted order: ranks wanting the same files never wait on each other in a cycle
            handle = open(locks / (name.replace("/", "__") + ".lock"), "w")
            fcntl.flock(handle, fcntl.LOCK_EX)
            held.append(handle)
        missing = [
            n
            for n in names
            if not ((node_dir / n).is_file() and (node_dir / n).stat().st_size == listed_size(listed[n]))
        ]
        parts = {n: node_dir / f"{n}.part-{os.getpid()}" for n in missing}
        for part in parts.values():
            part.parent.mkdir(parents=True, exist_ok=True)
        crcs = _download(fs, root, path, {n: (parts[n], listed_size(listed[n])) for n in missing})
        _check_files(path, node_dir, {n: listed[n] for n in missing}, at=parts, crcs=crcs)
        for name, part in parts.items():
            os.replace(part, node_dir / name)  # whole and checked, or not there
    finally:
        for handle in held:
            handle.close()
    (node_dir / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
    return node_dir, state, None


class LocalCheck:
    """The CRC-32C check of a local checkpoint's files, shared with their readers. While it is
    pending, a reader that reads one of the files whole takes its check (`file_check`) and checks
    it from the bytes it reads; `result()` reads and checks, in parallel, the files no reader took,
    once (`exception()`: what `result()` raises, or None)."""

    def __init__(self, path: str, files: dict[str, Path], listed: dict[str, Any]):
        self.path, self._files, self._listed = path, files, listed
        self._checked, self._problem = False, None
        with _PENDING_LOCK:
            for name, file in files.items():
                _PENDING[os.path.realpath(file)] = (self, name)

    def result(self) -> None:
        if not self._checked:
            with _PENDING_LOCK:
                left = [n for n, f in self._files.items() if _PENDING.get(os.path.realpath(f), (None,))[0] is self]
                for name in left:
                    del _PENDING[os.path.realpath(self._files[name])]
            try:
                _check_crc32cs(self.path, {n: self._files[n] for n in left}, {n: self._listed[n] for n in left})
            except BaseException as error:
                self._problem = error
            self._checked = True
        if self._problem is not None:
            raise self._problem

    def exception(self) -> BaseException | None:
        try:
            self.result()
        except BaseException as error:
            return error
        return None

    def file_check(self, name: str) -> FileCheck:
        def fail(problem: str) -> None:
            raise IncompleteCheckpointError(self.path, f"{name} {problem}")

        return FileCheck(listed_size(self._listed[name]), listed_crc32c(self._listed[name]), fail)


_PENDING: dict[str, tuple[LocalCheck, str]] = {}  # a file's real path -> the pending check that lists it
_PENDING_LOCK = threading.Lock()


def file_check(path: str | Path) -> FileCheck | None:
    """The listed size and CRC-32C of a file of a local checkpoint being restored (`start_rank_copy`),
    for a reader that reads it whole and checks it as it reads; the pending check then leaves it out.
    None when no pending check lists the file (nothing to check, or it is checked already)."""
    with _PENDING_LOCK:
        check, name = _PENDING.pop(os.path.realpath(path), (None, None))
    return check.file_check(name) if check is not None else None


# A remote checkpoint's files come down in ranges of this many bytes, this many at a time (ranged
# GETs, as boto3's TransferManager downloads: one GET streaming a large file is far slower).
DOWNLOAD_RANGE_BYTES = 16 * 2**20
DOWNLOAD_THREADS = 10


def _download(fs, root: str, path: str, files: dict[str, tuple[Path, int]]) -> dict[str, int]:
    """Download each file name -> (local path, listed size) of checkpoint `path` (at `root` on `fs`)
    in ranges, concurrently, and return the CRC-32C of the bytes each got, joined from its ranges'
    as they arrived (so that the check need not read the file again)."""

    def fetch(name: str, fd: int, start: int, nbytes: int) -> tuple[int, int]:
        data = storage.with_retries(
            lambda: storage.read_range(fs, f"{root}/{name}", start, start + nbytes, threads=DOWNLOAD_THREADS),
            what=f"downloading {name} of checkpoint {path}",
        )
        view = memoryview(data)
        while view.nbytes:
            view = view[os.pwrite(fd, view, start + len(data) - view.nbytes) :]
        return crc32c_extend(0, data), len(data)

    descriptors = {
        name: os.open(local, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for name, (local, _) in files.items()
    }
    try:
        with ThreadPoolExecutor(max_workers=DOWNLOAD_THREADS, thread_name_prefix="vitray-ckpt-get") as pool:
            ranges = {
                name: [
                    pool.submit(fetch, name, descriptors[name], start, n)
                    for start, n in byte_ranges(size, DOWNLOAD_RANGE_BYTES)
                ]
                for name, (_, size) in files.items()
            }
            return {name: joined_crc32c(part.result() for part in parts) for name, parts in ranges.items()}
    finally:
        for fd in descriptors.values():
            os.close(fd)


def _check_files(
    path: str,
    folder: Path,
    listed: dict[str, Any],
    at: dict[str, Path] | None = None,
    crcs: dict[str, int] | None = None,
) -> None:
    """Raise IncompleteCheckpointError unless each file has its listed size and CRC-32C (the files'
    ranges read in parallel: `checksums.files_crc32c`; or `crcs`, computed as they were downloaded)."""
    files = {name: (at or {}).get(name) or folder / name for name in listed}
    _check_sizes(path, files, listed)
    _check_crc32cs(path, files, listed, crcs)


def _check_sizes(path: str, files: dict[str, Path], listed: dict[str, Any]) -> None:
    for name in sorted(listed):
        try:
            actual = files[name].stat().st_size
        except FileNotFoundError:
            raise IncompleteCheckpointError(path, f"{name} is missing") from None
        if actual != listed_size(listed[name]):
            raise IncompleteCheckpointError(
                path, f"{name} has {actual} bytes, its record lists {listed_size(listed[name])}"
            )


def _check_crc32cs(
    path: str, files: dict[str, Path], listed: dict[str, Any], crcs: dict[str, int] | None = None
) -> None:
    unknown = [n for n in listed if listed_crc32c(listed[n]) is not None and n not in (crcs or {})]
    crcs = {**(crcs or {}), **files_crc32c({n: (files[n], listed_size(listed[n])) for n in unknown})}
    for name in sorted(crcs):
        if listed_crc32c(listed[name]) is not None and crcs[name] != listed_crc32c(listed[name]):
            raise IncompleteCheckpointError(path, f"{name} does not have the CRC-32C its record lists (corrupt)")


def _listed_files(fs, root: str, path: str, ranks: set[int]) -> dict[str, Any]:
    """File name -> what the completion records of `ranks` list for it (a size, or size and CRC)."""
    records = sorted(f"{root}/{completion_record(r)}" for r in ranks)
    listed: dict[str, Any] = {}
    for text in storage.with_retries(
        lambda: fs.cat(records), what=f"reading the records of checkpoint {path}"
    ).values():
        listed.update(json.loads(text))
    return listed


def _forget_the_dead(folder: Path) -> None:
    """The marks of ranks of this node that are gone (a worker group torn down when one rank failed,
    a staging disk that filled): their `.users` markers, which kept the folder -- a whole staged
    checkpoint -- for ever, and their `.part-PID` files."""
    import psutil

    def gone(pid: str) -> bool:
        return pid.isdigit() and not psutil.pid_exists(int(pid))

    for marker in (folder / ".users").glob("*-*"):
        if gone(marker.name.split("-", 1)[0]):
            marker.unlink(missing_ok=True)
    for part in folder.rglob("*.part-*"):
        if gone(part.name.rsplit(".part-", 1)[1]):
            part.unlink(missing_ok=True)


@contextlib.contextmanager
def node_restore_dir(path: str, root: str | None = None) -> Iterator[Path]:
    """The folder the ranks of this node share for their copies of checkpoint `path` (under the
    system's temporary folder unless `root`); the last rank to leave removes it."""
    import fcntl
    import hashlib
    import shutil
    import tempfile
    import uuid

    base = Path(root or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    # Per user: on a node shared by several users the system's temporary folder is sticky, and a lock
    # file or folder another user made could not be opened for writing (PermissionError).
    user = os.getuid()
    folder = base / f"vitray-restore-{user}-{hashlib.sha1(path.encode()).hexdigest()[:16]}"
    guard = base / f"vitray-restore-{user}.lock"  # one lock file for all checkpoints: nothing left per resume
    me = folder / ".users" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(guard, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        me.parent.mkdir(parents=True, exist_ok=True)
        _forget_the_dead(folder)
        me.touch()
    try:
        yield folder
    finally:
        with open(guard, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            me.unlink(missing_ok=True)
            if not any(me.parent.iterdir()):
                shutil.rmtree(folder, ignore_errors=True)
