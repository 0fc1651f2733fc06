"""What TFRecord checksums cost `vitray data prepare` (tfds: / vtab: sources): CRC-32C throughput
of google-crc32c's C extension against vitray's pure-Python fallback, measured in the same run.

    .venv/bin/python benchmarks/crc32c.py [--c-mb 200] [--python-mb 4] [--prepare-records 900]

Every record is checksummed twice (its length header and its data), so the data checksum is the
cost that grows with the dataset. The Python loop is timed on fewer bytes (it is ~1000x slower);
both are given in MB/s, with the ratio and what the 1.3 TB of ImageNet-21k's TFRecords would cost
in CPU time at each rate. Then `vitray data prepare` of a TFDS build of ~110 kB JPEG records
(written by the tests' TFDS writer) is timed whole with each implementation.
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from vitray.data.sources import tfrecord

IMAGENET21K_BYTES = 1.3e12
RECORD_BYTES = 110_000  # about one ImageNet JPEG per record


def rate_mb_s(crc, total_mb: float, repeats: int = 3) -> float:
    """Best of `repeats` passes over `total_mb` of distinct records (not one record again and
    again, which would stay in the CPU's cache as a dataset's records do not)."""
    count = max(1, int(total_mb * 1e6 / RECORD_BYTES))
    data = np.random.default_rng(0).bytes(count * RECORD_BYTES)
    records = [data[i * RECORD_BYTES : (i + 1) * RECORD_BYTES] for i in range(count)]
    del data
    crc(records[0])  # warm-up (the table, the extension)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for record in records:
            crc(record)
        best = min(best, time.perf_counter() - start)
    return count * RECORD_BYTES / 1e6 / best


def prepare_seconds(records: int) -> tuple[float, dict[str, float]]:
    """MB of TFRecords and the wall time of prepare_dataset on them with each CRC implementation."""
    from PIL import Image

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' TFDS build writer
    from tfds_helpers import write_tfds_build

    from vitray.data import prepare_dataset

    rng = np.random.default_rng(0)
    jpegs = []
    for _ in range(50):  # noise JPEGs of ~110 kB, cycled: prepare keeps the bytes as they are
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (340, 340, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=90)
        jpegs.append(buffer.getvalue())
    root = Path(tempfile.mkdtemp(prefix="vitray-crc-bench-"))
    try:
        examples = [{"image": jpegs[i % len(jpegs)], "label": i % 10} for i in range(records)]
        build = write_tfds_build(root / "x" / "1.0.0", "x", {"train": examples}, shards=4, num_classes={"label": 10})
        size = sum(p.stat().st_size for p in build.glob("*.tfrecord*")) / 1e6
        seconds = {}
        for name, impl in (("C", tfrecord._crc32c_c), ("Python", tfrecord._crc32c_python)):
            tfrecord._crc32c_impl = impl
            start = time.perf_counter()
            prepare_dataset(f"tfds:{build}", str(root / f"out-{name}"), samples_per_shard=300)
            seconds[name] = time.perf_counter() - start
        return size, seconds
    finally:
        tfrecord._crc32c_impl = tfrecord._crc32c_c
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--c-mb", type=float, default=200.0, help="MB checksummed by google-crc32c")
    parser.add_argument("--python-mb", type=float, default=4.0, help="MB checksummed by the Python loop")
    parser.add_argument("--prepare-records", type=int, default=900, help="records of the prepared TFDS build (0: skip)")
    args = parser.parse_args()
    if tfrecord._crc32c_impl is not tfrecord._crc32c_c:
        raise SystemExit("google-crc32c's C extension is not installed: pip install google-crc32c")
    fast = rate_mb_s(tfrecord._crc32c_c, args.c_mb)
    slow = rate_mb_s(tfrecord._crc32c_python, args.python_mb)
    print(f"google-crc32c (C):  {fast:10.1f} MB/s over {args.c_mb:g} MB")
    print(f"Python table loop:  {slow:10.2f} MB/s over {args.python_mb:g} MB")
    print(f"ratio: {fast / slow:.0f}x")
    for name, rate in (("C", fast), ("Python", slow)):
        hours = IMAGENET21K_BYTES / (rate * 1e6) / 3600
        print(f"ImageNet-21k's 1.3 TB of records, data checksums, {name}: {hours:.2f} CPU-hours")
    if args.prepare_records:
        size, seconds = prepare_seconds(args.prepare_records)
        for name, wall in seconds.items():
            print(f"prepare of a {size:.0f} MB TFDS build, CRC in {name}: {wall:.1f} s ({size / wall:.0f} MB/s)")


if __name__ == "__main__":
    main()
