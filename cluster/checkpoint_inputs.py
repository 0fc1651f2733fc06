"""Checkpoints as evaluation inputs: :func:`resolve_checkpoints` takes a checkpoint folder, or a
run folder's latest / every complete one, as grid inputs
(:class:`~vitray.evaluation.methods.CheckpointRef`, found and opened by
:mod:`vitray.runfolder.checkpoint_folders`). A grid's work loads its checkpoint itself
(`vitray.evaluation.methods.base.load_on_device`, or a fine-tune run's `init.checkpoint`).
"""

from __future__ import annotations

import os

from vitray import storage
from vitray.evaluation.methods import CheckpointRef
from vitray.runfolder import checkpoint_folders as ckpt


def absolute(path: str) -> str:
    """Local paths made absolute (they are part of cell ids); URLs unchanged."""
    return str(path).rstrip("/") if storage.is_remote(path) else os.path.abspath(path)


def checkpoint_ref(checkpoint: ckpt.CheckpointInfo) -> CheckpointRef:
    """A complete checkpoint as a grid input, from the trainer state its check read (a checkpoint
    found without one is verified here: IncompleteCheckpointError when it is not complete)."""
    path = absolute(checkpoint.path)
    state = checkpoint.state if checkpoint.state is not None else ckpt.checkpoint_state(path)
    target = state.get("config", {}).get("train", {}).get("steps")
    return CheckpointRef(path, int(state["step"]), dict(state["model"]), int(target) if target else None)


def resolve_checkpoints(path: str, *, all_checkpoints: bool = False) -> list[CheckpointRef]:
    """The checkpoint folder `path`, or the latest (`all_checkpoints`: every) complete checkpoint
    of the run folder `path`, oldest first. Local or s3://. Each is verified once."""
    path = absolute(path)
    if all_checkpoints and not ckpt.is_checkpoint(path):
        complete = [c for c in ckpt.find_checkpoints(path) if c.complete]
        if complete:
            return [checkpoint_ref(c) for c in complete]
    return [checkpoint_ref(ckpt.resolve_checkpoint(path))]
