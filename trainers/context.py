"""What the training loop needs from whoever runs it (Ray Train in `cluster/`, or a test).

Keeping this a plain interface is what keeps `trainers/` free of Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class Reporter(Protocol):
    def __call__(self, metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        """Publish metrics and, when given, a local checkpoint folder (every rank calls it)."""


@dataclass
class WorkerContext:
    rank: int
    world_size: int
    run_dir: str  # <storage>/<run name>, local path or s3:// URL
    report: Reporter
    restore_dir: Path | None = None  # a local copy of the checkpoint to resume from
    # Its trainer state (the copy may hold only this rank's files); None: the loop reads it from
    # `restore_dir`. Either way the checkpoint was chosen complete by `resume_point`, not re-verified.
    restore_state: dict[str, Any] | None = None
    # Asked on rank 0 at each pre-emption check: whether the cluster is about to take a worker's
    # node away (Ray's drain notice), as (reason, deadline in epoch seconds), else None.
    drain_notice: Callable[[], tuple[str, float] | None] | None = None
