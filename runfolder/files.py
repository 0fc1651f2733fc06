"""The one place that knows what vitray keeps in a run folder besides Ray Train's checkpoints.

  <storage>/<run name>/                       Ray Train's run folder (checkpoint_* + its snapshot)
  <storage>/<run name>/vitray/metrics.jsonl    one JSON object per logged step
  <storage>/<run name>/vitray/tensorboard/     TensorBoard events
  <storage>/<run name>/vitray/markers/         one-shot markers (fault-injection in tests)
  <storage>/<run name>/vitray/lease.json       the driver that holds the run (`vitray.runfolder.lease`)
  <storage>/<run name>/vitray/attempts/        one JSON record per `vitray pretrain` of the run
  <storage>/<run name>/vitray/stop.json        a pre-emption notice for the workers (read by `vitray.trainers.preemption`)
  <storage>/<run name>/vitray/pins/            readers' holds on checkpoints they read (`vitray.runfolder.pins`)

The checkpoint_* folders are found and opened by :mod:`vitray.runfolder.checkpoint_folders`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from vitray import storage

VITRAY_DIR = "vitray"
METRICS_FILE = "metrics.jsonl"  # written by rank 0 (`vitray.trainers.metrics`)


def run_dir(storage_root: str, name: str) -> str:
    """The folder of the run `name` under `storage_root` (run.storage): absolute where it is local."""
    return storage.join(storage.absolute(storage_root), name)


class RunFiles:
    def __init__(self, run_dir: str):
        self.run_dir = str(run_dir).rstrip("/")
        self.root = storage.join(self.run_dir, VITRAY_DIR)

    @property
    def metrics_path(self) -> str:
        return storage.join(self.root, METRICS_FILE)

    def put_metrics_file(self, relative_name: str, data: bytes) -> None:
        """Publish one file of the metrics folder (`metrics.jsonl`, `tensorboard/...`) whole: a
        reader sees the previous content or this one, never a part (see `metrics_upload`)."""
        storage.write_bytes_atomic(storage.join(self.root, *relative_name.split("/")), data)

    @property
    def lease_path(self) -> str:
        return storage.join(self.root, "lease.json")

    @property
    def stop_path(self) -> str:
        return storage.join(self.root, "stop.json")

    # -- the stop notice: the driver's (or a drained node's) request to checkpoint and stop -------
    def request_stop(self, reason: str, grace_s: float, kind: str = "sigterm") -> None:
        """Ask the run's workers to checkpoint and stop before `grace_s` is over (the driver, on
        SIGTERM; rank 0, on a drain notice: `kind` says which). The workers read it at their check
        steps (`vitray.trainers.preemption.PreemptionWatch`)."""
        now = time.time()
        record = {"reason": reason, "kind": kind, "requested": now, "deadline": now + grace_s}
        storage.write_bytes_atomic(self.stop_path, json.dumps(record).encode())

    def read_stop(self) -> dict[str, Any] | None:
        """The run's stop notice (reason, kind, requested, deadline), or None when there is none."""
        try:
            return json.loads(storage.read_bytes(self.stop_path)) if storage.exists(self.stop_path) else None
        except (OSError, ValueError):
            return None

    def clear_stop(self) -> None:
        """Driver side, before a run starts: an old notice must not stop the new attempt."""
        if storage.exists(self.stop_path):
            storage.remove(self.stop_path)

    # -- attempts: what each `vitray pretrain` of this run did ----------------------------------
    def write_attempt(self, record: dict[str, Any]) -> None:
        """Create or update this attempt's record (`record["id"]`, `record["started"]` name it)."""
        name = f"{int(record['started'] * 1000):015d}-{record['id']}.json"
        storage.write_bytes_atomic(storage.join(self.root, "attempts", name), json.dumps(record, indent=1).encode())

    def read_attempts(self) -> list[dict[str, Any]]:
        """Every attempt's record, oldest first."""
        folder = storage.join(self.root, "attempts")
        if not storage.exists(folder):
            return []
        records = []
        for name in sorted(storage.list_names(folder)):
            if name.endswith(".json"):
                try:
                    records.append(json.loads(storage.read_bytes(storage.join(folder, name))))
                except (ValueError, FileNotFoundError):
                    continue
        return records

    def new_attempt(self, attempt_id: str, **fields: Any) -> dict[str, Any]:
        import os
        import socket

        record = {
            "id": attempt_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "status": "running",
            **fields,
        }
        self.write_attempt(record)
        return record

    def end_attempt(self, record: dict[str, Any], status: str, error: str | None = None, **fields: Any) -> None:
        record.update(status=status, ended=time.time(), error=error, **fields)
        self.write_attempt(record)

    def read_metrics(self) -> list[dict[str, Any]]:
        if not storage.exists(self.metrics_path):
            return []
        text = storage.read_bytes(self.metrics_path).decode()
        records = []
        for line in text.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written right now
                break
        return records

    def seed_local_metrics(self, local_dir: Path, resumed_step: int) -> None:
        """Start a resumed attempt's metrics from what was logged up to its checkpoint."""
        kept = [r for r in self.read_metrics() if r.get("step", 0) <= resumed_step]
        (Path(local_dir) / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in kept))

    def claim_once(self, name: str) -> bool:
        """True the first time `name` is claimed in this run (markers live on storage)."""
        marker = storage.join(self.root, "markers", name)
        if storage.exists(marker):
            return False
        storage.write_bytes_atomic(marker, b"")
        return True
