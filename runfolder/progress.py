"""The driver's live view of a run: a rich progress bar fed by the run's metrics file."""

from __future__ import annotations

import datetime
import json
import logging
import math
import threading
import time
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from vitray import storage
from vitray.runfolder.files import RunFiles
from vitray.runfolder.listing import skipped_data
from vitray.runfolder.run_report import evaluations, result_text

log = logging.getLogger(__name__)


class MetricsTail:
    """The records of a run's `metrics.jsonl`, read on from where the last read stopped: one ranged
    read of the new bytes per poll, not a download of the whole file (a long run's file on S3 grows
    to megabytes). The file is only ever replaced whole by a longer copy, except when a resumed
    attempt starts it again from its checkpoint's lines; that shows as a file shorter than what was
    read, or whose last line read is no longer where it was, and then it is read again whole."""

    def __init__(self, path: str):
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.offset = 0  # bytes of complete lines read
        self._last_line = b""  # the last complete line read, to see that the file was not rewritten

    def read(self) -> list[dict[str, Any]]:
        fs, fs_path = storage.filesystem(self.path)
        fs.invalidate_cache(fs_path)  # s3fs keeps listings (and so sizes) otherwise
        try:
            size = fs.size(fs_path)
        except FileNotFoundError:
            return self.records
        if size < self.offset:
            self._restart()
        if size == self.offset:
            return self.records
        # From the start of the last line read: still there means the file only grew.
        data = self._read_from(fs, fs_path, self.offset - len(self._last_line), size)
        if not data.startswith(self._last_line):
            self._restart()
            data = self._read_from(fs, fs_path, 0, size)
        new = data[len(self._last_line) :]
        complete = new[: new.rfind(b"\n") + 1]  # a line being written right now waits for the next read
        lines = complete.splitlines(keepends=True)
        self.records += [json.loads(line) for line in lines]
        self.offset += len(complete)
        self._last_line = lines[-1] if lines else self._last_line
        return self.records

    def _restart(self) -> None:
        self.records, self.offset, self._last_line = [], 0, b""

    @staticmethod
    def _read_from(fs, fs_path: str, start: int, end: int) -> bytes:
        with fs.open(fs_path, "rb") as f:
            f.seek(start)
            return f.read(end - start)


