"""Weights as safetensors: vitray's own parameter names plus a description in the metadata.

Loading also accepts safetensors files with timm's names (as timm publishes them).
"""

from __future__ import annotations

import os

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .io_timm import from_timm_state_dict, is_timm_state_dict
from .loading import load_native_state_dict
from .vit import VisionTransformer
from .whole_file import read_as, written_whole


def save_safetensors(model: VisionTransformer, path: str | os.PathLike) -> None:
    """Writes the model's state dict to ``path``; the metadata records how to rebuild the model."""
    metadata = {
        "format": "vitray",
        "name": model.name,
        "depth": str(model.depth),
        "img_size": str(model.img_size),
        "head": model.head_type,
        "num_classes": str(model.num_classes),
        "representation_size": str(model.representation_size or ""),
    }
    state = {key: value.detach().contiguous() for key, value in model.state_dict().items()}
    with written_whole(path) as tmp:  # the file appears whole or not at all
        save_file(state, tmp, metadata=metadata)


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The metadata written by :func:`save_safetensors` (empty for files from elsewhere)."""
    with read_as(path, "safetensors"), safe_open(os.fspath(path), framework="pt") as file:
        return dict(file.metadata() or {})


def load_safetensors(model: VisionTransformer, path: str | os.PathLike, *, load_head: bool = True) -> None:
    """Loads a vitray- or timm-named safetensors file into ``model`` (strictly; posemb resampled)."""
    with read_as(path, "safetensors"):
        state = load_file(os.fspath(path), device="cpu")
    if is_timm_state_dict(state):
        state = from_timm_state_dict(state)
    load_native_state_dict(model, state, source=f"safetensors {os.fspath(path)!r}", load_head=load_head)
