"""The ViT model family by name ("B/16", "R50+B/16"...): sizes, patch sizes, hybrid layouts.

Sizes are the paper's Table 1 plus Ti/S (DeiT / AugReg) and g/14 of "Scaling Vision
Transformers" (Zhai et al.); hybrids put a BiT ResNet in front of the Transformer with the
authors' stage layouts (vit_jax/configs/models.py). For a hybrid the number after "/" is the
total stride of the ResNet, whose output is cut into 1x1 patches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransformerSize:
    """Width (hidden size D), depth (layers), MLP size and heads of one model size."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int


TRANSFORMER_SIZES: dict[str, TransformerSize] = {
    "Ti": TransformerSize(width=192, depth=12, mlp_dim=768, num_heads=3),
    "S": TransformerSize(width=384, depth=12, mlp_dim=1536, num_heads=6),
    "B": TransformerSize(width=768, depth=12, mlp_dim=3072, num_heads=12),
    "L": TransformerSize(width=1024, depth=24, mlp_dim=4096, num_heads=16),
    "H": TransformerSize(width=1280, depth=32, mlp_dim=5120, num_heads=16),
    "g": TransformerSize(width=1408, depth=40, mlp_dim=6144, num_heads=16),
}

# 4 is not a paper setting: it gives tiny models that run in tests and the demo (Ti/4 at 32 px).
PATCH_SIZES: tuple[int, ...] = (4, 8, 14, 16, 32)

# Units per ResNet stage for (ResNet depth, total stride). The /32 layouts are the standard
# ResNets; the /16 ones drop stage 4 and move its units into stage 3, as the paper does
# ("keeping the total number of layers"): R50 (3, 4, 9) is the authors' R50+ViT-B/16, and
# R26 (2, 2, 4) follows the same rule.
HYBRID_STAGES: dict[tuple[str, int], tuple[int, ...]] = {
    ("R26", 16): (2, 2, 4),
    ("R26", 32): (2, 2, 2, 2),
    ("R50", 16): (3, 4, 9),
    ("R50", 32): (3, 4, 6, 3),
}


@dataclass(frozen=True)
class Variant:
    """A parsed model name: the Transformer size, pixels per token side and the optional ResNet."""

    name: str
    size: TransformerSize
    patch_size: int
    resnet_stages: tuple[int, ...] | None = None

    @property
    def is_hybrid(self) -> bool:
        return self.resnet_stages is not None


def _all_variants() -> dict[str, Variant]:
    variants: dict[str, Variant] = {}
    for size_name, size in TRANSFORMER_SIZES.items():
        for patch in PATCH_SIZES:
            name = f"{size_name}/{patch}"
            variants[name] = Variant(name, size, patch)
    for (resnet, stride), stages in HYBRID_STAGES.items():
        for size_name, size in TRANSFORMER_SIZES.items():
            name = f"{resnet}+{size_name}/{stride}"
            variants[name] = Variant(name, size, stride, stages)
    return variants


VARIANTS: dict[str, Variant] = _all_variants()


def model_names() -> list[str]:
    """All valid model names: "<size>/<patch>" and hybrids "R26|R50+<size>/16|32"."""
    return list(VARIANTS)


def get_variant(name: str) -> Variant:
    """The :class:`Variant` called ``name``; ValueError naming the valid names otherwise (for a
    hybrid whose patch is not its ResNet's stride, the two that are)."""
    try:
        return VARIANTS[name]
    except (KeyError, TypeError):
        pass
    resnet, _, rest = str(name).partition("+")
    strides = [stride for (r, stride) in HYBRID_STAGES if r == resnet]
    size = rest.partition("/")[0]
    if strides and size in TRANSFORMER_SIZES:  # a known hybrid with a patch its ResNet does not make
        raise ValueError(
            f"unknown model name {name!r}: hybrids take {' or '.join(f'/{s}' for s in strides)} (the ResNet's "
            f"stride): {' or '.join(f'{resnet}+{size}/{s}' for s in strides)}"
        )
    raise ValueError(f"unknown model name {name!r}; valid names are: {', '.join(VARIANTS)}")


def find_variant_name(
    width: int, depth: int | None, mlp_dim: int, patch_size: int, resnet_stages: tuple[int, ...] | None
) -> str | None:
    """The registered name with this architecture (heads aside; any depth when `depth` is None: a
    variant built with another `depth`), or None."""
    for variant in VARIANTS.values():
        size = variant.size
        if (size.width, size.mlp_dim, variant.patch_size, variant.resnet_stages) == (
            width,
            mlp_dim,
            patch_size,
            resnet_stages,
        ) and depth in (None, size.depth):
            return variant.name
    return None
