"""A run's checkpoint folders as the driver (and whoever reads a checkpoint) sees them: the layout,
when one counts, which one a run resumes from, and opening one.

Layout of a checkpoint folder:
  deepspeed/state/...        each rank's DeepSpeed shards (optimizer with the fp32 master weights,
                             schedule; the module states hold no weight the master copy gives)
  model.safetensors          consolidated fp32 weights (rank 0), at the checkpoints that
                             `checkpoint.model_weights` asks for -- what evaluation and export read
  ema.safetensors            the EMA weights, when enabled (rank 0)
  trainer_state.json         step, data-loader position, world size, resolved config (rank 0)
  complete-rank-NNNN.json    written by each rank LAST, listing its files with their sizes and
                             CRC-32C (checkpoints written before: sizes only)

A checkpoint counts only when every rank's completion record is there and every file it lists
has the recorded size, so a half-written or half-uploaded checkpoint is never loaded. The ranks
write it straight into the run folder, durably, the record last
(`vitray.trainers.checkpoint.rank_files`); everything here only reads.

Finding and opening checkpoints (local or s3://), the one way every command does it:
:func:`find_checkpoints` (a run's checkpoint folders, oldest first, each checked),
:func:`resume_point` (the one answer to "which checkpoint does this run resume from", for the
driver, pre-flight and the workers), :func:`latest_complete_checkpoint` (the same checkpoint),
:func:`resolve_checkpoint` (a checkpoint folder, or a run folder's latest complete one) and
:func:`load_checkpoint` (its model and trainer state). Each checks a checkpoint's completion
records once and hands on what it read (`CheckpointInfo.state`), so a use of a checkpoint -- a
listing, a resume, a load -- reads them once, not once per step of the way.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import google_crc32c

from vitray import storage
from vitray.runfolder import derived_weights
from vitray.runfolder.pins import CheckpointPins, pinned_checkpoints

STATE_FILE = "trainer_state.json"
MODEL_FILE = "model.safetensors"
EMA_FILE = "ema.safetensors"
# Written into a checkpoint that was found corrupt as a resume read it (a file without the CRC-32C
# its record lists): from then on it does not count, and the next resume takes the one before it.
CORRUPT_FILE = "vitray-corrupt.json"
# Checkpoint folders a listing checks at once (each a few small reads).
CHECKS_AT_ONCE = 16
COMPLETION_PREFIX = "complete-rank-"
_COMPLETE = COMPLETION_PREFIX + "{rank:04d}.json"


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint that does not count; `reason` says why without its path (what `vitray runs`
    and a run's resume line show next to the checkpoint)."""

    def __init__(self, folder: str, reason: str = ""):
        # One argument: a whole message (how pickle, e.g. Ray returning the error, rebuilds it).
        super().__init__(f"checkpoint {folder}: {reason}" if reason else folder)
        self.reason = reason or folder


# The layout of the checkpoint folders this vitray writes (recorded in each trainer state, with the
# version of vitray that wrote it). One of a later layout, from a newer vitray, is refused by name
# rather than read wrongly; a state without the key is of layout 1.
CHECKPOINT_FORMAT = 1


def vitray_version() -> str:
    """The installed vitray's version ("unknown" from a checkout never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vitray")
    except PackageNotFoundError:
        return "unknown"


def writer_record() -> dict[str, Any]:
    """What a checkpoint's trainer state says of what wrote it."""
    return {"checkpoint_format": CHECKPOINT_FORMAT, "vitray_version": vitray_version()}


class NewerCheckpointFormat(IncompleteCheckpointError):
    """A checkpoint of a layout this vitray does not know (a newer vitray wrote it)."""


def refuse_newer_format(folder: str, state: dict[str, Any]) -> None:
    """Raises NewerCheckpointFormat for a trainer state of a later checkpoint layout than this vitray's."""
    written = state.get("checkpoint_format", 1)
    if isinstance(written, int) and written > CHECKPOINT_FORMAT:
        raise NewerCheckpointFormat(
            folder,
            f"vitray {state.get('vitray_version', '?')} wrote it in checkpoint format {written}, and this vitray "
            f"({vitray_version()}) reads format {CHECKPOINT_FORMAT}: upgrade vitray to read it",
        )


