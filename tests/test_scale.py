"""Scale: 300M samples in 300k shards read by 1,024 ranks x 8 loader workers.

What each rank and each worker process spends on the epoch plan, its slots and the checkpoint
bookkeeping is measured by `benchmarks/scale.py --one` in a fresh process, on a synthetic dataset
(a real manifest of 300k shards, no tar files), and held to bounds a few times today's figures
(README of the benchmark: BENCHMARKS.md, "Scale"). The plan a worker builds for its own slots is
checked against the whole plan built by the previous implementation, and the completion check
of a checkpoint is shown to read the ranks' records concurrently on S3 (SeaweedFS behind a proxy
that delays every request).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

from vitray.data.loader import ShardLoader
from vitray.data.plan import ExtentTable, ShardRange, epoch_plan, rank_slots
from vitray.data.splits import split_extents, split_table
from vitray.runfolder import checkpoint_folders as ckpt
from vitray.trainers.checkpoint.checked_copy import node_restore_dir, rank_copy
from vitray.trainers.checkpoint.rank_files import mark_complete

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import scale as bench  # noqa: E402  (benchmarks/scale.py: the synthetic inputs and the reference)

SHARDS, RANKS, WORKERS = 300_000, 1024, 8


@pytest.fixture(scope="module")
def big_dataset(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("scale") / "data")
    bench.make_dataset(folder, SHARDS)
    return folder


def test_a_rank_and_its_workers_plan_300m_samples_in_300k_shards_for_1024x8_within_bounds(big_dataset):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "scale.py"),
            "--one",
            "--json",
            "--no-reference",
            f"--shards={SHARDS}",
            f"--ranks={RANKS}",
            f"--workers={WORKERS}",
            f"--dataset={big_dataset}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    f = json.loads(result.stdout.strip().splitlines()[-1])
    assert f["shards"] == SHARDS and 290e6 < f["samples"] < 310e6 and f["num_slots"] == RANKS * WORKERS
    # Measured on the 2-core development VM (BENCHMARKS.md, "Scale"; CPU seconds, least of 3; peak =
    # tracemalloc + Arrow): rank start 0.03 s / 20 MiB, one worker's epoch start 0.005 s / 7 MiB, the
    # loader state 156 B, the completion check of 1,024 ranks' records 0.06 s. The previous
    # implementation: 3.0 s / 224 MiB to start a rank, 0.9 s / 54 MiB per worker and epoch.
    assert f["rank_start"]["cpu_s"] < 0.25 and f["rank_start"]["peak_mib"] < 64, f["rank_start"]
    assert f["worker_plan"]["cpu_s"] < 0.05 and f["worker_plan"]["peak_mib"] < 24, f["worker_plan"]
    assert f["loader_state_bytes"] < 512  # one position per epoch, whatever the ranks and shards
    assert f["completion_check"]["cpu_s"] < 0.6, f["completion_check"]


def test_the_slots_a_worker_plans_are_those_of_the_whole_plan(big_dataset):
    """At 300k shards: each rank's slots, planned alone, are exactly the previous implementation's
    whole-plan slots (runs resume across the change on the same samples)."""
    loader = ShardLoader(
        big_dataset,
        "train",
        rank=RANKS - 1,
        world_size=RANKS,
        batch_size=WORKERS * 4,
        img_size=224,
        train=True,
        seed=7,
        num_slots=RANKS * WORKERS,
        num_workers=WORKERS,
    )
    table = loader._spec.extents
    reference = bench.reference_plan(
        7,
        2,
        [bench._RefRange(*r) for r in zip(table.shard.tolist(), table.start.tolist(), table.stop.tolist())],
        RANKS * WORKERS,
    )
    for rank in (0, 511, RANKS - 1):
        mine = rank_slots(rank, RANKS, RANKS * WORKERS)
        plan = epoch_plan(7, 2, table, RANKS * WORKERS, slots=mine)
        assert plan.slot_size == reference[0] == loader.slot_size
        for slot in mine:
            assert [(r.shard, r.start, r.stop) for r in plan.slots[slot]] == [
                (r.shard, r.start, r.stop) for r in reference[1][slot]
            ]
        assert sum(s is None for s in plan.slots) == RANKS * WORKERS - WORKERS  # nothing else was built


def test_partial_plans_and_array_extents_match_the_reference_on_random_splits():
    """Random shard sizes (empty shards included), slices and slot counts: the same slots as the
    previous implementation's loop, whichever slots are asked for."""
    rng = random.Random(0)
    for trial in range(200):
        sizes = [rng.choice([0, 1, 3, 17, 100, 250]) for _ in range(rng.randint(1, 50))]
        total = sum(sizes)
        if total < 2:
            continue
        a, b = sorted(rng.sample(range(total + 1), 2))
        split = rng.choice(["train", f"train[{a}:{b}]"])
        extents = split_extents(split, sizes)
        table = split_table(split, sizes)
        assert table.ranges() == extents
        num_slots = rng.randint(1, min(40, table.total))
        seed, epoch = rng.randint(0, 99), rng.randint(0, 9)
        ref_size, ref_slots = bench.reference_plan(
            seed, epoch, [bench._RefRange(e.shard, e.start, e.stop) for e in extents], num_slots
        )
        whole = epoch_plan(seed, epoch, extents, num_slots)
        assert whole.slot_size == ref_size
        assert [[(r.shard, r.start, r.stop) for r in s] for s in whole.slots] == [
            [(r.shard, r.start, r.stop) for r in s] for s in ref_slots
        ], trial
        wanted = rng.sample(range(num_slots), rng.randint(0, num_slots))
        part = epoch_plan(seed, epoch, table, num_slots, slots=wanted)
        assert all(part.slots[s] == whole.slots[s] for s in wanted)
        assert all(part.slots[s] is None for s in set(range(num_slots)) - set(wanted))
    with pytest.raises(ValueError, match=r"slots must be in \[0, 4\)"):
        epoch_plan(0, 0, [10, 10], 4, slots=[4])
    assert ExtentTable.of([3, 0, 4]).ranges() == (ShardRange(0, 0, 3), ShardRange(1, 0, 0), ShardRange(2, 0, 4))


