"""MFU's two halves: model FLOPs (PaLM/Chinchilla convention, no recompute) and the GPU's peak."""

from __future__ import annotations

import pytest

from vitray.models import create_model
from vitray.trainers.metrics import (
    PEAK_TFLOPS,
    accelerator_peak_tflops,
    forward_flops,
    train_flops_per_image,
    vit_forward_flops,
)


def test_forward_flops_of_a_tiny_vit_match_the_formula():
    # Ti-like widths at 32 px, patch 8: 16 patches + the class token, with a pre-logits layer.
    counted = forward_flops(lambda: create_model("Ti/8", num_classes=7, img_size=32, representation_size=24), 32)
    formula = vit_forward_flops(
        width=192, depth=12, mlp_dim=768, patch_size=8, img_size=32, num_classes=7, representation_size=24
    )
    assert counted == formula


def test_b16_train_flops_do_not_count_the_recomputation_of_activation_checkpointing():
    plain = train_flops_per_image(lambda: create_model("B/16", num_classes=1000, img_size=224), 224)
    checkpointed = train_flops_per_image(
        lambda: create_model("B/16", num_classes=1000, img_size=224, grad_checkpointing=True), 224
    )
    assert plain == checkpointed
    formula = vit_forward_flops(width=768, depth=12, mlp_dim=3072, patch_size=16, img_size=224, num_classes=1000)
    assert plain == pytest.approx(3 * formula, rel=1e-9)
    assert 98e9 < plain < 99.5e9  # 3 x 32.9 GFLOPs


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L4", 121.0),
    ],
)
def test_peak_by_the_exact_device_name(name, peak):
    assert accelerator_peak_tflops(None, "bf16", name) == peak
    assert accelerator_peak_tflops(None, "fp16", name) == peak


def test_unknown_gpu_or_fp32_gives_no_mfu_unless_the_peak_is_configured():
    assert accelerator_peak_tflops(None, "bf16", "NVIDIA H100") is None  # not a name a driver reports
    assert accelerator_peak_tflops(None, "bf16", "Some Future GPU") is None
    assert accelerator_peak_tflops(None, "fp32", "NVIDIA H100 80GB HBM3") is None  # the table holds bf16 peaks
    assert accelerator_peak_tflops(400.0, "fp32", "Some Future GPU") == 400.0
    assert all(name.startswith("NVIDIA ") and peak > 100 for name, peak in PEAK_TFLOPS.items())
