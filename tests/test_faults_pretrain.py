"""Faults injected into real pre-training runs (local Ray, 2 CPU workers, DeepSpeed):

- a second `vitray pretrain` of a running run refuses (the run's lease);
- SIGTERM to the driver: a checkpoint at the next check step, exit 75 (pre-empted); Ctrl-C
  (SIGINT) to the re-run: the same, recorded as stopped by user, exit 130; the next re-run resumes
  from it (saying so);
- the run folder's disk (a small tmpfs) fills up under that re-run: a clear error, the previous
  checkpoint intact; once space is freed, the last re-run resumes from it, has one of its Ray Train
  workers SIGTERMed (Ray Train restarts the group) and ends with the uninterrupted run's weights,
  every step on its samples;
- an evaluation grid cell whose fine-tune run failed (a worker killed) is retried and completes; one
  that would fail the same way again is recorded as failed at once, and the rest of the grid completes;
- shards deleted mid-run: the run fails at once naming the shard, no restart spent on it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from disk_helpers import mounted_tmpfs
from pretrain_helpers import (
    HELD,
    REFERENCE,
    REFERENCE_STEPS,
    assert_same_weights,
    final_weights,
    pretrain_args,
    running,
    steps_begun,
    vitray_cmd,
)

from vitray.runfolder.checkpoint_folders import find_checkpoints, latest_complete_checkpoint, verify_complete
from vitray.runfolder.files import RunFiles
from vitray.runfolder.lease import read_lease
from vitray.trainers.keys import collect_keys

pytestmark = pytest.mark.slow

STEPS = REFERENCE_STEPS
EVERY = 10
CHECK_EVERY = 2
# Every run here is acted on while it runs.
COMMON = (*REFERENCE, f"checkpoint.preemption_check_every={CHECK_EVERY}", HELD)


def _args(dataset, storage, *extra: str) -> list[str]:
    return pretrain_args(str(dataset), str(storage), "ref", *COMMON, *extra)


def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines


@pytest.fixture(scope="module")
def reference(reference_run):
    """The uninterrupted run every faulted one must end up equal to (shared with test_drain and
    test_multinode)."""
    return reference_run


def _wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n{proc.stderr.read()[-4000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _train_workers(proc: subprocess.Popen) -> list:
    """The run's Ray Train workers themselves (their DataLoader processes are named pt_data_worker)."""
    import psutil

    return [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("ray::RayTrainWorker")]


def _complete_step(run_dir: str) -> int:
    latest = latest_complete_checkpoint(run_dir)
    return latest.step if latest else 0


def _fill(folder: Path) -> Path:
    """What another process on the machine does: write until the disk is full."""
    filler = folder / "filler"
    block = b"\0" * (1 << 20)
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC
    return filler


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    """A 320 MiB tmpfs: a real file system that runs out of space (mounting it needs root), room
    for the run's checkpoints (62 MB each, 82 MB the last; checkpoint.keep=2 and the one being
    written). None where it cannot be mounted: then nothing fills up and the full-disk test skips."""
    try:
        with mounted_tmpfs(tmp_path_factory.mktemp("small-disk") / "disk", "320m") as mount:
            yield mount
    except pytest.skip.Exception:
        yield None


