"""`vitray export`: consolidated model weights from a checkpoint (or a run's latest one)."""

from __future__ import annotations

import os
import tempfile

import torch

from vitray.data import storage
from vitray.trainers.checkpoint import load_checkpoint

FORMATS = ("npz", "safetensors", "timm")


def export(path: str, fmt: str, out: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    from vitray.models import save_npz, save_safetensors, to_timm_state_dict

    model, state = load_checkpoint(path)
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
