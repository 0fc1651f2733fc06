"""What the training loop needs from whoever runs it (Ray Train in `cluster/`, or a test).

Keeping this a plain interface is what keeps `trainers/` free of Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class Reporter(Protocol):
    def __call__(self, metrics: dict[str, Any], checkpoint_dir: str) -> None:
        """Hand a complete checkpoint folder, already in the run folder (a local path or a URL), with
        its step's metrics, to the run (every rank calls it, at the same step).

        Only checkpoints are reported: every log step's metrics are in the run's metrics file and
        trackers already. Under Ray Train every report is a barrier across the ranks that Ray holds
        until its controller collects it (every 2 s); reporting each log step stalled the step, and
        the loader behind it, whenever log steps came faster (BENCHMARKS.md, the loader inside a
        run). Made on a thread of their own instead, the ranks' reports could pair one rank's
        checkpoint with another's metrics in that barrier."""


@dataclass
class WorkerContext:
    rank: int
    world_size: int
    run_dir: str  # <storage>/<run name>, local path or s3:// URL
    report: Reporter
    # The checkpoint the driver announced (chosen complete by `resume_point`; local path or s3://)
    # and its step (None: unknown); None: from scratch. `trainers/checkpoint/restore.py` turns it
    # into what this rank resumes from.
    resume_from: str | None = None
    resume_step: int | None = None
    restarted: bool = False  # Ray Train restarted the worker group inside the run (a lost worker)
    # Where the collectives before the engine is built run (Ray's device for this worker; NCCL
    # needs the GPU, gloo takes the CPU).
    device: Any = "cpu"
    # Asked on rank 0 at each pre-emption check: whether the cluster is about to take a worker's
    # node away (Ray's drain notice), as (reason, deadline in epoch seconds), else None.
    drain_notice: Callable[[], tuple[str, float] | None] | None = None
