"""Which storage errors are worth retrying, and how: bounded attempts with jittered exponential
backoff. :func:`with_retries` wraps whole operations; the shard reader, which must reopen a stream
where it broke, runs the same test, delays and bound in a loop of its own."""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@functools.cache
def _network_errors() -> tuple[type[BaseException], ...]:
    """The HTTP clients' own connection errors, which s3fs lets through untranslated once its own
    retries are spent: aiohttp's (a body cut short, a dropped connection) and botocore's."""
    errors: list[type[BaseException]] = []
    with contextlib.suppress(ImportError):
        import aiohttp

        errors.append(aiohttp.ClientError)
    with contextlib.suppress(ImportError):
        import botocore.exceptions

        errors += [botocore.exceptions.HTTPClientError, botocore.exceptions.ConnectionError]
    return tuple(errors)


def is_transient(error: BaseException) -> bool:
    """Errors worth retrying: I/O, timeouts and dropped connections, but not a missing file or a
    permission problem."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
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