class TrainingProgress:
    """Polls `<run>/vitray/metrics.jsonl` (local or S3) and shows step, loss, images/s and ETA, and
    the metric named `headline` (`label` before it) when a record has it.

    On a terminal that is a live bar. Where the output is not one -- a log file, a pipe, `ray job
    logs`, a pod's log -- a bar shows nothing until the end, so each new record is printed as one
    line instead: step/total, loss, images/s, the data-wait share, the ETA, and the evaluations the
    record holds (`val/top1 0.783 fewshot/digits_10shot 0.767`).

    Only this attempt's records are shown: those past `resumed_from` (the step it resumes from), and
    written after `attempt_started` (a time.time(); None: any), since until the attempt's first
    upload the file still holds the previous attempt's lines, past its last checkpoint included."""

    # How far a worker's clock may run behind the driver's before its first lines go unshown.
    CLOCK_SKEW_S = 5.0
    # Lines mode: after this long without a new record a line says so (the workers starting, the first
    # steps compiling, or a run that hangs), then after twice as long, and so on up to QUIET_MAX_S.
    QUIET_S = 120.0
    QUIET_MAX_S = 3600.0

    def __init__(
        self,
        run_dir: str,
        total_steps: int,
        poll_seconds: float = 2.0,
        *,
        headline: str | None = None,
        label: str = "",
        outage_s: float = storage.retries.OUTAGE_S,
        resumed_from: int = 0,
        attempt_started: float | None = None,
    ):
        """`outage_s` (run.storage_outage_s): for the console's line when the run folder's store stops
        answering (`storage.polled`): how long the run waits for it."""
        self.resumed_from = resumed_from
        self.since = -math.inf if attempt_started is None else attempt_started - self.CLOCK_SKEW_S
        self.metrics = MetricsTail(RunFiles(run_dir).metrics_path)
        self.outage_s = outage_s
        self.headline, self.label = headline, label or headline
        self.total = total_steps
        self.poll = poll_seconds
        self._stop = threading.Event()
        self._progress = Progress(
            TextColumn("[bold]pretrain"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
        )
        # Started at the resumed step: the rate (and so the ETA) is this attempt's, not a jump to it.
        self._task = self._progress.add_task(
            "steps", total=total_steps, completed=resumed_from, status="starting workers..."
        )
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self.lines = not self._progress.console.is_terminal
        self._printed = resumed_from  # the last step printed as a line
        self._quiet_since = time.monotonic()  # lines mode: when the last line was printed
        self._quiet_s = self.QUIET_S  # and how long a quiet time now is

    def __enter__(self) -> TrainingProgress:
        if not self.lines:
            self._progress.start()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._refresh()
        if not self.lines:
            self._progress.stop()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll):
            self._refresh()

    def _refresh(self) -> None:
        try:
            self._show()
        except Exception:  # the display's own failure is no reason to stop a run, nor a traceback on its console
            log.debug("showing the run's progress failed", exc_info=True)

    def _show(self) -> None:
        try:
            records = storage.polled(self.metrics.read, what=f"reading {self.metrics.path}", within_s=self.outage_s)
        except Exception:
            return
        records = [r for r in records if r.get("step", 0) > self.resumed_from and r.get("time", math.inf) >= self.since]
        if self.lines:
            self._print_lines(records)
            return
        if not records:
            return
        last = records[-1]
        # The latest of each: a record of an evaluation or a checkpoint alone has no loss, and the
        # next log step has no evaluation (the bar showed "loss nan  0.0 img/s", then lost the top-1).
        trained = next((r for r in reversed(records) if "loss" in r), None)
        status = "starting..." if trained is None else f"loss {trained['loss']:.4f}"
        if trained is not None and "images_per_s" in trained:
            status += f"  {trained['images_per_s']:.1f} img/s"
        if trained is not None and "lr" in trained:
            status += f"  lr {trained['lr']:.2e}"
        scored = next((r for r in reversed(records) if self.headline in r), None) if self.headline else None
        if scored is not None:
            status += f"  {self.label} {scored[self.headline]:.3f}"
        skipped, _ = skipped_data(records)
        if skipped:
            status += f"  {skipped} corrupt sample{'s' if skipped != 1 else ''} skipped"
        self._progress.update(self._task, completed=min(last.get("step", 0), self.total), status=status)

    def _print_lines(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            if record.get("step", 0) > self._printed:
                self._say(progress_line(record, records, self.total))
                self._printed = record.get("step", 0)
                self._quiet_s = self.QUIET_S
        quiet = time.monotonic() - self._quiet_since
        if quiet >= self._quiet_s:  # where a bar would still move its clock, a log shows nothing
            waited = datetime.timedelta(seconds=round(quiet))
            if records:
                self._say(f"no new metrics for {waited} since step {self._printed}")
            else:
                self._say(f"no metrics yet after {waited} (the workers are starting, their first steps compiling)")
            self._quiet_s = min(2 * self._quiet_s, self.QUIET_MAX_S)

    def _say(self, line: str) -> None:
        self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        self._quiet_since = time.monotonic()


ETA_SHOWN_S = 365 * 24 * 3600.0


def progress_line(record: dict[str, Any], records: list[dict[str, Any]], total_steps: int) -> str:
    """One log line of a metrics record: "step 200/300  loss 1.0435  58.5 img/s  data wait 1%
    lr 1.00e-03  eta 0:01:42  val/top1 0.783"; the ETA from the pace between the first of `records` (this
    attempt's) and this one."""
    step = int(record.get("step", 0))
    parts = [f"step {step}/{total_steps}"]
    if "loss" in record:
        parts.append(f"loss {record['loss']:.4f}")
    if "images_per_s" in record:
        parts.append(f"{record['images_per_s']:.1f} img/s")
    if "data_wait_fraction" in record:
        parts.append(f"data wait {record['data_wait_fraction']:.0%}")
    if "lr" in record:
        parts.append(f"lr {record['lr']:.2e}")
    first = records[0]
    if "time" in record and "time" in first and step > first.get("step", 0) and step < total_steps:
        per_step = (record["time"] - first["time"]) / (step - first["step"])
        left = per_step * (total_steps - step)
        # (a timedelta of train.steps=1e20's seconds overflows, and would stop the progress lines)
        parts.append(f"eta {datetime.timedelta(seconds=round(left))}" if left < ETA_SHOWN_S else "eta over a year")
    parts += [result_text(key, value, digits=3) for key, value in evaluations(record)]
    if record.get("skipped_samples"):
        parts.append(f"{record['skipped_samples']} corrupt samples skipped")
    return "  ".join(parts)