@pytest.fixture(scope="module")
def preempted(digits_dataset, reference, small_disk, tmp_path_factory):
    """Start a run; start it again while it runs (refused); SIGTERM its driver mid-run; re-run it
    and Ctrl-C it; re-run it and fill its disk; free the disk and re-run it to its end, SIGTERM to
    one of its Ray Train workers once it has checkpointed. One run folder serves the checks of all
    five: a run costs ~50 CPU-s before its first step (its Ray instance, driver and workers), so
    each run here is one the suite saves."""
    # The run folder on the disk that fills up: checkpoints are written there once.
    storage = small_disk / "runs" if small_disk else tmp_path_factory.mktemp("preempted")
    run_dir = str(storage / "ref")
    keys = tmp_path_factory.mktemp("preempted-keys")
    args = _args(
        digits_dataset,
        storage,
        f"checkpoint.every={EVERY}",
        "cluster.max_failures=1",  # the worker SIGTERMed in the last run: one group restart
        f"evals.val={{type: val, every: {STEPS}}}",
        f"debug.record_sample_keys={keys}",
    )
    with running(args) as first:
        _wait_for(lambda: read_lease(RunFiles(run_dir).lease_path) is not None, first, "the run took its lease")
        second = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert first.poll() is None, "the first run must still be running when the second starts"
        _wait_for(lambda: steps_begun(keys) >= 2, first, "step 2 was trained")
        signalled_at = steps_begun(keys)
        first.send_signal(signal.SIGTERM)  # the driver only, as Kubernetes does
        stdout, stderr = first.communicate(timeout=240)
    stopped = latest_complete_checkpoint(run_dir)
    stopped_state = verify_complete(stopped.path) if stopped else None
    runs_while_stopped = subprocess.run(vitray_cmd("runs", str(storage)), capture_output=True, text=True, timeout=120)
    with running(args) as interrupted:  # Ctrl-C: the terminal signals the driver (Ray's processes block SIGINT)
        _wait_for(lambda: steps_begun(keys) >= stopped.step + 2, interrupted, "two steps after the resume")
        interrupted.send_signal(signal.SIGINT)
        out, err = interrupted.communicate(timeout=240)
        ctrl_c = (interrupted.returncode, out, err)
    by_user = latest_complete_checkpoint(run_dir)
    full_disk = None
    if small_disk:
        # Once the re-run trains, another process fills the disk; the re-run's first checkpoint is
        # fifteen steps later (about 4 s; the interval changes no weights), so the fill is done when
        # it is written (five steps once let a checkpoint through on a loaded machine, session 41).
        # No worker-group restart (cluster.max_failures' default): it would meet the same full disk.
        fill_args = ["--set", f"checkpoint.every={by_user.step + 16}", "--set", "cluster.max_failures=0"]
        with running([*args, *fill_args]) as filled:
            _wait_for(lambda: steps_begun(keys) > by_user.step, filled, "a step after the resume")
            filler = _fill(small_disk)
            out, err = filled.communicate(timeout=240)
        full_disk = {"run": (filled.returncode, out, err), "checkpoints": find_checkpoints(run_dir)}
        filler.unlink()  # the operator frees space, and re-runs the same command
    kept = latest_complete_checkpoint(run_dir)
    # The last re-run's first checkpoint two steps after its resume (the interval changes no weights),
    # wherever the Ctrl-C landed: the worker is lost with a checkpoint of the re-run's own to
    # restart from, steps before the run's end.
    with running([*args, "--set", f"checkpoint.every={kept.step + 2}"]) as rerun:
        _wait_for(lambda: _complete_step(run_dir) > kept.step, rerun, "a checkpoint after the resume")
        workers = _train_workers(rerun)
        if len(workers) == 2:  # else the test says so; the run goes on to its end
            workers[-1].send_signal(signal.SIGTERM)
        rerun_out, rerun_err = rerun.communicate(timeout=300)
    return {
        "run_dir": run_dir,
        "storage": storage,
        "second": second,
        "signalled_at": signalled_at,
        "first": (first.returncode, stdout, stderr),
        "stopped": stopped,
        "stopped_state": stopped_state,
        "runs_while_stopped": runs_while_stopped,
        "ctrl_c": ctrl_c,
        "by_user": by_user,
        "full_disk": full_disk,
        "kept": kept,
        "rerun": (rerun.returncode, rerun_out, rerun_err),
        "workers": workers,
        "keys": collect_keys(keys),
        # worker groups that recorded sample keys (a file a rank and group)
        "groups": len({p.name.split("-from")[0] for p in keys.glob("keys-attempt*.tsv")}),
    }


def test_a_second_start_of_a_running_run_refuses(preempted):
    second = preempted["second"]
    message = _flat(second.stderr)
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-3000:]
    assert "is already running" in message and "holds" in message and "last heartbeat" in message
    assert "--force" in message
    # It took nothing: no attempt of its own, and the first run went on to its notice.
    runs = 4 if preempted["full_disk"] else 3  # the first run and its re-runs
    assert len(RunFiles(preempted["run_dir"]).read_attempts()) == runs


def test_sigterm_checkpoints_at_the_next_check_step_and_exits_as_preempted(preempted):
    code, stdout, stderr = preempted["first"]
    assert code == 75, stdout[-2000:] + stderr[-4000:]  # not 0: a scheduler must run it again
    assert "SIGTERM to the driver" in stderr and "stopped on a pre-emption notice" in _flat(stderr)
    step = preempted["stopped"].step
    # The notice is read every CHECK_EVERY steps: the checkpoint is at the first check step after it
    # (the step logged when the signal went may be that step: it is checked after it is logged).
    assert preempted["signalled_at"] <= step < STEPS and step % CHECK_EVERY == 0, (preempted["signalled_at"], step)
    assert preempted["stopped_state"]["world_size"] == 2
    attempts = RunFiles(preempted["run_dir"]).read_attempts()
    assert attempts[0]["status"] == "stopped" and "SIGTERM" in attempts[0]["error"]
    assert "1 stopped" in _flat(preempted["runs_while_stopped"].stdout)


