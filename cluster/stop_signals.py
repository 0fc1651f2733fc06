"""SIGTERM and Ctrl-C on the driver of a `vitray pretrain` run: a stop notice for the workers
(`vitray.trainers.preemption`), which checkpoint at their next agreed step and stop; the driver
then exits 75 (or 130 after Ctrl-C; `vitray.common.exit_codes`)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from vitray.trainers.preemption import request_stop


class StopOnSignal:
    """While training: SIGTERM (a pre-emption) or Ctrl-C (SIGINT) writes a stop notice for the
    workers, which checkpoint at their next check step and stop. If they have not stopped when the
    grace period is over, the driver exits (143 after SIGTERM, 130 after Ctrl-C) without a new
    checkpoint; a second Ctrl-C stops at once (KeyboardInterrupt)."""

    def __init__(self, folder: str, grace_s: float):
        self.folder, self.grace_s = folder, grace_s
        self.reason: str | None = None
        self.by_user = False
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StopOnSignal:
        # Only a main thread may take signals (`vitray evaluate` runs fine-tunes from a thread pool).
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._timer is not None:
            self._timer.cancel()

    def _on_signal(self, signum, frame) -> None:
        if self.reason is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # the second Ctrl-C: at once
            return
        self.by_user = signum == signal.SIGINT
        self.reason = "stopped by user (Ctrl-C)" if self.by_user else f"SIGTERM to the driver (pid {os.getpid()})"
        again = "; Ctrl-C again to stop at once, without one" if self.by_user else ""
        print(
            f"vitray: {self.reason}: the workers checkpoint at their next check step and stop "
            f"(grace {self.grace_s:g} s, run.preemption_grace_s){again}",
            file=sys.stderr,
            flush=True,
        )
        # Storage writes do not belong in a signal handler's frame (it may interrupt one).
        threading.Thread(target=request_stop, args=(self.folder, self.reason, self.grace_s), daemon=True).start()
        self._timer = threading.Timer(self.grace_s, self._out_of_time, args=(128 + signum,))
        self._timer.daemon = True
        self._timer.start()

    def _out_of_time(self, code: int) -> None:
        print(
            f"vitray: grace period of {self.grace_s:g} s over before the workers stopped: exiting without a new "
            "checkpoint (a re-run resumes from the latest complete one)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(code)
