"""One checkpoint folder per save, written by every rank and merged by whoever uploads it.

Layout of a checkpoint folder:
  deepspeed/state/...        each rank's DeepSpeed shards (model, optimizer, schedule)
  model.safetensors          consolidated fp32 weights (rank 0) -- what `vitray export` reads
  ema.safetensors            the EMA weights, when enabled (rank 0)
  trainer_state.json         step, data-loader position, world size, resolved config (rank 0)
  complete-rank-NNNN.json    written by each rank LAST, listing its files and sizes

A checkpoint counts only when every rank's completion record is there and every file it lists
has the recorded size, so a half-written or half-uploaded checkpoint is never loaded.

Finding and opening checkpoints (local or s3://), the one way every command does it:
:func:`find_checkpoints` (a run's checkpoint folders, oldest first), :func:`latest_complete_checkpoint`,
:func:`resolve_checkpoint` (a checkpoint folder, or a run folder's latest complete one) and
:func:`load_checkpoint` (its model and trainer state).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from vitray.data import storage

STATE_FILE = "trainer_state.json"
MODEL_FILE = "model.safetensors"
EMA_FILE = "ema.safetensors"
_COMPLETE = "complete-rank-{rank:04d}.json"


class IncompleteCheckpointError(RuntimeError):
    pass


def write_state(folder: Path, state: dict[str, Any]) -> None:
    (folder / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))


def read_state(folder: str | Path, fs=None) -> dict[str, Any]:
    fs = fs or fsspec.filesystem("file")
    with fs.open(f"{folder}/{STATE_FILE}", "r") as f:
        return json.load(f)


def mark_complete(folder: Path, rank: int, files: list[Path]) -> None:
    """Record this rank's files; called after they are fully written."""
    listing = {str(p.relative_to(folder)): p.stat().st_size for p in files}
    record = folder / _COMPLETE.format(rank=rank)
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps(listing, indent=1, sort_keys=True))
    os.replace(tmp, record)


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("complete-rank-"))


def verify_complete(folder: str | Path, fs=None) -> dict[str, Any]:
    """Raises IncompleteCheckpointError unless all ranks finished; returns the trainer state.

    `folder` is local, or remote with the fsspec filesystem `fs` (S3 for `vitray runs`/`export`).
    """
    fs = fs or fsspec.filesystem("file")
    folder = str(folder).rstrip("/")
    if not fs.isfile(f"{folder}/{STATE_FILE}"):
        raise IncompleteCheckpointError(f"checkpoint {folder} has no {STATE_FILE}: it was not finished")
    state = read_state(folder, fs)
    sizes = {info["name"].rstrip("/"): info["size"] for info in fs.find(folder, detail=True).values()}
    prefix = fs._strip_protocol(folder).rstrip("/")
    # The listing above says which records exist; they are then read in one call, which s3fs
    # sends concurrently (not one request after another: 1,024 round trips in turn at 1,024 ranks).
    records = [f"{prefix}/{_COMPLETE.format(rank=rank)}" for rank in range(state["world_size"])]
    for rank, record in enumerate(records):
        if record not in sizes:
            raise IncompleteCheckpointError(f"checkpoint {folder}: rank {rank} never finished writing it")
    contents = fs.cat(records) if records else {}
    for record in records:
        listing = json.loads(contents[record])
        for name, size in listing.items():
            if sizes.get(f"{prefix}/{name}") != size:
                raise IncompleteCheckpointError(f"checkpoint {folder}: {name} is missing or truncated")
    return state


# Picks, from a complete checkpoint's trainer state and its files, those one rank reads to resume
# (the backend knows its own files: `deepspeed_backend.restore_files`); None: all of them.
FileSelector = Callable[[dict[str, Any], list[str]], "list[str] | None"]


