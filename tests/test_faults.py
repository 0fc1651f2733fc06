"""Faults that need no training run: the run lease against a real second process (local and on a
real S3 store, SeaweedFS), two drivers racing for one run, a results-table writer killed mid-write, and
where a re-run resumes (with the reason for skipping a newer checkpoint)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import filelock
import pytest
from disk_helpers import mounted_tmpfs

from vitray.runfolder.files import RunFiles
from vitray.runfolder.lease import LeaseRecord, RunLease, RunLeaseHeld, read_lease
from vitray.storage import write_bytes_atomic

HOLD = textwrap.dedent(
    """
    import sys, time
    from vitray.runfolder.lease import RunLease
    lease = RunLease(sys.argv[1], timeout_s=float(sys.argv[2]))
    lease.acquire()
    print(lease.owner, flush=True)
    time.sleep(600)
    """
)


def _holder(run_dir: str, timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """A real second process that takes the lease and keeps it alive."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, run_dir, str(timeout_s)], stdout=subprocess.PIPE, text=True)
    owner = proc.stdout.readline().strip()
    assert owner, "the holder process did not take the lease"
    return proc, owner


def test_a_second_driver_refuses_while_the_first_holds_the_run(tmp_path):
    run_dir = str(tmp_path / "run")
    proc, owner = _holder(run_dir)
    try:
        with pytest.raises(RunLeaseHeld) as refused:
            RunLease(run_dir, timeout_s=60).acquire()
        message = str(refused.value)
        assert "already running" in message and owner in message and f"pid {proc.pid}" in message
        assert "--force" in message and "run.lease_timeout_s" in message
        age = float(message.split("last heartbeat ")[1].split(" s ago")[0])
        assert 0 <= age < 60
        assert read_lease(RunFiles(run_dir).lease_path).owner == owner  # untouched
    finally:
        proc.kill()
        proc.wait()
    # kill -9: the holder is gone from this host, so its lease is taken over at once, with a warning.
    lease = RunLease(run_dir, timeout_s=60)
    warning = lease.acquire()
    try:
        assert "process is gone" in warning and owner in warning
        assert read_lease(lease.path).owner == lease.owner
    finally:
        lease.release()
    assert read_lease(lease.path) is None  # released


def _foreign_lease(path: Path, age_s: float, timeout_s: float = 60.0) -> LeaseRecord:
    """A lease held by a driver on another host, last heartbeat `age_s` ago."""
    now = time.time()
    record = LeaseRecord("otherdriver1", "other-host", 4242, 0.0, now - age_s - 10, now - age_s, timeout_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record.__dict__))
    return record


def test_a_driver_whose_lease_was_taken_says_so_when_it_ends_before_its_next_heartbeat(tmp_path):
    """A --force take-over between two heartbeats of a driver that then finishes: it said nothing."""
    lost = []
    lease = RunLease(str(tmp_path / "run"), timeout_s=600, on_lost=lost.append)  # no heartbeat in this test
    lease.acquire()
    thief = RunLease(str(tmp_path / "run"), timeout_s=600, force=True)
    thief.acquire()
    lease.release()
    assert [holder.owner for holder in lost] == [thief.owner] and lease.lost
    assert read_lease(lease.path).owner == thief.owner  # the new holder's lease is left alone
    thief.release()


def test_ray_trains_advice_to_delete_a_run_written_by_two_drivers_is_not_passed_on(tmp_path, monkeypatch):
    """Ray Train refuses to start on a checkpoint list (its snapshot) that names a folder gone since:
    with two drivers on one run (a --force take-over of a live one) the other prunes meanwhile. Its
    message calls the run folder corrupt and says to delete it; vitray's says what happened."""
    from ray.train.v2._internal.exceptions import CheckpointManagerInitializationError

    from vitray.cluster import pretrain as training
    from vitray.cluster import torch_trainer
    from vitray.common.config import load_config
    from vitray.trainers.config import TrainingConfig

    class Trainer:
        def fit(self):
            raise CheckpointManagerInitializationError("You are running in a corrupted run directory ... delete it")

    monkeypatch.setattr(torch_trainer, "build_trainer", lambda cfg, resume, notes: Trainer())
    monkeypatch.setattr(torch_trainer, "check_ray_alive", lambda what: None)
    cfg = load_config(TrainingConfig, None, [f"data.train={tmp_path}", f"run.storage={tmp_path}", "run.name=r"])
    with pytest.raises(torch_trainer.RunWrittenElsewhere, match="another driver is writing the run r") as raised:
        torch_trainer.fit(cfg, None)
    assert "do not delete it" in str(raised.value) and isinstance(raised.value, training.REFUSED)


