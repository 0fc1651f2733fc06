"""One entry point for loading weights from any supported file, chosen by its suffix."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from .io_npz import load_npz
from .io_safetensors import load_safetensors
from .io_timm import from_timm_state_dict, is_timm_state_dict
from .loading import load_native_state_dict
from .vit import VisionTransformer
from .whole_file import read_as

WEIGHT_SUFFIXES = (".npz", ".safetensors", ".pt", ".pth", ".bin")
_WRAPPER_KEYS = ("state_dict", "model")  # common containers around a state dict in .pt files


def _unwrap_state_dict(obj: object, path: str) -> Mapping[str, torch.Tensor]:
    if isinstance(obj, Mapping):
        for key in _WRAPPER_KEYS:
            if isinstance(obj.get(key), Mapping) and len(obj) <= 2:
                obj = obj[key]
                break
        if obj and all(isinstance(value, torch.Tensor) for value in obj.values()):
            return obj
    raise ValueError(
        f"{path!r} does not hold a state dict (a mapping of names to tensors, optionally under "
        f"{' or '.join(map(repr, _WRAPPER_KEYS))}); got {type(obj).__name__}"
    )


def load_weights(model: VisionTransformer, path: str | os.PathLike, *, load_head: bool = True) -> None:
    """Loads ``path`` into ``model``: ``.npz`` (original layout), ``.safetensors`` or ``.pt``/``.pth``/``.bin``.

    State dicts may use vitray's or timm's names; ``.pt`` files are read with
    ``torch.load(weights_only=True)``. A different patch grid is resampled; anything else that
    does not fit raises ValueError. ``load_head=False`` keeps the model's own head. A vitray run or
    checkpoint folder (local or s3://) loads with ``vitray.runfolder.load_checkpoint``.
    """
    if not isinstance(model, VisionTransformer):
        raise TypeError(
            f"load_weights(model, path) takes a vitray model first (vitray.models.create_model), got "
            f"{type(model).__name__}; a state dict loads with load_timm_state_dict or model.load_state_dict"
        )
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_weights(model, path): path must be a file path, got {type(path).__name__}")
    where = os.fspath(path)
    if "://" in where or Path(where).is_dir():
        raise ValueError(
            f"load_weights reads a weights file on this machine, not {where!r}: a vitray run or checkpoint folder "
            "(also on s3://) loads with vitray.runfolder.load_checkpoint(PATH); copy another remote file here first"
        )
    suffix = Path(path).suffix.lower()
    if suffix == ".npz":
        load_npz(model, path, load_head=load_head)
    elif suffix == ".safetensors":
        load_safetensors(model, path, load_head=load_head)
    elif suffix in (".pt", ".pth", ".bin"):
        with read_as(path, "torch"):
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        state = _unwrap_state_dict(loaded, os.fspath(path))
        if is_timm_state_dict(state):
            state = from_timm_state_dict(state)
        load_native_state_dict(model, state, source=f"{os.fspath(path)!r}", load_head=load_head)
    else:
        raise ValueError(
            f"cannot tell the weight format of {os.fspath(path)!r}: use one of {', '.join(WEIGHT_SUFFIXES)}"
        )
