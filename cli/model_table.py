"""The README's model table, computed from the code: each model's sizes (vitray.models.variants),
its parameters (built on PyTorch's meta device: nothing allocated), the FLOPs of its forward pass at
224 px (vitray.trainers.metrics.forward_flops) and the timm architecture `vitray export --format
timm` names for it (vitray.runfolder.timm_folder).

    python -m vitray.cli.model_table

tests/test_docs.py fails when the README's table differs from what this prints.
"""

from __future__ import annotations

from vitray.models import create_model, on_meta_device
from vitray.models.variants import get_variant
from vitray.runfolder.timm_folder import HYBRIDS, plain_architecture
from vitray.trainers.metrics import forward_flops

MODELS = ("Ti/16", "S/16", "B/32", "B/16", "L/32", "L/16", "H/14", "R50+B/16")
IMG_SIZE = 224
NUM_CLASSES = 1000


def timm_name(name: str) -> str:
    variant = get_variant(name)
    return HYBRIDS.get(name) or plain_architecture(name, variant.patch_size, IMG_SIZE)


def row(name: str) -> str:
    variant = get_variant(name)
    size = variant.size

    def build():
        return create_model(name, num_classes=NUM_CLASSES, img_size=IMG_SIZE)

    with on_meta_device():
        parameters = sum(p.numel() for p in build().parameters())
    gflops = forward_flops(build, IMG_SIZE) / 1e9
    return (
        f"| `{name}` | {size.depth} | {size.width} | {size.mlp_dim} | {size.num_heads} | {parameters / 1e6:.1f}M "
        f"| {gflops:.1f} | `{timm_name(name)}` |"
    )


def render() -> str:
    """The table: header, separator and one row per model of `MODELS`."""
    lines = [
        "| model | layers | width | MLP | heads | parameters | GFLOPs | timm architecture |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    return "\n".join([*lines, *(row(name) for name in MODELS)]) + "\n"


if __name__ == "__main__":
    print(render(), end="")
