"""The original google-research/vision_transformer ``.npz`` parameter layout.

The released checkpoints are flattened Flax trees saved with ``np.savez``: keys such as
``embedding/kernel`` (HWIO), ``cls``, ``Transformer/posembed_input/pos_embedding``,
``Transformer/encoderblock_N/MultiHeadDotProductAttention_1/query/kernel`` (D, heads, head_dim),
``head/kernel`` (in, out) and, for hybrids, the ResNet's ``conv_root``, ``gn_root`` and
``blockS/unitU/{conv,gn}{1,2,3,_proj}``. Files written here load into the authors' code and
into timm's ``_load_weights``; released files load here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import numpy as np
import torch

from .loading import load_native_state_dict
from .vit import VisionTransformer
from .whole_file import read_as, written_whole

# How one tensor is stored: Dense kernels are (in, out), Conv kernels HWIO, attention kernels
# split per head; "vector" also absorbs old GroupNorm params stored as (1, 1, 1, C).
_DENSE, _CONV, _VECTOR, _RAW, _QKV_KERNEL, _QKV_BIAS, _OUT_KERNEL = (
    "dense",
    "conv",
    "vector",
    "raw",
    "qkv_kernel",
    "qkv_bias",
    "out_kernel",
)
_QKV_NAMES = ("query", "key", "value")
_OLD_PREFIX = "opt/target/"  # early checkpoints kept the optimizer's target tree
_ENCODER_BLOCK = re.compile(r"Transformer/encoderblock_(\d+)/")
_RESNET_UNIT = re.compile(r"block(\d+)/unit(\d+)/")


def _layout(
    depth: int, resnet_stages: tuple[int, ...] | None, has_cls: bool, has_pre_logits: bool, has_head: bool
) -> list[tuple[str, str, str]]:
    """(vitray key, npz key or key prefix, kind) for every parameter of such a model."""
    rows: list[tuple[str, str, str]] = []
    if resnet_stages is not None:
        rows += [("stem.conv_root.weight", "conv_root/kernel", _CONV)]
        rows += [(f"stem.gn_root.{p}", f"gn_root/{n}", _VECTOR) for p, n in (("weight", "scale"), ("bias", "bias"))]
        for stage, units in enumerate(resnet_stages):
            for unit in range(units):
                native, npz = f"stem.stages.{stage}.{unit}.", f"block{stage + 1}/unit{unit + 1}/"
                convs = ["1", "2", "3"] + (["_proj"] if unit == 0 else [])
                for c in convs:
                    rows.append((f"{native}conv{c}.weight", f"{npz}conv{c}/kernel", _CONV))
                    rows.append((f"{native}gn{c}.weight", f"{npz}gn{c}/scale", _VECTOR))
                    rows.append((f"{native}gn{c}.bias", f"{npz}gn{c}/bias", _VECTOR))
    rows += [("patch_embed.weight", "embedding/kernel", _CONV), ("patch_embed.bias", "embedding/bias", _VECTOR)]
    if has_cls:
        rows.append(("cls_token", "cls", _RAW))
    rows.append(("pos_embed", "Transformer/posembed_input/pos_embedding", _RAW))
    for i in range(depth):
        native, npz = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
        attention = f"{npz}MultiHeadDotProductAttention_1"
        rows += [
            (f"{native}norm1.weight", f"{npz}LayerNorm_0/scale", _VECTOR),
            (f"{native}norm1.bias", f"{npz}LayerNorm_0/bias", _VECTOR),
            (f"{native}attn.qkv.weight", attention, _QKV_KERNEL),
            (f"{native}attn.qkv.bias", attention, _QKV_BIAS),
            (f"{native}attn.proj.weight", f"{attention}/out/kernel", _OUT_KERNEL),
            (f"{native}attn.proj.bias", f"{attention}/out/bias", _VECTOR),
            (f"{native}norm2.weight", f"{npz}LayerNorm_2/scale", _VECTOR),
            (f"{native}norm2.bias", f"{npz}LayerNorm_2/bias", _VECTOR),
            (f"{native}mlp.fc1.weight", f"{npz}MlpBlock_3/Dense_0/kernel", _DENSE),
            (f"{native}mlp.fc1.bias", f"{npz}MlpBlock_3/Dense_0/bias", _VECTOR),
            (f"{native}mlp.fc2.weight", f"{npz}MlpBlock_3/Dense_1/kernel", _DENSE),
            (f"{native}mlp.fc2.bias", f"{npz}MlpBlock_3/Dense_1/bias", _VECTOR),
        ]
    rows += [
        ("norm.weight", "Transformer/encoder_norm/scale", _VECTOR),
        ("norm.bias", "Transformer/encoder_norm/bias", _VECTOR),
    ]
    if has_pre_logits:
        rows += [("pre_logits.weight", "pre_logits/kernel", _DENSE), ("pre_logits.bias", "pre_logits/bias", _VECTOR)]
    if has_head:
        rows += [("head.weight", "head/kernel", _DENSE), ("head.bias", "head/bias", _VECTOR)]
    return rows


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
        tensor = tensor.float()
    return np.ascontiguousarray(tensor.numpy())


def to_npz_arrays(model: VisionTransformer) -> dict[str, np.ndarray]:
    """The model's parameters as a flat dict in the original .npz layout."""
    state = model.state_dict()
    heads = model.num_heads
    arrays: dict[str, np.ndarray] = {}
    # A model without a classifier (num_classes=0) is stored without head/*; the layout has no
    # place for masked patch prediction's [mask] embedding and predictor, which are not stored.
    rows = _layout(
        model.depth,
        model.variant.resnet_stages,
        "cls_token" in state,
        "pre_logits.weight" in state,
        "head.weight" in state,
    )
    for native, npz, kind in rows:
        value = state[native]
        if kind == _CONV:
            arrays[npz] = _to_numpy(value.permute(2, 3, 1, 0))
        elif kind == _DENSE:
            arrays[npz] = _to_numpy(value.t())
        elif kind == _QKV_KERNEL:
            for name, part in zip(_QKV_NAMES, value.chunk(3, dim=0)):
                arrays[f"{npz}/{name}/kernel"] = _to_numpy(part.t().reshape(part.shape[1], heads, -1))
        elif kind == _QKV_BIAS:
            for name, part in zip(_QKV_NAMES, value.chunk(3, dim=0)):
                arrays[f"{npz}/{name}/bias"] = _to_numpy(part.reshape(heads, -1))
        elif kind == _OUT_KERNEL:
            arrays[npz] = _to_numpy(value.t().reshape(heads, -1, value.shape[0]))
        else:
            arrays[npz] = _to_numpy(value)
    return arrays


