"""What the training reader delivers inside `vitray pretrain` against what it delivers alone, for the
same loader workers (issue 24 item 2).

    .venv/bin/python benchmarks/loader_in_run.py [--images 1200] [--workers 1,2] [--steps 200] [--rounds 1]

It prepares ``--images`` ImageNet-size JPEGs (``data_pipeline.py``'s ``imagenet`` set: about
500x375, quality 90) into local shards, then for each worker count N in ``--workers``:

1. the reference, measured alone: a ``ShardLoader`` with N workers read as fast as it goes, in the
   run's own setting (224 px training crops, uint8, the micro batch, the run's ``num_slots`` and
   shuffle windows): samples per wall-clock second after its first batch, read in a child process
   at the niceness Ray gives its workers (``--niceness``: 15, ``RAY_worker_niceness``), so that
   other work on the machine takes the same share from both sides;
2. `vitray pretrain` on a local Ray instance (1 training worker with all of this machine's CPUs,
   ``data.num_workers=N``, DeepSpeed, the same crops and batch) with ``debug.loader_only``: every
   step reads its batch through the device feed and trains on none, a step that costs nothing, so
   that the run waits on its loader and its images/s is what the loader delivers there (with Ray,
   the training process, its feed and its threads around it). On this CPU a real model's step,
   however small, costs more than the loader: converting a batch of 224 px images to floats alone
   takes longer than decoding it. Its figure is the mean of the logged windows' ``images_per_s``,
   without the first window (worker start-up, the first shuffle windows) and the last one (the
   final checkpoint).

The last lines give in-run / alone per N; goal: >= 0.9. Rounds alternate the two measurements so
that a change in the machine's load hits both sides; each side's best round counts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_pipeline import OUTPUT, make_loader, write_jpegs

from vitray.common.config import validate_config
from vitray.data import prepare_dataset
from vitray.runfolder.files import RunFiles
from vitray.trainers.config import TrainingConfig


def run_config(
    data: str, storage: str, *, workers: int, batch: int, steps: int, log_every: int
) -> tuple[TrainingConfig, list[str]]:
    """The run's config, and the ``--set`` overrides that give it to `vitray pretrain`."""
    sets = {
        "data.train": data,
        "run.storage": storage,
        "run.name": f"loader-{workers}",
        "model.name": "Ti/32",
        "model.img_size": OUTPUT,
        "train.steps": steps,
        "train.batch_size": batch,
        "train.micro_batch_size": batch,
        "log.every": log_every,
        "schedule.warmup_steps": 1,
        "checkpoint.every": steps,
        "cluster.num_workers": 1,
        "cluster.cpus_per_worker": os.cpu_count(),
        "data.num_workers": workers,
        "debug.loader_only": "true",
    }
    overrides = [f"{k}={v}" for k, v in sets.items()]
    return validate_config(TrainingConfig, {}, overrides, source=None), overrides


def alone(cfg: TrainingConfig, samples: int) -> float:
    """Samples/s of the run's loader read alone, after its first batch."""
    data = cfg.data
    loader = make_loader(
        data.train,
        workers=data.num_workers,
        batch_size=cfg.train.micro_batch_size,
        num_slots=cfg.new_run_num_slots(),
        shuffle_buffer=data.shuffle_buffer,
        min_crop_area=data.min_crop_area,
    )
    iterator = iter(loader)
    next(iterator)
    start = time.perf_counter()
    count = sum(len(b) for b in itertools.islice(iterator, max(1, samples // cfg.train.micro_batch_size - 1)))
    rate = count / (time.perf_counter() - start)
    iterator.close()
    return rate


def alone_at(niceness: int, cfg: TrainingConfig, samples: int) -> float:
    """:func:`alone` in a child process at ``niceness`` (its loader workers inherit it): the priority
    Ray starts its workers with (``RAY_worker_niceness``, 15 by default), so that where other work
    shares the machine both sides get the same share of it."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        os.nice(niceness)
        send.send(alone(cfg, samples))

    process = context.Process(target=child)
    process.start()
    rate = receive.recv()
    process.join()
    return rate


def in_run(cfg: TrainingConfig, sets: list[str]) -> tuple[float, float]:
    """(images/s, data_wait_fraction) of `vitray pretrain`, over its steady windows."""
    cmd = [sys.executable, "-m", "vitray.cli", "pretrain", *[a for s in sets for a in ("--set", s)]]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    metrics = [m for m in RunFiles(f"{cfg.run.storage}/{cfg.run.name}").read_metrics() if "images_per_s" in m]
    steady = metrics[1:-1] or metrics
    return float(np.mean([m["images_per_s"] for m in steady])), float(
        np.mean([m["data_wait_fraction"] for m in steady])
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1200, help="JPEGs in the dataset")
    parser.add_argument("--workers", default="1,2", help="comma-separated loader worker counts (data.num_workers)")
    parser.add_argument("--batch", type=int, default=64, help="the run's micro batch (one training worker)")
    parser.add_argument("--steps", type=int, default=200, help="training steps of each run")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=1, help="alone / in-run pairs; each side's best counts")
    parser.add_argument(
        "--niceness",
        type=int,
        default=int(os.environ.get("RAY_worker_niceness", 15)),  # noqa: SIM112 -- Ray spells it so
        help="niceness of the loader read alone: that of Ray's workers (RAY_worker_niceness, default 15)",
    )
    args = parser.parse_args()
    if args.steps < 3 * args.log_every:
        parser.error("--steps must be at least 3 x --log-every (the first and last windows are not counted)")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    results = {}
    with tempfile.TemporaryDirectory(prefix="vitray-bench-") as tmp:
        root = Path(tmp)
        paths = write_jpegs(root / "jpegs", args.images, "imagenet")
        prepare_dataset(f"imagefolder:{root / 'jpegs'}", str(root / "shards"), samples_per_shard=250)
        mean_kib = np.mean([p.stat().st_size for p in paths]) / 1024
        print(
            f"{args.images} ImageNet-size JPEGs (mean {mean_kib:.0f} KiB), {OUTPUT} px crops, batch {args.batch}, "
            f"{os.cpu_count()} CPUs; in-run: 1 training worker with {os.cpu_count()} CPUs, debug.loader_only",
            flush=True,
        )
        for workers in [int(w) for w in args.workers.split(",")]:
            alone_rates, run_rates, waits = [], [], []
            for round_ in range(args.rounds):
                cfg, sets = run_config(
                    str(root / "shards"),
                    str(root / f"runs-{workers}-{round_}"),
                    workers=workers,
                    batch=args.batch,
                    steps=args.steps,
                    log_every=args.log_every,
                )
                alone_rates.append(alone_at(args.niceness, cfg, args.steps * args.batch))
                rate, wait = in_run(cfg, sets)
                run_rates.append(rate)
                waits.append(wait)
                print(
                    f"  {workers} worker(s), {cfg.new_run_num_slots()} slots, round {round_ + 1}: alone "
                    f"{alone_rates[-1]:6.1f} samples/s, in the run {rate:6.1f} images/s (data_wait_fraction "
                    f"{wait:.2f}): {rate / alone_rates[-1]:.2f}",
                    flush=True,
                )
            results[workers] = {"alone": max(alone_rates), "in_run": max(run_rates), "data_wait": min(waits)}
    print(json.dumps(results))
    for workers, r in results.items():
        print(
            f"data.num_workers={workers}: alone {r['alone']:.1f} samples/s, in `vitray pretrain` {r['in_run']:.1f}: "
            f"in-run / alone {r['in_run'] / r['alone']:.2f}"
        )


if __name__ == "__main__":
    main()
