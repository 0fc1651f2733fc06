"""The model section of a run's config (owned here so `models/` stays self-contained)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .variants import get_variant

# The settings of how a model trains, not of what its weights are: a run that starts from a
# checkpoint (fine-tuning) takes these from its own config, the rest from the checkpoint.
TRAINING_SETTINGS = ("dropout", "attn_dropout", "grad_checkpointing", "remat_policy")


class ModelConfig(BaseModel):
    """Which ViT to build: the one declaration of the model's arguments, which :func:`create_model`,
    :class:`~vitray.models.VisionTransformer` and a checkpoint's ``model`` record take from here."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field("Ti/4", description='Variant, e.g. "B/16", "L/32", "R50+B/16", "Ti/4".')
    img_size: int = Field(32, gt=0, description="Input resolution in pixels (square).")
    depth: int | None = Field(
        None,
        gt=0,
        description="Encoder blocks (the Transformer's layers), to override the variant's (e.g. 12 for Ti, S and B): "
        "fewer give a quick model of the same width for trials and tests. None: the variant's.",
    )
    head: Literal["token", "gap"] = Field(
        "token",
        description="token: classify the class token (the paper's); gap: the mean of the patch tokens, no class token.",
    )
    representation_size: int | None = Field(
        None, gt=0, description="Width of the tanh pre-logits layer used in pre-training; none for fine-tuning."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout after the embeddings, attention and MLP layers.")
    attn_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the attention probabilities.")
    grad_checkpointing: bool = Field(
        False, description="Activation checkpointing: keep only what remat_policy saves of each encoder block."
    )
    remat_policy: Literal["nothing_saveable", "dots_saveable"] = Field(
        "nothing_saveable",
        description="With grad_checkpointing, what each block keeps for the backward pass (big_vision's "
        "names): nothing_saveable recomputes the whole block (least memory); dots_saveable keeps the "
        "outputs of its matrix products and attention (~10 values per token and unit of width a block) "
        "and recomputes only LayerNorm, GELU and the additions (almost no recompute; not with "
        "train.backend=xla).",
    )
    head_bias_init: float = Field(
        0.0,
        allow_inf_nan=False,
        description="Initial bias of the (zero-weight) head: -10 for sigmoid pre-training on many classes, "
        "as in the authors' configs; fine-tuning heads always start at zero.",
    )
    masked_patch_outputs: int | None = Field(
        None,
        gt=0,
        description="Predictions per patch of the masked patch predictor; a run config sets it from "
        "train.objective and train.masked_patch (none for every other objective).",
    )

    @property
    def blocks(self) -> int:
        """The number of encoder blocks the model is built with: `depth`, else the variant's."""
        return self.depth or get_variant(self.name).size.depth