def test_the_workers_check_that_their_driver_still_holds_the_run(tmp_path, monkeypatch, capsys):
    """A driver that stops at once (a second Ctrl-C, kill -9) releases its lease, or leaves it behind
    with its process gone, while Ray is still ending the workers: a checkpoint they finish meanwhile
    must not count (one completed the run's last step after the driver had said it stopped at once),
    nor one finished after another driver took the run over. Rank 0 asks `holder_check`'s check
    before its completion record (tests/test_checkpointer.py: the checkpoint then does not count)."""
    from vitray.runfolder.lease import DriverGone, holder_check

    run_dir = str(tmp_path / "run")
    path = RunFiles(run_dir).lease_path
    assert holder_check(path) is None  # no driver: a training loop run by hand
    lease = RunLease(run_dir, timeout_s=600)
    lease.acquire()
    check = holder_check(path)
    check()
    lease.release()
    with pytest.raises(DriverGone, match=f"driver \\({lease.owner} .*\\) released it: this worker stops without"):
        check()

    lease = RunLease(run_dir, timeout_s=600)
    lease.acquire()
    check = holder_check(path)
    thief = RunLease(run_dir, timeout_s=600, force=True)
    thief.acquire()
    with pytest.raises(DriverGone, match=f"lost it to {thief.owner}"):
        check()
    thief.release()
    lease.release()

    proc, owner = _holder(run_dir)
    try:
        check = holder_check(path)
        check()
    finally:
        proc.kill()  # kill -9 of the driver alone: its lease stays, its process is gone from this host
        proc.wait()
    with pytest.raises(DriverGone, match=f"driver \\({owner} .*\\) is gone"):
        check()

    # A driver on another host, killed: its lease stays, its heartbeat stops (what a re-run takes over)
    lease = RunLease(run_dir, timeout_s=60)
    lease.acquire()
    check = holder_check(path)
    record = json.loads(Path(path).read_text())
    lease.release()  # (its heartbeat must not write the lease back)
    Path(path).write_text(json.dumps({**record, "host": "head-node", "heartbeat": time.time() - 3600}))
    with pytest.raises(DriverGone, match="is gone"):
        check()

    # A lease that cannot be read when the workers start: no check, and that is said
    from vitray.runfolder import lease as lease_module

    def unreadable(path):
        raise PermissionError(f"[Errno 13] Permission denied: {path!r}")

    monkeypatch.setattr(lease_module, "read_lease", unreadable)
    assert holder_check(path) is None
    assert "lease could not be read ([Errno 13] Permission denied" in capsys.readouterr().out


def test_a_stale_lease_is_taken_over_and_a_fresh_one_needs_force(tmp_path):
    run_dir = str(tmp_path / "run")
    path = Path(RunFiles(run_dir).lease_path)
    _foreign_lease(path, age_s=5)
    with pytest.raises(RunLeaseHeld, match=r"otherdriver1 \(host other-host, pid 4242\).*heartbeat 5 s ago"):
        RunLease(run_dir, timeout_s=60).acquire()

    forced = RunLease(run_dir, timeout_s=60, force=True)
    assert "--force" in forced.acquire()
    forced.release()

    _foreign_lease(path, age_s=90)
    stale = RunLease(run_dir, timeout_s=60)
    warning = stale.acquire()
    stale.release()
    assert "heartbeat is 90 s old" in warning and "run.lease_timeout_s=60" in warning


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_heartbeat_keeps_the_lease_fresh_and_notices_a_take_over(where, tmp_path, request):
    run_dir = request.getfixturevalue("seaweed_s3").url("runs", "beat") if where == "s3" else str(tmp_path / "run")
    lost = threading.Event()
    lease = RunLease(run_dir, timeout_s=0.8, on_lost=lambda holder: lost.set())
    lease.acquire()
    first = read_lease(lease.path).heartbeat
    time.sleep(0.6)
    assert read_lease(lease.path).heartbeat > first  # refreshed every timeout/4
    with pytest.raises(RunLeaseHeld):
        RunLease(run_dir, timeout_s=0.8).acquire()  # never stale while it beats
    thief = RunLease(run_dir, timeout_s=60, force=True)
    thief.acquire()
    assert lost.wait(5) and lease.lost
    time.sleep(0.5)
    assert read_lease(lease.path).owner == thief.owner  # the displaced driver leaves a fresh lease alone
    # The driver that took the run ends: the displaced one, still running, holds the run again (it
    # stopped beating for good, and a later plain start of the run trained beside it).
    thief.release()
    assert _eventually(lambda: _owner(lease.path) == lease.owner and not lease.lost)
    with pytest.raises(RunLeaseHeld):
        RunLease(run_dir, timeout_s=0.8).acquire()
    # One that takes it and stops beating (killed on another host): taken back once its lease is stale.
    lost.clear()
    silent = RunLease(run_dir, timeout_s=0.8, force=True)
    silent.acquire()
    silent._stop.set()
    silent._thread.join()
    assert lost.wait(5) and lease.lost
    assert _eventually(lambda: _owner(lease.path) == lease.owner and not lease.lost)
    lease.release()
    assert read_lease(lease.path) is None


def _owner(path: str) -> str | None:
    held = read_lease(path)
    return held.owner if held is not None else None


