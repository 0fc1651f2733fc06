"""vitray's checkpoint save and restore against the disk and against PyTorch's own writers, on the
state of a real run: one DeepSpeed worker (gloo, ZeRO-1, bf16, AdamW after one step) of a ViT.

    .venv/bin/python benchmarks/checkpoint_io.py [--models B/16,L/16] [--rounds 3] [--dir /path/on/the/disk]

In each round, alternating, on the same disk and with the same bytes: `dd` writing the checkpoint's
size (bs=16M, oflag=direct, conv=fsync: the disk's sequential write), `torch.save` of the same state
(one file, fsynced), `torch.distributed.checkpoint.save` of it (fsynced: DCP's `sync_files`), and
vitray's whole save (`Checkpointer.save` to the last file and the completion record in the run
folder, fsynced). Then the restore: `dd iflag=direct` reading a file the checkpoint's size (the
disk's read) against vitray's (each file's size and CRC-32C checked, then DeepSpeed's load), with
the checkpoint's pages dropped from the page cache first (`posix_fadvise(DONTNEED)`).

Printed per round: MB/s of each (MB = 1e6 bytes of the checkpoint vitray writes; the references
write the bytes they write), vitray's ratio to `dd` and to `torch.save`, bytes a parameter, and how
long the training step stood still for the save (the snapshot into host buffers) with its ms per
GB. `model.img_size=32` keeps the step cheap; the checkpoint does not depend on it but for the
position embedding.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

MB = 1e6


def _fsync_tree(folder: Path) -> None:
    for path in [folder, *folder.rglob("*")]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _drop_cache(folder: Path) -> None:
    """Evict a folder's (clean, fsynced) pages from the page cache, so the next read is the disk's."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dd(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - t0


def build(model: str):
    """A one-worker DeepSpeed backend after one AdamW step, the checkpointer over it."""
    from vitray.common.config import load_config
    from vitray.models import create_model_from_config
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.engines.deepspeed.backend import DeepSpeedBackend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    settings = [
        "data.train=/unused",
        f"model.name={model}",
        "model.img_size=32",
        "train.zero_stage=1",
        "precision.dtype=bf16",
        "train.batch_size=1",
        "train.micro_batch_size=1",
        "cluster.num_workers=1",
        "data.num_slots=1",
    ]
    cfg = load_config(TrainingConfig, None, settings)
    torch.manual_seed(0)
    backend = DeepSpeedBackend(cfg, create_model_from_config(cfg.model, 1000), 1, None)
    images = torch.randn(1, 3, 32, 32, dtype=backend.dtype)
    backend.backward_step(backend(images).float().square().mean())
    params = sum(p.numel() for p in backend.module.parameters())
    return cfg, backend, params


def vitray_save(backend, run_dir: Path, model_weights: str):
    from vitray.trainers.checkpoint.checkpointer import Checkpointer

    reports = []
    saver = Checkpointer(
        backend,
        rank=0,
        world_size=1,
        every=10**9,
        last_step=10**9,
        report=lambda m, d: reports.append(d),
        states={},
        weights={},
        record={},
        run_dir=str(run_dir),
        model_weights=model_weights,
    )
    t0 = time.perf_counter()
    saver.save(1, {})
    saver.finish(wait=True)
    seconds = time.perf_counter() - t0
    costs = saver.take_costs()
    return Path(reports[0]), seconds, costs


def vitray_restore(cfg, backend, folder: Path) -> float:
    from vitray.trainers.checkpoint.rank_files import rank_copy
    from vitray.trainers.engines.deepspeed.resume_files import restore_files

    t0 = time.perf_counter()
    local, state = rank_copy(str(folder), restore_files(0, 1, 1), folder.parent / "restore", 0)
    backend.load(local, state)
    return time.perf_counter() - t0


def the_state(backend) -> dict:
    """What a resume needs, as plain tensors: the optimizer (fp32 master and moments) and the module."""
    optimizer = backend.engine.optimizer.state_dict()
    return {"module": backend.module.state_dict(), "optimizer": optimizer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="B/16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="a folder on the disk to measure (default: the temp folder)")
    parser.add_argument("--model-weights", default="last", help="checkpoint.model_weights for vitray's save")
    args = parser.parse_args()
    import torch.distributed.checkpoint as dcp

    for model in args.models.split(","):
        cfg, backend, params = build(model)
        root = Path(tempfile.mkdtemp(prefix="vitray-ckio-", dir=args.dir))
        print(f"\n{model}: {params / 1e6:.1f}M parameters, 1 worker, ZeRO-1, bf16, AdamW; disk of {root}")
        print(
            "| round | dd write MB/s | torch.save MB/s | DCP save MB/s | vitray save MB/s | vs dd | vs torch.save "
            "| bytes/param | stall ms (ms/GB) | dd read MB/s | vitray restore MB/s | vs dd read |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for round_ in range(1, args.rounds + 1):
            run_dir = root / "run"
            run_dir.mkdir(exist_ok=True)
            folder, seconds, costs = vitray_save(backend, run_dir, args.model_weights)
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            vitray_mb_s = size / MB / seconds

            blocks = max(1, round(size / 2**24))
            dd_file = root / "dd.bin"
            dd_s = _dd(["if=/dev/zero", f"of={dd_file}", "bs=16M", f"count={blocks}", "oflag=direct", "conv=fsync"])
            dd_mb_s = blocks * 2**24 / MB / dd_s

            state = the_state(backend)
            ts_file = root / "torch_save.pt"
            t0 = time.perf_counter()
            with open(ts_file, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            ts_mb_s = ts_file.stat().st_size / MB / (time.perf_counter() - t0)

            dcp_dir = root / "dcp"
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dcp_dir), sync_files=True), no_dist=True)
            dcp_bytes = sum(p.stat().st_size for p in dcp_dir.rglob("*") if p.is_file())
            dcp_mb_s = dcp_bytes / MB / (time.perf_counter() - t0)

            _drop_cache(root)
            read_s = _dd([f"if={dd_file}", "of=/dev/null", "bs=16M", "iflag=direct"])
            read_mb_s = blocks * 2**24 / MB / read_s
            restore_mb_s = size / MB / vitray_restore(cfg, backend, folder)

            stall = costs["checkpoint_snapshot_s"]
            print(
                f"| {round_} | {dd_mb_s:.0f} | {ts_mb_s:.0f} | {dcp_mb_s:.0f} | {vitray_mb_s:.0f} | "
                f"{vitray_mb_s / dd_mb_s:.2f}x | {vitray_mb_s / ts_mb_s:.2f}x | {size / params:.2f} | "
                f"{stall * 1e3:.0f} ({stall * 1e3 / (size / 1e9):.0f}) | {read_mb_s:.0f} | {restore_mb_s:.0f} | "
                f"{restore_mb_s / read_mb_s:.2f}x |",
                flush=True,
            )
            for path in (run_dir, dcp_dir, folder.parent / "restore"):
                shutil.rmtree(path, ignore_errors=True)
            for path in (dd_file, ts_file):
                path.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
