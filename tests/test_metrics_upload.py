"""Metrics reach the run folder in the background: a training step never waits for storage, and
what readers find there (RunFiles, pandas, pyarrow, TensorBoard) is complete and correct.

The slow storage is real storage behind a slow link: `SlowFileSystem` is an fsspec filesystem
over a local folder whose every write first sleeps, registered as ``slowfs://`` so the training
loop reaches it by URL exactly as it reaches ``s3://``.
"""

from __future__ import annotations

import io
import itertools
import json
import threading
import time
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from vitray.common.config import load_config
from vitray.runfolder import checkpoint_folders as ckpt
from vitray.runfolder.files import RunFiles
from vitray.trainers.config import TrainingConfig
from vitray.trainers.context import WorkerContext
from vitray.trainers.metrics import METRICS_FILE, MetricsWriter
from vitray.trainers.metrics_upload import BackgroundMirror, MetricsUploadError


class SlowFileSystem(DirFileSystem):
    """``slowfs://PATH``: PATH under `root`, and every write (upload, pipe, open for writing)
    takes `delay_s` longer. `writes` records (start, end, path, bytes) of each upload (wall clock)."""

    protocol = "slowfs"
    cachable = False
    root: str = ""
    delay_s = 0.0
    writes: list[tuple[float, float, str, bytes]] = []

    def __init__(self, *args, **kwargs):
        super().__init__(path=self.root, fs=LocalFileSystem(auto_mkdir=True))

    def _slowly(self, path, data, write):
        start = time.time()
        time.sleep(self.delay_s)
        result = write()
        SlowFileSystem.writes.append((start, time.time(), str(path), data))
        return result

    def put_file(self, lpath, rpath, *args, **kwargs):
        data = Path(lpath).read_bytes()
        return self._slowly(rpath, data, lambda: super(SlowFileSystem, self).put_file(lpath, rpath, *args, **kwargs))

    def pipe_file(self, path, value, *args, **kwargs):
        return self._slowly(path, value, lambda: super(SlowFileSystem, self).pipe_file(path, value, *args, **kwargs))

    def open(self, path, mode="rb", *args, **kwargs):
        if any(m in mode for m in "wax"):
            time.sleep(self.delay_s)
        return super().open(path, mode, *args, **kwargs)