def _eventually(condition, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_a_heartbeat_waiting_for_the_store_does_not_write_the_lease_back_after_its_release(tmp_path, monkeypatch):
    """The driver ends while its heartbeat rides out an outage (up to run.storage_outage_s): the release
    ends that wait at once and removes the lease, and the beat does not put it back when the store
    answers again -- which would keep the run's next driver out for run.lease_timeout_s."""
    from vitray import storage
    from vitray.runfolder import lease as lease_module

    cut = threading.Event()
    write = storage.write_bytes_atomic

    def cuttable_write(*args, **kwargs):
        if cut.is_set():
            raise ConnectionRefusedError("the store is cut")
        return write(*args, **kwargs)

    monkeypatch.setattr(lease_module.storage, "write_bytes_atomic", cuttable_write)
    lease = RunLease(str(tmp_path / "run"), timeout_s=0.4)
    lease.acquire()
    cut.set()
    deadline = time.monotonic() + 10
    while storage.retries.outage_since() is None:  # a heartbeat met the cut and waits
        assert time.monotonic() < deadline
        time.sleep(0.05)
    started = time.monotonic()
    lease.release()
    assert time.monotonic() - started < 5  # not the 30 s join nor the 300 s outage budget
    cut.clear()
    time.sleep(1.0)  # the store answers again: a beat still waiting would write now
    assert read_lease(lease.path) is None


def test_a_forced_take_over_on_s3_wins_against_a_live_heartbeat(seaweed_s3):
    """--force replaces the version of the lease it judged; the holder's heartbeat (here every
    25 ms, about an S3 round trip here) often rewrites it in between. That write is the same holder's,
    so the take-over judges the new version and goes on, instead of stopping as if another driver
    had started at the same moment (which the first of these ten take-overs nearly always did)."""
    for attempt in range(10):
        run_dir = seaweed_s3.url("runs", f"forced-{attempt}")
        holder = RunLease(run_dir, timeout_s=0.1)
        holder.acquire()
        time.sleep(0.05)
        thief = RunLease(run_dir, timeout_s=60, force=True)
        try:
            assert thief.acquire().startswith("--force: taking over the lease of")
            assert read_lease(thief.path).owner == thief.owner
        finally:
            holder.release()
            thief.release()


def test_a_release_on_s3_deletes_only_the_lease_it_wrote(seaweed_s3, monkeypatch):
    """A forced take-over that lands between the holder's read of the lease and its delete (the
    holder's read still shows its own record): the delete is conditional on the holder's version, so
    the new driver keeps its lease, and the holder is told it was taken over."""
    from vitray.runfolder import lease as lease_module

    run_dir = seaweed_s3.url("runs", "raced-release")
    taken = []
    holder = RunLease(run_dir, timeout_s=60, on_lost=taken.append)
    holder.acquire()
    as_read = read_lease(holder.path)
    thief = RunLease(run_dir, timeout_s=60, force=True)
    thief.acquire()
    monkeypatch.setattr(lease_module, "read_lease", lambda path: as_read)  # read before the take-over
    holder.release()
    monkeypatch.undo()
    assert read_lease(thief.path).owner == thief.owner
    assert [record.owner for record in taken] == [thief.owner]
    thief.release()
    assert read_lease(thief.path) is None


def test_a_take_over_waits_for_a_heartbeat_between_its_read_and_its_write(tmp_path):
    """Local storage: the holder's heartbeat reads the lease (its own), then writes it. A driver
    taking over a stale lease in between used to write its own, find it still there after the
    settle time, and go on, and then the holder's write put the holder's back: two drivers on one
    run until the next heartbeat. Now every read-judge-write holds the lease's file lock; here the
    test holds it for the holder paused between its read and its write."""
    run_dir = str(tmp_path / "run")
    path = Path(RunFiles(run_dir).lease_path)
    _foreign_lease(path, age_s=90)  # the holder's last heartbeat: stale
    taker = RunLease(run_dir, timeout_s=60)
    outcome: list[str] = []

    def take() -> None:
        try:
            outcome.append(taker.acquire() or "")
        except RunLeaseHeld as refused:
            outcome.append(f"refused: {refused}")

    lock = f"{path}.lock"  # beside the lease
    with filelock.FileLock(lock, thread_local=False):  # the holder, between read and write
        thread = threading.Thread(target=take)
        thread.start()
        thread.join(1.0)
        assert thread.is_alive() and not outcome, "the take-over did not wait for the heartbeat's write"
        _foreign_lease(path, age_s=0)  # the holder's write: a fresh heartbeat
    thread.join(10)
    assert outcome and outcome[0].startswith("refused: ") and "already running" in outcome[0], outcome
    assert read_lease(str(path)).owner == "otherdriver1"  # the holder's lease, untouched

    # A lock held longer than LOCK_WAIT_S (a driver stopped mid-write) is reported, not waited on forever.
    taker.LOCK_WAIT_S = 0.2
    stopped_mid_write = filelock.FileLock(lock, thread_local=False)
    with stopped_mid_write, pytest.raises(RunLeaseHeld, match=r"lease\.json\.lock has been locked for over 0\.2 s"):
        taker.acquire()


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("before", ["no lease", "a stale lease"])
def test_two_drivers_starting_at_once_one_goes_on(where, before, tmp_path, request):
    """Two starts at once, with no lease yet (both create) or a stale one (both take it over).
    Locally: each reads, judges and writes under the lease's file lock, so the second finds the
    first's fresh lease. On S3: conditional writes (If-None-Match to create, If-Match on the stale
    lease's ETag): S3 lets exactly one through."""
    if where == "s3":
        endpoint = request.getfixturevalue("seaweed_s3")
        run_dir = endpoint.url("runs", "race")
    else:
        run_dir = str(tmp_path / "race")
    if before == "a stale lease":
        stale = LeaseRecord("otherdriver1", "other-host", 4242, 0.0, time.time() - 500, time.time() - 300, 60.0)
        write_bytes_atomic(RunFiles(run_dir).lease_path, json.dumps(stale.__dict__).encode())
    start = threading.Barrier(2)
    outcomes: list[str] = []
    winners: list[RunLease] = []

    def start_driver() -> None:
        lease = RunLease(run_dir, timeout_s=60)
        start.wait()
        try:
            lease.acquire()
            outcomes.append("won")
            winners.append(lease)
        except RunLeaseHeld as refused:
            outcomes.append(str(refused))

    threads = [threading.Thread(target=start_driver) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("won") == 1, outcomes
    loser = next(o for o in outcomes if o != "won")
    assert "two runs started at once" in loser or "already running" in loser
    (winner,) = winners
    assert read_lease(winner.path).owner == winner.owner  # the lease is the winner's, not the loser's
    winner.release()


def test_s3_lease_writes_are_conditional_and_the_server_enforces_them(seaweed_s3):
    """The S3 server (SeaweedFS here, S3 itself in production) refuses a create over an existing lease
    and a write over a version other than the one read -- what the race above relies on."""
    from vitray.runfolder.lease_s3 import ConditionalObject, WriteConflict

    obj = ConditionalObject(seaweed_s3.url("runs", "cas", "lease.json"))
    assert obj.get() is None
    first = obj.create(b"one")
    with pytest.raises(WriteConflict):
        obj.create(b"two")  # If-None-Match: * on an existing object
    second = obj.replace(b"two", first)
    assert obj.get() == (b"two", second) and second != first
    with pytest.raises(WriteConflict):
        obj.replace(b"three", first)  # If-Match on a version that was replaced
    obj.delete()
    with pytest.raises(WriteConflict):
        obj.replace(b"four", second)  # If-Match on a deleted object
    assert obj.get() is None


def test_a_store_that_ignores_conditional_writes_is_refused_unless_the_risk_is_accepted(seaweed_s3, monkeypatch):
    """SeaweedFS behind a proxy that drops If-None-Match and If-Match (what some S3-compatible
    stores and gateways do: they write whatever the condition): racing drivers would each believe
    they hold the run. The lease probes the store once and refuses it in one line naming the
    setting that accepts the risk; with it, the lease falls back to the read-back after settle_s."""
    import s3fs
    from s3_proxy import CONDITIONAL_HEADERS, FlakyS3Proxy

    proxy = FlakyS3Proxy(
        seaweed_s3.endpoint_url,
        rate=0.0,
        drop_headers=CONDITIONAL_HEADERS,
        credentials=(seaweed_s3.key, seaweed_s3.secret),
    ).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        run_dir = seaweed_s3.url("runs", "unsafe")
        with pytest.raises(RunLeaseHeld) as refused:
            RunLease(run_dir, timeout_s=60).acquire()
        message = str(refused.value)
        assert type(refused.value).__name__ == "UnsafeLeaseStore"
        assert "\n" not in message and "conditional writes" in message
        assert "run.lease_without_conditional_writes=true" in message
        assert proxy.dropped["If-None-Match"] >= 1
        assert read_lease(RunFiles(run_dir).lease_path) is None  # nothing written, no probe left behind
        assert not [path for path in s3fs.S3FileSystem().find(seaweed_s3.url("runs")) if "probe" in path]

        accepted = RunLease(run_dir, timeout_s=60, settle_s=0.2, without_conditional_writes=True)
        assert accepted.acquire() is None
        assert read_lease(accepted.path).owner == accepted.owner
        accepted.release()
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        proxy.stop()


def test_lease_on_s3_refuses_a_second_driver(seaweed_s3):
    run_dir = seaweed_s3.url("runs", "shared")
    first = RunLease(run_dir, timeout_s=60)
    first.acquire()
    try:
        with pytest.raises(RunLeaseHeld, match="already running"):
            RunLease(run_dir, timeout_s=60).acquire()
    finally:
        first.release()
    second = RunLease(run_dir, timeout_s=60)
    assert second.acquire() is None  # released: no take-over needed
    second.release()


KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    import pyarrow.parquet as pq
    from vitray.evaluation.results import Cell, ResultsTable

    table = ResultsTable(sys.argv[1])
    table.append(Cell("ckpt", "digits", "fewshot", {"shots": 1}).ok({"top1": 0.5}, 1.0))
    real_write = pq.write_table

    def write_half_then_die(t, sink, **kw):
        real_write(t.slice(0, 1), sink, **kw)
        sink.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # the process dies in the middle of the part

    pq.write_table = write_half_then_die
    table.append(Cell("ckpt", "digits", "fewshot", {"shots": 5}).ok({"top1": 0.7, "top5": 0.9}, 1.0))
    """
)


def test_a_results_writer_killed_mid_part_leaves_no_half_written_parquet(tmp_path):
    from vitray.evaluation.results import ResultsTable

    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(results)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftovers = [p.name for p in results.iterdir()]
    assert len(leftovers) == 2, leftovers  # the finished part and the dead writer's temp file
    table = ResultsTable(str(results))
    assert len(table.part_files()) == 1
    rows = table.to_table().to_pylist()
    assert [(r["settings"], r["metric"], r["value"]) for r in rows] == [('{"shots":1}', "top1", 0.5)]


def test_resume_point_names_the_newer_checkpoints_it_skips_and_why(tmp_path):
    from vitray.runfolder import checkpoint_folders as ckpt
    from vitray.trainers.checkpoint.rank_files import files_under, mark_complete, write_state

    run_dir = tmp_path / "run"
    for name, step in (("checkpoint_2026-01-01_00-00-00.000001", 6), ("checkpoint_2026-01-01_00-01-00.000001", 12)):
        folder = run_dir / name
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 100)
        write_state(folder, {"step": step, "world_size": 1})
        mark_complete(folder, 0, files_under(folder))
    newest = run_dir / "checkpoint_2026-01-01_00-01-00.000001" / "model.safetensors"
    newest.write_bytes(b"x" * 50)  # cut short
    chosen, skipped = ckpt.resume_point(str(run_dir))
    assert chosen.step == 6 and [Path(c.path).name for c in skipped] == [newest.parent.name]
    line = ckpt.describe_resume("r", chosen, skipped)
    assert line.startswith(f"resuming r from step 6 ({chosen.path})")
    assert f"skipped newer checkpoint {newest.parent}: " in line and "model.safetensors is missing or truncated" in line
    assert ckpt.describe_resume("r", None, []) == "starting r from scratch (no complete checkpoint)"
    # A fine-tune starts from its init.checkpoint's weights: "from scratch" read as though they were not loaded.
    assert ckpt.describe_resume("ft", None, [], init="/runs/pre") == (
        "starting ft from the weights of init.checkpoint /runs/pre (no complete checkpoint of its own)"
    )


def _complete_checkpoints(run_dir: Path, steps: tuple[int, ...], names: list[str] | None = None) -> list[Path]:
    """Complete one-rank checkpoint folders of `run_dir` at `steps`, oldest first: named as an
    earlier vitray named them (its clock's date-time, a minute apart), or `names`."""
    from vitray.trainers.checkpoint.rank_files import files_under, mark_complete, write_state

    folders = []
    for minute, step in enumerate(steps):
        folder = run_dir / (names[minute] if names else f"checkpoint_2026-01-01_00-{minute:02d}-00.000001")
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 100)
        write_state(folder, {"step": step, "world_size": 1})
        mark_complete(folder, 0, files_under(folder))
        folders.append(folder)
    return folders


def test_resume_point_knowing_a_checkpoint_reads_only_the_newer_ones(tmp_path, monkeypatch):
    """The workers' rank 0 after a restart inside the run asks resume_point again, knowing the
    checkpoint the driver chose and verified: only what was written since is read."""
    import shutil

    from vitray.runfolder import checkpoint_folders as ckpt

    run_dir = tmp_path / "run"
    folders = _complete_checkpoints(run_dir, (6, 12, 18))
    (folders[2] / "model.safetensors").write_bytes(b"x")  # the newest cut short
    checked = []
    check = ckpt.check_checkpoint
    monkeypatch.setattr(ckpt, "check_checkpoint", lambda path: checked.append(Path(path).name) or check(path))
    known = ckpt.CheckpointInfo(str(folders[1]), 12, True)
    chosen, skipped = ckpt.resume_point(str(run_dir), known=known)
    assert (Path(chosen.path).name, chosen.step) == (folders[1].name, 12)
    assert checked == [folders[2].name] and [Path(c.path).name for c in skipped] == [folders[2].name]
    checked.clear()
    assert ckpt.resume_point(str(run_dir))[0].step == 12  # not knowing it: the same answer, newest first
    assert checked == [folders[2].name, folders[1].name]  # and nothing older is read
    shutil.rmtree(folders[1])  # the known one deleted since (checkpoint.keep): the older ones are read
    assert ckpt.resume_point(str(run_dir), known=known)[0].step == 6


def test_pruning_keeps_the_newest_complete_checkpoints_and_anything_newer(tmp_path):
    """checkpoint.keep counts complete checkpoints only: uploads that failed (silently, as Ray's
    pyarrow upload can) never push the last complete checkpoint out."""
    from vitray.runfolder import checkpoint_folders as ckpt

    run_dir = tmp_path / "run"
    names = [folder.name for folder in _complete_checkpoints(run_dir, (4, 8, 12, 16, 20, 24))]
    for name in names[3:]:  # the newest three uploads lost a file each
        (run_dir / name / "model.safetensors").write_bytes(b"x" * 10)
    assert ckpt.prune_checkpoints(str(run_dir), keep=2) == [str(run_dir / names[0])]
    left = ckpt.find_checkpoints(str(run_dir))
    assert sorted(Path(c.path).name for c in left) == names[1:]
    assert [c.step for c in left if c.complete] == [8, 12]
    assert ckpt.prune_checkpoints(str(run_dir), keep=2) == []  # nothing more to delete
    assert ckpt.prune_checkpoints(str(run_dir), keep=1) == [str(run_dir / names[1])]
    assert ckpt.latest_complete_checkpoint(str(run_dir)).step == 12
    with pytest.raises(ValueError, match="keep must be at least 1"):
        ckpt.prune_checkpoints(str(run_dir), keep=0)


def test_checkpoints_go_in_step_order_whatever_rank_0s_clock_says(tmp_path):
    """Rank 0 moved to a node whose clock is 15 minutes behind (or in another time zone, or in a
    daylight-saving hour run twice) names the step-3000 checkpoint: the run resumes from it, and a
    prune deletes the oldest, not it. (Named by the clock alone, the resume took step 2000 and the
    prune deleted step 3000.) A run an earlier vitray began, its names its clock's, goes on in order."""
    from datetime import UTC, datetime

    from vitray.runfolder import checkpoint_folders as ckpt
    from vitray.trainers.checkpoint.rank_files import checkpoint_name

    clock = [datetime(2026, 3, 1, hour, minute, tzinfo=UTC) for hour, minute in ((10, 0), (10, 10), (9, 57))]
    steps = (1000, 2000, 3000)
    names = [checkpoint_name(step, now) for step, now in zip(steps, clock, strict=True)]
    assert names[0] == "checkpoint_s000000001000_2026-03-01_10-00-00.000000"
    for run_dir, run_names in ((tmp_path / "skewed", names), (tmp_path / "upgraded", [None, None, names[2]])):
        earlier = [f"checkpoint_2026-03-01_11-0{minute}-00.000001" for minute in range(3)]  # a clock ahead
        folders = _complete_checkpoints(run_dir, steps, [n or e for n, e in zip(run_names, earlier, strict=True)])
        assert ckpt.resume_point(str(run_dir))[0].step == 3000
        assert ckpt.prune_checkpoints(str(run_dir), keep=2) == [str(folders[0])]
        assert [c.step for c in ckpt.find_checkpoints(str(run_dir))] == [2000, 3000]
    with pytest.raises(ValueError, match="within 0..999999999999"):
        checkpoint_name(10**12)


def test_a_prune_reads_only_the_checkpoints_it_keeps(tmp_path, monkeypatch):
    """Rank 0 prunes after every save: it reads the newest folders until `keep` complete ones and
    nothing older, and nothing at all where the run keeps every checkpoint so far (it read every
    folder, so a run keeping N checkpoints read N(N+1)/2 of them over its saves)."""
    from vitray.runfolder import checkpoint_folders as ckpt

    run_dir = tmp_path / "run"
    folders = _complete_checkpoints(run_dir, tuple(range(10, 130, 10)))
    (folders[-1] / "model.safetensors").write_bytes(b"x")  # the newest cut short (an upload under way)
    checked = []
    check = ckpt.check_checkpoint
    monkeypatch.setattr(ckpt, "check_checkpoint", lambda path: checked.append(Path(path).name) or check(path))
    assert ckpt.prune_checkpoints(str(run_dir), keep=len(folders)) == [] and checked == []
    assert ckpt.prune_checkpoints(str(run_dir), keep=2) == [str(folder) for folder in folders[:-3]]
    assert checked == [folder.name for folder in folders[-1:-4:-1]]
    seen = {str(folder) for folder in folders[-3:-1]}  # a watcher's checkpoints evaluated already
    checked.clear()
    assert [c.step for c in ckpt.find_checkpoints(str(run_dir), leaving_out=seen)] == [None]
    assert checked == [folders[-1].name]


def test_runs_lists_attempts_and_marks_a_vanished_one_lost(tmp_path):
    from vitray.runfolder.listing import list_runs

    files = RunFiles(str(tmp_path / "run"))
    done = files.new_attempt("a1")
    files.end_attempt(done, "failed", "RuntimeError: boom")
    files.new_attempt("a2")  # never ended, and holds no lease: killed
    (run,) = list_runs(str(tmp_path))
    assert [a["status"] for a in run.attempts] == ["failed", "lost"]
    assert run.attempts_summary.startswith("2: 1 failed, 1 lost (last failure: killed or lost")
    # Held by a live driver on this host: running, not lost.
    lease = RunLease(files.run_dir, timeout_s=60)
    lease.acquire()
    try:
        files.new_attempt(lease.owner)
        (run,) = list_runs(str(tmp_path))
        assert run.attempts[-1]["status"] == "running"
        assert run.status.startswith(f"running ({lease.owner} (host {socket.gethostname()}, pid {os.getpid()})")
    finally:
        lease.release()


def test_an_attempt_whose_end_cannot_be_recorded_says_so_and_the_run_keeps_its_own_outcome(tmp_path, capsys):
    """The run folder's disk full when the driver ends its attempt: the console says the record
    could not be written, and the command reports what the run itself did (its error, or its end)."""
    from vitray.cluster.run_attempts import RunAttempts

    with mounted_tmpfs(tmp_path / "disk", "4m") as disk:
        folder = str(disk / "run")
        failing, finishing = RunAttempts(folder, "owner-1"), RunAttempts(folder, "owner-2")
        failing.start(None)
        finishing.start(None)
        with open(disk / "filler", "wb") as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        with pytest.raises(RuntimeError, match="the run's own error"), failing:
            raise RuntimeError("the run's own error")
        finishing.end("finished")  # a run that finished is not turned into a failure
        said = " ".join(capsys.readouterr().err.split())
        assert [a["status"] for a in RunFiles(folder).read_attempts()] == ["running", "running"]
    for status in ("failed", "finished"):
        assert f"vitray: could not record the end of this attempt ({status}) in {folder}/vitray/attempts (" in said
    assert (
        said.count("No space left on device") == 2 and "`vitray runs` lists it as lost once this driver is gone" in said
    )


def test_runs_that_a_ctrl_c_of_their_command_ends_are_recorded_as_stopped_not_failed(tmp_path, monkeypatch):
    """`vitray evaluate` runs fine-tunes in threads: its Ctrl-C shuts Ray down under them, and they
    ended failed (ActorDiedError, SystemExit) in `vitray runs`."""
    from vitray.cluster import run_attempts

    monkeypatch.setattr(run_attempts, "_STOPPED_BY_USER", threading.Event())  # this process's only
    before, after = (
        run_attempts.RunAttempts(str(tmp_path / "a"), "o1"),
        run_attempts.RunAttempts(str(tmp_path / "b"), "o2"),
    )
    for attempts, stopping in ((before, False), (after, True)):
        if stopping:
            run_attempts.stopping_by_user()
        attempts.start(None)
        with pytest.raises(RuntimeError), attempts:
            raise RuntimeError("ActorDiedError: the actor died")
    (failed,) = RunFiles(str(tmp_path / "a")).read_attempts()
    (stopped,) = RunFiles(str(tmp_path / "b")).read_attempts()
    assert failed["status"] == "failed" and stopped["status"] == "stopped"
    assert stopped["error"] == "stopped by user (Ctrl-C): the command that ran it stopped"


@pytest.fixture
def full_disk(tmp_path):
    """A 4 MiB tmpfs filled to the last byte (mounting it needs root)."""
    with mounted_tmpfs(tmp_path / "staging", "4m") as mount:
        with open(mount / "filler", "wb") as f, pytest.raises(OSError) as full:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        assert full.value.errno == errno.ENOSPC
        yield mount


def test_a_run_folder_whose_disk_fills_is_said_at_once_not_ridden_out_as_an_outage(tmp_path, capsys):
    """The run folder's disk filled between checkpoints: the driver said "storage unreachable ...
    retrying for up to 300 s", then "storage reachable again" of a disk still full, and the run
    trained on to fail at its next checkpoint. A full disk is no outage: the heartbeat says it once,
    naming the folder, and again only after a beat got through."""
    from vitray.storage.retries import is_transient

    assert not is_transient(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_transient(OSError(errno.EDQUOT, "Disk quota exceeded"))
    with mounted_tmpfs(tmp_path / "disk", "1m") as disk:
        lease = RunLease(str(disk / "run"), timeout_s=0.4)
        lease.acquire()
        try:
            with open(disk / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
                while True:
                    f.write(b"\0" * 4096)
            time.sleep(1.0)  # several beats into the full disk
            said = capsys.readouterr().out
            assert said.count("vitray: no space left on the disk of") == 1, said
            assert str(disk / "run") in said and "storage unreachable" not in said, said
            (disk / "filler").unlink()
            time.sleep(0.5)
            assert "no space left" not in capsys.readouterr().out
        finally:
            lease.release()


def test_a_full_disk_raises_what_to_free_and_leaves_no_partial_files(full_disk):
    import torch
    from test_checkpointer import FakeBackend, FakeLoader

    from vitray.trainers.checkpoint.checkpointer import CheckpointDiskFull, Checkpointer

    reports = []
    saver = Checkpointer(
        FakeBackend(),
        rank=0,
        world_size=1,
        every=2,
        last_step=4,
        report=lambda m, d: reports.append(d),
        states={"data": FakeLoader()},
        weights={},
        record={},
        run_dir=str(full_disk),
    )
    saver.backend.module = torch.nn.Linear(64, 64)
    saver.save(2, {})
    with pytest.raises(CheckpointDiskFull) as stopped:
        saver.finish(wait=True)
    message = str(stopped.value)
    assert stopped.value.errno == errno.ENOSPC and "No space left on device" in message
    assert f"checkpoint of step 2 into the run folder {full_disk}" in message
    assert f"Free space in {full_disk}" in message and "checkpoint.keep" in message
    assert reports == []  # nothing handed to the run
    assert [p.name for p in full_disk.iterdir()] == ["filler"]  # the partial folder is gone


def test_an_atomic_write_is_on_disk_before_its_name_and_its_name_after(tmp_path, monkeypatch):
    """`storage.atomic_write` (dataset.json, results parts, attempts, the lease...): the data is fsynced
    before the rename and the folder after it, so that a power loss never leaves an empty file under
    the final name that a reader would take for a whole one."""
    import os

    from vitray import storage

    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: (events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}"))), fsync(fd))
    )
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), replace(a, b)))
    target = tmp_path / "dataset.json"
    storage.write_bytes_atomic(str(target), b"{}")
    (first, renamed, folder) = events
    assert first[0] == "fsync" and first[1].startswith(str(tmp_path / ".dataset.json."))  # the temporary file
    assert renamed == ("replace", str(target)) and folder == ("fsync", str(tmp_path))
    assert target.read_bytes() == b"{}"


