"""Training metrics: JSONL + TensorBoard events in the run folder, FLOPs and MFU.

Rank 0 writes locally; a background thread mirrors the files to the run folder on storage (local
or S3) so the driver's progress display and `vitray runs` can read them, without a step waiting.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from vitray.common.imports import import_without
from vitray.models import on_meta_device
from vitray.runfolder.files import METRICS_FILE

# Dense (no sparsity) bf16/fp16 tensor-core peak TFLOP/s per GPU, from the vendor's datasheets,
# keyed by the exact name `torch.cuda.get_device_name()` gives: the same chip differs by form
# factor (H100 SXM5 989 vs PCIe 756), so a substring match would credit a PCIe card with SXM
# clocks. A GPU not listed gets no MFU unless `log.peak_tflops` is set.
PEAK_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.0,  # H100 SXM5
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.0,  # H200 SXM
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA GH200 480GB": 989.0,
    "NVIDIA B200": 2250.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA L40S": 362.0,
    "NVIDIA L4": 121.0,
    "NVIDIA A10": 125.0,
}


def accelerator_peak_tflops(
    configured: float | None, dtype: str = "bf16", device_name: str | None = None
) -> float | None:
    """The peak MFU divides by: `log.peak_tflops` if set, else the table's bf16/fp16 peak of this
    GPU (`device_name`, default the current CUDA device's). None (no MFU) for an unknown GPU, no GPU,
    or fp32 training, whose peak (TF32 or plain fp32) the table does not hold. fp8 training is
    measured against the bf16 peak too, so that its MFU compares with a bf16 run's (its products
    run on tensor cores of twice that peak)."""
    if configured:
        return configured
    if dtype not in ("bf16", "fp16", "fp8"):
        return None
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    return PEAK_TFLOPS.get(device_name)


def forward_flops(build_model, img_size: int) -> float:
    """FLOPs of one image's forward pass (a multiply-add counts 2), by torch's FlopCounterMode on
    the meta device (nothing is allocated or computed). `build_model` makes the model."""
    from torch.utils.flop_counter import FlopCounterMode

    with on_meta_device():
        model = build_model()
        images = torch.empty(1, 3, img_size, img_size)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(images)
    return float(counter.get_total_flops())


def train_flops_per_image(build_model_on_meta, img_size: int) -> float:
    """Model FLOPs of one training image: 3x the forward pass (the backward pass costs twice the
    forward), the convention of PaLM's MFU and Chinchilla. Activation checkpointing's recomputed
    forward is not counted: it is work the hardware does, not work the model needs, and counting
    it would raise MFU by a third of the forward (~23% for B/16 with every block checkpointed)."""
    return 3.0 * forward_flops(build_model_on_meta, img_size)


def vit_forward_flops(
    *,
    width: int,
    depth: int,
    mlp_dim: int,
    patch_size: int,
    img_size: int,
    num_classes: int,
    representation_size: int | None = None,
) -> float:
    """The forward FLOPs of one image through a plain ViT with a class-token head, by formula
    (matmuls only; norms, softmax and GELU are left out, as the MFU convention does): the patch
    embedding; per block the q/k/v and output projections, the attention scores and weighted
    values over T tokens, the MLP; the last block only for the class token (the head reads nothing
    else: all T tokens still give keys and values); then the head."""
    patches = (img_size // patch_size) ** 2
    tokens = patches + 1
    embed = 2 * patches * 3 * patch_size**2 * width
    block = 2 * tokens * width * (4 * width + 2 * mlp_dim) + 2 * 2 * tokens**2 * width
    last = 2 * tokens * width * 3 * width + 2 * 2 * tokens * width + 2 * width * (width + 2 * mlp_dim)
    head_in = representation_size or width
    head = (2 * width * representation_size if representation_size else 0) + 2 * head_in * num_classes
    return float(embed + (depth - 1) * block + last + head)


class MetricsWriter:
    """Appends one JSON object per log step; TensorBoard scalars beside it. With a `mirror`
    (`RunFiles`), a background thread copies the folder to the run folder, at most every
    `upload_every_s` seconds (`vitray.trainers.metrics_upload`): a step never waits for storage."""

    def __init__(
        self,
        local_dir: Path,
        mirror=None,
        *,
        upload_every_s: float = 10.0,
        outage_s: float | None = None,
        resumed_at: int = 0,
    ):
        """`resumed_at`: the step a resumed attempt goes on from. TensorBoard is told to hide what
        earlier attempts logged after it (they logged past their last checkpoint before they were
        stopped; metrics.jsonl is cut there, `RunFiles.seed_local_metrics`), or a killed run's
        plots held those steps twice."""
        self.local_dir = local_dir
        self.local_dir.mkdir(parents=True, exist_ok=True)
        # TensorBoard's file layer imports boto3 for its own s3:// support, about 0.3 CPU-s of a
        # worker's start-up; its events go to this local folder (the mirror uploads them).
        SummaryWriter = import_without("torch.utils.tensorboard", hidden=("boto3",)).SummaryWriter

        from vitray.trainers.metrics_upload import BackgroundMirror

        self._tb = SummaryWriter(str(local_dir / "tensorboard"), purge_step=resumed_at + 1 if resumed_at else None)
        self._jsonl = open(local_dir / METRICS_FILE, "a", encoding="utf-8")
        outage = {} if outage_s is None else {"outage_s": outage_s}  # run.storage_outage_s
        self._upload = (
            BackgroundMirror(local_dir, mirror.put_metrics_file, every_s=upload_every_s, **outage) if mirror else None
        )
        if self._upload is not None:
            self._upload.changed()  # a resumed run's seeded lines replace what its failed attempt logged

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._tb.add_scalar(key, value, step)
        self._tb.flush()
        if self._upload is not None:
            self._upload.changed()

    def flush(self):
        """Start uploading what was written so far; returns a handle whose `wait()` returns once it
        is in the run folder (None without a mirror)."""
        return self._upload.flush() if self._upload is not None else None

    def close(self, *, raise_errors: bool = True) -> bool:
        """Close the files and upload their last state (waits for it); returns whether that is in
        the run folder (False without a mirror: the local files are the only copy)."""
        self._jsonl.close()
        self._tb.close()
        if self._upload is None:
            return False
        self._upload.changed()
        return self._upload.close(raise_errors=raise_errors)
