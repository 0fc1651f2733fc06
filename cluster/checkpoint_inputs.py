"""Checkpoints as evaluation inputs, and the one way an evaluation loads one onto a device.

- :func:`resolve_checkpoints`: a checkpoint folder, or a run folder's latest / every complete one,
  as grid inputs (:class:`~vitray.evaluation.grid.CheckpointRef`, found and opened by
  :mod:`vitray.runfolder.checkpoint_folders`);
- :func:`load_on_device`: a checkpoint's model on the GPU when asked for and present, else the CPU
  (`vitray fewshot` and the grid's few-shot tasks; a fine-tune cell scores its test split in its
  own run, `vitray.cluster.finetune`).
"""

from __future__ import annotations

import os
from typing import Any

from vitray import storage
from vitray.evaluation.grid import CheckpointRef
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


def load_on_device(path: str, *, use_gpu: bool = False) -> tuple[Any, str]:
    """The model of the checkpoint at `path` and the device it is to run on: "cuda" when `use_gpu`
    and a GPU is visible (a Ray task given one), else "cpu"."""
    import torch

    model, _ = ckpt.load_checkpoint(path)
    device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
    return model.to(device), device
