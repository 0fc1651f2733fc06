"""A failure as a person reads it: the root exception's type and message on one line, and whether
re-running the same command can help.

Ray Train reports a worker group's failure as one message that holds each failed rank's whole
traceback ("[Rank 0 Error Snippet]: Traceback ..."); the cause is the last line of it. The full
text belongs in the attempt record and the log; the console, result tables and `vitray runs`
show :func:`describe_failure`'s one line. Works on an exception or on its recorded text, so a
record written by an older vitray is shortened the same way.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

__all__ = ["Failure", "RestartCannotFix", "describe_failure", "restart_cannot_fix"]


class RestartCannotFix(Exception):
    """A worker's error that a new worker group would meet again: data missing from storage, a
    config value that only the worker finds wrong. Raised in the worker (its message: the cause's
    one line), it fails the run at once instead of spending `cluster.max_failures` restarts on it
    (`cluster/torch_trainer.py`); the console shows the cause's line."""


# The line a traceback ends with, right after its last frame: "module.TypeName: message" (or the
# bare type name); any exception class name, vitray's own (CheckpointDiskFull) included.
_RAISED_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?(?P<type>[A-Za-z_]\w*)(?::\s?(?P<message>.*))?$")
# Without frames to go by: a line shaped like an exception's ("ValueError: ...").
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w.]*\.)?(?P<type>[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Warning))(?::\s?(?P<message>.*))?$"
)

# Failures that a re-run of the same command can get past: a lost worker or node, a pre-emption,
# storage or network trouble. Anything else (a bad config, a bad input, a bug) fails again the
# same way until its cause is fixed.
_TRANSIENT = {
    "ActorDiedError",
    "ActorUnavailableError",
    "RayActorError",
    "NodeDiedError",
    "WorkerCrashedError",
    "WorkerHealthCheckFailedError",
    "WorkerHealthCheckTimeoutError",
    "PreemptionError",
    "ObjectLostError",
    "OwnerDiedError",
    "ConnectionError",
    "ConnectionResetError",
    "ConnectionRefusedError",
    "TimeoutError",
    "BrokenPipeError",
    "EndpointConnectionError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ServerDisconnectedError",
    "ClientOSError",
    "DistBackendError",
    "DistNetworkError",
    "GetTimeoutError",
    # A checkpoint found damaged as a resume read it: marked so (`runfolder.checkpoint_folders.mark_corrupt`),
    # the next attempt resumes from the one before it.
    "IncompleteCheckpointError",
}


# Failures that the same work meets again however often it is tried: a bad input, a refused
# config, a bug. (Not the storage errors' OSErrors: a flaky read is worth another try.)
_REPEATS = {
    "ValueError",
    "PreflightError",
    "CheckpointNotHere",  # (a PreflightError: an init.checkpoint that is not there)
    "FinishedWithOtherSettings",
    "ConfigError",
    "ValidationError",
    "TypeError",
    "KeyError",
    "IndexError",
    "AttributeError",
    "NotImplementedError",
    "ZeroDivisionError",
    "AssertionError",
    "FileNotFoundError",
    "RestartCannotFix",
    "CheckpointDiskFull",  # (the run folder's disk is full: it stays full until someone frees it)
}


@dataclass(frozen=True)
class Failure:
    kind: str  # the root exception's type name ("FileNotFoundError")
    message: str  # its message, on one line
    transient: bool  # a re-run of the same command may get past it

    @property
    def repeats(self) -> bool:
        """Whether trying the same work again would meet it again (a grid does not retry it)."""
        return self.kind in _REPEATS

    def one_line(self, limit: int | None = None) -> str:
        """`kind: message`; cut to `limit` characters (tables) or whole (the console)."""
        text = f"{self.kind}: {self.message}" if self.message else self.kind
        return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."

    def advice(self) -> str:
        resumes = "it resumes from the run's latest complete checkpoint, or starts over where it has none"
        if self.kind in _DIED_WITHOUT_A_WORD:
            return (
                f"re-run the same command: {resumes}. A worker that dies again at the same point is most likely out "
                "of memory: lower train.micro_batch_size (accumulation keeps train.batch_size), or give it more memory"
            )
        if self.transient:
            return f"re-run the same command: {resumes}"
        return f"fix the cause, then re-run the same command: {resumes}"


# Ray's word for a worker process that ended without an exception of its own: killed (the kernel's
# or a cgroup's OOM killer, most often; a SIGKILL from outside), its account ~1,500 characters long.
_DIED_WITHOUT_A_WORD = {"WorkerHealthCheckFailedError", "ActorDiedError", "RayActorError", "WorkerCrashedError"}
_RAYS_ACCOUNT_CHARS = 160


def describe_failure(error: BaseException | str) -> Failure:
    """The root cause of `error` (an exception, possibly Ray Train's TrainingFailedError wrapping
    the workers' tracebacks, or the text of one); a worker killed without an exception of its own
    is said so, Ray's long account of it cut."""
    failure = _described(error)
    if failure.kind in _DIED_WITHOUT_A_WORD and len(failure.message) > _RAYS_ACCOUNT_CHARS:
        failure = Failure(
            failure.kind,
            "a worker process was killed without an error of its own (out of memory, or stopped from outside); "
            f"Ray's account: {failure.message[:_RAYS_ACCOUNT_CHARS]}...",
            failure.transient,
        )
    return failure


