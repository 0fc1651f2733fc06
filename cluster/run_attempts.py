"""The attempt records a `vitray pretrain` driver keeps in the run folder (what `vitray runs`
lists): each attempt -- one worker group, from its start to its end -- recorded when it starts
(from which checkpoint, skipping which) and when it ends, finished, stopped or failed, with the run
folder's latest complete step then."""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Iterable

from vitray.common.failures import describe_failure
from vitray.runfolder.checkpoint_folders import CheckpointInfo, latest_complete_checkpoint
from vitray.runfolder.files import RunFiles

_STOPPED_BY_USER = threading.Event()


def stopping_by_user() -> None:
    """This process stops on a Ctrl-C while runs go on in its threads (`vitray evaluate`'s fine-tune
    runs): an attempt that ends with an error from now on ends stopped by the user, not failed."""
    _STOPPED_BY_USER.set()


def stopped_while_waiting(seconds: float) -> bool:
    """Waits `seconds` in a thread of a grid; True at once when the user stops the process meanwhile."""
    return _STOPPED_BY_USER.wait(seconds)


class RunAttempts:
    """Used as a context manager around the driver's work: an attempt still open when an error
    leaves it ends failed (its traceback text recorded), or stopped after a second Ctrl-C."""

    def __init__(self, folder: str, owner: str):
        self.folder, self.owner = folder, owner
        self.files = RunFiles(folder)
        self._open: dict | None = None
        self.worker_group_failures: list[str] = []  # each failure's causes, one line; Ray Train restarted after each

    def worker_group_failed(self, count: int, causes: list[str], max_failures: int, final: bool = False) -> None:
        """Said on the console as it happens and kept for the attempt's record: Ray Train restarts a
        failed worker group from the latest checkpoint in silence (its own lines say only that a
        worker died). `final`: the failure policy ends the run (a restart would meet it again)."""
        self.worker_group_failures.append("; ".join(causes))
        if final:
            then = "no restart: a new worker group would meet it again"
        elif 0 <= max_failures < count:
            then = f"no restart left (cluster.max_failures={max_failures})"
        else:
            of = "" if max_failures < 0 else f" of {max_failures}"
            then = f"restart {count}{of}: Ray Train starts a new worker group from the latest complete checkpoint"
        print(f"vitray: the worker group failed ({'; '.join(causes)}); {then}", file=sys.stderr, flush=True)

    def start(self, resume: CheckpointInfo | None, skipped: Iterable[CheckpointInfo] = ()) -> None:
        self.worker_group_failures = []
        self._open = self.files.new_attempt(
            self.owner,
            resumed_from_step=resume.step if resume else None,
            resumed_from=resume.path if resume else None,
            skipped=[f"{c.path}: {c.problem}" for c in skipped],
        )

    def end(self, status: str, reason: str | None = None) -> None:
        """`status`: finished, stopped or failed. A record that cannot be written (the run folder's
        disk full, its store gone) is said on the console instead of raised: the run's own outcome
        -- its error, or its success -- is what the command reports; the record stays `running`."""
        if self._open is None:
            return
        record, self._open = self._open, None
        failures = {"worker_group_failures": self.worker_group_failures} if self.worker_group_failures else {}
        try:
            self.files.end_attempt(record, status, reason, **self._last_step(), **failures)
        except Exception as error:
            print(
                f"vitray: could not record the end of this attempt ({status}) in {self.folder}/vitray/attempts "
                f"({describe_failure(error).one_line()}): `vitray runs` lists it as lost once this driver is gone",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self) -> RunAttempts:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if error is None:
            return
        if isinstance(error, KeyboardInterrupt):  # a second Ctrl-C: stopped at once, without a new checkpoint
            self.end("stopped", "stopped by user (a second Ctrl-C: no new checkpoint)")
        elif _STOPPED_BY_USER.is_set():  # its workers went with the Ray the command shut down
            self.end("stopped", "stopped by user (Ctrl-C): the command that ran it stopped")
        else:
            # The whole traceback text for the record (and `vitray runs --verbose`); consoles show its last line.
            self.end("failed", "".join(traceback.format_exception_only(error)).strip()[-4000:])

    def _last_step(self) -> dict:
        try:
            latest = latest_complete_checkpoint(self.folder)
        except Exception:
            return {}
        return {"checkpoint_step": latest.step if latest else None}