def rank_copy(path: str, select: FileSelector, node_dir: Path, rank: int) -> tuple[Path, dict[str, Any]] | None:
    """A local folder with what rank `rank` reads of the complete checkpoint `path` (local or
    s3://), and its trainer state; None when `select` wants the whole checkpoint (the caller then
    copies it whole).

    A local checkpoint is its own copy. Of a remote one, only the files `select` picks are
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
    records = sorted({f"{root}/{_COMPLETE.format(rank=r)}" for r in (0, rank) if r < state["world_size"]})
    sizes: dict[str, int] = {}
    for text in storage.with_retries(
        lambda: fs.cat(records), what=f"reading the records of checkpoint {path}"
    ).values():
        sizes.update(json.loads(text))
    wanted = select(state, sorted(sizes))
    if wanted is None:
        return None
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
                    f"checkpoint {path}: {name} came down with {part.stat().st_size} bytes, its record lists {sizes[name]}"
                )
            os.replace(part, node_dir / name)  # whole, or not there
    finally:
        for handle in held:
            handle.close()
    (node_dir / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
    return node_dir, state


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


def load_model(folder: str, fs=None, *, ema: bool = True):
    """The trained model stored in a complete checkpoint folder (built from its own config), and
    the checkpoint's trainer state, with the weights file read under ``"weights_file"``.

    With ``ema`` (the default) a run trained with ``optim.ema_decay`` gives its EMA weights -- the
    averaged weights are the model, as the paper reports its Polyak-averaged models; ``ema=False``
    (or a run without EMA) gives the raw weights."""
    from safetensors.torch import load

    from vitray.models import ModelConfig, create_model_from_config

    fs = fs or fsspec.filesystem("file")
    state = verify_complete(folder, fs)
    model = create_model_from_config(ModelConfig.model_validate(state["model"]), int(state["num_classes"]))
    name = EMA_FILE if ema and fs.isfile(f"{str(folder).rstrip('/')}/{EMA_FILE}") else MODEL_FILE
    with fs.open(f"{str(folder).rstrip('/')}/{name}", "rb") as f:
        model.load_state_dict(load(f.read()), strict=True)
    return model, {**state, "weights_file": name}


# ---------------------------------------------------------------------------------------------
# Finding and opening checkpoints by path (local or s3://)
# ---------------------------------------------------------------------------------------------


@dataclass
class CheckpointInfo:
    path: str
    step: int | None
    complete: bool
    problem: str = ""


def is_checkpoint(path: str) -> bool:
    """True for a checkpoint folder (complete or not), False for anything else (e.g. a run folder)."""
    fs, fs_path = storage.filesystem(path)
    return fs.isfile(f"{fs_path.rstrip('/')}/{STATE_FILE}")


def checkpoint_state(path: str) -> dict[str, Any]:
    """The trainer state of the complete checkpoint folder `path` (IncompleteCheckpointError otherwise)."""
    fs, fs_path = storage.filesystem(path)
    return verify_complete(fs_path, fs)


def find_checkpoints(run_dir: str) -> list[CheckpointInfo]:
    """The run's checkpoint folders (Ray Train names them checkpoint_<time>), complete or not,
    oldest first."""
    fs, root = storage.filesystem(run_dir)
    protocol_root = str(run_dir).rstrip("/")
    found = []
    for name in storage.list_names(run_dir):
        if not name.startswith("checkpoint_") or not fs.isdir(f"{root}/{name}"):
            continue
        path = storage.join(protocol_root, name)
        try:
            state = verify_complete(f"{root}/{name}", fs)
            found.append(CheckpointInfo(path, int(state["step"]), True))
        except (IncompleteCheckpointError, KeyError, ValueError) as err:
            found.append(CheckpointInfo(path, None, False, str(err)))
    return sorted(found, key=lambda c: (c.step is None, c.step or 0, c.path))


def latest_complete_checkpoint(run_dir: str) -> CheckpointInfo | None:
    complete = [c for c in find_checkpoints(run_dir) if c.complete]
    return complete[-1] if complete else None


def resume_point(run_dir: str) -> tuple[CheckpointInfo | None, list[CheckpointInfo]]:
    """Where a re-run of the run resumes: its newest complete checkpoint (None: from scratch), and
    the checkpoints newer than that which are not complete, each with what is wrong with it (an
    unfinished write or a cut-short upload), so that a fall back to an older one says why."""
    found = find_checkpoints(run_dir)
    complete = [c for c in found if c.complete]
    chosen = complete[-1] if complete else None
    # Incomplete folders carry no readable step: newer means a later folder name (Ray names them
    # checkpoint_<date-time>), which sorts in time order.
    skipped = [
        c for c in found if not c.complete and (chosen is None or _folder_name(c.path) > _folder_name(chosen.path))
    ]
    return chosen, skipped


def prune_checkpoints(run_dir: str, keep: int) -> list[str]:
    """Delete the run's checkpoint folders older than its `keep` newest complete ones; returns
    their paths.

    Only what a complete checkpoint has superseded goes: the `keep` newest complete ones stay, and
    so does everything newer than the oldest of them, complete or not (an upload still under
    way). Ray Train's own rotation (`num_to_keep`) is not used: it counts the checkpoints it
    uploaded, and an upload whose last write failed in silence would count, so a few such failures
    in a row could delete the last complete checkpoint."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    found = find_checkpoints(run_dir)
    complete = [c for c in found if c.complete]
    if len(complete) <= keep:
        return []
    oldest_kept = _folder_name(complete[-keep].path)
    doomed = [c.path for c in found if _folder_name(c.path) < oldest_kept]
    for path in doomed:
        fs, fs_path = storage.filesystem(path)
        with contextlib.suppress(FileNotFoundError):  # another prune (rank 0's, the driver's) got there first
            fs.rm(fs_path, recursive=True)
    return doomed


def describe_resume(run_name: str, chosen: CheckpointInfo | None, skipped: list[CheckpointInfo]) -> str:
    """The line a (re-)started run prints: where it resumes and, on a fall back, why."""
    if chosen is None:
        line = f"starting {run_name} from scratch (no complete checkpoint)"
    else:
        line = f"resuming {run_name} from step {chosen.step} ({chosen.path})"
    for c in skipped:
        line += f"\n  skipped newer checkpoint {c.path}: {c.problem}"
    return line


def _folder_name(path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def resolve_checkpoint(path: str) -> str:
    """A complete checkpoint folder as given, or the latest complete checkpoint of a run folder."""
    if is_checkpoint(path):
        checkpoint_state(path)
        return path
    latest = latest_complete_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(
            f"{path} is neither a checkpoint folder (no {STATE_FILE}) nor a run folder with a complete "
            "checkpoint (see `vitray runs STORAGE`)"
        )
    return latest.path


def load_checkpoint(path: str, *, ema: bool = True):
    """The model of a checkpoint (or of a run's latest complete one) and its trainer state, with
    the checkpoint folder it came from under ``"checkpoint"``; its EMA weights when it has them
    and ``ema`` is true (see :func:`load_model`)."""
    checkpoint = resolve_checkpoint(path)
    fs, fs_path = storage.filesystem(checkpoint)
    model, state = load_model(fs_path, fs, ema=ema)
    return model, {**state, "checkpoint": checkpoint}