def test_ctrl_c_checkpoints_and_stops_like_sigterm_recorded_as_stopped_by_user(preempted):
    code, stdout, stderr = preempted["ctrl_c"]
    assert code == 130, stdout[-2000:] + stderr[-4000:]
    assert "stopped by user" in _flat(stderr) and "re-run the same command to resume" in _flat(stderr)
    assert "Traceback" not in stderr
    assert (
        preempted["stopped"].step < preempted["by_user"].step < STEPS and preempted["by_user"].step % CHECK_EVERY == 0
    )
    attempt = RunFiles(preempted["run_dir"]).read_attempts()[1]
    assert attempt["status"] == "stopped" and attempt["error"] == "stopped by user (Ctrl-C)", attempt


def test_the_rerun_resumes_from_the_stop_checkpoint_exactly(preempted, reference):
    # The re-run after the Ctrl-C: the one whose disk fills up (exit 1), or (no small disk) the last.
    code, stdout, stderr = preempted["full_disk"]["run"] if preempted["full_disk"] else preempted["rerun"]
    assert code == (1 if preempted["full_disk"] else 0), stdout[-2000:] + stderr[-4000:]
    stopped = preempted["by_user"]
    assert f"resuming ref from step {stopped.step} ({stopped.path})" in _flat(stderr)
    assert_same_weights(final_weights(preempted["run_dir"]), reference["weights"])
    attempts = RunFiles(preempted["run_dir"]).read_attempts()
    # (The full-disk run's end may go unrecorded, said on its console: its record goes into the full run folder.)
    assert [attempts[0]["status"], attempts[1]["status"], attempts[-1]["status"]] == ["stopped", "stopped", "finished"]
    assert attempts[1]["resumed_from_step"] == preempted["stopped"].step
    assert attempts[2]["resumed_from_step"] == stopped.step
    assert attempts[-1]["resumed_from_step"] == preempted["kept"].step
    assert read_lease(RunFiles(preempted["run_dir"]).lease_path) is None  # released at the end


def test_sigterm_to_a_worker_restarts_the_group_and_the_run_finishes_identically(preempted, reference):
    """Ray's worker turns SIGTERM into an immediate exit; Ray Train restarts the group from the
    latest complete checkpoint (cluster.max_failures), so nothing is lost: the same weights (checked
    by the test above), and every step, over all of the run's starts and its restart, trained on
    the same samples as the uninterrupted run's. The worker is the re-run's of `preempted`, after
    its first checkpoint. (A worker that kills itself at a given step is
    `tests/test_zero_stages.py`'s ZeRO-3 restart.)"""
    code, stdout, stderr = preempted["rerun"]
    assert code == 0, stdout[-2000:] + stderr[-4000:]
    workers = preempted["workers"]
    assert len(workers) == 2, [p.name() for p in workers]
    assert not workers[-1].is_running()
    # one a start (the full-disk run's too, where there is one) and the last re-run's restart
    attempts = RunFiles(preempted["run_dir"]).read_attempts()
    assert preempted["groups"] == len(attempts) + 1
    # The restart is said as it happens (Ray's own line says only that a worker died) and recorded
    said = _flat(stderr)
    assert "vitray: the worker group failed (rank " in said, said[-4000:]
    assert "restart 1 of 1: Ray Train starts a new worker group from the latest complete checkpoint" in said
    (failure,) = attempts[-1]["worker_group_failures"]
    assert failure.startswith("rank "), failure
    assert_same_weights(final_weights(preempted["run_dir"]), reference["weights"])
    assert preempted["keys"] == reference["keys"]


def test_a_full_disk_stops_with_what_to_free_and_loses_nothing(preempted, reference):
    """The run folder's disk filled up under the re-run after the Ctrl-C (`preempted`), before its
    first checkpoint; the next re-run, once space is freed, is the fixture's last."""
    if not preempted["full_disk"]:
        pytest.skip("no small disk: mounting a tmpfs needs root")
    code, stdout, stderr = preempted["full_disk"]["run"]
    message = _flat(stdout + stderr)
    assert code == 1, message[-4000:]
    # Whichever write into the run folder meets the full disk first stops the run: a checkpoint's
    # (CheckpointDiskFull, its message pinned by test_faults.py) or the metrics' upload.
    assert "No space left on device" in message
    # Nothing lost: every checkpoint in the run folder is complete; the last is the one before the fault.
    checkpoints = preempted["full_disk"]["checkpoints"]
    assert checkpoints and all(c.complete for c in checkpoints), checkpoints
    assert checkpoints[-1].path == preempted["by_user"].path == preempted["kept"].path

    code, stdout, stderr = preempted["rerun"]  # after the operator freed space: the same command again
    assert code == 0, stdout[-2000:] + stderr[-4000:]
    assert f"resuming ref from step {preempted['kept'].step} (" in _flat(stderr)
    assert_same_weights(final_weights(preempted["run_dir"]), reference["weights"])


