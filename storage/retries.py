"""Which storage errors are worth retrying, and how: bounded attempts with jittered exponential
backoff. :func:`with_retries` wraps whole operations; the shard reader, which must reopen a stream
where it broke, runs the same test, delays and bound in a loop of its own.

:func:`ride_out` is for the storage calls a run makes while it trains (the stop-file check, the
lease heartbeat, the metrics upload, the checkpoint upload): an object store that does not answer
for a while (503 SlowDown, timeouts, an endpoint that refuses connections) is waited for, up to
``run.storage_outage_s``, instead of failing the worker -- which would cost a worker-group restart
or, with ``cluster.max_failures=0``, the run. The console says once when an outage starts and once
when it ends, however many calls of the process wait for it."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from vitray.common.failures import NO_SPACE_ERRNOS

log = logging.getLogger(__name__)

T = TypeVar("T")


@functools.cache
def _network_errors() -> tuple[type[BaseException], ...]:
    """The HTTP clients' own connection errors, which s3fs lets through untranslated once its own
    retries are spent, as the blocking botocore client of `s3_client` does once botocore's are:
    aiohttp's (a body cut short, a dropped connection) and botocore's."""
    errors: list[type[BaseException]] = []
    with contextlib.suppress(ImportError):
        import aiohttp

        errors.append(aiohttp.ClientError)
    with contextlib.suppress(ImportError):
        import botocore.exceptions

        # IncompleteReadError: a body shorter than its Content-Length (a connection cut mid-body)
        errors += [
            botocore.exceptions.HTTPClientError,
            botocore.exceptions.ConnectionError,
            botocore.exceptions.IncompleteReadError,
        ]
    return tuple(errors)


# OSErrors that the same call meets again: s3fs's translation of an S3 store's answer to a request
# that is wrong in itself (400: an invalid argument, a part smaller than the store's least, a
# malformed request; 501: what the store does not implement), and a read-only file system.
# (A full disk too: it stays full until someone frees space, and riding it out as a store's outage
# said "storage reachable again" of a disk still full.)
_PERMANENT_ERRNOS = {errno.EINVAL, errno.ENOSYS, errno.EROFS, errno.ENAMETOOLONG, *NO_SPACE_ERRNOS}


def is_transient(error: BaseException) -> bool:
    """Errors worth retrying: I/O, timeouts and dropped connections, but not a missing file, a
    permission problem or a request the store refuses as invalid."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if type(error) is OSError and error.errno in _PERMANENT_ERRNOS:
        return False
    return isinstance(error, (OSError, TimeoutError, ConnectionError, *_network_errors()))


# Transient failures are retried this many times in all, waiting about 0.5, 1, 2, 4 s in between.
RETRY_ATTEMPTS = 5
RETRY_BASE_DELAY_S = 0.5
RETRY_MAX_DELAY_S = 20.0


