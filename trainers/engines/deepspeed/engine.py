"""The DeepSpeed engine as the config, the driver and the loop see it (nothing heavy imported)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from vitray.trainers.engines.deepspeed.resume_files import restore_files, shared_universal
from vitray.trainers.engines.seam import Engine, FileSelector


def _process_group(use_gpu: bool) -> str:
    # On GPUs DeepSpeed joins an NCCL group; on CPUs gloo.
    return "nccl" if use_gpu else "gloo"


def _restore_files(cfg: Any, rank: int, world: int) -> FileSelector:
    return restore_files(rank, world, cfg.train.zero_stage)


def _convert_once_for_new_world_size(cfg: Any, chosen: Any) -> None:
    """A checkpoint of another number of workers is converted to the universal layout here, on the
    driver, once, into the checkpoint folder, before the workers start (each loads it) -- not by
    every rank on the whole checkpoint."""
    if chosen is None or cfg.train.zero_stage == 0:
        return
    written_by = int(chosen.state["world_size"])  # what resume_point read when it verified it
    if written_by == cfg.cluster.num_workers:
        return
    import torch

    if not torch.cuda.is_available():  # DeepSpeed would warn on the console that it "set" the CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    started = time.monotonic()
    print(
        f"vitray: the checkpoint was written by {written_by} workers; converting it once for {cfg.cluster.num_workers} "
        "(DeepSpeed's universal layout, kept in the checkpoint for later resumes)...",
        file=sys.stderr,
        flush=True,
    )
    where = shared_universal(chosen.path)
    print(f"vitray: converted in {time.monotonic() - started:.1f} s: {where}", file=sys.stderr, flush=True)


ENGINE = Engine(
    name="deepspeed",
    description="GPUs and CPUs (ZeRO, mixed precision)",
    backend="vitray.trainers.engines.deepspeed.backend:DeepSpeedBackend",
    hardware="GPUs and CPUs",
    gpu_decode=True,
    skips_nonfinite=True,  # its overflow check drops the step
    zero_stages=True,
    process_group=_process_group,
    restore_files=_restore_files,
    prepare_resume=_convert_once_for_new_world_size,
)
