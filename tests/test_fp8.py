"""precision.dtype=fp8 on the CPU, through torchao's emulated float8 path: the same casts to float8
(with the same dynamic scales) as on an H100, the products in high precision. What only a GPU
shows (the speed, the float8 tensor cores' own rounding) is measured by benchmarks/gpu_step.py
--dtype fp8 and benchmarks/fp8_loss.py; BENCHMARKS.md holds the figures."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from pretrain_helpers import assert_same_weights, in_process_loop
from torch import nn

from vitray.common.config import load_config
from vitray.models import ModelConfig, create_model_from_config
from vitray.runfolder import checkpoint_folders as ckpt
from vitray.trainers.config import TrainingConfig
from vitray.trainers.driver_checks.preflight import PreflightError, check_inputs
from vitray.trainers.step.float8 import convert_to_fp8, float8_layer_names, fp8_device_problem


def _float8_layers(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def _bf16_and_fp8_models(scaling: str = "tensorwise") -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = create_model_from_config(ModelConfig(name="Ti/16", img_size=32), 10)
    nn.init.normal_(model.head.weight, std=0.02)  # a zero head (the paper's init) passes no gradient back
    reference = model.bfloat16()
    fp8 = copy.deepcopy(reference)
    convert_to_fp8(fp8, scaling, emulate=True, layers="all")  # Ti/16 is too narrow for "auto" to pick any
    return reference, fp8


def _loss_and_grads(model: nn.Module, images: torch.Tensor, labels: torch.Tensor):
    loss = nn.functional.cross_entropy(model(images).float(), labels)
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_swaps_only_the_blocks_linear_layers_and_stays_close_to_bf16(scaling):
    reference, fp8 = _bf16_and_fp8_models(scaling)
    # Ti/16: 12 blocks x (qkv, proj, fc1, fc2); the patch embedding, head and norms stay bf16.
    swapped = _float8_layers(fp8)
    assert len(swapped) == 48 and all(name.startswith("blocks.") for name in swapped)
    assert not _float8_layers(reference)
    # The parameter names are nn.Linear's: checkpoints load across precisions.
    assert fp8.state_dict().keys() == reference.state_dict().keys()
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(16, 3, 32, 32, generator=generator).bfloat16()
    labels = torch.randint(0, 10, (16,), generator=generator)
    ref_loss, ref_grads = _loss_and_grads(reference, images, labels)
    fp8_loss, fp8_grads = _loss_and_grads(fp8, images, labels)
    # Float8 (e4m3 forward, e5m2 gradients) rounds far more coarsely than bf16: not the same numbers, ...
    assert fp8_loss != ref_loss
    # ... but close: the loss within 1%, the whole gradient within 15% (relative L2; measured ~5%).
    assert fp8_loss == pytest.approx(ref_loss, rel=0.01)
    flat_ref = torch.cat([g.flatten() for g in ref_grads.values()])
    flat_fp8 = torch.cat([fp8_grads[n].flatten() for n in ref_grads])
    assert ((flat_fp8 - flat_ref).norm() / flat_ref.norm()).item() < 0.15
    # Each float8 layer's weight gradient points the same way as bf16's (cosine > 0.9).
    for name in swapped:
        a, b = fp8_grads[f"{name}.weight"].flatten(), ref_grads[f"{name}.weight"].flatten()
        assert nn.functional.cosine_similarity(a, b, dim=0) > 0.9, name


def _weights(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """A checkpoint's weights: its model.safetensors, or derived from its shards (not the run's last)."""
    from vitray import storage

    return ckpt.model_weights(checkpoint_dir, storage.filesystem(checkpoint_dir)[0], ckpt.read_state(checkpoint_dir))


def test_fp8_run_checkpoints_and_resumes_bit_exactly(process_group, digits_dataset, tmp_path):
    """6 steps straight against a new loop resumed from the straight run's step-3 checkpoint: the same
    weights at step 6, bit for bit (dynamic scaling keeps no state beyond the weights)."""
    extra = ("precision.dtype=fp8", "precision.fp8_layers=all", "train.steps=6", "checkpoint.every=3", "log.every=3")
    saved: dict[str, list[tuple[int, str]]] = {"straight": [], "resumed": []}

    def keep(name):
        return lambda metrics, folder: saved[name].append((metrics["step"], folder))

    straight = in_process_loop(digits_dataset, tmp_path / "straight", *extra, report=keep("straight"))
    assert len(_float8_layers(straight.backend.module)) == 2 * 4  # 2 blocks x (qkv, proj, fc1, fc2)
    assert straight.backend.dtype == torch.bfloat16
    straight.run()
    assert [step for step, _ in saved["straight"]] == [3, 6]
    (_, first), (_, last) = saved["straight"]
    resumed = in_process_loop(digits_dataset, tmp_path / "b", *extra, restore_dir=Path(first), report=keep("resumed"))
    assert resumed.step == 3
    resumed.run()
    assert [s for s, _ in saved["resumed"]] == [6]
    final_straight = _weights(last)
    assert_same_weights(_weights(saved["resumed"][-1][1]), final_straight)
    # The run trained (the weights moved from step 3's) and its checkpoint is plain nn.Linear's names.
    at_three = _weights(first)
    assert any(not torch.equal(at_three[k], final_straight[k]) for k in at_three)
    assert "blocks.0.mlp.fc1.weight" in final_straight


@pytest.mark.parametrize(
    ("name", "scaling", "expected"),
    [
        ("H/14", "tensorwise", ("qkv", "proj", "fc1", "fc2")),  # wide enough everywhere
        ("L/16", "tensorwise", ("qkv", "fc1")),  # proj and fc2 have 1,024 outputs: float8 is slower there
        ("B/16", "tensorwise", ("qkv", "fc1")),
        ("S/16", "tensorwise", ("qkv", "fc1")),
        ("Ti/16", "tensorwise", ()),
        ("H/14", "rowwise", ("fc1",)),  # a scale per row needs the larger products
        ("L/16", "rowwise", ()),
    ],
)
def test_auto_takes_the_layers_where_float8_is_faster(name, scaling, expected):
    with torch.device("meta"):
        model = create_model_from_config(ModelConfig(name=name, img_size=224), 1000)
    chosen = float8_layer_names(model, scaling)
    depth = len(model.blocks)
    assert sorted(chosen) == sorted(
        f"blocks.{i}.{'attn' if layer in ('qkv', 'proj') else 'mlp'}.{layer}"
        for i in range(depth)
        for layer in expected
    )
    assert len(float8_layer_names(model, scaling, "all")) == 4 * depth  # and never the head or the embedding


def test_fp8_is_refused_where_it_cannot_run(digits_dataset, tmp_path, monkeypatch):
    # A GPU without float8 tensor cores: one line naming the GPU, what is needed and the fix.
    problem = fp8_device_problem("cuda", (8, 0), "NVIDIA A100-SXM4-80GB")
    assert problem is not None and "\n" not in problem
    assert "NVIDIA A100-SXM4-80GB is 8.0" in problem and "precision.dtype=bf16" in problem
    assert fp8_device_problem("cuda", (9, 0), "NVIDIA H100 80GB HBM3") is None
    assert fp8_device_problem("cuda", (8, 9), "NVIDIA L4") is None
    assert fp8_device_problem("cpu", None) is None  # emulated
    # The driver refuses it before Ray starts when its own GPU is such a one (the device query
    # stands in for a GPU this machine does not have; everything else is the real pre-flight).
    cfg = load_config(
        TrainingConfig,
        None,
        [
            f"data.train={digits_dataset}",
            f"run.storage={tmp_path}",
            "precision.dtype=fp8",
            "cluster.gpus_per_worker=1",
            "train.batch_size=64",  # (the paper's 4096 is more than the digits hold)
        ],
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(PreflightError, match=r"compute capability 8\.9 or later.*use precision\.dtype=bf16"):
        check_inputs(cfg)
    monkeypatch.undo()
    # A model too narrow for float8 to pay (the default Ti/4 here) under fp8_layers=auto: before Ray.
    with pytest.raises(PreflightError, match=r"wide enough for float8 to be faster.*precision\.fp8_layers=all"):
        check_inputs(cfg)
    check_inputs(cfg.model_copy(update={"precision": cfg.precision.model_copy(update={"fp8_layers": "all"})}))
    # The TPU backend has no float8 path: refused when the config is read.
    with pytest.raises(ValueError, match="precision.dtype=fp8 is for GPUs"):
        load_config(TrainingConfig, None, [f"data.train={digits_dataset}", "train.backend=xla", "precision.dtype=fp8"])
