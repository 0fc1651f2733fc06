"""Throughput of the training reader (ShardLoader) against a plain PIL decode + crop loop, and
the longest stall between its batches.

    python benchmarks/data_pipeline.py [--images 2000] [--samples 4000] [--workers 2] [--skip-s3]

For each of two JPEG sets -- ``256``: about 256x256 (224-320 px a side), and ``imagenet``: about
ImageNet's typical 500x375 (450-550 x 330-420, either orientation), both quality 90, cut from
scikit-learn's two sample photos (they ship with the package) -- it prepares ``--images`` JPEGs
into local shards and measures samples per CPU-second of

1. the reference: a plain single-process loop over the JPEG files: read the file, PIL decode to
   RGB, torchvision's ``RandomResizedCrop(224, scale=(0.05, 1))`` + ``RandomHorizontalFlip`` on the
   PIL image, out as a uint8 ``(H, W, 3)`` array; torch on one thread;
2. ``ShardLoader`` with ``--workers`` DataLoader workers, uint8 batches (``float_images=False``,
   what the trainers take) and float32 batches;
3. ``ShardLoader`` decoding in the calling process (``num_workers=0``);
4. where the region decoder is built: the same as 2. with ``REGION_DECODE`` off (every JPEG
   decoded whole, then cropped: the loader before region decoding);
5. the same as 2. with ``device_decode=True`` (``data.decode=gpu``): the workers read the shards
   and draw the crops but hand the JPEGs over undecoded, for the accelerator to decode; this
   measures only the CPU's side (the decode itself is the GPU's, see ``vitray.data.device_decode``);
6. (``256`` set only) the same as 2. over S3 (a moto server on 127.0.0.1: the S3 code path, not a
   network; moto's own CPU time is not counted).

CPU time is summed over the main process and its workers (``getrusage``; worker start-up, the
shuffle windows and the chunks prefetched but never used included, amortised over ``--samples``);
"steady" counts only the CPU time after the first batch (the workers' from ``/proc``), what a long
run pays per sample.
The readers run in ``--repeats`` rounds, every reader once per round, and each reader's best run
counts: CPU time per sample is the steady measure on a machine shared with other work; wall-clock
rates are printed too but depend on that load.

The stall probe then reads batches with 2 slots of ``--probe-window``-sample shuffle windows (a
window switch every few batches), one worker per slot, and reports the median and the longest gap
between two consecutive batches, and the longest gap at a window switch. The last line prints the
ratios: loader / plain loop per CPU-second for both sets, region / whole decodes, and the longest gap at a
switch / the median.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import resource
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_sample_images
from torchvision.transforms import v2

from vitray.data import ShardLoader, prepare_dataset

OUTPUT = 224
SETS = {"256": ((224, 320), (224, 320)), "imagenet": ((450, 550), (330, 420))}  # (long side, short side) ranges


@dataclass
class Rate:
    per_second: float  # samples per wall-clock second
    per_cpu_second: float  # samples per CPU-second of this process and its (finished) children
    steady_per_cpu_second: float = 0.0  # the same after the first batch (no start-up, no first windows)


def cpu_seconds() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def live_children_cpu_seconds() -> float:
    """CPU time of this process's running children (DataLoader workers), from /proc."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids = f.read().split()
        except FileNotFoundError:  # a thread that has just ended
            continue
        for pid in pids:
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def write_jpegs(root: Path, count: int, kind: str, classes: int = 10, seed: int = 0) -> list[Path]:
    """``count`` JPEGs of the set ``kind`` (quality 90) in ``classes`` class folders."""
    photos = load_sample_images().images  # two 427x640 RGB photos
    (long_lo, long_hi), (short_lo, short_hi) = SETS[kind]
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        photo = photos[i % len(photos)]
        h = int(rng.integers(200, photo.shape[0] + 1))
        w = int(rng.integers(200, photo.shape[1] + 1))
        top, left = int(rng.integers(0, photo.shape[0] - h + 1)), int(rng.integers(0, photo.shape[1] - w + 1))
        long, short = int(rng.integers(long_lo, long_hi + 1)), int(rng.integers(short_lo, short_hi + 1))
        size = (long, short) if rng.random() < 0.75 else (short, long)  # mostly landscape, like ImageNet
        image = Image.fromarray(photo[top : top + h, left : left + w]).resize(size, Image.BILINEAR)
        path = root / f"class{i % classes}" / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, format="JPEG", quality=90)
        paths.append(path)
    return paths


def plain_loop(paths: list[Path], samples: int) -> Rate:
    """The reference: decode + RandomResizedCrop + flip with PIL, uint8 out, one thread."""
    crop = v2.RandomResizedCrop(OUTPUT, scale=(0.05, 1.0), antialias=True)
    flip = v2.RandomHorizontalFlip()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cpu, start = cpu_seconds(), time.perf_counter()
        for i in range(samples):
            with Image.open(paths[i % len(paths)]) as image:
                out = np.asarray(flip(crop(image.convert("RGB"))))
            assert out.shape == (OUTPUT, OUTPUT, 3)
        wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    finally:
        torch.set_num_threads(threads)
    return Rate(samples / wall, samples / cpu, samples / cpu)


