"""The attempt records a `vitray pretrain` driver keeps in the run folder (what `vitray runs`
lists): each attempt -- one worker group, from its start to its end -- recorded when it starts
(from which checkpoint, skipping which) and when it ends, finished, stopped or failed, with the run
folder's latest complete step then."""

from __future__ import annotations

import traceback
from collections.abc import Iterable

from vitray.runfolder.checkpoint_folders import CheckpointInfo, latest_complete_checkpoint
from vitray.runfolder.files import RunFiles


class RunAttempts:
    """Used as a context manager around the driver's work: an attempt still open when an error
    leaves it ends failed (its traceback text recorded), or stopped after a second Ctrl-C."""

    def __init__(self, folder: str, owner: str):
        self.folder, self.owner = folder, owner
        self.files = RunFiles(folder)
        self._open: dict | None = None

    def start(self, resume: CheckpointInfo | None, skipped: Iterable[CheckpointInfo] = ()) -> None:
        self._open = self.files.new_attempt(
            self.owner,
            resumed_from_step=resume.step if resume else None,
            resumed_from=resume.path if resume else None,
            skipped=[f"{c.path}: {c.problem}" for c in skipped],
        )

    def end(self, status: str, reason: str | None = None) -> None:
        """`status`: finished, stopped or failed."""
        if self._open is not None:
            self.files.end_attempt(self._open, status, reason, **self._last_step())
            self._open = None

    def __enter__(self) -> RunAttempts:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if error is None:
            return
        if isinstance(error, KeyboardInterrupt):  # a second Ctrl-C: stopped at once, without a new checkpoint
            self.end("stopped", "stopped by user (a second Ctrl-C: no new checkpoint)")
        else:
            # The whole traceback text for the record (and `vitray runs --verbose`); consoles show its last line.
            self.end("failed", "".join(traceback.format_exception_only(error)).strip()[-4000:])

    def _last_step(self) -> dict:
        try:
            latest = latest_complete_checkpoint(self.folder)
        except Exception:
            return {}
        return {"checkpoint_step": latest.step if latest else None}