@pytest.fixture
def slow_storage(tmp_path):
    root = tmp_path / "slow"
    root.mkdir()
    fsspec.register_implementation("slowfs", SlowFileSystem, clobber=True)
    SlowFileSystem.root, SlowFileSystem.writes = str(root), []
    yield root
    SlowFileSystem.delay_s = 0.0


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_training_steps_never_wait_for_a_slow_metrics_upload(
    process_group, single_thread, digits_dataset, slow_storage, tmp_path
):
    """The real loop, logging every step into a run folder whose every write takes 2.5 s: the
    steps go on at their own pace while uploads run beside them; at the end every line and every
    TensorBoard scalar is in the run folder, and the checkpoint's step was uploaded before the
    checkpoint counted."""
    from vitray.trainers.loop import TrainingLoop

    delay, steps = 2.5, 10
    SlowFileSystem.delay_s = delay
    cfg = load_config(
        TrainingConfig,
        None,
        [
            f"data.train={digits_dataset}",
            "model.img_size=16",
            "train.steps=10",
            "train.batch_size=8",
            "train.micro_batch_size=8",
            "schedule.warmup_steps=1",
            "log.every=1",
            "log.upload_every_s=0",
            "checkpoint.every=5",
            "cluster.num_workers=1",
            "data.num_workers=0",
            f"run.storage={tmp_path}",
        ],
    )
    reports = []
    ctx = WorkerContext(rank=0, world_size=1, run_dir="slowfs://run", report=lambda m, d: reports.append((m, d)))
    loop = TrainingLoop(cfg, ctx)
    closed, local = loop.metrics.close, {}

    def close_keeping_the_local_records(**kwargs):
        closed(**kwargs)
        local["records"] = _records(loop.metrics.local_dir / METRICS_FILE)

    loop.metrics.close = close_keeping_the_local_records
    loop.run()

    remote = slow_storage / "run" / "vitray"
    records = _records(remote / METRICS_FILE)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records == local["records"]  # the last local state, byte for byte
    assert not loop.metrics.local_dir.exists()  # removed once all of it was uploaded
    # Written synchronously, each log step would wait for two uploads (JSONL + events): at least
    # 2 x 2.5 s between two records. The steps did not wait (a step here takes about 0.2 s), and
    # records were written while uploads ran. (The last step is left out: a checkpoint step
    # waits for the previous checkpoint's write to finish, which includes its metrics upload.)
    gaps = sorted(b["time"] - a["time"] for a, b in itertools.pairwise(records))
    assert gaps[len(gaps) // 2] < delay and gaps[-1] < 2 * delay, f"steps waited for the uploads: {gaps}"
    uploads = [w for w in SlowFileSystem.writes if w[2].endswith(METRICS_FILE)]
    during = [r["step"] for r in records if any(start < r["time"] < end for start, end, *_ in SlowFileSystem.writes)]
    assert len(during) >= 2, (during, SlowFileSystem.writes)
    assert len(uploads) < steps, f"{len(uploads)} uploads of metrics.jsonl for {steps} log steps: not coalesced"
    # TensorBoard: the run folder's events hold the loss of every step.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(remote / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, steps + 1))
    # The checkpoint of step 5 counted (completion record) only after a metrics upload holding
    # step 5 had finished.
    (folder5,) = [d for m, d in reports if d is not None and m["step"] == 5]
    # The checkpoint was written straight into the (slow) run folder: its files lie under slow_storage.
    on_disk = slow_storage / str(folder5).split("://", 1)[1]
    completed = (on_disk / "complete-rank-0000.json").stat().st_mtime
    holding_step5 = [end for start, end, path, data in uploads if b'"step": 5,' in data]
    assert holding_step5 and min(holding_step5) <= completed, (holding_step5, completed)
    assert ckpt.verify_complete(on_disk)["step"] == 5


def _mirror_of_one_line(tmp_path, put) -> tuple:
    """A local folder with a.jsonl's first line, and a BackgroundMirror of it (through `put`) told of it."""
    local = tmp_path / "local"
    local.mkdir()
    mirror = BackgroundMirror(local, put, every_s=0.05)
    (local / "a.jsonl").write_text('{"step": 1}\n')
    mirror.changed()
    return local, mirror


def test_a_flush_waits_for_the_upload_and_a_failed_one_is_reported_and_retried(tmp_path):
    """The handle a checkpoint waits on: returns once the bytes are on storage, raises naming the
    failure when the upload failed for good, and the next upload retries. (A transient failure, a
    SlowDown say, is retried inside the upload, `storage.ride_out`: the next test.)"""
    published: dict[str, bytes] = {}
    failures = [PermissionError("AccessDenied: the bucket policy refuses PutObject")]
    gate = threading.Event()

    def put(name: str, data: bytes) -> None:
        gate.wait()
        if failures:
            raise failures.pop()
        published[name] = data

    local, mirror = _mirror_of_one_line(tmp_path, put)
    handle = mirror.flush()
    assert not published  # the upload is held at the gate; flush() itself did not wait
    gate.set()
    with pytest.raises(MetricsUploadError, match="AccessDenied"):
        handle.wait()
    with open(local / "a.jsonl", "a") as f:
        f.write('{"step": 2}\n')
    mirror.changed()
    mirror.flush().wait()
    assert published == {"a.jsonl": b'{"step": 1}\n{"step": 2}\n'}
    mirror.close()


def test_a_transient_upload_failure_is_retried_inside_the_upload(tmp_path):
    """A store that answers SlowDown (an OSError: transient) is waited for: the flush returns once
    the bytes are there, without an error."""
    published: dict[str, bytes] = {}
    failures = [OSError("SlowDown: please reduce your request rate")]

    def put(name: str, data: bytes) -> None:
        if failures:
            raise failures.pop()
        published[name] = data

    _, mirror = _mirror_of_one_line(tmp_path, put)
    mirror.flush().wait()
    assert published == {"a.jsonl": b'{"step": 1}\n'} and not failures
    mirror.close()


def test_only_complete_records_are_uploaded(tmp_path):
    """A line being written while an upload reads the file is not published half-written."""
    published = []
    local = tmp_path / "local"
    local.mkdir()
    mirror = BackgroundMirror(local, lambda name, data: published.append(data), every_s=0)
    with open(local / "m.jsonl", "w") as f:
        f.write('{"step": 1}\n')
        f.flush()
        mirror.changed()
        f.write('{"step": 2, "lo')  # in progress: flushed to the OS, not yet recorded as complete
        f.flush()
        mirror.flush().wait()
    mirror.close()
    assert published[-1] == b'{"step": 1}\n'


def test_metrics_on_s3_read_back_by_run_files_pandas_and_pyarrow_and_resume_replaces_the_tail(seaweed_s3, tmp_path):
    import pandas as pd
    import pyarrow.json as paj

    run = RunFiles(seaweed_s3.url("run"))
    writer = MetricsWriter(tmp_path / "first", run, upload_every_s=3600)  # only flushes and close upload
    for step in range(1, 7):
        writer.write(step, {"loss": 1.0 / step, "lr": 0.1})
    writer.flush().wait()
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3, 4, 5, 6]
    writer.close()
    # A resumed attempt from step 3: its metrics go on from the checkpoint's lines.
    (tmp_path / "second").mkdir()
    run.seed_local_metrics(tmp_path / "second", 3)
    writer = MetricsWriter(tmp_path / "second", run, upload_every_s=3600)
    for step in (4, 5):
        writer.write(step, {"loss": 2.0 / step, "lr": 0.2})
    writer.close()
    records = run.read_metrics()
    assert [(r["step"], r["lr"]) for r in records] == [(1, 0.1), (2, 0.1), (3, 0.1), (4, 0.2), (5, 0.2)]
    raw = fsspec.open(run.metrics_path).open().read()
    frame = pd.read_json(io.BytesIO(raw), lines=True)
    assert frame["step"].tolist() == [1, 2, 3, 4, 5] and frame["loss"].iloc[-1] == pytest.approx(0.4)
    table = paj.read_json(io.BytesIO(raw))
    assert table.column("step").to_pylist() == [1, 2, 3, 4, 5]


