"""A real `vitray pretrain` on ImageNet-size JPEG shards with ``data.decode=gpu`` and ``data.decode=cpu``,
one after the other on the same shards (issue 24: "data at GPU rate").

    python3 benchmarks/pretrain_decode.py [--images 12000] [--model B/16] [--batch 256] [--steps 200]
                                          [--decode gpu,cpu] [--step-rate IMG_PER_S]

It writes ``--images`` ImageNet-size JPEGs (``data_pipeline.py``'s ``imagenet`` set: about 500x375,
quality 90; written by all of the machine's cores at once), prepares them into local shards, then
runs `vitray pretrain` once per ``--decode`` setting: one training worker with one GPU, bf16,
compiled, the loader's worker and slot counts left to their defaults (from the CPUs Ray gives the
worker). Each run's figure is the mean of its logged windows' ``images_per_s`` and
``data_wait_fraction``, without the first window (compilation, worker start-up) and the last one
(the final checkpoint). ``--step-rate``: `benchmarks/gpu_step.py`'s vitray figure for the same
model and batch, measured on the same machine; the script then prints each run's images/s against it
(goal: >= 0.95 with ``data.decode=gpu``, and ``data_wait_fraction`` < 0.03).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_pipeline import OUTPUT, write_jpegs

from vitray.data import prepare_dataset
from vitray.runfolder.checkpoint_folders import latest_complete_checkpoint, read_state
from vitray.runfolder.files import RunFiles


def _write_part(args: tuple[Path, int, int]) -> None:
    root, count, part = args
    write_jpegs(root / f"part{part}", count, "imagenet", seed=part)


def write_jpegs_in_parallel(root: Path, count: int) -> Path:
    """``count`` JPEGs in class folders under ``root/jpegs``, written by one process per core."""
    parts = max(1, min(os.cpu_count() or 1, count // 100))
    with multiprocessing.get_context("fork").Pool(parts) as pool:
        pool.map(_write_part, [(root, count // parts + (i < count % parts), i) for i in range(parts)])
    jpegs = root / "jpegs"
    for part in range(parts):  # part{k}/class{c}/{i}.jpg -> jpegs/class{c}/{k}-{i}.jpg
        for path in (root / f"part{part}").glob("*/*.jpg"):
            target = jpegs / path.parent.name / f"{part}-{path.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            path.rename(target)
        shutil.rmtree(root / f"part{part}")
    return jpegs


def pretrain(data: str, storage: str, decode: str, args: argparse.Namespace) -> dict[str, float]:
    """Runs `vitray pretrain` and returns its steady windows' mean images/s and data_wait_fraction."""
    sets = {
        "run.name": f"decode-{decode}",
        "run.storage": storage,
        "data.train": data,
        "data.decode": decode,
        "model.name": args.model,
        "model.img_size": OUTPUT,
        "train.steps": args.steps,
        "train.batch_size": args.batch,
        "train.micro_batch_size": args.batch,
        "schedule.warmup_steps": min(10, args.steps),  # (a short trial run is refused a longer warm-up)
        "precision.dtype": "bf16",
        "cluster.num_workers": 1,
        "cluster.gpus_per_worker": 1,
        "log.every": args.log_every,
        "checkpoint.every": args.steps,
        **dict(item.split("=", 1) for item in args.set),
    }
    cmd = [sys.executable, "-m", "vitray.cli", "pretrain", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
    except subprocess.TimeoutExpired as err:
        print(
            f"decode={decode}: vitray pretrain ran past {args.run_timeout} s\n{str(err.stdout)[-3000:]}\n{str(err.stderr)[-6000:]}"
        )
        return {}
    wall = time.perf_counter() - start
    if done.returncode != 0:
        print(
            f"decode={decode}: vitray pretrain exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        )
        return {}
    run = f"{storage}/{sets['run.name']}"
    # The loader as the run resolved it (on GPUs its CPUs, hence its workers, are known once Ray is
    # up): the final checkpoint's record of the config and the data position.
    state = read_state(latest_complete_checkpoint(run).path)
    windows = [m for m in RunFiles(run).read_metrics() if "images_per_s" in m]
    steady = windows[1:-1] or windows
    return {
        "images_per_s": float(np.mean([m["images_per_s"] for m in steady])),
        "data_wait_fraction": float(np.mean([m["data_wait_fraction"] for m in steady])),
        "windows": [round(m["images_per_s"], 1) for m in windows],
        "waits": [round(m["data_wait_fraction"], 3) for m in windows],
        "num_workers": state["config"]["data"]["num_workers"],
        "num_slots": state["data"]["num_slots"],
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=12000)
    parser.add_argument("--model", default="B/16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument(
        "--decode", default="gpu,cpu", help='comma-separated data.decode settings, run in this order ("": prepare only)'
    )
    parser.add_argument("--step-rate", type=float, default=None, help="gpu_step.py's vitray img/s, same model/batch")
    parser.add_argument("--set", action="append", default=[], help="more KEY=VALUE settings for both runs")
    parser.add_argument("--run-timeout", type=float, default=300, help="seconds each `vitray pretrain` may take")
    parser.add_argument("--workdir", default=None, help="keep the JPEGs, shards and runs here (default: a temp dir)")
    args = parser.parse_args()
    if args.steps < 3 * args.log_every:
        parser.error("--steps must be at least 3 x --log-every (the first and last windows are not counted)")
    with tempfile.TemporaryDirectory(prefix="vitray-decode-") as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        jpegs = root / "jpegs"
        if not (root / "shards").exists():  # a --workdir prepared by an earlier call is reused
            write_jpegs_in_parallel(root, args.images)
            prepare_dataset(f"imagefolder:{jpegs}", str(root / "shards"), samples_per_shard=1000)
        sizes = [p.stat().st_size for p in jpegs.glob("*/*.jpg")]
        print(
            f"{len(sizes)} ImageNet-size JPEGs (mean {np.mean(sizes) / 1024:.0f} KiB) ready after "
            f"{time.perf_counter() - start:.0f} s; {args.model}, {OUTPUT} px, batch {args.batch}, {args.steps} steps, "
            f"{os.cpu_count()} CPUs",
            flush=True,
        )
        results = {}
        for decode in filter(None, args.decode.split(",")):  # --decode "": prepare only
            results[decode] = pretrain(str(root / "shards"), str(root / "runs"), decode, args)
            print(f"data.decode={decode}: {json.dumps(results[decode])}", flush=True)
        for decode, r in results.items():
            if not r:
                continue
            against = f", {r['images_per_s'] / args.step_rate:.2f}x gpu_step.py's vitray step" if args.step_rate else ""
            print(
                f"data.decode={decode}: {r['images_per_s']:.0f} img/s, data_wait_fraction "
                f"{r['data_wait_fraction']:.3f}{against} (loader: {r['num_workers']} workers, {r['num_slots']} slots)"
            )


if __name__ == "__main__":
    main()