def test_a_pin_holds_while_its_reader_lives_and_beats(tmp_path, monkeypatch, capsys):
    """A reader's pin keeps its checkpoint from the run's prune; a pin whose heartbeat stopped (a
    reader killed elsewhere) or whose process is gone from this host holds nothing; a reader that
    cannot write its pin (read-only credentials) says so once and reads on."""
    import json as json_module

    from vitray.runfolder import checkpoint_folders as ckpt
    from vitray.runfolder import pins

    run_dir = tmp_path / "run"
    names = [folder.name for folder in _complete_checkpoints(run_dir, (4, 8, 12))]
    (run_dir / "vitray").mkdir()
    with pins.CheckpointPins([str(run_dir / names[0]), str(tmp_path / "elsewhere" / "checkpoint_x")], timeout_s=0.8):
        time.sleep(0.5)  # past a heartbeat: still held
        assert ckpt.prune_checkpoints(str(run_dir), keep=1) == [str(run_dir / names[1])]
        assert not (tmp_path / "elsewhere").exists()  # a checkpoint outside a run folder is not pinned
    assert ckpt.prune_checkpoints(str(run_dir), keep=1) == [str(run_dir / names[0])]

    def written_pin(**changes) -> None:
        record = pins.CheckpointPins([str(run_dir / names[2])]).reader
        fields = {**record.__dict__, **changes, "checkpoints": [names[2]]}
        folder = run_dir / "vitray" / "pins"
        folder.mkdir(exist_ok=True)
        (folder / f"{record.owner}.json").write_text(json_module.dumps(fields))

    written_pin(heartbeat=time.time() - 300)  # stopped beating
    written_pin(pid=2**22 + 17, pid_started=1.0)  # gone from this host
    assert pins.pinned_checkpoints(str(run_dir)) == set()
    written_pin()
    assert pins.pinned_checkpoints(str(run_dir)) == {names[2]}

    def read_only(*args, **kwargs):
        raise PermissionError("Access Denied")

    monkeypatch.setattr(pins.storage, "write_bytes_atomic", read_only)
    with pins.CheckpointPins([str(run_dir / names[2])], timeout_s=0.4):
        time.sleep(0.3)
    said = capsys.readouterr().err
    assert said.count("could not pin the checkpoints read from") == 1 and "checkpoint.keep may delete" in said


