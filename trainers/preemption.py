"""Pre-emption notices: checkpoint at the next agreed step, then stop cleanly.

How a notice reaches the workers: the driver (`vitray pretrain`, the process Kubernetes or a spot
instance sends SIGTERM to) writes `<run>/vitray/stop.json` with the reason and a deadline (now +
`run.preemption_grace_s`). The workers cannot each act on their own reading of that file: ranks
that saw it at different steps would disagree on whether to checkpoint and hang in the
checkpoint's collectives. So rank 0 reads it only every `checkpoint.preemption_check_every` steps
and broadcasts its decision (one 8-byte broadcast): a host sync every N steps rather than every
step, costing at most N steps of the grace period. At that step every rank writes a checkpoint
(unless one was just written, or the deadline has passed), waits until it is handed to the run,
and the loop ends; the driver then exits 75 (pre-empted: schedulers retry) and a re-run resumes from
that checkpoint.

A cluster that is about to take a node away says so before it does: Ray's drain of a node (what
KubeRay and Ray's autoscaler send for a spot reclaim or a scale-down, with a deadline). Rank 0
asks for such a notice at the same check steps (`WorkerContext.drain_notice`, made in
`cluster/drain.py`); one that concerns a worker's node is written to the same stop file (kind
"drain"), so that the workers stop the same way and the driver knows to start a new worker group
away from that node.

A SIGTERM sent to a worker process itself is not seen here: Ray's worker turns it into an
immediate exit, which Ray Train handles as a worker failure (restart from the latest complete
checkpoint under `cluster.max_failures`, or the run fails and a re-run resumes).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from vitray import storage
from vitray.runfolder.files import RunFiles
from vitray.trainers.collectives import broadcast_int

_NONE, _SAVE_AND_STOP, _STOP = 0, 1, 2


@dataclass
class StopDecision:
    step: int
    save: bool  # False: the grace period was already over when the workers saw the notice


class PreemptionWatch:
    """Worker side: `check(step)` on every rank at every step returns a StopDecision, the same on
    every rank, at the first check step after a notice, else None."""

    def __init__(
        self,
        run_dir: str,
        *,
        rank: int,
        every: int,
        device,
        drain_notice=None,
        outage_s: float = storage.retries.OUTAGE_S,
    ):
        """`outage_s` (run.storage_outage_s): how long rank 0's read of the stop file waits for
        storage that does not answer (the step waits with it) before the worker fails."""
        self.run_dir, self.path = run_dir, RunFiles(run_dir).stop_path
        self.rank, self.every, self.device = rank, every, device
        self.drain_notice = drain_notice  # WorkerContext.drain_notice: asked on rank 0 only
        self.outage_s = outage_s

    def check(self, step: int) -> StopDecision | None:
        if step % self.every:
            return None
        decision = _NONE
        if self.rank == 0:
            decision = self._read()
        decision = broadcast_int(decision, device=self.device)
        if decision == _NONE:
            return None
        return StopDecision(step, save=decision == _SAVE_AND_STOP)

    def _read(self) -> int:
        # A store that does not answer is waited for (storage.ride_out): failing here would cost a
        # worker-group restart, and the other ranks only wait in the broadcast meanwhile.
        try:
            data = storage.ride_out(self._read_file, what=f"checking {self.path}", within_s=self.outage_s)
            notice = json.loads(data) if data is not None else None
        except (FileNotFoundError, ValueError):  # deleted meanwhile, or not a notice: the next check reads again
            notice = None
        if notice is None and self.drain_notice is not None:
            drain = self.drain_notice()
            if drain is not None:
                reason, deadline = drain
                print(f"vitray: {reason}: checkpointing and stopping", flush=True)
                RunFiles(self.run_dir).request_stop(reason, deadline - time.time(), kind="drain")
                notice = {"deadline": deadline}
        if notice is None:
            return _NONE
        return _SAVE_AND_STOP if time.time() < float(notice.get("deadline", 0)) else _STOP

    def _read_file(self) -> bytes | None:
        return storage.read_bytes(self.path) if storage.exists(self.path) else None

    @staticmethod
    def stop(decision: StopDecision, checkpointer, metrics: dict) -> None:
        """Write (unless just written or too late) and hand over the checkpoint at the stop step."""
        checkpointer.finish(wait=True)
        if decision.save and not checkpointer.due(decision.step):
            checkpointer.save(decision.step, metrics)
            checkpointer.finish(wait=True)
        where = "checkpoint written" if decision.save else "grace period over: no new checkpoint"
        print(f"vitray: pre-emption notice: stopping at step {decision.step} ({where})", flush=True)
