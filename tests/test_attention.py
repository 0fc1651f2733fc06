"""`train.attention`: the training step runs on the attention kernel it names, and the kernel
that really runs is checked and recorded (`trainers/step/attention.py`).

The CPU has two of PyTorch's kernels (its own flash attention and the unfused math path), so the
choice, the check and the refusal of a kernel the device lacks are all exercised here; which
kernel an H100 picks is printed at the start of a GPU run (not measured here: no GPU).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from pretrain_helpers import in_process_loop

from vitray.models import ModelConfig, create_model_from_config
from vitray.trainers.step.attention import _KernelRecorder, attention_context, attention_kernel, model_attention_shape

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_check_names_the_kernel_each_setting_runs_on_the_cpu(dtype):
    shape = {"tokens": 17, "heads": 3, "head_dim": 64, "dtype": dtype, "device": CPU}
    assert attention_kernel("auto", **shape) == "flash"
    assert attention_kernel("flash", **shape) == "flash"
    assert attention_kernel("math", **shape) == "math"


def test_a_kernel_the_device_lacks_is_refused_naming_what_it_runs():
    with pytest.raises(ValueError) as err:
        attention_kernel("efficient", tokens=17, heads=3, head_dim=64, dtype=torch.float32, device=CPU)
    message = str(err.value)
    assert "train.attention='efficient'" in message and "on cpu" in message
    assert "runs: auto, flash, math" in message  # cuDNN and memory-efficient attention are CUDA kernels
    with pytest.raises(ValueError, match="expected one of auto, flash, cudnn, efficient, math"):
        attention_context("fastest", CPU)


def test_the_model_runs_the_kernel_of_its_context():
    model = create_model_from_config(ModelConfig(name="Ti/4", img_size=16), num_classes=10).train()
    assert model_attention_shape(model) == (17, 3, 64, 0.0)  # 16 patches + the class token
    images = torch.randn(2, 3, 16, 16)
    for setting, expected in (("auto", "flash"), ("math", None)):
        recorder = _KernelRecorder()
        with attention_context(setting, CPU)(), recorder:
            model(images).sum().backward()
        depth = len(model.blocks)
        assert recorder.kernels == ([expected] * depth if expected else []), setting


def test_training_steps_run_on_the_checked_kernel_and_record_it(process_group, digits_dataset, tmp_path):
    runs = {}
    for setting in ("auto", "math"):
        loop = in_process_loop(digits_dataset, tmp_path / setting, f"train.attention={setting}")
        recorder = _KernelRecorder()
        with recorder:
            last = loop.run()
        assert math.isfinite(last["loss"])
        assert loop.checkpointer.record["attention_kernel"] == loop.attention_kernel  # into trainer_state.json
        runs[setting] = Counter(recorder.kernels), loop.attention_kernel
    (auto_kernels, auto_checked), (math_kernels, math_checked) = runs["auto"], runs["math"]
    assert auto_checked == "flash" and math_checked == "math"
    # 4 steps x the blocks' forward (the math path dispatches no fused kernel at all).
    assert set(auto_kernels) == {"flash"} and auto_kernels["flash"] >= 4
    assert not math_kernels


def test_a_refused_kernel_stops_the_run_before_it_trains(process_group, digits_dataset, tmp_path):
    with pytest.raises(ValueError, match="train.attention='cudnn'.*runs: auto, flash, math"):
        in_process_loop(digits_dataset, tmp_path, "train.attention=cudnn")
