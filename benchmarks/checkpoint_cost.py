"""What a checkpoint costs as the model and the number of ranks grow: files and bytes written,
and the DeepSpeed universal conversion a resume onto another number of ranks needs.

    .venv/bin/python benchmarks/checkpoint_cost.py [--models Ti/16,S/16,B/16] [--ranks 1,2,4] [--stage 1]

For each model and world size, W CPU processes (gloo) build vitray's DeepSpeed engine (bf16, the
given ZeRO stage, AdamW as configured by default) and write one checkpoint through the backend
the training loop uses. Then the checkpoint of the largest world size is converted to the
universal layout, once, timed (CPU seconds and wall) with the converting process's peak memory.

The reference is what a resume onto another number of ranks did before: every rank converted
the whole checkpoint itself, so a node of 8 ranks did the same conversion 8 times at once (8x the
CPU and memory of one); now the driver converts once and every rank loads the result. The ratio
printed is ranks-per-node conversions against one, from the conversion measured here.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write(rank: int, world: int, port: int, model_name: str, stage: int, folder: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from vitray.common.config import load_config
    from vitray.models import create_model_from_config
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.engines.deepspeed.backend import DeepSpeedBackend

    cfg = load_config(
        TrainingConfig,
        None,
        [
            "data.train=/unused",
            f"model.name={model_name}",
            "model.img_size=224",
            f"train.zero_stage={stage}",
            "precision.dtype=bf16",
            f"train.batch_size={world}",
            "train.micro_batch_size=1",
            f"cluster.num_workers={world}",
            f"data.num_slots={world}",
        ],
    )
    torch.manual_seed(0)
    backend = DeepSpeedBackend(cfg, create_model_from_config(cfg.model, 1000), world, None)
    # One optimizer step, so that AdamW's moments exist (a checkpoint of a run, not of a fresh engine).
    images = torch.randn(1, 3, 224, 224, dtype=backend.dtype)
    backend.backward_step(backend(images).float().square().mean())
    backend.save(str(folder)).wait()
    weights = backend.full_state_dict()  # what the checkpointer writes as model.safetensors (rank 0)
    if rank == 0:
        from safetensors.torch import save_file

        save_file(weights, str(Path(folder) / "model.safetensors"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def checkpoint_files(folder: Path) -> tuple[int, int, Counter]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    kinds: Counter = Counter()
    for p in files:
        kind = (
            "optimizer shards" if "optim_states" in p.name else "module states" if "model_states" in p.name else p.name
        )
        kinds[kind] += p.stat().st_size
    return len(files), sum(p.stat().st_size for p in files), kinds


def convert(folder: Path) -> tuple[float, float, int]:
    """(CPU s, wall s, bytes written) of converting once, in this process."""
    from vitray.trainers.engines.deepspeed.resume_files import to_universal

    with tempfile.TemporaryDirectory() as out:
        wall, cpu = time.perf_counter(), time.process_time()
        target = to_universal(folder, Path(out))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        written = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    return cpu, wall, written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="Ti/16,S/16,B/16")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--ranks-per-node", type=int, default=8, help="for the before/now conversion ratio")
    args = parser.parse_args()
    mib = 1024**2
    print("| model | params | ranks | files | MiB | optimizer shards MiB | module states MiB | model.safetensors MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    largest = {}
    for model in args.models.split(","):
        from vitray.models import ModelConfig, create_model_from_config

        params = sum(
            p.numel() for p in create_model_from_config(ModelConfig(name=model, img_size=224), 1000).parameters()
        )
        for world in (int(w) for w in args.ranks.split(",")):
            root = Path(tempfile.mkdtemp(prefix="vitray-ckcost-"))
            mp.spawn(_write, args=(world, _free_port(), model, args.stage, str(root)), nprocs=world, join=True)
            count, total, kinds = checkpoint_files(root)
            print(
                f"| {model} | {params / 1e6:.1f}M | {world} | {count} | {total / mib:.0f} | "
                f"{kinds['optimizer shards'] / mib:.0f} | {kinds['module states'] / mib:.0f} | "
                f"{kinds['model.safetensors'] / mib:.0f} |",
                flush=True,
            )
            largest[model] = (root, params, total)
    print()
    print(
        f"| model | checkpoint MiB | convert once: CPU s | wall s | peak RSS GiB | universal MiB | before ({args.ranks_per_node} ranks per node each converting): CPU s per node | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for model, (root, _params, total) in largest.items():
        cpu, wall, written = convert(root)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
        print(
            f"| {model} | {total / mib:.0f} | {cpu:.1f} | {wall:.1f} | {peak:.2f} | {written / mib:.0f} | "
            f"{cpu * args.ranks_per_node:.1f} | {args.ranks_per_node:.1f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