def completion_record(rank: int) -> str:
    """The name of rank `rank`'s completion record in a checkpoint folder."""
    return _COMPLETE.format(rank=rank)


def listed_size(entry: Any) -> int:
    """The size a completion record lists for a file (an entry is {"size", "crc32c"}, or the bare
    size in checkpoints written before CRCs were listed)."""
    return int(entry["size"]) if isinstance(entry, dict) else int(entry)


def listed_crc32c(entry: Any) -> int | None:
    """The CRC-32C a completion record lists for a file, or None (an older record: sizes only)."""
    return int(entry["crc32c"], 16) if isinstance(entry, dict) and "crc32c" in entry else None


def read_state(folder: str | Path, fs=None) -> dict[str, Any]:
    fs = fs or fsspec.filesystem("file")
    with fs.open(f"{folder}/{STATE_FILE}", "r") as f:
        return json.load(f)


def verify_complete(folder: str | Path, fs=None) -> dict[str, Any]:
    """Raises IncompleteCheckpointError unless all ranks finished; returns the trainer state.

    `folder` is local, or remote with the fsspec filesystem `fs` (S3 for `vitray runs`/`export`).
    """
    fs = fs or fsspec.filesystem("file")
    folder = str(folder).rstrip("/")
    if not fs.isfile(f"{folder}/{STATE_FILE}"):
        raise IncompleteCheckpointError(folder, f"no {STATE_FILE}: it was not finished")
    state = read_state(folder, fs)
    sizes = {info["name"].rstrip("/"): info["size"] for info in fs.find(folder, detail=True).values()}
    prefix = fs._strip_protocol(folder).rstrip("/")
    if f"{prefix}/{CORRUPT_FILE}" in sizes:
        raise IncompleteCheckpointError(folder, f"found corrupt by a resume: {_corrupt_reason(fs, folder)}")
    # The listing above says which records exist; they are then read in one call, which s3fs
    # sends concurrently (not one request after another: 1,024 round trips in turn at 1,024 ranks).
    records = [f"{prefix}/{_COMPLETE.format(rank=rank)}" for rank in range(state["world_size"])]
    for rank, record in enumerate(records):
        if record not in sizes:
            raise IncompleteCheckpointError(folder, f"rank {rank} never finished writing it")
    contents = fs.cat(records) if records else {}
    for rank, record in enumerate(records):
        try:
            listing = json.loads(contents[record])
        except ValueError:
            listing = None
        if not isinstance(listing, dict):  # (a damaged record: the trainer state may be whole)
            raise IncompleteCheckpointError(
                folder, f"rank {rank}'s completion record {_COMPLETE.format(rank=rank)} is unreadable"
            )
        for name, entry in listing.items():
            if sizes.get(f"{prefix}/{name}") != listed_size(entry):
                raise IncompleteCheckpointError(folder, f"{name} is missing or truncated")
    return state


def mark_corrupt(folder: str, reason: str) -> None:
    """Records in the checkpoint `folder` (local or s3://) that reading it found `reason` (a file
    that is not what its record lists), so that it no longer counts (:func:`verify_complete`): a
    re-run, or Ray's restart of the worker group, resumes from the checkpoint before it instead of
    failing on this one again. Best effort: where the write fails the error still stops the run."""
    with contextlib.suppress(OSError):
        storage.write_bytes_atomic(storage.join(folder, CORRUPT_FILE), json.dumps({"reason": reason}).encode())


def marked_corrupt(folder: str) -> bool:
    """Whether a resume found the checkpoint `folder` corrupt (:func:`mark_corrupt`): one request."""
    return storage.exists(storage.join(folder, CORRUPT_FILE))


