"""`vitray export`: consolidated model weights from a checkpoint (or a run's latest one)."""

from __future__ import annotations

import os
import tempfile

import torch

from vitray.data import storage
from vitray.models import ModelConfig, create_model_from_config
from vitray.trainers import checkpoint as ckpt
from vitray.trainers.run_files import latest_complete_checkpoint

FORMATS = ("npz", "safetensors", "timm")


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder as given, or the latest complete checkpoint of a run folder."""
    fs, fs_path = storage.filesystem(path)
    if fs.isfile(f"{fs_path.rstrip('/')}/{ckpt.STATE_FILE}"):
        ckpt.verify_complete(fs_path, fs)
        return path
    latest = latest_complete_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint nor a run folder with a complete checkpoint")
    return latest.path


def load_checkpoint_model(path: str) -> tuple[torch.nn.Module, dict]:
    """The model of a (complete) checkpoint, with its trained weights, and the trainer state."""
    from safetensors.torch import load

    checkpoint = resolve_checkpoint(path)
    fs, fs_path = storage.filesystem(checkpoint)
    state = ckpt.verify_complete(fs_path, fs)
    model = create_model_from_config(ModelConfig.model_validate(state["model"]), int(state["num_classes"]))
    weights = load(storage.read_bytes(storage.join(checkpoint, ckpt.MODEL_FILE)))
    model.load_state_dict(weights, strict=True)
    return model, {**state, "checkpoint": checkpoint}


def export(path: str, fmt: str, out: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    from vitray.models import save_npz, save_safetensors, to_timm_state_dict

    model, state = load_checkpoint_model(path)
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, os.path.basename(out) or "weights")
        if fmt == "npz":
            save_npz(model, local)
        elif fmt == "safetensors":
            save_safetensors(model, local)
        else:
            torch.save(to_timm_state_dict(model), local)
        with open(local, "rb") as f:
            storage.write_bytes_atomic(out, f.read())
    return state["checkpoint"]
