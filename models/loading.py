"""Strict loading of a vitray-named state dict, shared by every weight format.

Each format (.npz, timm, safetensors) converts to vitray's own parameter names first and then
comes here, so the checks live in one place: the checkpoint must be the same variant, keys and
shapes must match exactly (never a silent partial load), and a different patch grid is
resampled (paper section 3.2).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .posemb import resample_posemb
from .variants import find_variant_name
from .vit import VisionTransformer

# The pre-training heads: the classifier, the pre-logits layer and masked patch prediction's parts.
HEAD_PREFIXES = ("head.", "pre_logits.", "masked_patch.")
_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.")
# A hybrid's ResNet root; alone (no stages), it is the stem-only R+ViT-Ti/16, which is refused.
STEM_ROOT_KEYS = {"stem.conv_root.weight", "stem.gn_root.weight", "stem.gn_root.bias"}
_STEM_UNIT_KEY = re.compile(r"stem\.stages\.(\d+)\.(\d+)\.conv1\.weight")


@dataclass(frozen=True)
class Architecture:
    """What a set of weights says about the model that produced it."""

    width: int
    depth: int
    mlp_dim: int
    patch_size: int
    resnet_stages: tuple[int, ...] | None
    has_class_token: bool
    num_heads: int | None = None  # known only for formats that store heads separately (.npz)

    @property
    def variant_name(self) -> str | None:
        return find_variant_name(self.width, self.depth, self.mlp_dim, self.patch_size, self.resnet_stages)

    def same_variant(self, other: Architecture) -> bool:
        core = (self.width, self.depth, self.mlp_dim, self.patch_size, self.resnet_stages)
        other_core = (other.width, other.depth, other.mlp_dim, other.patch_size, other.resnet_stages)
        heads_differ = None not in (self.num_heads, other.num_heads) and self.num_heads != other.num_heads
        return core == other_core and not heads_differ

    def describe(self) -> str:
        named = find_variant_name(self.width, None, self.mlp_dim, self.patch_size, self.resnet_stages)
        name = self.variant_name or (f"{named} at depth {self.depth}" if named else "an unregistered variant")
        details = f"width {self.width}, depth {self.depth}, mlp {self.mlp_dim}, patch {self.patch_size}"
        if self.num_heads is not None:
            details += f", {self.num_heads} heads"
        if self.resnet_stages is not None:
            details += f", ResNet stages {self.resnet_stages}"
        return f"{name} ({details})"


def architecture_of_model(model: VisionTransformer) -> Architecture:
    """The :class:`Architecture` of a built model."""
    return Architecture(
        width=model.width,
        depth=model.depth,
        mlp_dim=model.mlp_dim,
        patch_size=model.patch_size,
        resnet_stages=model.variant.resnet_stages,
        has_class_token=model.cls_token is not None,
        num_heads=model.num_heads,
    )


def architecture_of_state_dict(state_dict: Mapping[str, torch.Tensor], num_heads: int | None = None) -> Architecture:
    """Infers the :class:`Architecture` from vitray parameter names and shapes."""
    required = ("patch_embed.weight", "pos_embed", "blocks.0.mlp.fc1.weight")
    missing = [key for key in required if key not in state_dict]
    if missing:
        raise ValueError(f"not a ViT state dict: missing {missing}; it has keys like {sorted(state_dict)[:8]}")
    patch_weight = state_dict["patch_embed.weight"]
    depth = 1 + max(int(m.group(1)) for key in state_dict if (m := _BLOCK_KEY.match(key)))
    units: dict[int, int] = {}
    for key in state_dict:
        if match := _STEM_UNIT_KEY.fullmatch(key):
            stage, unit = int(match.group(1)), int(match.group(2))
            units[stage] = max(units.get(stage, 0), unit + 1)
    resnet_stages = tuple(units[stage] for stage in sorted(units)) if units else None
    patch_size = 4 * 2 ** (len(resnet_stages) - 1) if resnet_stages else patch_weight.shape[-1]
    return Architecture(
        width=patch_weight.shape[0],
        depth=depth,
        mlp_dim=state_dict["blocks.0.mlp.fc1.weight"].shape[0],
        patch_size=patch_size,
        resnet_stages=resnet_stages,
        has_class_token="cls_token" in state_dict,
        num_heads=num_heads,
    )


def _refuse_stem_only_hybrid(state_dict: Mapping[str, torch.Tensor], source: str) -> None:
    """The authors' R+ViT-Ti/16 (timm's vit_tiny_r_s16_p8) puts only the ResNet's root (stem) in
    front of 8x8 patches of its 64 channels; vitray's hybrids have ResNet stages, so say that rather
    than a patch-size mismatch whose advice (another patch size) cannot load it either."""
    if {key for key in state_dict if key.startswith("stem.")} == STEM_ROOT_KEYS:
        raise ValueError(
            f"{source} holds a stem-only hybrid (R+Ti/16: a ResNet root without stages), which is not supported: "
            "vitray's hybrids have R26 or R50 stages (R50+B/16, R26+S/32, ...)"
        )


def _shown(value: object) -> str:
    return "none" if value is None else str(value)


def _check_same_model(model: VisionTransformer, found: Architecture, source: str) -> None:
    expected = architecture_of_model(model)
    if not found.same_variant(expected):
        fields = ("width", "depth", "mlp_dim", "patch_size", "resnet_stages", "num_heads")
        # num_heads None is unknown (a format without it); resnet_stages None is no ResNet.
        differ = [
            f"{field} {_shown(getattr(found, field))} vs {_shown(getattr(expected, field))}"
            for field in fields
            if getattr(found, field) != getattr(expected, field)
            and (field != "num_heads" or None not in (found.num_heads, expected.num_heads))
        ]
        if differ == [f"depth {found.depth} vs {expected.depth}"]:
            fix = f"create the model with depth={found.depth}"
        else:
            named = find_variant_name(found.width, None, found.mlp_dim, found.patch_size, found.resnet_stages)
            fix = f"create the model as {named}" + (
                f" with depth={found.depth}" if named and not found.variant_name else ""
            )
            fix = fix if named else "create the model with the checkpoint's architecture"
        raise ValueError(
            f"{source} holds weights of {found.describe()}, but the model is {expected.describe()}: "
            f"{', '.join(differ)} (checkpoint vs model); {fix}"
        )
    if found.has_class_token != expected.has_class_token:
        found_head = "token" if found.has_class_token else "gap"
        raise ValueError(
            f"{source} was trained with head={found_head!r} (class token: {found.has_class_token}), "
            f"but the model uses head={model.head_type!r}; create the model with head={found_head!r}"
        )


def _head_hint(model: VisionTransformer, state_dict: Mapping[str, torch.Tensor]) -> str:
    has_pre_logits = "pre_logits.weight" in state_dict
    if has_pre_logits != (model.pre_logits is not None):
        size = state_dict["pre_logits.weight"].shape[0] if has_pre_logits else None
        return (
            f" The checkpoint's representation_size is {size} but the model's is {model.representation_size}: "
            f"create the model with representation_size={size}, or pass load_head=False."
        )
    if "head.weight" in state_dict and state_dict["head.weight"].shape[0] != model.num_classes:
        return (
            f" The checkpoint has {state_dict['head.weight'].shape[0]} classes, the model {model.num_classes}: "
            f"pass load_head=False to keep the model's own head (reset_head() makes a fresh one)."
        )
    return ""


def load_native_state_dict(
    model: VisionTransformer,
    state_dict: Mapping[str, torch.Tensor],
    *,
    source: str,
    load_head: bool = True,
    num_heads: int | None = None,
) -> None:
    """Loads vitray-named weights into ``model`` after checking they fit exactly.

    ``load_head=False`` ignores the checkpoint's ``head`` and ``pre_logits`` and keeps the
    model's own (the usual start of fine-tuning). A position embedding for another grid is
    resampled to the model's resolution. ``source`` names the checkpoint in error messages.
    """
    _refuse_stem_only_hybrid(state_dict, source)
    _check_same_model(model, architecture_of_state_dict(state_dict, num_heads), source)
    weights = dict(state_dict)
    expected = model.state_dict()
    if not load_head:
        weights = {k: v for k, v in weights.items() if not k.startswith(HEAD_PREFIXES)}
        expected = {k: v for k, v in expected.items() if not k.startswith(HEAD_PREFIXES)}
    tokens = weights["pos_embed"].shape[1]
    if tokens != expected["pos_embed"].shape[1]:
        grid = tokens - model.num_prefix_tokens
        if grid < 1 or round(grid**0.5) ** 2 != grid:
            raise ValueError(
                f"{source} has a position embedding of {tokens} tokens, which is not "
                f"{model.num_prefix_tokens} class token(s) and a square grid of patches: weights of a model with "
                "other prefix tokens (timm's register tokens, no_embed_class=True) do not load into vitray's ViT"
            )
        weights["pos_embed"] = resample_posemb(
            weights["pos_embed"], model.grid_size, num_prefix_tokens=model.num_prefix_tokens
        )

    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    mismatched = [
        f"{key}: checkpoint {tuple(weights[key].shape)} vs model {tuple(expected[key].shape)}"
        for key in expected.keys() & weights.keys()
        if weights[key].shape != expected[key].shape
    ]
    if missing or unexpected or mismatched:
        problems = []
        if missing:
            problems.append(f"missing from the checkpoint: {missing}")
        if unexpected:
            problems.append(f"not in the model: {unexpected}")
        if mismatched:
            problems.append(f"shape mismatches: {sorted(mismatched)}")
        raise ValueError(
            f"cannot load {source} into {model.name}: " + "; ".join(problems) + _head_hint(model, state_dict)
        )
    model.load_state_dict(weights, strict=load_head)