def _corrupt_reason(fs, folder: str) -> str:
    try:
        return str(json.loads(fs.cat(f"{folder}/{CORRUPT_FILE}"))["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        return "(no reason recorded)"


def load_model(
    folder: str,
    fs=None,
    *,
    ema: bool = True,
    state: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    weights: bool = True,
):
    """The trained model stored in a complete checkpoint folder (built from its own config), and
    the checkpoint's trainer state, with the weights file read under ``"weights_file"``
    (``weights=False``: the model as built, its weights not read -- their shapes only matter, as
    where other weights replace them at once). `state`:
    the trainer state of a checkpoint this use already verified (`CheckpointInfo.state`): it is
    not verified again. `settings`: how the model is to train (`vitray.models.config.TRAINING_SETTINGS`:
    dropout, activation checkpointing), in place of the checkpoint's.

    With ``ema`` (the default) a run trained with ``optim.ema_decay`` gives its EMA weights -- the
    averaged weights are the model, as the paper reports its Polyak-averaged models; ``ema=False``
    (or a run without EMA) gives the raw weights. A checkpoint written without the consolidated
    weights (`checkpoint.model_weights`) has them derived from its shards (``"weights_file"`` then
    names the shards)."""
    from safetensors.torch import load

    from vitray.models import ModelConfig, create_model_from_config

    fs = fs or fsspec.filesystem("file")
    folder = str(folder).rstrip("/")
    state = state if state is not None else verify_complete(folder, fs)
    model = create_model_from_config(
        ModelConfig.model_validate({**state["model"], **(settings or {})}), int(state["num_classes"])
    )
    if not weights:
        return model, {**state, "weights_file": None}
    name = EMA_FILE if ema and fs.isfile(f"{folder}/{EMA_FILE}") else MODEL_FILE
    if name == MODEL_FILE and not fs.isfile(f"{folder}/{MODEL_FILE}"):
        model.load_state_dict(model_weights(folder, fs, state), strict=True)
        return model, {**state, "weights_file": derived_weights.SHARDS}
    model.load_state_dict(load(_read_checked(folder, fs, name, _listed_files(folder, fs, ranks=[0]))), strict=True)
    return model, {**state, "weights_file": name}


def _listed_files(folder: str, fs, ranks) -> dict[str, Any]:
    """The files that the completion records of `ranks` list, by name, with their sizes and CRCs
    (read in one call; a record that cannot be read lists nothing: `verify_complete` read it a
    moment ago, so the folder is being pruned, and the read of its files says so)."""
    records = [f"{folder}/{completion_record(rank)}" for rank in ranks]
    try:
        contents = fs.cat(records) if records else {}
    except OSError:
        return {}
    listed: dict[str, Any] = {}
    for content in contents.values():
        with contextlib.suppress(ValueError):
            listing = json.loads(content)
            listed.update(listing if isinstance(listing, dict) else {})
    return listed


def _read_checked(folder: str, fs, name: str, listed: dict[str, Any]) -> bytes:
    """The whole file `name` of the complete checkpoint `folder`, checked against the CRC-32C its
    record lists (`listed`: :func:`_listed_files`; rank 0 writes the model's and the EMA's weights).
    Completeness is checked by size (`verify_complete`): a bit flipped at rest or in transit
    passes that, and weights read from such a file were evaluated and exported without a word. A
    record of an older vitray lists no CRC: nothing to check against."""
    with fs.open(f"{folder}/{name}", "rb") as f:
        data = f.read()
    listed_crc = listed_crc32c(listed.get(name))
    if listed_crc is not None and google_crc32c.value(data) != listed_crc:
        raise IncompleteCheckpointError(
            folder,
            f"{name} does not have the CRC-32C its record lists: the file was damaged after it was written. "
            "Give an earlier checkpoint folder of the run instead",
        )
    return data


def model_weights(folder: str, fs, state: dict[str, Any]) -> dict[str, Any]:
    """The consolidated fp32 weights of a complete checkpoint: its `model.safetensors`, or, for one
    written without them, derived from its shards (the fp32 master copy the optimizer keeps)."""
    from safetensors.torch import load

    folder = str(folder).rstrip("/")
    if fs.isfile(f"{folder}/{MODEL_FILE}"):
        return load(_read_checked(folder, fs, MODEL_FILE, _listed_files(folder, fs, ranks=[0])))
    prefix = fs._strip_protocol(folder).rstrip("/")
    names = {info.rstrip("/")[len(prefix) + 1 :] for info in fs.find(folder)}
    if not derived_weights.derivable(state, names):
        raise IncompleteCheckpointError(
            folder,
            f"it holds no {MODEL_FILE} (checkpoint.model_weights) and its weights cannot be derived from its "
            f"{state.get('backend', 'deepspeed')} shards here: use a checkpoint written with them (the run's last one)",
        )
    listed = _listed_files(folder, fs, ranks=range(int(state["world_size"])))
    return derived_weights.derive(folder, fs, state, read=lambda name: _read_checked(folder, fs, name, listed))


# ---------------------------------------------------------------------------------------------
# Finding and opening checkpoints by path (local or s3://)
# ---------------------------------------------------------------------------------------------


@dataclass
class CheckpointInfo:
    path: str
    step: int | None
    complete: bool
    problem: str = ""  # why it does not count (an incomplete one): what `vitray runs` shows
    state: dict[str, Any] | None = field(default=None, repr=False, compare=False)  # a complete one's trainer state
    # When chosen for a run folder: its newer checkpoints that do not count, each with why.
    passed_over: list[CheckpointInfo] = field(default_factory=list, repr=False, compare=False)


def check_checkpoint(path: str) -> CheckpointInfo | None:
    """The checkpoint folder `path` (local or s3://), its completion records read once: complete
    with its step and trainer state, or not, with why. None when there is no checkpoint there after
    all: deleted meanwhile (another process's prune), or a prefix with nothing under it, which an
    object store may go on listing for minutes after the folder was deleted (SeaweedFS does)."""
    fs, fs_path = storage.filesystem(path)
    try:
        state = verify_complete(fs_path, fs)
        return CheckpointInfo(str(path).rstrip("/"), int(state["step"]), True, state=state)
    except IncompleteCheckpointError as err:
        if not storage.holds_files(path):
            return None
        return CheckpointInfo(str(path).rstrip("/"), None, False, err.reason)
    except FileNotFoundError:
        return None
    except (KeyError, ValueError) as err:  # a trainer state that is not vitray's
        return CheckpointInfo(
            str(path).rstrip("/"), None, False, f"unreadable {STATE_FILE} ({type(err).__name__}: {err})"
        )


def is_checkpoint(path: str) -> bool:
    """True for a checkpoint folder (complete or not), False for anything else (e.g. a run folder)."""
    fs, fs_path = storage.filesystem(path)
    return fs.isfile(f"{fs_path.rstrip('/')}/{STATE_FILE}")


def checkpoint_state(path: str) -> dict[str, Any]:
    """The trainer state of the complete checkpoint folder `path` (IncompleteCheckpointError otherwise)."""
    fs, fs_path = storage.filesystem(path)
    return verify_complete(fs_path, fs)


def checkpoint_folders(run_dir: str) -> list[str]:
    """The paths of the run's checkpoint folders, complete or not, oldest first: their names sort
    in the run's order (`checkpoint_s<step>_<UTC time>`; an earlier vitray's `checkpoint_<date-time>`
    before them, `trainers.checkpoint.rank_files.checkpoint_name`). One listing; nothing is verified."""
    fs, root = storage.filesystem(run_dir)
    protocol_root = str(run_dir).rstrip("/")
    names = sorted(n for n in storage.list_names(run_dir) if n.startswith("checkpoint_") and fs.isdir(f"{root}/{n}"))
    return [storage.join(protocol_root, name) for name in names]


def find_checkpoints(run_dir: str, *, leaving_out: Collection[str] = ()) -> list[CheckpointInfo]:
    """The run's checkpoint folders, each checked once (:func:`check_checkpoint`), complete or not:
    oldest step first, the incomplete ones (no readable step) last. The folders are checked
    concurrently (a few requests each, a round trip apart on an object store: a run keeping
    hundreds of checkpoints took minutes one by one); `leaving_out`: paths not to check (a
    watcher's checkpoints already seen)."""
    folders = [path for path in checkpoint_folders(run_dir) if path not in leaving_out]
    with ThreadPoolExecutor(min(CHECKS_AT_ONCE, len(folders) or 1), thread_name_prefix="vitray-check") as pool:
        found = [c for c in pool.map(check_checkpoint, folders) if c is not None]
    return sorted(found, key=lambda c: (c.step is None, c.step or 0, c.path))


def resume_point(
    run_dir: str, *, known: CheckpointInfo | None = None
) -> tuple[CheckpointInfo | None, list[CheckpointInfo]]:
    """Where the run at `run_dir` resumes: its newest complete checkpoint (None: from scratch), and
    the checkpoints newer than that which are not complete, each with what is wrong with it (an
    unfinished write or a cut-short upload), so that a fall back to an older one says why.

    The one answer to "which checkpoint does this run resume from": the driver asks it (through
    pre-flight's `check_resume`) and announces the answer to the workers, whose rank 0 asks it
    again with that answer as `known` -- after a restart inside the run (a lost worker, a node
    drain) the run folder has newer checkpoints than the driver saw. Folders are tried newest
    first and only until a complete one: the older ones are not read. `known` is a checkpoint of
    this run already verified in this use; it is not read again, nor is anything older than it."""
    skipped: list[CheckpointInfo] = []
    known_name = _folder_name(known.path) if known is not None else None
    for path in reversed(checkpoint_folders(run_dir)):
        if known_name is not None and _folder_name(path) <= known_name:
            if _folder_name(path) == known_name and not marked_corrupt(path):
                return CheckpointInfo(path, known.step, True, state=known.state), skipped
            # Gone since (checkpoint.keep), or found corrupt: it and the older ones are read as usual.
            known_name = None
        checked = check_checkpoint(path)
        if checked is None:
            continue  # no checkpoint there (deleted, an empty prefix)
        if checked.complete:
            return checked, skipped
        skipped.append(checked)
    return None, skipped


def latest_complete_checkpoint(run_dir: str) -> CheckpointInfo | None:
    """The run's newest complete checkpoint (where it resumes, :func:`resume_point`), or None."""
    return resume_point(run_dir)[0]


def describe_resume(
    run_name: str, chosen: CheckpointInfo | None, skipped: list[CheckpointInfo], *, init: str | None = None
) -> str:
    """The line a (re-)started run prints: where it resumes and, on a fall back, why; a new run
    with `init` (its init.checkpoint, a fine-tune's) starts from those weights, not from scratch."""
    if chosen is None and init is not None:
        line = f"starting {run_name} from the weights of init.checkpoint {init} (no complete checkpoint of its own)"
    elif chosen is None:
        line = f"starting {run_name} from scratch (no complete checkpoint)"
    else:
        line = f"resuming {run_name} from step {chosen.step} ({chosen.path})"
    for c in skipped:
        line += f"\n  skipped newer checkpoint {c.path}: {c.problem}"
    return line


def prune_checkpoints(run_dir: str, keep: int) -> list[str]:
    """Delete the run's checkpoint folders older than its `keep` newest complete ones; returns
    the paths it deleted.

    Only what a complete checkpoint has superseded goes: the `keep` newest complete ones stay, and
    so does everything newer than the oldest of them, complete or not (an upload still under
    way). Ray Train's own rotation (`num_to_keep`) is not used: it counts the checkpoints it
    uploaded, and an upload whose last write failed in silence would count, so a few such failures
    in a row could delete the last complete checkpoint.

    Rank 0 and the driver both prune, each with its own s3fs listing cache: the run is listed
    afresh, and a checkpoint that the other deleted (before or while this one looks) is gone, as
    wanted, not an error. A checkpoint that a reader pins (`vitray evaluate` of the live run,
    :mod:`vitray.runfolder.pins`) is left for a later prune."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    _forget_listings(run_dir)
    folders = checkpoint_folders(run_dir)
    if len(folders) <= keep:  # (a run keeping every checkpoint: one listing, nothing read)
        return []
    # Newest first, and only until the `keep`-th complete one: the older folders go unread, so a
    # prune costs the same however many checkpoints the run keeps (it runs after every save).
    complete = 0
    for index in range(len(folders) - 1, 0, -1):
        checked = check_checkpoint(folders[index])
        complete += checked is not None and checked.complete
        if complete == keep:
            break
    else:
        return []
    doomed = folders[:index]
    if doomed:  # a checkpoint that a reader of the run pins goes at a later prune, once it is let go
        pinned = pinned_checkpoints(run_dir)
        doomed = [path for path in doomed if _folder_name(path) not in pinned]
    deleted = []
    for path in doomed:
        # Gone already: another prune (rank 0's, the driver's) got there first; an object store may
        # go on listing a deleted folder as a prefix with nothing under it.
        if not storage.holds_files(path):
            continue
        fs, fs_path = storage.filesystem(path)
        with contextlib.suppress(FileNotFoundError):  # deleted meanwhile, as wanted
            fs.rm(fs_path, recursive=True)
        deleted.append(path)
    return deleted


def _forget_listings(run_dir: str) -> None:
    """Drops what this process's filesystem has cached of the listings in and under `run_dir`
    (s3fs keeps them for the life of the process: another process's writes and deletes since are
    not in them)."""
    fs, root = storage.filesystem(run_dir)
    root = root.rstrip("/")
    for cached in [p for p in list(fs.dircache) if p == root or p.startswith(f"{root}/")]:
        fs.dircache.pop(cached, None)
    fs.invalidate_cache(root)  # and its parents'


def _folder_name(path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def resolve_checkpoint(path: str) -> CheckpointInfo:
    """A complete checkpoint folder as given, or the latest complete checkpoint of a run folder,
    verified (IncompleteCheckpointError for a checkpoint folder that is not complete), with its
    trainer state: what uses it reads that, not the records again."""
    if is_checkpoint(path):
        fs, fs_path = storage.filesystem(path)
        state = verify_complete(fs_path, fs)
        refuse_newer_format(path, state)
        return CheckpointInfo(path, int(state["step"]), True, state=state)
    latest, passed_over = resume_point(path)
    if latest is not None:
        refuse_newer_format(latest.path, latest.state or {})
        latest.passed_over = passed_over
    if latest is None and not storage.exists(path):
        raise FileNotFoundError(f"{path} does not exist: give a checkpoint folder or a run folder")
    if latest is None:
        raise FileNotFoundError(
            f"{path} is neither a checkpoint folder (no {STATE_FILE}) nor a run folder with a complete "
            "checkpoint (see `vitray runs STORAGE`)"
        )
    return latest


def load_checkpoint(
    path: str, *, ema: bool = True, settings: dict[str, Any] | None = None, weights: bool = True, pin: bool = False
):
    """The model of a checkpoint (or of a run's latest complete one) and its trainer state, with
    the checkpoint folder it came from under ``"checkpoint"`` (and, for a run folder, its newer
    checkpoints that do not count under ``"passed_over"``); its EMA weights when it has them and
    ``ema`` is true, trained as `settings` say (see :func:`load_model`; ``weights=False``: not read).
    ``pin``: the checkpoint is pinned while it is read (a command of its own, as `vitray export`:
    a live run's prune would delete it under the read)."""
    checkpoint = resolve_checkpoint(path)
    fs, fs_path = storage.filesystem(checkpoint.path)
    with CheckpointPins([checkpoint.path] if pin else []):
        model, state = load_model(fs_path, fs, ema=ema, state=checkpoint.state, settings=settings, weights=weights)
    return model, {**state, "checkpoint": checkpoint.path, "passed_over": checkpoint.passed_over}