def test_a_drivers_signals_are_taken_before_its_lease(tmp_path, monkeypatch):
    """SIGTERM in the moment after the lease was written and before the driver took its signals
    killed it at once (exit -15: `test_sigterm_while_the_run_starts_stops_it_at_once_recorded_and_released`
    under load), the lease and an open attempt left behind: the signals are vitray's before the
    lease is taken, and are given back after it is released."""
    import signal as signals

    from vitray.cluster import pretrain as training
    from vitray.cluster.stop_signals import StopOnSignal
    from vitray.common.config import load_config
    from vitray.runfolder.lease import RunLease
    from vitray.trainers.config import TrainingConfig

    seen = []
    acquire = RunLease.acquire

    def taking(self):
        seen.append(signals.getsignal(signals.SIGTERM))
        return acquire(self)

    def started(cfg, verbose=False):  # the lease is held now: stop before Ray starts
        raise training.RunLeaseHeld("refused here, after the lease")

    monkeypatch.setattr(RunLease, "acquire", taking)
    monkeypatch.setattr(training, "check_inputs", lambda cfg: None)
    monkeypatch.setattr(training, "check_resume", lambda cfg, folder, info: started(cfg))
    cfg = load_config(TrainingConfig, None, [f"data.train={tmp_path}", f"run.storage={tmp_path}", "run.name=r"])
    before = signals.getsignal(signals.SIGTERM)
    with pytest.raises(training.RunLeaseHeld, match="after the lease"):
        training.pretrain(cfg, show_progress=False)
    (handler,) = seen
    assert getattr(handler, "__func__", None) is StopOnSignal._on_signal, handler
    assert signals.getsignal(signals.SIGTERM) is before
    assert read_lease(RunFiles(str(tmp_path / "r")).lease_path) is None