def test_a_grid_cell_whose_run_failed_is_retried_and_one_that_would_fail_again_is_recorded_at_once(
    reference, digits_dataset, tmp_path
):
    from vitray.evaluation.results import ResultsTable

    data_root = tmp_path / "prepared"
    data_root.mkdir()
    (data_root / "digits").symlink_to(digits_dataset)
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        yaml.safe_dump(
            {
                "data_root": str(data_root),
                "output": str(tmp_path / "eval"),
                "benchmarks": ["digits"],
                # 143 shots: as many examples as the train split holds in all (1,437 of 10 classes),
                # but fewer of some class: that cell fails on drawing its set, the same way every time.
                "fewshot": {"shots": [1, 143], "seeds": 1},
                # A worker of the fine-tune run killed once (no restart in the run: it fails): a new try
                # of the cell resumes the run, which completes.
                "finetune": {
                    "learning_rates": [0.01],
                    "steps": 6,
                    "batch_size": 16,
                    "warmup_steps": 1,
                    "resolution": 16,
                    "checkpoint_every": 3,
                    "overrides": {"debug.kill_worker_at_step": 5, "cluster.max_failures": 0},
                },
                "retries": 2,
            }
        )
    )
    out = subprocess.run(
        vitray_cmd("evaluate", reference["run_dir"], "-c", str(grid)), capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]  # a failed cell remains
    table = ResultsTable(str(tmp_path / "eval" / "results"))
    rows = table.to_table().to_pylist()
    ok = {(r["method"], json.loads(r["settings"]).get("shots")) for r in rows if r["status"] == "ok"}
    failed = [r for r in rows if r["status"] == "failed"]
    assert ok == {("fewshot", 1), ("finetune", None)}, rows
    assert len(failed) == 1 and json.loads(failed[0]["settings"])["shots"] == 143
    assert failed[0]["error"].startswith("ValueError: 143-shot sampling needs at least 143 examples"), failed[0]
    (run_dir,) = (tmp_path / "eval" / "finetune_runs").iterdir()
    assert [a["status"] for a in RunFiles(str(run_dir)).read_attempts()] == ["failed", "finished"]
    # Every part file is whole (each written under a temporary name, then renamed).
    assert len(table.part_files()) == len(list((tmp_path / "eval" / "results").glob("part-*.parquet")))


def test_when_the_grace_period_runs_out_the_driver_exits_without_a_new_checkpoint(digits_dataset, tmp_path):
    """Workers that do not reach a check step in time (here: checks every 1000 steps) do not hold
    the driver past `run.preemption_grace_s`; the previous complete checkpoint is what remains."""
    storage = tmp_path / "runs"
    run_dir = str(storage / "ref")
    args = pretrain_args(
        str(digits_dataset),
        str(storage),
        "ref",
        "train.steps=200",
        "checkpoint.every=4",
        "checkpoint.keep=1000",  # no prune, which a kill can cut short too: only the newest may be
        "checkpoint.preemption_check_every=1000",
        "run.preemption_grace_s=3",
        HELD,
    )
    with running(args) as proc:
        _wait_for(lambda: latest_complete_checkpoint(run_dir) is not None, proc, "the first checkpoint")
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        stdout, stderr = proc.communicate(timeout=120)
        waited = time.monotonic() - signalled
    assert proc.returncode == 128 + signal.SIGTERM, stdout[-2000:] + stderr[-4000:]
    assert "grace period of 3 s over before the workers stopped" in _flat(stderr)
    assert 3 <= waited < 30
    # The driver is gone, and with it (and `running`'s kill of what is left of its session) the
    # workers, which went on training and checkpointing (every 4 steps, ~1 s) until then: the
    # checkpoint one of them was writing may be cut short. It has no completion record, so it is
    # never taken; everything before it is whole.
    latest = latest_complete_checkpoint(run_dir)
    cut_short = [Path(c.path).name for c in find_checkpoints(run_dir) if not c.complete]
    assert latest is not None and all(name > Path(latest.path).name for name in cut_short), cut_short  # dated names
    # The driver settled its records before it went: the attempt stopped (not "lost"), the lease free.
    (attempt,) = RunFiles(run_dir).read_attempts()
    assert attempt["status"] == "stopped" and "the grace period (3 s) ended" in attempt["error"], attempt
    assert read_lease(RunFiles(run_dir).lease_path) is None