# ---------------------------------------------------------------------------------------------
# completion records on S3: one listing, the records read concurrently
# ---------------------------------------------------------------------------------------------


class DelayingProxy:
    """An HTTP proxy on 127.0.0.1 in front of the S3 store that holds every request `delay_s` before
    forwarding it, and counts requests and how many were in flight at once."""

    def __init__(self, upstream: str, delay_s: float):
        from ports import free_port

        self.upstream, self.delay_s = upstream.rstrip("/"), delay_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: list[tuple[str, str]] = []
        self.in_flight = self.max_in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        from aiohttp import ClientSession, web

        async def forward(request: web.Request) -> web.Response:
            self.requests.append((request.method, request.path))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.delay_s)
                # Host stays the proxy's: the client signed it (the store checks the signature)
                headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
                async with (
                    ClientSession(auto_decompress=False) as session,
                    session.request(
                        request.method,
                        self.upstream + request.path_qs,
                        headers=headers,
                        data=await request.read(),
                        allow_redirects=False,
                    ) as answer,
                ):
                    body = await answer.read()
                    dropped = ("transfer-encoding", "connection", "content-encoding") + (
                        () if request.method == "HEAD" else ("content-length",)
                    )  # a HEAD's length is the object's
                    keep = {k: v for k, v in answer.headers.items() if k.lower() not in dropped}
                    return web.Response(
                        status=answer.status, body=None if request.method == "HEAD" else body, headers=keep
                    )
            finally:
                self.in_flight -= 1

        async def start() -> None:
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{tail:.*}", forward)
            runner = self._runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._ready.set()

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def __enter__(self) -> DelayingProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def test_completion_records_are_checked_concurrently_on_s3(seaweed_s3, tmp_path, monkeypatch):
    """64 ranks' records behind 0.1 s per request: read one after another (as before: 7.7 s here,
    one request in flight) they take at least 6.4 s; read concurrently after one listing, less.
    The bound is the sequential read's floor, not a fraction of it: on a loaded two-core machine
    the proxy's own work took 3.4 s with 10 requests in flight (CI, session 34)."""
    import s3fs

    world, delay = 64, 0.1
    local = bench.make_checkpoint(tmp_path / "checkpoint", world)
    fs = s3fs.S3FileSystem()
    remote = f"{seaweed_s3.bucket}/run/checkpoint_000001"
    fs.put(str(local), remote, recursive=True)
    with DelayingProxy(seaweed_s3.endpoint_url, delay) as proxy:
        slow = s3fs.S3FileSystem(endpoint_url=proxy.url, skip_instance_cache=True)
        started = time.perf_counter()
        state = ckpt.verify_complete(remote, slow)
        elapsed = time.perf_counter() - started
        records = [path for method, path in proxy.requests if method == "GET" and "complete-rank-" in path]
        assert state["world_size"] == world
        assert len(records) == world  # each record read once, no per-record existence check
        assert len(proxy.requests) < world + 10, proxy.requests
        assert proxy.max_in_flight >= 4 and elapsed < world * delay, (proxy.max_in_flight, elapsed)
        # Still as strict: a missing record and a cut-short file are refused.
        fs.rm(f"{remote}/complete-rank-0017.json")
        slow.invalidate_cache()
        with pytest.raises(ckpt.IncompleteCheckpointError, match="rank 17 never finished writing it"):
            ckpt.verify_complete(remote, slow)
    fs.put(str(local / "complete-rank-0017.json"), f"{remote}/complete-rank-0017.json")
    fs.pipe(f"{remote}/deepspeed/zero_pp_rank_5_mp_rank_00_optim_states.pt", b"cut")
    fs.invalidate_cache()
    with pytest.raises(
        ckpt.IncompleteCheckpointError, match="zero_pp_rank_5_mp_rank_00_optim_states.pt is missing or truncated"
    ):
        ckpt.verify_complete(remote, fs)


