"""SIGTERM and Ctrl-C on the driver of a `vitray pretrain` run: a stop notice for the workers
(`vitray.trainers.preemption`), which checkpoint at their next agreed step and stop; the driver
then exits 75 (or 130 after Ctrl-C; `vitray.common.exit_codes`). Before the workers start there
is nothing to checkpoint: the driver stops at once, its attempt recorded as stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from vitray.runfolder.files import RunFiles


class StoppedBeforeTraining(BaseException):
    """SIGTERM or Ctrl-C before the workers started (`by_user`: Ctrl-C): nothing to checkpoint. A
    BaseException, as KeyboardInterrupt is: what catches errors on the way must not take a stop for
    one."""

    def __init__(self, reason: str, *, by_user: bool):
        super().__init__(reason)
        self.by_user = by_user


class StopOnSignal:
    """From just before the run's lease is taken, SIGTERM (a pre-emption) and Ctrl-C (SIGINT) stop the
    run. Before the workers start there is nothing to checkpoint: the signal is noted and the driver
    stops at its next `check` (never by an exception raised from the handler, wherever the main
    thread is: a lock it held then would stay held). Once `workers_started`, a signal writes a stop
    notice for the workers, which checkpoint at their next check step and stop. If they have not
    stopped when the grace period is over, `before_exit` runs (the attempt's record, the lease;
    bounded) and the driver exits (143 after SIGTERM, 130 after Ctrl-C) without a new checkpoint; a
    second Ctrl-C stops at once (KeyboardInterrupt)."""

    # How long the records written on the way out may take once the grace period is over.
    BEFORE_EXIT_S = 10.0

    def __init__(self, folder: str, grace_s: float, *, before_exit: Callable[[str], None] | None = None):
        self.folder, self.grace_s, self.before_exit = folder, grace_s, before_exit
        self.reason: str | None = None
        self.by_user = False
        self._workers_started = False
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StopOnSignal:
        self._previous: dict[int, Any] = {}
        self.take_signals()
        return self

    def take_signals(self) -> None:
        """Handles SIGTERM and SIGINT; again after Ray started in this process, whose C++ core
        installs a SIGTERM handler of its own (it prints a stack and aborts the driver). Only a main
        thread may take signals (`vitray evaluate` runs fine-tunes from a thread pool)."""
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous = signal.signal(signum, self._on_signal)
                self._previous.setdefault(signum, previous)

    def check(self) -> None:
        """Raises StoppedBeforeTraining if a signal came before the workers started."""
        if self.reason is not None and not self._workers_started:
            raise StoppedBeforeTraining(f"{self.reason} before the workers started", by_user=self.by_user)

    @staticmethod
    def early_stop(error: BaseException) -> StoppedBeforeTraining | None:
        """The stop that an error raised while the run starts is, if any: ours, or the exit of a
        SIGTERM handler Ray set after all (SystemExit(15))."""
        if isinstance(error, StoppedBeforeTraining):
            return error
        if isinstance(error, SystemExit) and error.code == signal.SIGTERM:
            return StoppedBeforeTraining(
                f"SIGTERM to the driver (pid {os.getpid()}) before the workers started", by_user=False
            )
        return None

    def workers_started(self) -> None:
        """From now on a signal is a stop notice for the workers; a stop that came while the run
        started raises StoppedBeforeTraining here."""
        self.check()
        self._workers_started = True

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
        if not self._workers_started:
            print(f"vitray: {self.reason}: stopping before the workers start{again}", file=sys.stderr, flush=True)
            return
        print(
            f"vitray: {self.reason}: the workers checkpoint at their next check step and stop "
            f"(grace {self.grace_s:g} s, run.preemption_grace_s){again}",
            file=sys.stderr,
            flush=True,
        )
        # Storage writes do not belong in a signal handler's frame (it may interrupt one).
        threading.Thread(
            target=RunFiles(self.folder).request_stop, args=(self.reason, self.grace_s), daemon=True
        ).start()
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
        if self.before_exit is not None:
            why = f"{self.reason}; the grace period ({self.grace_s:g} s) ended before the workers stopped"
            records = threading.Thread(target=self.before_exit, args=(why,), daemon=True)
            records.start()
            records.join(self.BEFORE_EXIT_S)  # a store that does not answer does not keep the driver
        os._exit(code)


@contextlib.contextmanager
def ray_init_keeps_sigterm() -> Iterator[None]:
    """Keeps the process's SIGTERM handler while Ray starts: ray.init sets one that raises
    SystemExit(15) wherever the main thread is (a lock taken and not yet released stays taken: the
    logging module's, seen deadlocking a run; Ray's agents started so far are left running).
    Private on purpose: Ray has no option to keep a process's own handler; without the function (a
    Ray that renamed it), Ray's handler is set and its exit is taken for a stop
    (`StopOnSignal.early_stop`)."""
    import ray._private.utils as ray_utils

    original = getattr(ray_utils, "set_sigterm_handler", None)
    if original is None:
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original
