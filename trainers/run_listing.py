"""`vitray runs`: what is under a storage folder, read from the files alone (no Ray needed)."""

from __future__ import annotations

from dataclasses import dataclass

from vitray.data import storage
from vitray.trainers.checkpoint import find_checkpoints, read_state
from vitray.trainers.run_files import RunFiles


@dataclass
class RunSummary:
    name: str
    latest_step: int | None
    num_checkpoints: int
    latest_checkpoint: str | None
    status: str


def list_runs(storage_root: str) -> list[RunSummary]:
    runs = []
    for name in storage.list_names(storage_root):
        run_dir = storage.join(storage_root, name)
        checkpoints = find_checkpoints(run_dir)
        files = RunFiles(run_dir)
        if not checkpoints and not storage.exists(files.root):
            continue  # not a vitray run
        complete = [c for c in checkpoints if c.complete]
        metrics = files.read_metrics()
        latest_step = metrics[-1].get("step") if metrics else None
        target = _target_steps(complete[-1].path) if complete else None
        if complete and target is not None and complete[-1].step >= target:
            status = "finished"
        elif complete:
            status = f"resumable from step {complete[-1].step}"
        else:
            status = "no complete checkpoint yet"
        if len(complete) < len(checkpoints):
            status += f" ({len(checkpoints) - len(complete)} incomplete checkpoint(s) ignored)"
        runs.append(
            RunSummary(name, latest_step, len(complete), complete[-1].path if complete else None, status)
        )
    return runs


def _target_steps(checkpoint_path: str) -> int | None:
    fs, path = storage.filesystem(checkpoint_path)
    try:
        return int(read_state(path, fs)["config"]["train"]["steps"])
    except (KeyError, FileNotFoundError, ValueError):
        return None
