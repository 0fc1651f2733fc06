"""One rank's share of a checkpoint folder: its files written straight into the run folder (local
or s3://), durably, and its completion record last.

The layout, and when a checkpoint counts as complete, are `vitray.runfolder.checkpoint_folders`'s
(which the driver reads). Each file is written once, where it stays: on a local disk it is
fsynced as it is closed, and every folder that gained an entry is fsynced before the rank's
completion record, which is written last, to a temporary name, fsynced and renamed into place --
so a power loss or a kill -9 at any moment leaves either a whole record over whole files or no
record. On S3 an object exists only once its upload is complete (a multipart upload whose parts go
up, in parallel, as they are serialised), and the record is PUT after every file. The record lists each
file's size and CRC-32C, which a restore checks (`vitray.trainers.checkpoint.checked_copy`).
When to save and the background write are `vitray.trainers.checkpoint.checkpointer`'s, which uses
these.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from vitray import storage
from vitray.runfolder.checkpoint_folders import COMPLETION_PREFIX, EMA_FILE, MODEL_FILE, STATE_FILE, completion_record
from vitray.trainers.checkpoint.checksums import RunningCrc32c, files_crc32c
from vitray.trainers.engines.seam import Written

__all__ = [
    "EMA_FILE",
    "MODEL_FILE",
    "STATE_FILE",
    "Written",
    "checkpoint_name",
    "files_under",
    "mark_complete",
    "sync_folders",
    "write_bytes",
    "write_file",
    "write_state",
]


# Digits of the step in a checkpoint's name: a trillion steps.
STEP_DIGITS = 12


def checkpoint_name(step: int, now: datetime | None = None) -> str:
    """A new checkpoint folder's name: its step, zero-padded, then rank 0's clock in UTC
    (``checkpoint_s000000005000_2026-12-06_02-30-21.123456``; `now`: that clock's reading, a UTC
    datetime). Rank 0 picks it and tells the others.

    The names sort in the run's order (`checkpoint_folders` relies on it): by step, and a step
    trained again (after a fall back from a damaged checkpoint) after its earlier try. A clock
    alone did not: rank 0 on a node in another time zone, a daylight-saving hour run twice or a
    clock behind named a newer checkpoint as older, so a resume took the older one and a prune
    deleted the newer. The ``s`` sorts after the digits of the date-time names of earlier vitrays
    (``checkpoint_2026-...``, Ray Train's form), so a run an earlier vitray began goes on in order."""
    if step < 0 or step >= 10**STEP_DIGITS:
        raise ValueError(f"a checkpoint's step must be within 0..{10**STEP_DIGITS - 1}, got {step}")
    return f"checkpoint_s{step:0{STEP_DIGITS}d}_{(now or datetime.now(UTC)).strftime('%Y-%m-%d_%H-%M-%S.%f')}"


def write_file(folder: str, name: str, write: Callable[[IO[bytes]], None]) -> Written:
    """Write the checkpoint file `name` (relative, `/`-separated) of `folder` (a local path or a
    URL) once, where it stays, through `write(f)`. Locally the file is written past the page cache
    and fsynced before this returns (`storage.DirectFile`; its folder's entry is `sync_folders`'s);
    remotely its parts go up as they are serialised (`storage.UploadStream`: a multipart upload,
    parts in parallel), riding out an outage of the store (the worker's run.storage_outage_s)."""
    crc = RunningCrc32c()  # computed as each buffer or part goes out, beside the write before it
    if storage.is_remote(folder):
        # An outage of the store is waited for (run.storage_outage_s), not spent as a restart.
        what = f"uploading {name} of checkpoint {folder}"
        with storage.UploadStream(storage.join(folder, name), what=what, on_bytes=crc.update) as f:
            write(f)
        return Written(name, f.size, crc.value)
    path = os.path.join(folder, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with storage.DirectFile(path, on_bytes=crc.update) as f:
        write(f)
    return Written(name, f.size, crc.value)


def write_bytes(folder: str, name: str, data: bytes) -> Written:
    return write_file(folder, name, lambda f: f.write(data))


def write_state(folder: str, state: dict[str, Any]) -> Written:
    return write_bytes(folder, STATE_FILE, json.dumps(state, indent=2, sort_keys=True).encode())


def sync_folders(folder: str, written: list[Written]) -> None:
    """Make the entries of the files in `written` durable: fsync every local folder that holds one,
    up to the checkpoint folder and the run folder above it (which gained the checkpoint folder's
    entry). Nothing to do on an object store."""
    if storage.is_remote(folder):
        return
    root = Path(folder)
    # A rank that wrote no file (ZeRO-0: DeepSpeed saves from rank 0 alone) still records its
    # completion in the folder, which rank 0 may not have made yet.
    root.mkdir(parents=True, exist_ok=True)
    folders = {root, root.parent}
    for w in written:
        parent = (root / w.name).parent
        while parent != root and parent not in folders:
            folders.add(parent)
            parent = parent.parent
    for path in sorted(folders, key=lambda p: len(p.parts), reverse=True):  # the deepest first
        storage.fsync_folder(path)


def mark_complete(folder: str | Path, rank: int, written: list[Written] | list[Path]) -> None:
    """Record this rank's files (name -> size and CRC-32C), last: after every file it lists is
    whole and durable (`write_file`, `sync_folders`). Locally: a temporary file, fsynced, renamed
    into place and its folder fsynced; on S3 one PUT (an object appears whole or not at all).
    Files may also be given as local paths under `folder` (read for their size and CRC)."""
    folder = str(folder)
    written = [w if isinstance(w, Written) else _read_written(Path(folder), Path(w)) for w in written]
    listing = {w.name: {"size": w.size, "crc32c": f"{w.crc32c:08x}"} for w in written}
    data = json.dumps(listing, indent=1, sort_keys=True).encode()
    name = completion_record(rank)
    if storage.is_remote(folder):
        write_bytes(folder, name, data)
        return
    tmp = os.path.join(folder, f".{name}.tmp")
    write_bytes(folder, f".{name}.tmp", data)
    os.replace(tmp, os.path.join(folder, name))
    storage.fsync_folder(Path(folder))


def _read_written(folder: Path, path: Path) -> Written:
    size = path.stat().st_size
    return Written(path.relative_to(folder).as_posix(), size, files_crc32c({"": (path, size)})[""])


def files_under(folder: Path) -> list[Path]:
    """The files of a local checkpoint folder but the completion records."""
    return sorted(p for p in Path(folder).rglob("*") if p.is_file() and not p.name.startswith(COMPLETION_PREFIX))
