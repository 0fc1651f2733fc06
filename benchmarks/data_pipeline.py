"""Throughput of the training reader (ShardLoader) against a plain decode-and-augment loop.

    python benchmarks/data_pipeline.py [--images 2000] [--workers 2] [--img-size 224]

It writes ``--images`` JPEGs of about 256x256 (random crops of scikit-learn's two sample photos,
which ship with the package), prepares them into local shards, and measures decoded + augmented
samples per second of

1. a plain single-process loop over the JPEG files: read, decode, the same training transform;
2. ``ShardLoader`` with ``--workers`` DataLoader workers over the local shards;
3. the same over S3 (a moto server on 127.0.0.1, so it measures the S3 code path, not a network).

Each figure is the best of ``--repeats`` runs, since other work on the machine only slows runs down.

The per-core ratio, (ShardLoader samples/s / workers) / (plain loop samples/s), says what the
shard format, shuffling and resumable bookkeeping cost per decoding core; the last line prints it.
Near 1 means workers decode as fast as a bare loop; on a machine with no more cores than workers,
the main process (concatenating batches, as a trainer would) takes its share of them too.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_sample_images

from vitray.data import ShardLoader, prepare_dataset, train_transform
from vitray.data.transforms import apply_seeded, decode_image, to_model_range


def write_jpegs(root: Path, count: int, classes: int = 10, seed: int = 0) -> list[Path]:
    """``count`` JPEG crops (about 256x256, quality 90) in ``classes`` class folders."""
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


def plain_loop(paths: list[Path], img_size: int) -> float:
    """Samples/s of reading, decoding and augmenting the files one by one in this process, on one
    core (DataLoader workers also run torch single-threaded; more threads only contend here)."""
    transform = train_transform(img_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        for i, path in enumerate(paths):
            to_model_range(apply_seeded(transform, decode_image(path.read_bytes()), seed=i))
        return len(paths) / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def loader_rate(path: str, *, workers: int, img_size: int, batch_size: int, samples: int) -> tuple[float, float]:
    """(steady samples/s after the first batch, seconds to the first batch) of ShardLoader."""
    data_loader = ShardLoader(path, "train", rank=0, world_size=1, batch_size=batch_size, img_size=img_size,
                              train=True, seed=0, num_workers=workers)  # fmt: skip
    start = time.perf_counter()
    iterator = iter(data_loader)
    next(iterator)
    first = time.perf_counter()
    steps = max(1, samples // batch_size - 1)
    count = sum(len(b) for b in itertools.islice(iterator, steps))
    return count / (time.perf_counter() - first), first - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs (the machine may be busy)")
    parser.add_argument("--skip-s3", action="store_true", help="measure local shards only")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="vitray-bench-") as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        paths = write_jpegs(root / "jpegs", args.images)
        mean_kb = np.mean([p.stat().st_size for p in paths]) / 1024
        print(f"wrote {len(paths)} JPEGs (mean {mean_kb:.0f} KiB) in {time.perf_counter() - t:.1f}s")

        t = time.perf_counter()
        prepare_dataset(f"imagefolder:{root / 'jpegs'}", str(root / "shards"), samples_per_shard=500)
        print(f"prepare (serial, local): {args.images / (time.perf_counter() - t):.0f} images/s")

        plain = max(plain_loop(paths, args.img_size) for _ in range(args.repeats))
        print(f"plain loop, 1 process:             {plain:8.1f} samples/s")
        local, startup = max(
            loader_rate(str(root / "shards"), workers=args.workers, img_size=args.img_size,
                        batch_size=args.batch_size, samples=args.images)
            for _ in range(args.repeats)
        )  # fmt: skip
        print(f"ShardLoader local, {args.workers} workers:      {local:8.1f} samples/s "
              f"({local / max(args.workers, 1):.1f} per worker; first batch after {startup:.1f}s)")  # fmt: skip

        if not args.skip_s3:
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

            port = free_port()
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            server.start()
            try:
                os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                                  AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
                                  AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")  # fmt: skip
                import boto3

                boto3.client("s3").create_bucket(Bucket="bench")
                t = time.perf_counter()
                prepare_dataset(f"imagefolder:{root / 'jpegs'}", "s3://bench/shards", samples_per_shard=500)
                print(f"prepare (serial, to S3): {args.images / (time.perf_counter() - t):.0f} images/s")
                remote, startup = max(
                    loader_rate("s3://bench/shards", workers=args.workers, img_size=args.img_size,
                                batch_size=args.batch_size, samples=args.images)
                    for _ in range(args.repeats)
                )  # fmt: skip
                print(f"ShardLoader S3 (moto), {args.workers} workers: {remote:8.1f} samples/s "
                      f"(first batch after {startup:.1f}s); S3 / local = {remote / local:.2f}")  # fmt: skip
            finally:
                server.stop()

    per_core = local / max(args.workers, 1) / plain
    print(f"ratio (ShardLoader samples/s per worker / plain loop samples/s): {per_core:.2f}")


if __name__ == "__main__":
    main()