def test_once_the_driver_is_gone_no_checkpoint_of_its_workers_counts(digits_dataset, tmp_path):
    """`kill -9` of the driver's process group (the driver, Ray's GCS and raylet; the Ray workers run
    in groups of their own): the workers trained on for seconds and completed checkpoints that a
    re-run then resumed from, and a re-run started meanwhile would have met them. A checkpoint no
    longer counts once the driver that started its workers is gone or let go of the run (its lease:
    `runfolder.lease.holder_check`; a second Ctrl-C releases it while Ray ends the workers)."""
    import os

    keys, storage = tmp_path / "keys", tmp_path / "runs"
    args = _args(digits_dataset, storage, "checkpoint.every=1", f"debug.record_sample_keys={keys}")
    with running(args) as proc:
        _wait_for(lambda: steps_begun(keys) >= 6, proc, "step 6 was begun")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        at_exit = latest_complete_checkpoint(str(storage / "ref"))
        before = steps_begun(keys)
        time.sleep(10)  # the workers' last seconds, before `running` ends what is left of the run
        later = latest_complete_checkpoint(str(storage / "ref"))
        assert steps_begun(keys) > before, "the workers went on training after the driver was killed"
    assert later.path == at_exit.path, (at_exit, later)


def test_sigterm_while_the_run_starts_stops_it_at_once_recorded_and_released(digits_dataset, tmp_path):
    """A pre-emption in the seconds between the lease and the workers (ray.init, the conversion of a
    checkpoint): nothing to checkpoint, so the driver stops at once, as one that was stopped (exit
    75, its attempt `stopped`, the lease released); it exited 15 in silence, leaving both behind."""
    storage = tmp_path / "runs"
    run_dir = str(storage / "ref")
    args = pretrain_args(str(digits_dataset), str(storage), "ref", "train.steps=200", HELD)
    with running(args) as proc:
        _wait_for(lambda: read_lease(RunFiles(run_dir).lease_path) is not None, proc, "the run took its lease")
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stdout[-2000:] + stderr[-4000:]
    assert "stopped on a pre-emption notice (SIGTERM to the driver" in _flat(stderr)
    assert "before the workers started" in _flat(stderr) and "Traceback" not in stderr
    assert read_lease(RunFiles(run_dir).lease_path) is None
    assert all(a["status"] == "stopped" for a in RunFiles(run_dir).read_attempts())
    assert latest_complete_checkpoint(run_dir) is None


def test_shards_gone_mid_run_fail_it_at_once_without_spending_restarts(digits_dataset, tmp_path):
    """The dataset's shards deleted after the run's pre-flight listed them: the worker that opens
    the next one meets ShardMissing, which a new worker group would meet again, so the run fails at
    once with the shard's one line although cluster.max_failures allows two restarts."""
    import psutil

    data = tmp_path / "data"
    shutil.copytree(digits_dataset, data)
    storage = tmp_path / "runs"
    run_dir = str(storage / "ref")
    keys = tmp_path / "keys"
    seen: set[int] = set()  # every Ray Train worker process of the run: a restart starts new ones

    def workers(proc: subprocess.Popen) -> set[int]:
        with contextlib.suppress(psutil.Error):
            seen.update(
                p.pid
                for p in psutil.Process(proc.pid).children(recursive=True)
                if p.name().startswith("ray::RayTrainWorker")
            )
        return seen

    # Step 2 as rank 0 begins it (its sample keys; the metrics reach the run folder 10 s later, by
    # which time the ranks may have opened every shard they read), long before a slot's second shard.
    extra = ("checkpoint.every=100", "cluster.max_failures=2", f"debug.record_sample_keys={keys}")
    with running(_args(data, storage, *extra)) as proc:
        _wait_for(lambda: steps_begun(keys) >= 2, proc, "step 2")
        first = set(workers(proc))
        for shard in data.glob("train-*.tar"):
            shard.unlink()
        while proc.poll() is None:
            workers(proc)
            time.sleep(0.2)
        stdout, stderr = proc.communicate()
    said = _flat(stderr)
    assert proc.returncode == 1, stdout[-2000:] + stderr[-4000:]
    assert len(first) == 2 and seen == first, f"a new worker group started: {sorted(seen - first)}"
    assert "error: pre-training failed: ShardMissing: shard " in said and "is missing (listed in the manifest)" in said
    assert "fix the cause" in said and "Traceback" not in stderr
    (attempt,) = RunFiles(run_dir).read_attempts()
    assert attempt["status"] == "failed" and "ShardMissing" in attempt["error"]
