"""FP8 training (`precision.dtype=fp8`): the transformer blocks' linear layers compute in float8.

torchao's float8 training (`torchao.float8`) swaps each chosen `nn.Linear` for a `Float8Linear`:
its weights stay high-precision parameters (bf16 under DeepSpeed's bf16 mode, with fp32 master
weights in the ZeRO optimizer, as with `precision.dtype=bf16`), and each of its three matrix
products (forward, gradient of the input, gradient of the weight) casts its operands to float8
with a scale computed from the tensor itself at that moment ("dynamic" scaling: no amax history
to checkpoint, so a resumed run computes exactly what an uninterrupted one does).

Which layers (`precision.fp8_layers`): of the blocks' qkv, proj, fc1 and fc2 -- where nearly all
the FLOPs are -- "auto" takes those wide enough for float8 to be faster than bf16 on an H100
(`gains_from_float8`), "all" every one (numerics on small models, tests). The patch embedding,
the head and the norms stay bf16 (small, and the head's logits are the most sensitive to
rounding), as in torchtitan and torchao's own recipes.

Scaling (`precision.fp8_scaling`): "tensorwise" (the default) keeps one scale per tensor, which
Hopper's float8 tensor cores take directly: the fastest recipe on H100/H200. "rowwise" keeps one
scale per row (more accurate with outliers, slower on Hopper; the recipe for Blackwell).

Parameter names stay those of `nn.Linear` (weight, bias): a checkpoint of an fp8 run loads into a
bf16 or fp32 model and back, and exports unchanged. On a device without float8 tensor cores
(the CPU) torchao's emulation computes the same casts and products in high precision: slow, for
tests and small runs; a GPU older than compute capability 8.9 is refused.
"""

from __future__ import annotations

import torch
from torch import nn

# The float8 tensor cores' matrix products need both dimensions of each weight divisible by 16.
_FLOAT8_ALIGNMENT = 16
FP8_MIN_CAPABILITY = (8, 9)  # Ada (L4, L40S, RTX 4090) and Hopper (H100, H200) and later


def fp8_device_problem(device_type: str, capability: tuple[int, int] | None, device_name: str = "") -> str | None:
    """Why precision.dtype=fp8 cannot train on this device, in one line; None when it can (a CPU
    emulates float8, a GPU needs compute capability 8.9 or later)."""
    if device_type != "cuda" or capability is None:
        return None
    if tuple(capability) >= FP8_MIN_CAPABILITY:
        return None
    major, minor = capability
    return (
        f"precision.dtype=fp8 needs a GPU with float8 tensor cores (compute capability 8.9 or later: L4, L40S, "
        f"H100, H200); {device_name or 'this GPU'} is {major}.{minor}: use precision.dtype=bf16"
    )


def local_gpu_fp8_problem() -> str | None:
    """`fp8_device_problem` of this process's CUDA device; None without one (the CPU emulates)."""
    if not torch.cuda.is_available():
        return None
    return fp8_device_problem("cuda", torch.cuda.get_device_capability(), torch.cuda.get_device_name())


def torchao_missing() -> str | None:
    """The one-line refusal when torchao (a dependency) cannot be imported; None when it can."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        return f"precision.dtype=fp8 needs torchao ({err}): pip install torchao"
    return None


def is_block_linear(module: nn.Module, fqn: str) -> bool:
    """A linear layer inside the transformer blocks whose both dimensions suit the float8 products."""
    return (
        isinstance(module, nn.Linear)
        and (fqn.startswith("blocks.") or ".blocks." in fqn)
        and module.in_features % _FLOAT8_ALIGNMENT == 0
        and module.out_features % _FLOAT8_ALIGNMENT == 0
    )


def gains_from_float8(module: nn.Linear, scaling: str) -> bool:
    """Whether float8 is faster than bf16 for this layer's product on an H100, by torchao's measured
    thresholds (its float8 README's tables; `torchao.float8._auto_filter_for_recipe` applies the same):
    below them the casts around the product (an amax reduction and a scaled copy of each operand)
    cost more than the faster product saves. For ViT (tensorwise): every block layer of H/14 and
    wider; of S/16 to L/16 only qkv and fc1 (proj and fc2 have 1,024 outputs or fewer); none of Ti/16."""
    out_features, in_features = module.out_features, module.in_features
    if scaling == "tensorwise":
        return not (in_features <= 4096 and out_features <= 1024)
    # rowwise: larger products are needed to pay for a scale per row
    return not (out_features <= 2048 or in_features <= 1024 or (out_features <= 4096 and in_features <= 2048))


def float8_layer_names(model: nn.Module, scaling: str, layers: str = "auto") -> list[str]:
    """The blocks' linear layers that compute in float8: with `layers="auto"` those where float8 is
    the faster (`gains_from_float8`), with "all" every one. A model on the meta device will do."""
    return [
        fqn
        for fqn, module in model.named_modules()
        if is_block_linear(module, fqn) and (layers == "all" or gains_from_float8(module, scaling))
    ]


def no_float8_layer(layers: str) -> str:
    """The one-line refusal of a model with no layer to train in float8."""
    if layers == "all":
        return (
            "precision.dtype=fp8: no linear layer of the model's blocks has both dimensions divisible by 16; "
            "use precision.dtype=bf16 for this model"
        )
    return (
        "precision.dtype=fp8: no linear layer of the model's blocks is wide enough for float8 to be faster than bf16 "
        "(those of H/14 are, and qkv and fc1 of S/16 to L/16); use precision.dtype=bf16, or "
        "precision.fp8_layers=all to train in float8 anyway"
    )


def convert_to_fp8(model: nn.Module, scaling: str, *, emulate: bool, layers: str = "auto") -> list[str]:
    """Swaps the layers `float8_layer_names` chooses for torchao's Float8Linear, in place (before the
    model is compiled and handed to the engine); returns their names."""
    missing = torchao_missing()  # a dependency of vitray; missing only in a hand-made environment
    if missing:
        raise RuntimeError(missing)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = float8_layer_names(model, scaling, layers)
    if not names:
        raise ValueError(no_float8_layer(layers))
    recipe = Float8LinearConfig.from_recipe_name(scaling)
    config = Float8LinearConfig(**{**vars(recipe), "emulate": emulate})
    chosen = set(names)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in chosen)
    return names
