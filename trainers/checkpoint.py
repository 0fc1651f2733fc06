"""One checkpoint folder per save, written by every rank and merged by whoever uploads it.

Layout of a checkpoint folder:
  deepspeed/state/...        each rank's DeepSpeed shards (model, optimizer, schedule)
  model.safetensors          consolidated fp32 weights (rank 0) -- what `vitray export` reads
  ema.safetensors            the EMA weights, when enabled (rank 0)
  trainer_state.json         step, data-loader position, world size, resolved config (rank 0)
  complete-rank-NNNN.json    written by each rank LAST, listing its files and sizes

A checkpoint counts only when every rank's completion record is there and every file it lists
has the recorded size, so a half-written or half-uploaded checkpoint is never loaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import fsspec

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
    for rank in range(state["world_size"]):
        record = f"{folder}/{_COMPLETE.format(rank=rank)}"
        if not fs.isfile(record):
            raise IncompleteCheckpointError(f"checkpoint {folder}: rank {rank} never finished writing it")
        with fs.open(record, "r") as f:
            listing = json.load(f)
        for name, size in listing.items():
            if sizes.get(f"{prefix}/{name}") != size:
                raise IncompleteCheckpointError(f"checkpoint {folder}: {name} is missing or truncated")
    return state


def load_model(folder: str, fs=None):
    """The trained model stored in a complete checkpoint folder (built from its own config), and
    the checkpoint's trainer state."""
    from safetensors.torch import load

    from vitray.models import ModelConfig, create_model_from_config

    fs = fs or fsspec.filesystem("file")
    state = verify_complete(folder, fs)
    model = create_model_from_config(ModelConfig.model_validate(state["model"]), int(state["num_classes"]))
    with fs.open(f"{str(folder).rstrip('/')}/{MODEL_FILE}", "rb") as f:
        model.load_state_dict(load(f.read()), strict=True)
    return model, state
