"""Scale: what one rank and one of its loader workers spend on the epoch plan, the slots and the
checkpoint bookkeeping as the dataset grows to 300k shards (300M samples) and the job to 1,024
ranks x 8 loader workers (num_slots = ranks x workers), against the previous implementation
(the reference, measured in the same run).

    .venv/bin/python benchmarks/scale.py [--shards 3000,30000,300000] [--ranks 8,128,1024] [--workers 8]
    .venv/bin/python benchmarks/scale.py --one --shards 300000 --ranks 1024 --json   # one configuration

Each configuration runs in a fresh process (so memory figures are its own), on a synthetic
dataset: a real `dataset.json` and Parquet manifest of N shards of 900-1,100 samples (no tar
files: nothing here reads a sample). Stages, each timed in CPU seconds (steadier than wall time on
a shared machine) and then measured for memory (tracemalloc's peak plus Arrow's allocations):

- rank start: `ShardLoader(...)` for the last rank: manifest, extents, shard URLs, slot size;
- worker plan: one loader worker's start of an epoch: the plan of its slots and its slot readers
  (every worker process does this at every epoch);
- loader state: the bytes of the loader's checkpoint state, the same on every rank (it is
  independent of ranks and shards: one position per epoch), and a resume onto half the ranks;
- completion check: `verify_complete` of a checkpoint folder written by all ranks (each rank's
  completion record lists its two DeepSpeed files), as every rank runs at a resume.

The reference is the code before this change, kept below: manifest rows as Python objects, one
`ShardRange` and one URL string per shard, the whole plan (every slot) built per process in a
Python loop, and completion records checked one `isfile` + `open` after another.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vitray import storage
from vitray.data.layout import (
    MANIFEST_SCHEMA,
    DatasetInfo,
    SplitInfo,
    manifest_name,
    read_manifest,
    shard_name,
    write_dataset_info,
)
from vitray.data.loader import ShardLoader, _share, _TrainStream
from vitray.runfolder import checkpoint_folders as ckpt
from vitray.trainers.checkpoint.rank_files import mark_complete, write_state

SEED, EPOCH = 0, 3


# ---------------------------------------------------------------------------------------------
# synthetic inputs
# ---------------------------------------------------------------------------------------------


def make_dataset(folder: str, shards: int) -> int:
    """A prepared dataset's metadata for `shards` shards (900-1,100 samples each); its sample count."""
    sizes = np.random.default_rng(shards).integers(900, 1101, shards)
    names = [shard_name("train", i) for i in range(shards)]
    table = pa.table(
        {"name": names, "num_samples": sizes, "bytes": sizes * 110_000, "sha256": ["0" * 64] * shards},
        schema=MANIFEST_SCHEMA,
    )
    os.makedirs(folder, exist_ok=True)
    pq.write_table(table, os.path.join(folder, manifest_name("train")))
    total = int(sizes.sum())
    write_dataset_info(
        folder,
        DatasetInfo(
            name="synthetic",
            source="synthetic",
            classes=["a", "b"],
            num_classes=2,
            label_kind="single",
            splits={"train": SplitInfo(num_samples=total, num_shards=shards)},
        ),
    )
    return total


