"""What TFRecord checksums cost `vitray data prepare` (tfds: / vtab: sources): CRC-32C throughput
of google-crc32c's C extension against vitray's pure-Python fallback, measured in the same run.

    .venv/bin/python benchmarks/crc32c.py [--c-mb 200] [--python-mb 4]

Every record is checksummed twice (its length header and its data), so the data checksum is the
cost that grows with the dataset. The Python loop is timed on fewer bytes (it is ~1000x slower);
both are given in MB/s, with the ratio and what the 1.3 TB of ImageNet-21k's TFRecords would cost
in CPU time at each rate.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from vitray.data import tfrecord

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--c-mb", type=float, default=200.0, help="MB checksummed by google-crc32c")
    parser.add_argument("--python-mb", type=float, default=4.0, help="MB checksummed by the Python loop")
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


if __name__ == "__main__":
    main()