def test_ranks_starting_from_the_announced_checkpoint_do_not_each_recheck_it_on_storage(
    seaweed_s3, tmp_path, monkeypatch
):
    """The driver verifies the checkpoint it resumes from and sends its step with it; before, each
    rank verified it again on storage: world_size + 2 requests per rank, 1M at 1,024 ranks. Each
    rank then downloads only its own shards and the shared files, reading 2 completion records."""
    import s3fs

    from vitray.trainers.checkpoint.restore import choose_checkpoint
    from vitray.trainers.engines.deepspeed.resume_files import restore_files

    world = 32
    local = bench.make_checkpoint(tmp_path / "checkpoint", world)
    s3fs.S3FileSystem().put(str(local), f"{seaweed_s3.bucket}/run/checkpoint_000001", recursive=True)
    announced = seaweed_s3.url("run", "checkpoint_000001")
    run = seaweed_s3.url("run")
    with DelayingProxy(seaweed_s3.endpoint_url, 0.0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        s3fs.S3FileSystem.clear_instance_cache()
        assert choose_checkpoint(run, announced, 1000, restarted=False) == announced
        # whatever the world size, only rank 0's probe of whether an earlier group found it corrupt
        # (s3fs asks with a HEAD, then a listing): nothing of the checkpoint itself is read
        probes = [path for _, path in proxy.requests if not path.endswith(ckpt.CORRUPT_FILE)]
        assert len(proxy.requests) <= 2 and all(path.count("/") == 1 for path in probes), proxy.requests
        # After a restart inside the run: only checkpoints newer than the announced one are read.
        assert choose_checkpoint(run, announced, 1000, restarted=True) == announced
        assert not [path for method, path in proxy.requests if "complete-rank-" in path]

        proxy.requests.clear()
        folder, state = rank_copy(announced, restore_files(5, world, zero_stage=1), tmp_path / "r5", 5)
        assert state["step"] == 1000
        got = sorted(
            p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and ".locks" not in p.parts
        )
        assert got == [
            "deepspeed/zero_pp_rank_5_mp_rank_00_model_states.pt",
            "deepspeed/zero_pp_rank_5_mp_rank_00_optim_states.pt",
            ckpt.STATE_FILE,
        ]
        records = [path for method, path in proxy.requests if method == "GET" and "complete-rank-" in path]
        assert sorted(records) == sorted(
            f"/{seaweed_s3.bucket}/run/checkpoint_000001/complete-rank-{r:04d}.json" for r in (0, 5)
        )
        assert len(proxy.requests) < 12, proxy.requests  # the same for any world size
        # Onto another number of ranks, the whole checkpoint is wanted (with the shared conversion).
        folder, _ = rank_copy(announced, restore_files(5, world * 2, zero_stage=1), tmp_path / "r5b", 5)
        assert {f"deepspeed/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)} <= {
            p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
        }


def test_ranks_of_one_node_share_the_files_they_all_read(seaweed_s3, tmp_path):
    """Module states and EMA weights come down once per node: a second rank of the node finds
    them there and downloads only its own shard; the folder goes with the last rank to leave."""
    import s3fs

    from vitray.trainers.engines.deepspeed.resume_files import restore_files

    local = bench.make_checkpoint(tmp_path / "checkpoint", 4)
    shared = local / "deepspeed" / "mp_rank_00_model_states.pt"
    shared.write_bytes(b"m" * 1000)
    mark_complete(local, 0, [shared, local / ckpt.STATE_FILE, *(local / "deepspeed").glob("zero_pp_rank_0_*")])
    s3fs.S3FileSystem().put(str(local), f"{seaweed_s3.bucket}/run/checkpoint_000002", recursive=True)
    remote = seaweed_s3.url("run", "checkpoint_000002")
    with node_restore_dir(remote, str(tmp_path / "node")) as node:
        first = rank_copy(remote, restore_files(1, 4, zero_stage=1), node, 1)[0]
        stamp = (first / "deepspeed" / "mp_rank_00_model_states.pt").stat().st_mtime_ns
        with node_restore_dir(remote, str(tmp_path / "node")) as again:
            assert again == node
            second = rank_copy(remote, restore_files(2, 4, zero_stage=1), again, 2)[0]
        assert (second / "deepspeed" / "mp_rank_00_model_states.pt").stat().st_mtime_ns == stamp  # not fetched again
        names = sorted(p.name for p in (node / "deepspeed").iterdir())
        assert names == [
            "mp_rank_00_model_states.pt",
            *(f"zero_pp_rank_{r}_mp_rank_00_{k}_states.pt" for r in (1, 2) for k in ("model", "optim")),
        ]
        assert node.is_dir()  # the first rank is still using it
    assert not node.exists()
    # Another user of the node (a shared host: its /tmp is sticky) gets a folder and a lock of its own.
    me, other_user = os.getuid(), os.getuid() + 1
    with mock.patch("os.getuid", return_value=other_user), node_restore_dir(remote, str(tmp_path / "node")) as other:
        assert other != node and other.name.startswith(f"vitray-restore-{other_user}-")
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == [
        f"vitray-restore-{me}.lock",
        f"vitray-restore-{other_user}.lock",
    ]
    # Ranks that are gone (the group torn down when one failed on a full staging disk) left their
    # markers and .part files: the folder, a whole staged checkpoint, stayed for good. The next
    # resume forgets them, and removes the folder when it is done.
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    with node_restore_dir(remote, str(tmp_path / "node")) as node:
        (node / ".users" / f"{dead.pid}-deadbeef").touch()
        (node / "deepspeed").mkdir(parents=True)
        (node / "deepspeed" / f"mp_rank_00_model_states.pt.part-{dead.pid}").write_bytes(b"half")
    assert node.exists()  # (the dead rank's marker was added behind the lock's back: kept until the next use)
    with node_restore_dir(remote, str(tmp_path / "node")) as again:
        assert not list(again.rglob("*.part-*")) and len(list((again / ".users").iterdir())) == 1
    assert not node.exists()
