"""The model factory: a ViT from its name or from a run config's ``model`` section."""

from __future__ import annotations

from .config import ModelConfig
from .variants import get_variant
from .vit import VisionTransformer


def create_model(
    name: str,
    *,
    num_classes: int,
    img_size: int = 224,
    head: str = "token",
    representation_size: int | None = None,
    dropout: float = 0.0,
    attn_dropout: float = 0.0,
    grad_checkpointing: bool = False,
    masked_patch_outputs: int | None = None,
    head_bias_init: float = 0.0,
) -> VisionTransformer:
    """Builds the ViT called ``name`` (see :func:`model_names`) with the authors' initialisation.

    ``head`` is "token" (class token) or "gap" (mean of the patch tokens, no class token);
    ``representation_size`` adds the tanh pre-logits layer used in pre-training;
    ``num_classes=0`` builds no classification head (``forward`` returns the representation);
    ``masked_patch_outputs`` adds the [mask] embedding and a predictor with that many outputs
    per patch, for masked patch prediction (see :mod:`vitray.models.masked_patch`);
    ``head_bias_init`` is the head's initial bias (its weights start at zero): -10 for sigmoid
    pre-training, as in the authors' configs (big_vision ``config.init_head_bias``).
    """
    variant = get_variant(name)
    return VisionTransformer(
        variant,
        num_classes=num_classes,
        img_size=img_size,
        head=head,
        representation_size=representation_size,
        dropout=dropout,
        attn_dropout=attn_dropout,
        grad_checkpointing=grad_checkpointing,
        masked_patch_outputs=masked_patch_outputs,
        head_bias_init=head_bias_init,
    )


def create_model_from_config(cfg: ModelConfig, num_classes: int) -> VisionTransformer:
    """:func:`create_model` with the arguments of a run config's ``model`` section."""
    return create_model(
        cfg.name,
        num_classes=num_classes,
        img_size=cfg.img_size,
        head=cfg.head,
        representation_size=cfg.representation_size,
        dropout=cfg.dropout,
        attn_dropout=cfg.attn_dropout,
        grad_checkpointing=cfg.grad_checkpointing,
        masked_patch_outputs=cfg.masked_patch_outputs,
        head_bias_init=cfg.head_bias_init,
    )