def backoff_delay(attempt: int) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based): jittered exponential backoff."""
    return min(RETRY_MAX_DELAY_S, RETRY_BASE_DELAY_S * 2 ** (attempt - 1)) * (0.5 + random.random())


def with_retries(fn: Callable[[], T], *, what: str, attempts: int | None = None) -> T:
    """Call ``fn`` until it succeeds, retrying transient errors (see :func:`is_transient`) with
    backoff, at most ``attempts`` times in all; other errors and the last failure propagate."""
    if getattr(_riding, "out", 0):
        return fn()  # inside ride_out, whose own tries and backoff take the place of these
    attempts = attempts or RETRY_ATTEMPTS
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as error:
            if not is_transient(error):
                raise
            if attempt == attempts:
                raise gave_up(error, what, attempts) from error
            delay = backoff_delay(attempt)
            log.warning("%s failed (%s); retry %d/%d in %.1fs", what, error, attempt, attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def gave_up(error: BaseException, what: str, attempts: int) -> OSError:
    """The error to raise when retries are spent: the last one's type where it is an OSError (an
    OSError otherwise), saying what failed, how often, and the last error."""
    message = f"{what} failed {attempts} times; the last error: {error}"
    if not isinstance(error, OSError):
        return OSError(message)
    try:
        return type(error)(error.errno, message) if getattr(error, "errno", None) else type(error)(message)
    except Exception:
        return OSError(message)


# run.storage_outage_s's default: how long a run waits for storage that does not answer.
OUTAGE_S = 300.0
# The longest wait between two tries while riding out an outage.
OUTAGE_MAX_DELAY_S = 10.0
OUTAGE_SETTING = "run.storage_outage_s"
_budget_s = OUTAGE_S  # this process's run.storage_outage_s (set_outage_budget)


def set_outage_budget(seconds: float) -> None:
    """How long the ride_out calls of this process that name no time of their own wait for an
    outage to end: a worker sets its run's ``run.storage_outage_s`` here once, for the calls made deep
    below the loop (the checkpoint uploads, on the writer's threads)."""
    global _budget_s
    _budget_s = seconds


class _Outage:
    """This process's view of an outage: its first failing call says that it started, the first
    call that succeeds after failing says that it ended (one line each on the console)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.since: float | None = None  # monotonic time of the first failure; None: no outage

    def failed(self, what: str, error: BaseException, within_s: float, tried_at: float) -> None:
        """`tried_at`: when the failed try began (a try against a cut store takes seconds to fail,
        botocore's own retries included): the outage is counted from there."""
        with self._lock:
            if self.since is not None:
                return
            self.since = tried_at
        reason = " ".join(str(error).split()) or type(error).__name__
        _say(f"vitray: storage unreachable ({what}: {reason}): retrying for up to {within_s:g} s ({OUTAGE_SETTING})")

    def recovered(self) -> None:
        with self._lock:
            since, self.since = self.since, None
        if since is not None:
            _say(f"vitray: storage reachable again after {time.monotonic() - since:.0f} s")

    def gave_up(self) -> None:
        with self._lock:
            self.since = None  # the next failure is a new outage, said again


_outage = _Outage()


def outage_since() -> float | None:
    """When the outage this process is riding out began (`time.monotonic()`), None without one."""
    return _outage.since


_riding = threading.local()  # `out`: how many ride_out calls this thread is inside


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def ride_out(
    fn: Callable[[], T], *, what: str, within_s: float | None = None, stop: threading.Event | None = None
) -> T:
    """Call ``fn`` until it succeeds, retrying transient errors (see :func:`is_transient`) with
    jittered backoff for up to ``within_s`` seconds (default: the process's, `set_outage_budget`)
    from the start of the first failed try (no try starts after that; one already started may take
    its few seconds past it); other errors, and the last failure once that time is spent, propagate
    (an OSError saying what failed for how long). Once ``stop`` is set (the caller no longer wants
    the result: an upload aborted), the wait ends and the last failure propagates as it is.

    The first failure of an outage prints ``vitray: storage unreachable (WHAT: ERROR): retrying for
    up to N s``, the first success after it ``vitray: storage reachable again after N s``: one line
    each per process, however many threads ride the same outage out (the checkpoint writer, the
    lease heartbeat, the metrics uploader)."""
    within_s = _budget_s if within_s is None else within_s
    deadline, attempt = None, 0
    while True:
        _riding.out = getattr(_riding, "out", 0) + 1
        tried_at = time.monotonic()
        try:
            result = fn()
        except Exception as error:
            if not is_transient(error):
                if deadline is not None:
                    _outage.recovered()  # the store answered (with an error of another kind)
                raise
            if stop is not None and stop.is_set():
                if deadline is not None:
                    _outage.gave_up()  # the next failure is said again, and counted from itself
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = tried_at + within_s
                _outage.failed(what, error, within_s, tried_at)
            attempt += 1
            if now >= deadline:
                _outage.gave_up()
                raise gave_up(
                    error, f"{what} (storage unreachable for {within_s:g} s, {OUTAGE_SETTING})", attempt
                ) from error
            delay = min(OUTAGE_MAX_DELAY_S, backoff_delay(attempt), max(0.0, deadline - now))
            # debug, not warning: with no logging set up a warning reaches the console, at every retry
            log.debug("%s failed (%s); riding out, retry %d in %.1fs", what, error, attempt, delay)
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
            continue
        finally:
            _riding.out -= 1
        if deadline is not None:
            _outage.recovered()
        return result


def polled(fn: Callable[[], T], *, what: str, within_s: float = OUTAGE_S) -> T:
    """One try of ``fn`` for a caller that tries again by itself (the driver's progress, which
    reads the run's metrics every few seconds): a transient failure says that an outage started,
    as :func:`ride_out` does (once per process), the next success that it ended; errors propagate.
    The driver's console learns of an outage this way, as the workers' own lines go to their logs."""
    tried_at = time.monotonic()
    try:
        result = fn()
    except Exception as error:
        if is_transient(error):
            _outage.failed(what, error, within_s, tried_at)
        raise
    _outage.recovered()
    return result
