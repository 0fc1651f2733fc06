"""timm's ``VisionTransformer`` parameter names (and its ResNetV2 hybrid backbone).

vitray's names already follow timm's for the Transformer (``blocks.N.attn.qkv`` ...); only the
patch embedding and the hybrid's ResNet are named differently. A token-head vitray model matches
``timm.models.VisionTransformer(class_token=True, global_pool="token")``; a gap model matches
``class_token=False, global_pool="avg", fc_norm=False`` (final norm before pooling, as here).
timm has no pre-logits layer, so models with ``representation_size`` cannot be exported; the
masked patch prediction parts are left out, and a model with ``num_classes=0`` matches timm's
``num_classes=0`` (no head).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from .loading import load_native_state_dict
from .vit import VisionTransformer

# Full-match regex -> replacement, one table per direction (each is short enough to read).
_TO_TIMM: tuple[tuple[str, str], ...] = (
    (r"patch_embed\.(weight|bias)", r"patch_embed.proj.\1"),
    (r"stem\.conv_root\.weight", r"patch_embed.backbone.stem.conv.weight"),
    (r"stem\.gn_root\.(weight|bias)", r"patch_embed.backbone.stem.norm.\1"),
    (
        r"stem\.stages\.(\d+)\.(\d+)\.conv_proj\.weight",
        r"patch_embed.backbone.stages.\1.blocks.\2.downsample.conv.weight",
    ),
    (
        r"stem\.stages\.(\d+)\.(\d+)\.gn_proj\.(weight|bias)",
        r"patch_embed.backbone.stages.\1.blocks.\2.downsample.norm.\3",
    ),
    (r"stem\.stages\.(\d+)\.(\d+)\.conv(\d)\.weight", r"patch_embed.backbone.stages.\1.blocks.\2.conv\3.weight"),
    (r"stem\.stages\.(\d+)\.(\d+)\.gn(\d)\.(weight|bias)", r"patch_embed.backbone.stages.\1.blocks.\2.norm\3.\4"),
)
_FROM_TIMM: tuple[tuple[str, str], ...] = (
    (r"patch_embed\.proj\.(weight|bias)", r"patch_embed.\1"),
    (r"patch_embed\.backbone\.stem\.conv\.weight", r"stem.conv_root.weight"),
    (r"patch_embed\.backbone\.stem\.norm\.(weight|bias)", r"stem.gn_root.\1"),
    # The stem-only R+ViT-Ti/16 (vit_tiny_r_s16_p8) names its root without "stem.": read it as
    # vitray's root so that loading refuses that model by name.
    (r"patch_embed\.backbone\.conv\.weight", r"stem.conv_root.weight"),
    (r"patch_embed\.backbone\.norm\.(weight|bias)", r"stem.gn_root.\1"),
    (
        r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.downsample\.conv\.weight",
        r"stem.stages.\1.\2.conv_proj.weight",
    ),
    (
        r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.downsample\.norm\.(weight|bias)",
        r"stem.stages.\1.\2.gn_proj.\3",
    ),
    (r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.conv(\d)\.weight", r"stem.stages.\1.\2.conv\3.weight"),
    (r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.norm(\d)\.(weight|bias)", r"stem.stages.\1.\2.gn\3.\4"),
)


def _rename(key: str, rules: tuple[tuple[str, str], ...]) -> str:
    for pattern, replacement in rules:
        if re.fullmatch(pattern, key):
            return re.sub(pattern, replacement, key)
    return key


def is_timm_state_dict(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """True when the keys are timm's (``patch_embed.proj.*``), False for vitray's own."""
    return any(key.startswith(("patch_embed.proj.", "patch_embed.backbone.")) for key in state_dict)


def to_timm_state_dict(model: VisionTransformer) -> dict[str, torch.Tensor]:
    """The model's weights under timm's ``VisionTransformer`` parameter names."""
    if model.pre_logits is not None:
        raise ValueError(
            f"timm's VisionTransformer has no pre-logits layer, but this model has representation_size="
            f"{model.representation_size}; call reset_head() first, or export with save_npz()"
        )
    # timm has no masked patch prediction parts; they serve pre-training only.
    return {
        _rename(key, _TO_TIMM): value
        for key, value in model.state_dict().items()
        if not key.startswith("masked_patch.")
    }


def from_timm_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm parameter names -> vitray's (unknown keys pass through and fail at loading)."""
    return {_rename(key, _FROM_TIMM): value for key, value in state_dict.items()}


def load_timm_state_dict(
    model: VisionTransformer,
    state_dict: Mapping[str, torch.Tensor],
    *,
    load_head: bool = True,
    source: str = "timm state dict",
) -> None:
    """Loads a timm ``VisionTransformer`` state dict into ``model`` (strictly; posemb resampled)."""
    load_native_state_dict(model, from_timm_state_dict(state_dict), source=source, load_head=load_head)
