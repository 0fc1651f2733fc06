"""Training metrics: JSONL + TensorBoard events in the run folder, FLOPs and MFU.

Rank 0 writes locally and mirrors the small files to the run folder on storage (local or S3)
after every log, so the driver's progress display and `vitray runs` can read them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

# Dense bf16/fp16 peak TFLOP/s per device, for MFU. Others: set log.peak_tflops.
_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0, "V100": 125.0, "B200": 2250.0}

METRICS_FILE = "metrics.jsonl"


def accelerator_peak_tflops(configured: float | None) -> float | None:
    if configured:
        return configured
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, peak in _PEAK_TFLOPS.items():
            if key in name:
                return peak
    return None


def train_flops_per_image(build_model_on_meta, img_size: int) -> float:
    """Forward + backward FLOPs of one image, counted by torch's FlopCounterMode on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build_model_on_meta()
        images = torch.empty(1, 3, img_size, img_size)
    counter = FlopCounterMode(display=False)
    with counter:
        model(images).sum().backward()
    return float(counter.get_total_flops())


class MetricsWriter:
    """Appends one JSON object per log step; TensorBoard scalars beside it."""

    def __init__(self, local_dir: Path, mirror=None):
        self.local_dir = local_dir
        self.local_dir.mkdir(parents=True, exist_ok=True)
        self._mirror = mirror  # callable(local_dir) that copies the files to the run folder
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(local_dir / "tensorboard"))
        self._jsonl = open(local_dir / METRICS_FILE, "a", encoding="utf-8")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._tb.add_scalar(key, value, step)
        self._tb.flush()
        if self._mirror is not None:
            self._mirror(self.local_dir)

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()
        if self._mirror is not None:
            self._mirror(self.local_dir)
