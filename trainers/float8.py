"""FP8 training (`precision.dtype=fp8`): the transformer blocks' linear layers compute in float8.

torchao's float8 training (`torchao.float8`) swaps each chosen `nn.Linear` for a `Float8Linear`:
its weights stay high-precision parameters (bf16 under DeepSpeed's bf16 mode, with fp32 master
weights in the ZeRO optimizer, as with `precision.dtype=bf16`), and each of its three matrix
products (forward, gradient of the input, gradient of the weight) casts its operands to float8
with a scale computed from the tensor itself at that moment ("dynamic" scaling: no amax history
to checkpoint, so a resumed run computes exactly what an uninterrupted one does).

Which layers: the blocks' qkv, proj, fc1 and fc2 -- where nearly all the FLOPs are. The patch
embedding, the head and the norms stay bf16 (small, and the head's logits are the most sensitive
to rounding), as in torchtitan and torchao's own recipes.

Scaling (`precision.fp8_scaling`): "tensorwise" (the default) keeps one scale per tensor, which
Hopper's float8 tensor cores take directly: the fastest recipe on H100/H200. "rowwise" keeps one
scale per row (more accurate with outliers, slower on Hopper; the recipe for Blackwell).

Parameter names stay those of `nn.Linear` (weight, bias): a checkpoint of an fp8 run loads into a
bf16 or fp32 model and back, and exports unchanged. On a device without float8 tensor cores
(the CPU) torchao's emulation computes the same casts and products in high precision: slow, for
tests and small runs; a GPU older than compute capability 8.9 is refused.
"""

from __future__ import annotations

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


def is_block_linear(module: nn.Module, fqn: str) -> bool:
    """The layers that compute in float8: linear layers inside the transformer blocks whose both
    dimensions suit the float8 products."""
    return (
        isinstance(module, nn.Linear)
        and (fqn.startswith("blocks.") or ".blocks." in fqn)
        and module.in_features % _FLOAT8_ALIGNMENT == 0
        and module.out_features % _FLOAT8_ALIGNMENT == 0
    )


def convert_to_fp8(model: nn.Module, scaling: str, *, emulate: bool) -> int:
    """Swaps the blocks' linear layers of `model` for torchao's Float8Linear in place (before the
    model is compiled and handed to the engine); returns how many were swapped."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:  # a dependency of vitray; missing only in a hand-made environment
        raise RuntimeError(f"precision.dtype=fp8 needs torchao ({err}): pip install torchao") from err
    recipe = Float8LinearConfig.from_recipe_name(scaling)
    config = Float8LinearConfig(**{**vars(recipe), "emulate": emulate})
    convert_to_float8_training(model, config=config, module_filter_fn=is_block_linear)
    swapped = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if not swapped:
        raise ValueError(
            "precision.dtype=fp8: no linear layer of the model's blocks has both dimensions divisible by 16; "
            "use precision.dtype=bf16 for this model"
        )
    return swapped
