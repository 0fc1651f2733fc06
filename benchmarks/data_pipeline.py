"""Throughput of the training reader (ShardLoader) against a plain decode-and-augment loop.

    python benchmarks/data_pipeline.py [--images 2000] [--samples 6000] [--workers 2] [--skip-s3]

It writes ``--images`` JPEGs of about 256x256 (random crops of scikit-learn's two sample photos,
which ship with the package), prepares them into local shards, and measures decoded + augmented
samples of

1. a plain single-process loop over the JPEG files (``--samples`` of them, passing over the files
   again like the loaders over their epochs): read, decode, the same training transform, the same
   conversion to float in [-1, 1], torch on one thread;
2. ``ShardLoader`` with ``--workers`` DataLoader workers over the local shards (batches of
   ``--batch-size``, the default 8 slots, 512-sample shuffle windows), with float32 batches and
   with uint8 batches (``float_images=False``: no conversion in the main process);
3. ``ShardLoader`` decoding in the calling process (``num_workers=0``), which shows the cost of
   the shard format, shuffling and per-sample seeding alone, without passing batches between
   processes;
4. the same as 2. over S3 (a moto server on 127.0.0.1: the S3 code path, not a network).

Two figures per reader: samples per second of wall-clock time (after the first batch), and
samples per CPU-second, summed over the main process and its workers (from ``getrusage``; worker
start-up, the first shuffle windows and the chunks prefetched but never used at the end included,
amortised over ``--samples``). The readers run in ``--repeats`` rounds, each round every reader in
turn, and each reader's best run counts: CPU time per sample moves less than wall-clock time when
other work shares the machine, but on a shared virtual machine it still moves by tens of percent,
and rounds let every reader meet the same spells of load. The last line's CPU ratio, (ShardLoader
samples per CPU-s) / (plain loop samples per CPU-s), is the steadier measure of what shards,
shuffling, seeding and passing batches between processes cost; the wall-clock per-core ratio,
(ShardLoader samples/s / workers) / (plain loop samples/s), is printed beside it and needs an
otherwise idle machine with a core per worker plus one for the main process.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import resource
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_sample_images

from vitray.data import ShardLoader, prepare_dataset, train_transform
from vitray.data.transforms import apply_seeded, decode_image, to_model_range


@dataclass
class Rate:
    per_second: float  # samples per wall-clock second
    per_cpu_second: float  # samples per CPU-second of this process and its (finished) children
    first_batch_s: float = 0.0


def cpu_seconds() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def write_jpegs(root: Path, count: int, classes: int = 10, seed: int = 0) -> list[Path]:
    """``count`` JPEG crops (224-320 px a side, quality 90) in ``classes`` class folders."""
    photos = load_sample_images().images  # two 427x640 RGB photos
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        photo = photos[i % len(photos)]
        side = int(rng.integers(160, 420))
        top, left = int(rng.integers(0, photo.shape[0] - side + 1)), int(rng.integers(0, photo.shape[1] - side + 1))
        size = (int(rng.integers(224, 320)), int(rng.integers(224, 320)))
        image = Image.fromarray(photo[top : top + side, left : left + side]).resize(size, Image.BILINEAR)
        path = root / f"class{i % classes}" / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, format="JPEG", quality=90)
        paths.append(path)
    return paths


def plain_loop(paths: list[Path], img_size: int, samples: int) -> Rate:
    """Read, decode and augment ``samples`` files one by one in this process (passing over the
    files again as the loaders do over their epochs, so that both are timed over as long a
    stretch), torch on one thread (as in DataLoader workers; more threads only contend on small
    images)."""
    transform = train_transform(img_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cpu, start = cpu_seconds(), time.perf_counter()
        for i in range(samples):
            image = decode_image(paths[i % len(paths)].read_bytes())
            to_model_range(apply_seeded(transform, image, seed=i)[None])
        wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    finally:
        torch.set_num_threads(threads)
    return Rate(samples / wall, samples / cpu)


def loader_run(path: str, *, workers: int, img_size: int, batch_size: int, samples: int, floats: bool = True) -> Rate:
    data_loader = ShardLoader(path, "train", rank=0, world_size=1, batch_size=batch_size, img_size=img_size,
                              train=True, seed=0, num_workers=workers, float_images=floats)  # fmt: skip
    threads = torch.get_num_threads()
    if workers == 0:
        torch.set_num_threads(1)  # decoding in this process: one thread, as in the plain loop
    cpu, start = cpu_seconds(), time.perf_counter()
    iterator = iter(data_loader)
    count = len(next(iterator))
    first = time.perf_counter()
    steps = max(1, samples // batch_size - 1)
    steady = sum(len(b) for b in itertools.islice(iterator, steps))
    wall = time.perf_counter() - first
    iterator.close()  # joins the workers, so that their CPU time is counted
    torch.set_num_threads(threads)
    return Rate(steady / wall, (count + steady) / (cpu_seconds() - cpu), first - start)


def best(runs: list[Rate]) -> Rate:
    return Rate(max(r.per_second for r in runs), max(r.per_cpu_second for r in runs),
                min(r.first_batch_s for r in runs))  # fmt: skip


def show(name: str, rate: Rate, workers: int = 0) -> None:
    per_worker = f", {rate.per_second / workers:.0f} per worker" if workers else ""
    first = f", first batch after {rate.first_batch_s:.1f}s" if workers else ""
    print(f"{name:<34} {rate.per_second:7.0f} samples/s{per_worker}; {rate.per_cpu_second:5.0f} per CPU-s{first}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_shards(root: Path, args: argparse.Namespace) -> Iterator[str]:
    """The JPEGs prepared into shards on an S3 endpoint (moto on 127.0.0.1) while the block runs."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                          AWS_EC2_METADATA_DISABLED="true", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")  # fmt: skip
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench")
        t = time.perf_counter()
        prepare_dataset(f"imagefolder:{root / 'jpegs'}", "s3://bench/shards", samples_per_shard=500)
        print(f"prepare (serial) to S3:            {args.images / (time.perf_counter() - t):7.0f} images/s")
        yield "s3://bench/shards"
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=6000,
                        help="samples per run of each reader (several epochs, so worker start-up is amortised)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds of every reader; each reader's best run counts (the machine may be busy)")
    parser.add_argument("--skip-s3", action="store_true", help="measure local shards only")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="vitray-bench-") as tmp:
        root = Path(tmp)
        paths = write_jpegs(root / "jpegs", args.images)
        mean_kib = np.mean([p.stat().st_size for p in paths]) / 1024
        print(f"{len(paths)} JPEGs, mean {mean_kib:.0f} KiB; img_size {args.img_size}, batch {args.batch_size}, "
              f"{os.cpu_count()} CPUs")  # fmt: skip
        t = time.perf_counter()
        prepare_dataset(f"imagefolder:{root / 'jpegs'}", str(root / "shards"), samples_per_shard=500)
        print(f"prepare (serial) to local disk:    {args.images / (time.perf_counter() - t):7.0f} images/s")
        sizes = dict(img_size=args.img_size, batch_size=args.batch_size, samples=args.samples)

        with contextlib.ExitStack() as stack:
            remote_path = None if args.skip_s3 else stack.enter_context(s3_shards(root, args))
            local_path = str(root / "shards")
            readers: dict[str, Callable[[], Rate]] = {
                "plain": lambda: plain_loop(paths, args.img_size, args.samples),
                "local": lambda: loader_run(local_path, workers=args.workers, **sizes),
                "uint8": lambda: loader_run(local_path, workers=args.workers, floats=False, **sizes),
                "inline": lambda: loader_run(local_path, workers=0, **sizes),
            }
            if remote_path is not None:
                readers["s3"] = lambda: loader_run(remote_path, workers=args.workers, **sizes)
            # Round after round of every reader, so that each sees the same spells of load from other
            # work on the machine; then the best run of each.
            runs: dict[str, list[Rate]] = {name: [] for name in readers}
            for _ in range(args.repeats):
                for name, measure in readers.items():
                    runs[name].append(measure())
        plain, local, uint8, inline = (best(runs[name]) for name in ("plain", "local", "uint8", "inline"))
        show("plain loop, 1 process", plain)
        show(f"ShardLoader local, {args.workers} workers", local, args.workers)
        show("  the same, uint8 batches", uint8, args.workers)
        show("ShardLoader local, no workers", inline)
        if "s3" in runs:
            remote = best(runs["s3"])
            show(f"ShardLoader S3 (moto), {args.workers} workers", remote, args.workers)
            print(f"S3 / local: {remote.per_second / local.per_second:.2f} (wall), "
                  f"{remote.per_cpu_second / local.per_cpu_second:.2f} (per CPU-s)")  # fmt: skip

    per_core = local.per_second / max(args.workers, 1) / plain.per_second
    print(f"ratio ShardLoader / plain loop: {local.per_cpu_second / plain.per_cpu_second:.2f} per CPU-second "
          f"({inline.per_cpu_second / plain.per_cpu_second:.2f} without workers); "
          f"{per_core:.2f} per worker, wall clock")  # fmt: skip


if __name__ == "__main__":
    main()