def test_a_failed_attempt_leaves_no_local_copy_once_its_lines_are_in_the_run_folder(
    process_group, digits_dataset, tmp_path
):
    """Each failed attempt (a worker group restart) kept rank 0's copy of the whole metrics history
    in /tmp; it is kept now only where its last lines could not be uploaded."""
    from pretrain_helpers import in_process_loop

    loop = in_process_loop(digits_dataset, tmp_path)
    local = loop.metrics.local_dir

    def fail() -> None:
        loop.metrics.write(1, {"loss": 2.0})
        raise RuntimeError("a worker's error")

    loop._run = fail
    with pytest.raises(RuntimeError, match="a worker's error"):
        loop.run()
    assert not local.exists()
    assert [r["step"] for r in RunFiles(str(tmp_path / "run")).read_metrics()] == [1]


def test_a_mirror_says_whether_its_last_state_reached_storage(tmp_path):
    def refused(name: str, data: bytes) -> None:
        raise PermissionError("AccessDenied")

    (tmp_path / "ok").mkdir()
    _, mirror = _mirror_of_one_line(tmp_path / "ok", lambda name, data: None)
    assert mirror.close() is True
    (tmp_path / "refused").mkdir()
    _, mirror = _mirror_of_one_line(tmp_path / "refused", refused)
    assert mirror.close(raise_errors=False) is False


def test_what_killed_processes_left_in_the_temporary_folder_is_removed_once_stale(tmp_path, monkeypatch):
    import os

    from vitray.common.leftovers import STALE_AFTER_S, remove_stale

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    old, live, notes, other = (tmp_path / name for name in ("vitray-metrics-a", "vitray-metrics-b", "n.jsonl", "x"))
    for folder in (old, live):
        (folder / "tensorboard").mkdir(parents=True)
        (folder / "metrics.jsonl").write_text("{}\n")
    notes.write_text("")
    other.write_text("")
    long_ago = time.time() - STALE_AFTER_S - 60
    for path in (old, old / "tensorboard", old / "metrics.jsonl", live, live / "tensorboard", notes, other):
        os.utime(path, (long_ago, long_ago))
    # (`live`'s metrics.jsonl was written just now: a live run's folder)
    assert remove_stale("vitray-metrics-") == [str(old)]
    assert live.exists() and notes.exists() and other.exists()
    assert remove_stale("n.json") == [str(notes)] and other.exists()


def test_tensorboard_shows_each_step_once_after_a_resume_from_before_the_last_logged_step(tmp_path):
    """A run killed at step 12, its last checkpoint at step 8: the resumed attempt logs 9..12 again
    (equal values: the resume is exact), and TensorBoard's plots held them twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsWriter(tmp_path / "first")
    for step in range(1, 13):
        first.write(step, {"loss": 100.0 + step})
    first.close()
    resumed = MetricsWriter(tmp_path / "resumed", resumed_at=8)
    for step in range(9, 15):
        resumed.write(step, {"loss": 100.0 + step})
    resumed.close()
    # The run folder's tensorboard/ holds both attempts' event files (the mirror uploads each).
    run = tmp_path / "run" / "tensorboard"
    run.mkdir(parents=True)
    for attempt in ("first", "resumed"):
        for events in (tmp_path / attempt / "tensorboard").iterdir():
            events.rename(run / events.name)
    plots = EventAccumulator(str(run))
    plots.Reload()
    assert [(e.step, e.value) for e in plots.Scalars("loss")] == [(s, 100.0 + s) for s in range(1, 15)]
