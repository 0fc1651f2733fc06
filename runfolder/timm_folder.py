"""The folder `timm.create_model("local-dir:PATH", pretrained=True)` loads: `config.json` +
`model.safetensors`, in the layout timm's own `save_for_hf` writes (timm/models/_hub.py).

`config.json` names a registered timm architecture and the `model_args` that make it this model:
a plain ViT is timm's `VisionTransformer` under any plain architecture name with its sizes given
explicitly; a hybrid needs a registered timm hybrid with the same ResNet layout (`TIMM_RESNETS`).
`pretrained_cfg` says what the inputs are: vitray's range [-1, 1] is mean = std = 0.5 on [0, 1],
and the checkpoint's own evaluation resize (`vitray.data.transforms.eval_resize`, bilinear, as its
`val` evaluator takes it) in timm's terms (`timm_crop`), so that timm's `resolve_data_config` +
`create_transform` feed the model the pixels vitray evaluated it on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from vitray.models import to_timm_state_dict
from vitray.models.variants import HYBRID_STAGES, VARIANTS

FILES = ("config.json", "model.safetensors")
# Plain ViTs: timm builds the same VisionTransformer for any of its plain names once the sizes
# are given, so the name only has to be registered; it is the one of the model's own family (size,
# patch and resolution where timm has them), so that a reader of config.json sees what it holds.
PLAIN_ARCHITECTURE = "vit_base_patch16_224"
TIMM_FAMILIES = {"Ti": "tiny", "S": "small", "B": "base", "L": "large", "H": "huge", "g": "giant"}
# timm's registered plain ViT names (every timm release since 0.9 has them).
TIMM_PLAIN_NAMES = (
    "vit_tiny_patch16_224",
    "vit_tiny_patch16_384",
    "vit_small_patch16_224",
    "vit_small_patch16_384",
    "vit_small_patch32_224",
    "vit_small_patch32_384",
    "vit_small_patch8_224",
    "vit_base_patch16_224",
    "vit_base_patch16_384",
    "vit_base_patch32_224",
    "vit_base_patch32_384",
    "vit_base_patch8_224",
    "vit_large_patch16_224",
    "vit_large_patch16_384",
    "vit_large_patch32_224",
    "vit_large_patch32_384",
    "vit_large_patch14_224",
    "vit_huge_patch14_224",
    "vit_giant_patch14_224",
)
# timm's registered hybrids by their ResNetV2 `layers` (vitray's `resnet_stages`; 3 stages are
# stride 16, 4 stride 32), then by Transformer size (another size takes the first). The name only
# selects the backbone: `model_args` sets the Transformer's width, depth, heads and MLP, so every
# vitray hybrid with one of these ResNets is a timm model (R50+S/16: vit_base_r50_s16_224 at width 384).
TIMM_RESNETS: dict[tuple[int, ...], dict[str, str]] = {
    (3, 4, 9): {"B": "vit_base_r50_s16_224"},
    (2, 2, 2, 2): {"S": "vit_small_r26_s32_224", "B": "vit_base_r26_s32_224"},
    (3, 4, 6, 3): {"L": "vit_large_r50_s32_224"},
}


def hybrid_architecture(name: str, resnet_stages: tuple[int, ...]) -> str | None:
    """The registered timm hybrid with the ResNet `resnet_stages` (the one of the model's own size
    where timm has it, "R26+B/32" -> vit_base_r26_s32_224), or None where timm has no such ResNet."""
    by_size = TIMM_RESNETS.get(tuple(resnet_stages))
    if by_size is None:
        return None
    size = name.split("+", 1)[1].split("/", 1)[0]
    return by_size.get(size) or next(iter(by_size.values()))


# Every vitray hybrid timm can build -> the architecture config.json names.
HYBRIDS: dict[str, str] = {
    name: architecture
    for name, variant in VARIANTS.items()
    if variant.is_hybrid and (architecture := hybrid_architecture(name, variant.resnet_stages)) is not None
}


def plain_architecture(name: str, patch_size: int, img_size: int) -> str:
    """The registered timm name closest to a plain vitray ViT: its family ("Ti/4" -> tiny), patch
    and resolution where timm registers them, else the family's first name (the sizes in
    `model_args` make it the model either way)."""
    family = TIMM_FAMILIES.get(name.split("/", 1)[0])
    if family is None:
        return PLAIN_ARCHITECTURE
    wanted = (f"vit_{family}_patch{patch_size}_{img_size}", f"vit_{family}_patch{patch_size}_224")
    same_family = [n for n in TIMM_PLAIN_NAMES if n.startswith(f"vit_{family}_")]
    return next((n for n in wanted if n in TIMM_PLAIN_NAMES), same_family[0])


# The val evaluator's resize when a run has none: `resize: aspect` at vitray.data.config's
# EVAL_RESIZE_RATIO, 256 / 224 (runfolder does not import data; tests/test_export.py holds them equal).
DEFAULT_EVAL_RESIZE: dict[str, Any] = {"resize": "aspect", "resize_ratio": 256 / 224}


def eval_resize_of(evals: Mapping[str, Any] | None) -> dict[str, Any]:
    """The resize of a run's evaluation (its config's `evals`, as recorded in a checkpoint): the
    evaluator named `val` when it is of type val, else the first of that type, else the default."""
    evals = evals or {}
    scored = [ev for ev in evals.values() if isinstance(ev, Mapping) and ev.get("type") == "val"]
    chosen = evals.get("val") if isinstance(evals.get("val"), Mapping) and evals["val"].get("type") == "val" else None
    chosen = chosen or (scored[0] if scored else {})
    return {key: chosen.get(key, default) for key, default in DEFAULT_EVAL_RESIZE.items()}


def enlarged_side(img_size: int, resize_ratio: float) -> int:
    """The side `resize: aspect` resizes the shorter side to before its central crop, rounded as
    `vitray.data.transforms.eval_resize` rounds it (timm floors)."""
    return round(img_size * resize_ratio)


def timm_crop(img_size: int, resize: str, resize_ratio: float) -> dict[str, Any]:
    """`crop_pct` and `crop_mode` that make timm's eval transform vitray's: `whole` squashes the
    image to S x S (timm's squash at crop_pct 1); `aspect` resizes the shorter side to
    R = round(S x ratio) and crops the central S (timm's center mode resizes to floor(S / crop_pct),
    so crop_pct = S / (R + 0.5) lands on R exactly, where S / ratio could floor one pixel short)."""
    if resize == "whole":
        return {"crop_pct": 1.0, "crop_mode": "squash"}
    if resize != "aspect":
        raise ValueError(f"evaluation resize {resize!r} has no timm equivalent; expected aspect or whole")
    return {"crop_pct": img_size / (enlarged_side(img_size, resize_ratio) + 0.5), "crop_mode": "center"}


def timm_config(model, eval_resize: Mapping[str, Any]) -> dict:
    """config.json for `model` (a vitray VisionTransformer without pre-logits), evaluated with
    `eval_resize` (:func:`eval_resize_of`)."""
    if model.pre_logits is not None:  # `vitray export`'s words; models' to_timm_state_dict says it for Python
        raise ValueError(
            f"timm's VisionTransformer has no pre-logits layer, and this {model.name} has one "
            f"(representation_size={model.representation_size}, as the paper's pre-training recipes): export "
            "--format npz or safetensors, or fine-tune it first (fine-tuning drops the layer) and export that"
        )
    stages = model.variant.resnet_stages
    hybrid = hybrid_architecture(model.name, stages) if stages is not None else None
    if stages is not None and hybrid is None:
        timm_has = [
            f"{resnet}/{stride}" for (resnet, stride), layout in HYBRID_STAGES.items() if layout in TIMM_RESNETS
        ]
        raise ValueError(
            f"timm has no ResNet backbone with the stages {stages} of {model.name} (vitray's own layout for "
            f"{model.name.split('+', 1)[0]} at stride {model.patch_size}); timm's hybrids have the ResNets "
            f"{', '.join(timm_has)}. Export npz or safetensors instead"
        )
    gap = model.head_type == "gap"
    model_args = {
        "img_size": model.img_size,
        "embed_dim": model.width,
        "depth": model.depth,
        "num_heads": model.num_heads,
        "mlp_ratio": model.mlp_dim / model.width,
        "class_token": not gap,
        "global_pool": "avg" if gap else "token",
        "fc_norm": False,  # vitray normalises before pooling, as the paper's gap models do
    }
    if model.stem is None:
        model_args["patch_size"] = model.patch_size
    return {
        "architecture": hybrid or plain_architecture(model.name, model.patch_size, model.img_size),
        "num_classes": model.num_classes,
        "num_features": model.width,
        "global_pool": model_args["global_pool"],
        "model_args": model_args,
        "pretrained_cfg": pretrained_cfg(
            model, eval_resize, f"vitray {model.name} at {model.img_size} px, exported by vitray export --format timm"
        ),
    }


def pretrained_cfg(model, eval_resize: Mapping[str, Any], description: str) -> dict[str, Any]:
    """timm's `pretrained_cfg` of `model` evaluated with `eval_resize` (:func:`eval_resize_of`): what
    `timm.data.resolve_data_config` reads to make the inputs vitray evaluated the model on."""
    return {
        "tag": "vitray",
        "custom_load": False,
        "input_size": (3, model.img_size, model.img_size),  # a tuple, as timm holds it (a list in JSON)
        "fixed_input_size": True,
        "interpolation": "bilinear",
        **timm_crop(model.img_size, eval_resize["resize"], float(eval_resize["resize_ratio"])),
        "mean": [0.5, 0.5, 0.5],
        "std": [0.5, 0.5, 0.5],
        "num_classes": model.num_classes,
        "pool_size": None,
        "first_conv": "patch_embed.proj" if model.stem is None else "patch_embed.backbone.stem.conv",
        "classifier": "head",
        "description": description,
    }


def write_timm_folder(model, folder: str, eval_resize: Mapping[str, Any]) -> tuple[str, ...]:
    """Write FILES into the existing local `folder` (`eval_resize`: :func:`timm_config`'s); returns their names."""
    from safetensors.torch import save_file

    config = timm_config(model, eval_resize)
    state = {key: value.detach().contiguous() for key, value in to_timm_state_dict(model).items()}
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return FILES
