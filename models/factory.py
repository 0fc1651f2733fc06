"""The model factory: a ViT from its name or from a run config's ``model`` section."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .config import ModelConfig
from .vit import VisionTransformer, square_side


def create_model(
    name: str, *, num_classes: int, img_size: int | tuple[int, int] = 224, **options: Any
) -> VisionTransformer:
    """Builds the ViT called ``name`` (see :func:`model_names`) with the authors' initialisation.

    ``img_size`` is the side of the square input, or its ``(height, width)`` as timm takes it.
    ``options`` are the other fields of :class:`ModelConfig`, which declares and validates them:
    ``head`` is "token" (class token) or "gap" (mean of the patch tokens, no class token);
    ``representation_size`` adds the tanh pre-logits layer used in pre-training; ``dropout``,
    ``attn_dropout``, ``grad_checkpointing``; ``masked_patch_outputs`` adds the [mask] embedding and
    a predictor with that many outputs per patch, for masked patch prediction (see
    :mod:`vitray.models.masked_patch`); ``head_bias_init`` is the head's initial bias (its weights
    start at zero): -10 for sigmoid pre-training, as in the authors' configs (big_vision
    ``config.init_head_bias``). ``num_classes=0`` builds no classification head (``forward``
    returns the representation).
    """
    try:
        cfg = ModelConfig(name=name, img_size=square_side(img_size), **options)
    except ValidationError as err:
        raise _argument_error(name, err) from None
    return VisionTransformer(cfg, num_classes=num_classes)


def _argument_error(name: str, err: ValidationError) -> Exception:
    """pydantic's report on ``create_model``'s arguments as one line in the caller's terms: an
    unknown argument is a TypeError naming those it takes (as Python's own for a function), a bad
    value a ValueError naming the argument, what was given and what is allowed."""
    problems = err.errors(include_url=False)
    unknown = [str(p["loc"][0]) for p in problems if p["type"] == "extra_forbidden"]
    if unknown:
        takes = ", ".join(["num_classes", *(field for field in ModelConfig.model_fields if field != "name")])
        return TypeError(f"create_model({name!r}) got unknown argument(s) {', '.join(unknown)}; it takes {takes}")
    said = "; ".join(f"{'.'.join(map(str, p['loc']))}={p['input']!r}: {p['msg']}" for p in problems)
    return ValueError(f"create_model({name!r}): {said}")


def create_model_from_config(cfg: ModelConfig, num_classes: int) -> VisionTransformer:
    """:func:`create_model` with the arguments of a run config's ``model`` section."""
    return VisionTransformer(cfg, num_classes=num_classes)