def _described(error: BaseException | str) -> Failure:
    if isinstance(error, BaseException):
        ranks = list(dict(getattr(error, "worker_failures", None) or {}).values())
        # A rank that met what a restart cannot fix says more than the others' collateral errors.
        for rank_error in sorted(ranks, key=lambda e: not restart_cannot_fix(e)):
            # The worker's exception, or Ray Train's wrapper holding its traceback text (which ends with the cause).
            return describe_failure(rank_error if isinstance(rank_error, BaseException) else str(rank_error))
        cause = getattr(error, "controller_failure", None)
        if isinstance(cause, BaseException):
            return describe_failure(cause)
        while error.__cause__ is not None:
            error = error.__cause__
        found = _last_exception_line(str(error))
        if found is not None and (found.kind != type(error).__name__ or "\n  File " in str(error)):
            return found  # an exception whose message carries a traceback (Ray's RayTaskError, torch's DataLoader's)
        return _unwrapped(Failure(type(error).__name__, _one_line(str(error)), type(error).__name__ in _TRANSIENT))
    found = _last_exception_line(error)
    return found if found is not None else Failure("Error", _one_line(error), False)


# What the machine refused, rather than anything the command got wrong: said as such, the folder
# named (the catch-all's line was "OSError: [Errno 28] No space left on device" and a traceback file).
# A full disk (or quota): it stays full until someone frees space (the storage retries, the lease's
# heartbeat and the line below all tell it by these).
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_NOT_ALLOWED_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}


def environment_problem(error: BaseException) -> str | None:
    """One line for a full disk, a read-only file system or a permission refused, found in `error`
    or what it was raised from: the place it names (its folder's free space for a full disk) and
    what to do; None for anything else."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS | _NOT_ALLOWED_ERRNOS:
            return _said_of(error)
        error = error.__cause__ or error.__context__
    return None


def _said_of(error: OSError) -> str:
    import shutil

    path = error.filename if isinstance(error.filename, str) else None
    if error.errno in NO_SPACE_ERRNOS:
        if path is None:
            return (
                f"no space left on a disk it writes to ({error.strerror}): free space where its output, run folder "
                "or temporary folder (TMPDIR) lies, then re-run the same command (it goes on where it can)"
            )
        folder = os.path.dirname(path) or "."
        try:
            free = f", {shutil.disk_usage(folder).free / 2**20:,.0f} MiB free"
        except OSError:
            free = ""
        return (
            f"no space left on the disk of {folder} ({error.strerror}{free}): free space there, or give another "
            "place, then re-run the same command (it goes on where it can)"
        )
    where = path or "a path it uses"
    if error.errno == errno.EROFS:
        return f"{where} is on a read-only file system: give a place it may write"
    return (
        f"{where}: permission denied ({error.strerror}): give a place your user may read and write, or "
        "change its permissions"
    )


def restart_cannot_fix(error: BaseException | str) -> bool:
    """Whether `error` -- an exception, its cause chain, Ray Train's error for a worker group (any
    rank's), or a traceback's text -- is a RestartCannotFix raised in a worker."""
    if isinstance(error, BaseException):
        failures = dict(getattr(error, "worker_failures", None) or {})
        if failures:
            return any(restart_cannot_fix(rank_error) for rank_error in failures.values())
        seen: BaseException | None = error
        while seen is not None:
            if isinstance(seen, RestartCannotFix):
                return True
            seen = seen.__cause__
        error = str(error)  # Ray's wrapper of a worker's exception: its traceback text
    found = _last_exception_line(error)
    return found is not None and found.kind == RestartCannotFix.__name__


def _last_exception_line(text: str) -> Failure | None:
    """The exception a traceback text ends with: the first unindented line after its last frame
    (``  File "...", line N``) and what follows it (a message may run over several lines). Texts
    without frames (a record like "SystemExit: 1") are matched by the exception line's shape."""
    lines = text.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if frames:
        for index in range(frames[-1] + 1, len(lines)):
            if lines[index].strip() and not lines[index].startswith(" "):
                found = _exception_at(lines, index, _RAISED_LINE)
                if found is not None:
                    return found
                # Not an exception's line: Ray's "... (Output truncated ...) ..." and the fragment of a
                # line it cut (`ointDiskFull(`), before the raised line
                continue
    for index in range(len(lines) - 1, -1, -1):
        found = _exception_at(lines, index, _EXCEPTION_LINE)
        if found is not None:
            return found
    return None


def _exception_at(lines: list[str], index: int, pattern: re.Pattern) -> Failure | None:
    match = pattern.match(lines[index].strip())
    if not match or lines[index].startswith("Traceback"):
        return None
    # A message that runs over several lines: what follows belongs to it (up to another rank's report).
    rest = [line for line in lines[index + 1 :] if not line.startswith("[Rank ")]
    message = " ".join([match.group("message") or "", *rest]).strip()
    kind = match.group("type")
    return _unwrapped(Failure(kind, _one_line(message), kind in _TRANSIENT))


def _unwrapped(failure: Failure) -> Failure:
    """A RestartCannotFix's message is its cause's own line ("ShardMissing: shard ... is missing"):
    that is the failure to show (and no re-run gets past it)."""
    if failure.kind != RestartCannotFix.__name__:
        return failure
    inner = _RAISED_LINE.match(failure.message)
    if not inner:
        return Failure(failure.kind, failure.message, False)
    return Failure(inner.group("type"), _one_line(inner.group("message") or ""), False)


def _one_line(text: str) -> str:
    return " ".join(text.split())