def from_npz_arrays(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, torch.Tensor], int]:
    """Converts .npz arrays to vitray names; returns the state dict and the number of heads.

    Raises ValueError naming any key that is not part of the layout, or a layout key that is
    missing.
    """
    if arrays and all(key.startswith(_OLD_PREFIX) for key in arrays):
        arrays = {key[len(_OLD_PREFIX) :]: value for key, value in arrays.items()}
    blocks = [int(m.group(1)) for key in arrays if (m := _ENCODER_BLOCK.match(key))]
    if not blocks or "embedding/kernel" not in arrays:
        raise ValueError(
            "not a ViT .npz in the google-research/vision_transformer layout (needs 'embedding/kernel' and "
            f"'Transformer/encoderblock_N/...'); found keys like {sorted(arrays)[:8]}"
        )
    units: dict[int, int] = {}
    for key in arrays:
        if match := _RESNET_UNIT.match(key):
            stage, unit = int(match.group(1)), int(match.group(2))
            units[stage] = max(units.get(stage, 0), unit)
    # conv_root without units is the stem-only R+ViT-Ti/16: read as such, refused by the loader.
    resnet_stages = tuple(units[s] for s in sorted(units)) if units else (() if "conv_root/kernel" in arrays else None)
    rows = _layout(
        max(blocks) + 1, resnet_stages, "cls" in arrays, "pre_logits/kernel" in arrays, "head/kernel" in arrays
    )

    def take(key: str) -> torch.Tensor:
        if key not in arrays:
            raise ValueError(f".npz is missing {key!r}, which the layout of its other keys requires")
        used.add(key)
        return torch.from_numpy(np.array(arrays[key]))

    used: set[str] = set()
    state: dict[str, torch.Tensor] = {}
    num_heads = 0
    for native, npz, kind in rows:
        if kind == _CONV:
            state[native] = take(npz).permute(3, 2, 0, 1).contiguous()
        elif kind == _DENSE:
            state[native] = take(npz).t().contiguous()
        elif kind == _QKV_KERNEL:
            parts = [take(f"{npz}/{name}/kernel") for name in _QKV_NAMES]
            num_heads = parts[0].shape[1]
            state[native] = torch.cat([p.reshape(p.shape[0], -1).t() for p in parts], dim=0).contiguous()
        elif kind == _QKV_BIAS:
            state[native] = torch.cat([take(f"{npz}/{name}/bias").reshape(-1) for name in _QKV_NAMES])
        elif kind == _OUT_KERNEL:
            kernel = take(npz)
            state[native] = kernel.reshape(-1, kernel.shape[-1]).t().contiguous()
        elif kind == _VECTOR:
            state[native] = take(npz).reshape(-1)
        else:
            state[native] = take(npz)
    unknown = sorted(arrays.keys() - used)
    if unknown:
        raise ValueError(f".npz has keys outside the ViT layout: {unknown}")
    return state, num_heads


def save_npz(model: VisionTransformer, path: str | os.PathLike) -> None:
    """Writes the model's weights to ``path`` in the original vision_transformer .npz layout (the
    file appears whole or not at all)."""
    arrays = to_npz_arrays(model)
    with written_whole(path) as tmp, open(tmp, "wb") as file:  # a file object keeps np.savez from appending ".npz"
        np.savez(file, **arrays)


def load_npz(model: VisionTransformer, path: str | os.PathLike, *, load_head: bool = True) -> None:
    """Loads an original-layout .npz into ``model`` (strictly; the posemb is resampled if needed).

    ``load_head=False`` keeps the model's own head and pre-logits layer.
    """
    with read_as(path, "npz"), np.load(path, allow_pickle=False) as file:
        arrays = {key: file[key] for key in file.files}
    state, num_heads = from_npz_arrays(arrays)
    load_native_state_dict(model, state, source=f"npz {os.fspath(path)!r}", load_head=load_head, num_heads=num_heads)
