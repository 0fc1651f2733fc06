"""The device feed on a thread of its own against the feed in the training thread, with the
accelerator's step stood in for by a wait (issue 24: ``data_wait_fraction`` < 0.03).

    python benchmarks/feed_overlap.py [--images 1200] [--workers 1] [--batch 32] [--steps 30]
                                      [--step-ms 150] [--decode cpu,device] [--rounds 2]

On a GPU the training thread launches the step's kernels and then waits for the device (without
the GIL) while they run; here the step is that wait alone, ``--step-ms`` of ``time.sleep``. What
the feed does for a batch -- receive the loader workers' chunks and assemble the batch, and with
``--decode device`` decode the JPEGs and crop them (``data.decode=gpu``'s code with
``device="cpu"``: torchvision's libjpeg-turbo decode and the batched crops, standing in for
nvjpeg's decode, which also holds its thread until the batch is done) -- is either time between
two steps (the feed in the training thread, ``background=False``: what runs on the CPU, and what
ran on CUDA before session 19) or done on the feed's thread during the wait (``background=True``,
CUDA's default now).

Both feeds read the same ImageNet-size JPEG shards (``data_pipeline.py``'s ``imagenet`` set) with
``--workers`` DataLoader workers, alternately in ``--rounds`` rounds; each prints images/s and
``data_wait_fraction`` (the training thread's time in ``next()`` over the whole time, as
`vitray pretrain` logs it), the best round of each counting, and the thread's figures against the
inline feed's. A CPU stand-in: what the feed's thread gains on a GPU is measured there
(``run_gpu.sh decode``), not here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_pipeline import OUTPUT, write_jpegs

from vitray.data import ShardLoader, prepare_dataset
from vitray.trainers.step.feed import DeviceFeed


def run(shards: str, *, background: bool, device_decode: bool, args: argparse.Namespace) -> tuple[float, float]:
    """(images/s, data_wait_fraction) over ``args.steps`` steps after ``args.warmup``."""
    loader = ShardLoader(
        shards,
        "train",
        rank=0,
        world_size=1,
        batch_size=args.batch,
        img_size=OUTPUT,
        train=True,
        seed=0,
        num_workers=args.workers,
        float_images=False,
        device_decode=device_decode,
    )
    feed = DeviceFeed(loader, "cpu", background=background)
    batches = iter(feed)
    try:
        for _ in range(args.warmup):  # worker start-up and the first shuffle windows
            next(batches)
            time.sleep(args.step_ms / 1e3)
        waited, images, start = 0.0, 0, time.perf_counter()
        for _ in range(args.steps):
            asked = time.perf_counter()
            batch = next(batches)
            waited += time.perf_counter() - asked
            images += len(batch)
            time.sleep(args.step_ms / 1e3)  # the step: the host waits for the device
        elapsed = time.perf_counter() - start
    finally:
        batches.close()
    return images / elapsed, waited / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1200, help="ImageNet-size JPEGs written and sharded")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers of the loader")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--step-ms", type=float, default=150.0, help="the stand-in step's wait")
    parser.add_argument("--decode", default="cpu,device", help="comma-separated: cpu (workers decode), device")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both feeds; each one's best counts")
    args = parser.parse_args()
    decodes = [d for d in args.decode.split(",") if d]
    if not set(decodes) <= {"cpu", "device"} or not decodes:
        parser.error(f"--decode takes cpu and/or device, got {args.decode!r}")
    with tempfile.TemporaryDirectory(prefix="feed-overlap-") as work:
        write_jpegs(Path(work) / "jpegs", args.images, "imagenet")
        shards = str(Path(work) / "shards")
        prepare_dataset(f"imagefolder:{Path(work) / 'jpegs'}", shards, samples_per_shard=200)
        print(
            f"{args.images} ImageNet-size JPEGs, batch {args.batch}, {args.workers} loader worker(s), "
            f"step stood in for by a {args.step_ms:g} ms wait, {args.steps} timed steps, best of {args.rounds}"
        )
        for decode in decodes:
            results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for _ in range(args.rounds):
                for background in (False, True):
                    results[background].append(
                        run(shards, background=background, device_decode=decode == "device", args=args)
                    )
            best = {background: max(runs) for background, runs in results.items()}
            for background, (rate, wait) in best.items():
                where = "feed's own thread" if background else "training thread "
                print(f"decode={decode:6s} {where}: {rate:7.1f} img/s, data_wait_fraction {wait:.3f}")
            ceiling = args.batch / (args.step_ms / 1e3)
            print(
                f"decode={decode:6s} thread / inline: {best[True][0] / best[False][0]:.2f}x img/s "
                f"(the wait alone allows {ceiling:.1f} img/s)"
            )


if __name__ == "__main__":
    main()
