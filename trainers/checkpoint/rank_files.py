"""One rank's side of a checkpoint folder: writing its files and its completion record, and the
local copy of the checkpoint it resumes from.

The layout, and when a checkpoint counts as complete, are `vitray.runfolder.checkpoint_folders`'s
(which the driver reads); the rank writes its completion record last, after every file it lists.
When to save, the background write and restoring are `vitray.trainers.checkpoint.checkpointer`'s, which uses
these.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vitray import storage
from vitray.runfolder.checkpoint_folders import (
    COMPLETION_PREFIX,
    EMA_FILE,
    MODEL_FILE,
    STATE_FILE,
    IncompleteCheckpointError,
    completion_record,
    read_state,
)
from vitray.trainers.engines.seam import FileSelector

__all__ = [
    "EMA_FILE",
    "MODEL_FILE",
    "STATE_FILE",
    "files_under",
    "mark_complete",
    "node_restore_dir",
    "rank_copy",
    "write_state",
]


def write_state(folder: Path, state: dict[str, Any]) -> None:
    (folder / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))


def mark_complete(folder: Path, rank: int, files: list[Path]) -> None:
    """Record this rank's files; called after they are fully written."""
    listing = {str(p.relative_to(folder)): p.stat().st_size for p in files}
    record = folder / completion_record(rank)
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps(listing, indent=1, sort_keys=True))
    os.replace(tmp, record)


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(COMPLETION_PREFIX))


def rank_copy(path: str, select: FileSelector | None, node_dir: Path, rank: int) -> tuple[Path, dict[str, Any]]:
    """A local folder with what rank `rank` reads of the complete checkpoint `path` (local or
    s3://), and its trainer state.

    A local checkpoint is its own copy. Of a remote one, only the files `select` picks (the
    engine's `restore_files`; all of them when it is None or picks None) are
    downloaded (concurrently, each checked against the size its completion record lists) into
    `node_dir`, a folder the ranks of one node share (`node_restore_dir`): the files every rank
    reads (module states, EMA weights) come down once per node, each rank's own shards once, and
    no other rank's shards. The checkpoint must already be known complete (the driver or rank 0
    verified it): this reads the trainer state and the records of rank 0 (the shared files) and of
    `rank` only, so a resume costs each rank a constant number of requests, not one per rank."""
    import fcntl

    fs, fs_path = storage.filesystem(path)
    root = fs_path.rstrip("/")
    state = read_state(root, fs)
    if not storage.is_remote(path):
        return Path(path), state
    sizes = _listed_files(fs, root, path, {0, rank} & set(range(state["world_size"])))
    wanted = select(state, sorted(sizes)) if select is not None else None
    if wanted is None:  # the whole checkpoint: what every rank's record lists
        sizes = _listed_files(fs, root, path, set(range(state["world_size"])))
        wanted = sorted(sizes)
    names = sorted(set(wanted) - {STATE_FILE})
    locks = node_dir / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    held = []
    try:
        for name in names:  # in sorted order: ranks wanting the same files never wait on each other in a cycle
            handle = open(locks / (name.replace("/", "__") + ".lock"), "w")
            fcntl.flock(handle, fcntl.LOCK_EX)
            held.append(handle)
        missing = [n for n in names if not ((node_dir / n).is_file() and (node_dir / n).stat().st_size == sizes[n])]
        parts = {n: node_dir / f"{n}.part-{os.getpid()}" for n in missing}
        for part in parts.values():
            part.parent.mkdir(parents=True, exist_ok=True)
        if missing:
            storage.with_retries(
                lambda: fs.get([f"{root}/{n}" for n in missing], [str(parts[n]) for n in missing]),
                what=f"downloading {len(missing)} files of checkpoint {path}",
            )
        for name, part in parts.items():
            if part.stat().st_size != sizes[name]:
                raise IncompleteCheckpointError(
                    path, f"{name} came down with {part.stat().st_size} bytes, its record lists {sizes[name]}"
                )
            os.replace(part, node_dir / name)  # whole, or not there
    finally:
        for handle in held:
            handle.close()
    (node_dir / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
    return node_dir, state


def _listed_files(fs, root: str, path: str, ranks: set[int]) -> dict[str, int]:
    """File name -> size, as the completion records of `ranks` list them."""
    records = sorted(f"{root}/{completion_record(r)}" for r in ranks)
    sizes: dict[str, int] = {}
    for text in storage.with_retries(
        lambda: fs.cat(records), what=f"reading the records of checkpoint {path}"
    ).values():
        sizes.update(json.loads(text))
    return sizes


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
    folder = base / f"vitray-restore-{hashlib.sha1(path.encode()).hexdigest()[:16]}"
    guard = base / "vitray-restore.lock"  # one lock file for all checkpoints: nothing left behind per resume
    me = folder / ".users" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(guard, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        me.parent.mkdir(parents=True, exist_ok=True)
        me.touch()
    try:
        yield folder
    finally:
        with open(guard, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            me.unlink(missing_ok=True)
            if not any(me.parent.iterdir()):
                shutil.rmtree(folder, ignore_errors=True)
