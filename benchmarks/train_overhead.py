"""Training throughput through `vitray pretrain` (Ray Train + DeepSpeed, 1 worker) against a plain
single-process PyTorch loop of the same step (same model, batch, data loader and thread count),
measured in the same run; also how long each checkpoint blocks training against the full save.

    .venv/bin/python benchmarks/train_overhead.py [--rounds 2] [--steps 60] [--model Ti/4] [--img-size 32] [--storage s3|local]

Throughput is measured in rounds (the plain loop, then `vitray pretrain` with its run folder on
local disk), so that a change in the machine's load hits both sides; the checkpoint measurement is
one more run with the run folder on --storage (S3: moto's server on 127.0.0.1, which shares this
machine's CPUs with training while it takes the upload, so that run's images/s is shown apart).
The last line is the median of the rounds' throughput ratios (vitray / plain); goal: >= 0.9.

    .venv/bin/python benchmarks/train_overhead.py --host-work

counts instead, per ZeRO stage and dtype, what one training step that does not log makes the host
do (issue 24): device synchronisations, per-parameter gradient hooks and host reads of device
values, with vitray's DeepSpeed settings against its former ones (DeepSpeed's throughput timer,
overlapped ZeRO-1 reduction and clipping), measured in the same run; the counters are
tests/test_step_overhead.py's. On a GPU each of these is time the GPU may wait for the host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitray.data import ShardLoader, prepare_dataset, read_dataset_info
from vitray.models import create_model
from vitray.runfolder.checkpoint_folders import latest_complete_checkpoint
from vitray.runfolder.files import RunFiles


def plain_loop(data: str, args) -> float:
    """images/s of forward + backward + AdamW with the same loader, after warm-up."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    info = read_dataset_info(data)
    model = create_model(args.model, num_classes=info.num_classes, img_size=args.img_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    loader = ShardLoader(
        data,
        "train",
        rank=0,
        world_size=1,
        batch_size=args.batch,
        img_size=args.img_size,
        train=True,
        seed=0,
        num_slots=8,
        num_workers=1,
        shuffle_buffer=256,
    )
    batches = iter(loader)
    started = None
    for step in range(args.steps):
        if step == args.warmup:
            started = time.perf_counter()
        batch = next(batches)
        loss = F.cross_entropy(model(batch.images), batch.labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return (args.steps - args.warmup) * args.batch / (time.perf_counter() - started)


def vitray_run(data: str, storage: str, args) -> tuple[float, list[dict]]:
    log_every = max(1, (args.steps - args.warmup) // 4)
    sets = [
        f"data.train={data}",
        f"run.storage={storage}",
        "run.name=bench",
        f"model.name={args.model}",
        f"model.img_size={args.img_size}",
        f"train.steps={args.steps}",
        f"train.batch_size={args.batch}",
        f"train.micro_batch_size={args.batch}",
        f"log.every={log_every}",
        "schedule.warmup_steps=5",
        f"checkpoint.every={args.steps // 2}",
        "train.zero_stage=1",
        "cluster.num_workers=1",
        f"cluster.cpus_per_worker={args.threads}",
        "data.num_slots=8",
        "data.num_workers=1",
        "data.shuffle_buffer=256",
    ]
    cmd = [sys.executable, "-m", "vitray.cli", "pretrain", *[a for s in sets for a in ("--set", s)]]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    metrics = RunFiles(f"{storage}/bench").read_metrics()
    # Windows that start after the warm-up steps, without the one holding a checkpoint save.
    steady = [
        m["images_per_s"] for m in metrics if m["step"] > args.warmup + log_every and "checkpoint_blocked_s" not in m
    ]
    return float(np.mean(steady)), metrics


def full_save_seconds(run_dir: str, blocked_write_s: float) -> float:
    """Local write (measured by the trainer) + uploading the folder to the run storage again, as
    Ray's uploader does in the background (a copy for local storage, a PUT per file for S3)."""
    from vitray import storage

    checkpoint = latest_complete_checkpoint(run_dir).path
    fs, path = storage.filesystem(checkpoint)
    local = Path(tempfile.mkdtemp()) / "checkpoint"
    fs.get(path, str(local), recursive=True)
    target = f"{path.rstrip('/')}-upload-timing"
    t0 = time.perf_counter()
    fs.put(str(local), target, recursive=True)
    upload_s = time.perf_counter() - t0
    fs.rm(target, recursive=True)
    shutil.rmtree(local.parent)
    return blocked_write_s + upload_s


def host_work(data: str, tmp: str) -> None:
    """--host-work: the counts of the last step before the log step (one-time work excluded)."""
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_step_overhead import STEPS, deepspeed_as_before, measure

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    kinds = ("syncs", "hooks", "reads")
    print(f"per non-log step (Ti/4, 16 px, 1 worker), before -> after: {', '.join(kinds)}", flush=True)
    results = {}
    for stage in (0, 1, 2, 3):
        for dtype in ("bf16", "fp32"):
            sets = (f"train.zero_stage={stage}", f"precision.dtype={dtype}")
            with contextlib.redirect_stdout(sys.stderr), deepspeed_as_before():
                before = measure(data, Path(tmp) / f"before-{stage}-{dtype}", *sets)
            with contextlib.redirect_stdout(sys.stderr):
                after = measure(data, Path(tmp) / f"after-{stage}-{dtype}", *sets)
            row = {k: (before.non_log(k)[STEPS - 2], after.non_log(k)[STEPS - 2]) for k in kinds}
            results[f"zero{stage}-{dtype}"] = row
            print(f"ZeRO-{stage} {dtype}: " + ", ".join(f"{k} {b} -> {a}" for k, (b, a) in row.items()), flush=True)
    print(json.dumps(results))
    dist.destroy_process_group()


@contextlib.contextmanager
def run_storage(kind: str, tmp: str):
    """A local folder, or a bucket on moto's S3 server on 127.0.0.1 (AWS_* set for the children)."""
    if kind == "local":
        yield str(Path(tmp) / "runs")
        return
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_EC2_METADATA_DISABLED="true",
    )
    boto3.client("s3").create_bucket(Bucket="bench")
    try:
        yield "s3://bench/runs"
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Ti/4")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="plain loop / vitray pairs for the throughput ratio")
    parser.add_argument(
        "--storage",
        choices=("local", "s3"),
        default="s3",
        help="run storage for the checkpoint measurement: a local folder or moto's S3 on 127.0.0.1",
    )
    parser.add_argument("--host-work", action="store_true", help="count each step's host work instead (issue 24)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "digits")
        prepare_dataset("builtin:digits", data, samples_per_shard=200)
        if args.host_work:
            return host_work(data, tmp)
        ratios = []
        for round_ in range(args.rounds):
            plain = plain_loop(data, args)
            vitray, _ = vitray_run(data, str(Path(tmp) / f"runs-{round_}"), args)
            ratios.append(vitray / plain)
            print(
                f"round {round_ + 1}: plain PyTorch loop ({args.threads} threads) {plain:6.1f} images/s, vitray pretrain "
                f"(Ray Train + DeepSpeed, 1 worker x {args.threads} CPUs, local run folder) {vitray:6.1f} images/s: "
                f"{vitray / plain:.3f}",
                flush=True,
            )
        with run_storage(args.storage, tmp) as runs:
            vitray, metrics = vitray_run(data, runs, args)
            saves = [m for m in metrics if "checkpoint_blocked_s" in m]
            if saves:
                blocked = saves[0]["checkpoint_blocked_s"]
                full = full_save_seconds(f"{runs}/bench", saves[0]["checkpoint_write_s"])
                print(
                    f"checkpoint ({args.storage} run storage): training blocked {blocked:.3f} s "
                    f"of a {full:.3f} s full save ({blocked / full:.0%}): snapshot "
                    f"{saves[0].get('checkpoint_snapshot_s', float('nan')):.3f} s, waiting for the writer "
                    f"{saves[0].get('checkpoint_wait_s', float('nan')):.3f} s, handing over "
                    f"{saves[0].get('checkpoint_report_s', float('nan')):.3f} s; that run: {vitray:.1f} images/s"
                )
        print(json.dumps({"round_ratios": ratios}))
        print(f"ratio vitray/plain: {float(np.median(ratios)):.3f}")


if __name__ == "__main__":
    main()