def make_loader(path: str, *, workers: int, batch_size: int, floats: bool = False, **kwargs) -> ShardLoader:
    return ShardLoader(
        path,
        "train",
        rank=0,
        world_size=1,
        batch_size=batch_size,
        img_size=OUTPUT,
        train=True,
        seed=0,
        num_workers=workers,
        float_images=floats,
        **kwargs,
    )


@contextlib.contextmanager
def whole_image_decodes() -> Iterator[None]:
    """Decode JPEGs whole instead of by region (the loader before region decoding); the DataLoader
    workers are forked, so they inherit the switch."""
    from vitray.data import transforms

    region = transforms.REGION_DECODE
    transforms.REGION_DECODE = False
    try:
        yield
    finally:
        transforms.REGION_DECODE = region


def loader_run(
    path: str,
    *,
    workers: int,
    batch_size: int,
    samples: int,
    floats: bool = False,
    whole: bool = False,
    device_decode: bool = False,
) -> Rate:
    if whole:
        with whole_image_decodes():
            return loader_run(path, workers=workers, batch_size=batch_size, samples=samples, floats=floats)
    data_loader = make_loader(path, workers=workers, batch_size=batch_size, floats=floats, device_decode=device_decode)
    threads = torch.get_num_threads()
    if workers == 0:
        torch.set_num_threads(1)  # decoding in this process: one thread, as in the plain loop
    cpu, _start = cpu_seconds(), time.perf_counter()
    iterator = iter(data_loader)
    count = len(next(iterator))
    first, cpu_first = time.perf_counter(), cpu_seconds() + live_children_cpu_seconds()
    steady = sum(len(b) for b in itertools.islice(iterator, max(1, samples // batch_size - 1)))
    wall = time.perf_counter() - first
    steady_cpu = cpu_seconds() + live_children_cpu_seconds() - cpu_first
    iterator.close()  # joins the workers, so that their CPU time is counted
    torch.set_num_threads(threads)
    return Rate(steady / wall, (count + steady) / (cpu_seconds() - cpu), steady / steady_cpu)


def stall_probe(path: str, *, window: int, batch_size: int, batches: int) -> tuple[float, float, float, int]:
    """(median gap, longest gap, longest gap at a window switch, switches seen) between batches, in
    seconds. A batch is at a switch when one of its slots' windows (staggered or not) or the epoch
    begins within its positions."""
    try:
        from vitray.data.plan import window_offset
    except ImportError:  # the loader of before windows were staggered

        def window_offset(slot: int, num_slots: int, shuffle_buffer: int, staggered: bool = True) -> int:
            return 0

    data_loader = make_loader(path, workers=2, batch_size=batch_size, num_slots=2, shuffle_buffer=window)
    per_slot = batch_size // 2
    offsets = {window_offset(slot, 2, window) for slot in range(2)}
    iterator = iter(data_loader)
    next(iterator)  # worker start-up and the first windows are not a stall of the running stream
    gaps, at_switch, last = [], [], time.perf_counter()
    for batch in itertools.islice(iterator, batches):
        now = time.perf_counter()
        gaps.append(now - last)
        first = batch.step * per_slot
        if first == 0 or any((p + o) % window == 0 for o in offsets for p in range(first, first + per_slot)):
            at_switch.append(now - last)
        last = now
    iterator.close()
    return statistics.median(gaps), max(gaps), max(at_switch, default=float("nan")), len(at_switch)


def best(runs: list[Rate]) -> Rate:
    return Rate(
        max(r.per_second for r in runs), max(r.per_cpu_second for r in runs), max(r.steady_per_cpu_second for r in runs)
    )


def show(name: str, rate: Rate, reference: Rate | None = None) -> None:
    ratio = (
        f"  ({rate.per_cpu_second / reference.per_cpu_second:.2f}x the plain loop; steady "
        f"{rate.steady_per_cpu_second:4.0f}, {rate.steady_per_cpu_second / reference.per_cpu_second:.2f}x)"
        if reference
        else ""
    )
    print(f"  {name:<44} {rate.per_second:6.0f} samples/s; {rate.per_cpu_second:5.0f} per CPU-s{ratio}")


def region_decode_built() -> bool:
    """Whether this vitray decodes JPEG crops by region (False for a loader from before it)."""
    try:
        from vitray.data import transforms
    except ImportError:
        return False
    return bool(getattr(transforms, "REGION_DECODE", False))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_shards(jpegs: Path) -> Iterator[str]:
    """The JPEGs prepared into shards on an S3 endpoint (moto on 127.0.0.1) while the block runs."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        )
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench")
        prepare_dataset(f"imagefolder:{jpegs}", "s3://bench/shards", samples_per_shard=500)
        yield "s3://bench/shards"
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000, help="JPEGs per set")
    parser.add_argument("--sets", default="256,imagenet", help=f"comma-separated, of {sorted(SETS)}")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4000, help="samples per run of each reader")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every reader; each reader's best counts")
    parser.add_argument("--probe-window", type=int, default=256, help="shuffle window of the stall probe")
    parser.add_argument("--probe-batches", type=int, default=90, help="batches of the stall probe (0: no probe)")
    parser.add_argument("--skip-s3", action="store_true", help="measure local shards only")
    args = parser.parse_args()
    for option in ("images", "batch_size", "samples", "repeats", "probe_window"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be >= 1")
    if args.probe_batches < 0 or 0 < args.probe_batches < 3:
        parser.error("--probe-batches must be 0 (no probe) or >= 3 (gaps between batches need a few)")

    summary = []
    with tempfile.TemporaryDirectory(prefix="vitray-bench-") as tmp:
        for kind in args.sets.split(","):
            root = Path(tmp) / kind
            paths = write_jpegs(root / "jpegs", args.images, kind)
            mean_kib = np.mean([p.stat().st_size for p in paths]) / 1024
            sizes = [Image.open(p).size for p in paths[:200]]
            print(
                f"set {kind}: {len(paths)} JPEGs, mean {mean_kib:.0f} KiB, mean size "
                f"{np.mean([s[0] for s in sizes]):.0f}x{np.mean([s[1] for s in sizes]):.0f}; output {OUTPUT} px, "
                f"batch {args.batch_size}, {args.workers} workers, {os.cpu_count()} CPUs"
            )
            prepare_dataset(f"imagefolder:{root / 'jpegs'}", str(root / "shards"), samples_per_shard=500)
            local = str(root / "shards")
            common = {"batch_size": args.batch_size, "samples": args.samples}
            with contextlib.ExitStack() as stack:
                readers: dict[str, Callable[[], Rate]] = {
                    "plain loop (PIL + torchvision), 1 process": lambda: plain_loop(paths, args.samples),
                    f"ShardLoader, {args.workers} workers, uint8": lambda: loader_run(
                        local, workers=args.workers, **common
                    ),
                    f"ShardLoader, {args.workers} workers, float32": lambda: loader_run(
                        local, workers=args.workers, floats=True, **common
                    ),
                    "ShardLoader, no workers, uint8": lambda: loader_run(local, workers=0, **common),
                }
                if region_decode_built():
                    readers[f"ShardLoader, {args.workers} workers, uint8, whole decodes"] = lambda: loader_run(
                        local, workers=args.workers, whole=True, **common
                    )
                readers[f"ShardLoader, {args.workers} workers, JPEGs for the device"] = lambda: loader_run(
                    local, workers=args.workers, device_decode=True, **common
                )
                if kind == "256" and not args.skip_s3:
                    remote = stack.enter_context(s3_shards(root / "jpegs"))
                    readers[f"ShardLoader S3 (moto), {args.workers} workers"] = lambda: loader_run(
                        remote, workers=args.workers, **common
                    )
                runs: dict[str, list[Rate]] = {name: [] for name in readers}
                for _ in range(args.repeats):
                    for name, measure in readers.items():
                        runs[name].append(measure())
            rates = {name: best(r) for name, r in runs.items()}
            plain = next(iter(rates.values()))
            for name, rate in rates.items():
                show(name, rate, None if rate is plain else plain)
            loader = rates[f"ShardLoader, {args.workers} workers, uint8"]
            summary.append(
                f"{kind} {loader.per_cpu_second / plain.per_cpu_second:.2f} "
                f"(steady {loader.steady_per_cpu_second / plain.per_cpu_second:.2f})"
            )
            whole = rates.get(f"ShardLoader, {args.workers} workers, uint8, whole decodes")
            if whole is not None:
                summary.append(
                    f"{kind} region / whole decodes {loader.per_cpu_second / whole.per_cpu_second:.2f} "
                    f"(steady {loader.steady_per_cpu_second / whole.steady_per_cpu_second:.2f})"
                )
            device = rates[f"ShardLoader, {args.workers} workers, JPEGs for the device"]
            summary.append(
                f"{kind} JPEGs for the device / decoded {device.per_cpu_second / loader.per_cpu_second:.2f} "
                f"(steady {device.steady_per_cpu_second / loader.steady_per_cpu_second:.2f})"
            )
            if kind == args.sets.split(",")[0] and args.probe_batches:
                median, longest, switch, switches = stall_probe(
                    local, window=args.probe_window, batch_size=args.batch_size, batches=args.probe_batches
                )
                print(
                    f"  stall probe ({args.probe_window}-sample windows, 2 slots, 2 workers, {args.probe_batches} "
                    f"batches, {switches} at a window switch): median gap {median * 1e3:.0f} ms, longest "
                    f"{longest * 1e3:.0f} ms, longest at a window switch {switch * 1e3:.0f} ms"
                )
                summary.append(f"longest gap at a window switch / median gap {switch / median:.2f}")
    print("ratios: loader (uint8, workers) / plain loop per CPU-second: " + ", ".join(summary))


if __name__ == "__main__":
    main()