def make_checkpoint(folder: Path, ranks: int) -> Path:
    """A checkpoint folder as `ranks` ranks leave it: each rank's two DeepSpeed files and its
    completion record (rank 0 also the trainer state)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "deepspeed").mkdir(exist_ok=True)
    write_state(folder, {"step": 1000, "world_size": ranks, "data": {"epoch": 0}})
    for rank in range(ranks):
        files = []
        for name in (
            f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
        ):
            path = folder / "deepspeed" / name
            path.write_bytes(b"x" * (64 + rank % 7))
            files.append(path)
        mark_complete(folder, rank, files + ([folder / ckpt.STATE_FILE] if rank == 0 else []))
    return folder


# ---------------------------------------------------------------------------------------------
# the reference: the implementation before this change
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RefRange:
    shard: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def reference_plan(seed: int, epoch: int, extents, num_slots: int):
    """The whole plan (every slot), built in a Python loop, as every process used to build it."""
    total = sum(len(e) for e in extents)
    slot_size = total // num_slots
    order = np.random.default_rng([seed, epoch]).permutation(len(extents))
    slots, current, room = [], [], slot_size
    for index in order.tolist():
        extent = extents[index]
        offset = extent.start
        while offset < extent.stop and len(slots) < num_slots:
            take = min(room, extent.stop - offset)
            current.append(_RefRange(extent.shard, offset, offset + take))
            offset += take
            room -= take
            if room == 0:
                slots.append(tuple(current))
                current, room = [], slot_size
    return slot_size, tuple(slots)


def reference_rank_start(dataset: str, num_slots: int):
    rows = read_manifest(dataset, "train")
    extents = tuple(_RefRange(i, 0, r.num_samples) for i, r in enumerate(rows))
    urls = tuple(storage.join(dataset, r.name) for r in rows)
    slot_size = reference_plan(SEED, 0, extents, num_slots)[0]
    return extents, urls, slot_size


def reference_verify(folder: Path) -> dict:
    import fsspec

    fs = fsspec.filesystem("file")
    state = ckpt.read_state(folder, fs)
    sizes = {info["name"].rstrip("/"): info["size"] for info in fs.find(str(folder), detail=True).values()}
    prefix = fs._strip_protocol(str(folder)).rstrip("/")
    for rank in range(state["world_size"]):
        record = f"{folder}/complete-rank-{rank:04d}.json"
        if not fs.isfile(record):
            raise ckpt.IncompleteCheckpointError(str(folder), f"{record} is missing")
        with fs.open(record, "r") as f:
            for name, size in json.load(f).items():
                if sizes.get(f"{prefix}/{name}") != size:
                    raise ckpt.IncompleteCheckpointError(str(folder), f"{name} is missing or truncated")
    return state


# ---------------------------------------------------------------------------------------------
# one configuration, in this process
# ---------------------------------------------------------------------------------------------


def _measure(fn, memory: bool = True, repeat: int = 3) -> dict[str, float]:
    """CPU seconds of `fn()` (the least of `repeat` runs), then (run again, fresh) its peak memory in MiB."""
    times = []
    for _ in range(repeat):
        start = time.process_time()
        result = fn()
        times.append(time.process_time() - start)
        del result
    figures = {"cpu_s": min(times)}
    if memory:
        arrow_before = pa.total_allocated_bytes()
        tracemalloc.start()
        kept = fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        figures["peak_mib"] = (peak + max(0, pa.total_allocated_bytes() - arrow_before)) / 2**20
        del kept
    return figures


def one(dataset: str, ranks: int, workers: int, reference: bool, scratch: Path) -> dict:
    num_slots = ranks * workers
    batch = workers * 4  # 4 positions of each of the rank's slots per batch

    def rank_start(rank: int = ranks - 1, world: int = ranks):
        return ShardLoader(
            dataset,
            "train",
            rank=rank,
            world_size=world,
            batch_size=batch,
            img_size=224,
            train=True,
            seed=SEED,
            num_slots=num_slots,
            num_workers=workers,
        )

    loader = rank_start()
    spec = loader._spec
    local_slots, stride, phase = _share(0, workers, len(spec.slots))

    def worker_plan():
        readers, _batches = _TrainStream._open_epoch(spec, EPOCH, 0, 0, local_slots, stride, phase, None)
        assert sum(len(r) for r in readers[0].plan.slots[spec.slots[local_slots[0]]]) == loader.slot_size
        return readers

    state = loader.state_dict()
    resumed = rank_start(rank=0, world=max(1, ranks // 2))
    resumed.load_state_dict(json.loads(json.dumps(state)))  # a resume onto half the ranks takes it as it is
    folder = make_checkpoint(scratch / f"checkpoint-{ranks}", ranks)
    out = {
        "ranks": ranks,
        "workers": workers,
        "num_slots": num_slots,
        "shards": len(spec.shard_urls),
        "samples": loader.num_samples,
        "rank_start": _measure(rank_start),
        "worker_plan": _measure(worker_plan),
        "loader_state_bytes": len(json.dumps(state)),
        "completion_check": _measure(lambda: ckpt.verify_complete(folder), memory=False),
    }
    if reference:
        extents = reference_rank_start(dataset, num_slots)[0]
        out["reference"] = {
            "rank_start": _measure(lambda: reference_rank_start(dataset, num_slots), repeat=1),
            "worker_plan": _measure(lambda: reference_plan(SEED, EPOCH, extents, num_slots), repeat=1),
            "completion_check": _measure(lambda: reference_verify(folder), memory=False),
        }
    return out


# ---------------------------------------------------------------------------------------------
# the growth table
# ---------------------------------------------------------------------------------------------


def _cell(figures: dict) -> str:
    return f"{figures['cpu_s']:.3f} s / {figures['peak_mib']:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", default="3000,30000,300000")
    parser.add_argument("--ranks", default="8,128,1024")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--no-reference", action="store_true", help="measure only the current implementation")
    parser.add_argument("--one", action="store_true", help="one configuration in this process (first of each list)")
    parser.add_argument("--dataset", help="(with --one) an existing synthetic dataset folder")
    parser.add_argument("--json", action="store_true", help="(with --one) print the figures as JSON")
    args = parser.parse_args()
    shard_counts = [int(s) for s in args.shards.split(",")]
    rank_counts = [int(r) for r in args.ranks.split(",")]
    with tempfile.TemporaryDirectory(prefix="vitray-scale-") as scratch:
        if args.one:
            dataset = args.dataset or f"{scratch}/data"
            if not args.dataset:
                make_dataset(dataset, shard_counts[0])
            figures = one(dataset, rank_counts[0], args.workers, not args.no_reference, Path(scratch))
            print(json.dumps(figures) if args.json else figures)
            return
        print(
            "| shards (samples) | ranks x workers | rank start: now | before | worker plan: now | before | "
            "loader state | completion check (all ranks' records): now | before |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        last = None
        for shards in shard_counts:
            dataset = f"{scratch}/data-{shards}"
            make_dataset(dataset, shards)
            for ranks in rank_counts:
                command = [
                    sys.executable,
                    __file__,
                    "--one",
                    "--json",
                    f"--shards={shards}",
                    f"--ranks={ranks}",
                    f"--workers={args.workers}",
                    f"--dataset={dataset}",
                ] + (["--no-reference"] if args.no_reference else [])
                for _attempt in range(3):  # a child killed from outside (a shared machine) is measured again
                    result = subprocess.run(command, capture_output=True, text=True)
                    if result.returncode >= 0:
                        break
                if result.returncode:
                    raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr[-2000:]}")
                f = json.loads(result.stdout.strip().splitlines()[-1])
                ref = f.get("reference")
                print(
                    f"| {shards:,} ({f['samples'] / 1e6:.1f}M) | {ranks:,} x {args.workers} | {_cell(f['rank_start'])} | "
                    f"{_cell(ref['rank_start']) if ref else '-'} | {_cell(f['worker_plan'])} | "
                    f"{_cell(ref['worker_plan']) if ref else '-'} | {f['loader_state_bytes']} B | "
                    f"{f['completion_check']['cpu_s']:.3f} s | "
                    f"{ref['completion_check']['cpu_s'] if ref else float('nan'):.3f} s |",
                    flush=True,
                )
                last = f
        if last and last.get("reference"):
            ref = last["reference"]
            start = ref["rank_start"]["cpu_s"] / last["rank_start"]["cpu_s"]
            plan = ref["worker_plan"]["cpu_s"] / last["worker_plan"]["cpu_s"]
            memory = (ref["rank_start"]["peak_mib"] + ref["worker_plan"]["peak_mib"]) / (
                last["rank_start"]["peak_mib"] + last["worker_plan"]["peak_mib"]
            )
            print(
                f"at {last['shards']:,} shards x {last['ranks']:,} ranks x {last['workers']} workers, before / now: "
                f"rank start CPU {start:.1f}x, worker plan CPU {plan:.1f}x, peak memory (start + plan) {memory:.1f}x"
            )


if __name__ == "__main__":
    main()
