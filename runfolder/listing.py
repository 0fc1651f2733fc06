"""`vitray runs`: what is under a storage folder, read from the files alone (no Ray needed)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from vitray import storage
from vitray.common.failures import describe_failure
from vitray.runfolder.checkpoint_folders import find_checkpoints
from vitray.runfolder.files import RunFiles
from vitray.runfolder.lease import read_lease


@dataclass
class RunSummary:
    name: str
    latest_step: int | None
    num_checkpoints: int
    latest_checkpoint: str | None
    status: str
    attempts: list[dict] = field(default_factory=list)  # each `vitray pretrain` of the run, oldest first
    # each checkpoint folder that does not count, oldest first: {"path": ..., "problem": why}
    incomplete: list[dict] = field(default_factory=list)
    skipped_samples: int = 0  # samples the run skipped as corrupt (damaged or cut-short shards)
    skipped_shards: list[str] = field(default_factory=list)  # the shards they came from

    @property
    def incomplete_lines(self) -> list[str]:
        """One line per checkpoint that does not count: its folder name and why (an unfinished
        write, a cut-short upload), e.g. "checkpoint_2026-...: rank 1 never finished writing it"."""
        return [f"{c['path'].rstrip('/').rsplit('/', 1)[-1]}: {c['problem']}" for c in self.incomplete]

    @property
    def attempts_summary(self) -> str:
        """E.g. "3: 1 finished, 1 stopped, 1 failed (last failure: RuntimeError: ...)"."""
        if not self.attempts:
            return "-"
        counts: dict[str, int] = {}
        for a in self.attempts:
            counts[a["status"]] = counts.get(a["status"], 0) + 1
        text = f"{len(self.attempts)}: " + ", ".join(f"{n} {status}" for status, n in counts.items())
        restarts = sum(len(a.get("worker_group_failures") or ()) for a in self.attempts)
        if restarts:  # Ray Train started a new worker group after each, within an attempt
            text += f", {restarts} worker group failure{'s' if restarts != 1 else ''}"
        failures = [a for a in self.attempts if a["status"] in ("failed", "lost")]
        if failures:
            text += f" (last failure: {failure_cause(failures[-1].get('error'))})"
        return text

    def as_dict(self) -> dict[str, Any]:
        """For `vitray runs --format json`: every field, and each attempt's one-line `cause` beside
        its recorded `error` (which may hold a whole traceback)."""
        fields = asdict(self)
        fields["attempts"] = [
            {**a, "cause": failure_cause(a.get("error")) if a.get("error") else None} for a in self.attempts
        ]
        return fields


def failure_cause(error: str | None) -> str:
    """An attempt's recorded error on one line: the root exception of a traceback (the whole text
    stays in the attempt record), or the text itself when it is a sentence of vitray's own."""
    if not error:
        return "no record"
    failure = describe_failure(error)
    if failure.kind != "Error":
        return failure.one_line(limit=300)
    return failure.message if len(failure.message) <= 300 else failure.message[:297] + "..."


def list_runs(storage_root: str) -> list[RunSummary]:
    """Every vitray run directly under `storage_root`, in name order."""
    runs = []
    for name in storage.list_names(storage_root):
        summary = run_summary(storage.join(storage_root, name))
        if summary is not None:
            runs.append(summary)
    return runs


def run_summary(run_dir: str) -> RunSummary | None:
    """What `vitray runs` says of the run in `run_dir`; None when it is not a vitray run."""
    checkpoints = find_checkpoints(run_dir)  # each checked once: its state or why it does not count
    files = RunFiles(run_dir)
    if not checkpoints and not storage.holds_files(files.root):  # not a run, or a deleted one's prefix
        return None
    complete = [c for c in checkpoints if c.complete]
    metrics = files.read_metrics()
    latest_step = metrics[-1].get("step") if metrics else None
    target = _target_steps(complete[-1].state) if complete else None
    if complete and target is not None and complete[-1].step >= target:
        status = "finished"
    elif complete:
        status = f"resumable from step {complete[-1].step}" + (f" of {target}" if target is not None else "")
    else:
        status = "no complete checkpoint yet"
    incomplete = [
        {"path": c.path, "problem": c.problem} for c in sorted(checkpoints, key=lambda c: c.path) if not c.complete
    ]
    if incomplete:
        status += f" ({len(incomplete)} incomplete checkpoint(s) ignored)"
    skipped_samples, skipped_shards = skipped_data(metrics)
    if skipped_samples:
        status += f"; {skipped_data_line(skipped_samples, skipped_shards)}"
    lease = read_lease(files.lease_path)
    attempts = _attempts(files, lease)
    if not (complete or incomplete or metrics or attempts or (lease is not None and lease.fresh())):
        return None  # a start refused before its first attempt (its lease's lock file alone): no run
    if lease is not None and lease.fresh():
        status = f"running ({lease.describe()}, heartbeat {lease.age():.0f} s ago); " + status
    elif attempts and attempts[-1]["status"] in ("failed", "lost", "stopped") and not status.startswith("finished"):
        # How its last attempt ended, first: "resumable from step 20" alone read like a run going on.
        status = f"{attempts[-1]['status']}; " + status.replace("no complete checkpoint yet", "no complete checkpoint")
    name = run_dir.rstrip("/").rsplit("/", 1)[-1]
    return RunSummary(
        name,
        latest_step,
        len(complete),
        complete[-1].path if complete else None,
        status,
        attempts,
        incomplete,
        skipped_samples,
        skipped_shards,
    )


def skipped_data(metrics: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """How many samples a run skipped as corrupt, and the shards they came from, from its metrics."""
    count = sum(int(m.get("skipped_samples", 0)) for m in metrics)
    shards = sorted({shard for m in metrics for shard in m.get("skipped_shards", ())})
    return count, shards


def skipped_data_line(count: int, shards: list[str], shown: int = 5) -> str:
    """E.g. "12 corrupt samples skipped, from train-000003.tar, train-000007.tar" (`shards`: their URLs,
    all in the run's data.train: named by file)."""
    named = ", ".join(shard.rstrip("/").rsplit("/", 1)[-1] for shard in shards[:shown]) + (
        f" and {len(shards) - shown} more" if len(shards) > shown else ""
    )
    return f"{count} corrupt sample{'s' if count != 1 else ''} skipped" + (f", from {named}" if named else "")


def _target_steps(state: dict[str, Any] | None) -> int | None:
    """The train.steps a checkpoint's run was configured for, from the state its check read."""
    try:
        return int((state or {})["config"]["train"]["steps"])
    except (KeyError, TypeError, ValueError):
        return None


def _attempts(files: RunFiles, lease) -> list[dict]:
    """The run's attempts; one still marked running that no longer holds the lease, or whose
    lease heartbeat stopped, was killed without a chance to say so: "lost"."""
    attempts = files.read_attempts()
    for a in attempts:
        if a["status"] != "running":
            continue
        if lease is None or lease.owner != a["id"] or not lease.fresh():
            a["status"] = "lost"
            a["error"] = (
                f"killed or lost without a record (started {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(a['started']))} UTC)"
            )
    return attempts
