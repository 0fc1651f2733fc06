"""One way to reach local and object-storage paths: fsspec, with bounded retries.

Every part of vitray opens dataset, checkpoint and report paths through this module, so that a
path is either a local folder or a URL such as ``s3://bucket/prefix`` and nothing else needs to
know which.

S3 endpoint and credentials come from the standard AWS configuration: environment variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL`` /
``AWS_ENDPOINT_URL_S3``, ``AWS_DEFAULT_REGION``), ``~/.aws/config`` profiles or an instance role.
s3fs passes them to botocore, which reads ``AWS_ENDPOINT_URL[_S3]`` by itself, so an S3-compatible
store (MinIO, moto, Ceph) works without extra options. ``storage_options`` (the keyword arguments of
the fsspec filesystem, e.g. ``{"endpoint_url": ...}``) override them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import posixpath
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import IO, Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

# The one quick probe of a path before expensive work starts; found here with the rest of storage.
from vitray.data.reachable import StorageUnreachable, check_reachable  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

T = TypeVar("T")

# Streamed shard reads fetch this much per request: large enough that skipping small tar members
# stays inside the read-ahead buffer instead of costing one request per member.
READ_BLOCK_SIZE = 8 * 1024 * 1024


def absolute(path: str) -> str:
    """``path`` with a local path made absolute against this process's working directory (``~``
    expanded); a URL (``s3://...``, ``file://...``) as given. A config's paths are resolved where
    the config is read: Ray's workers run in working directories of their own, where a relative
    path names another folder (or none)."""
    if fsspec.core.split_protocol(str(path))[0] is not None:
        return path
    return os.path.abspath(os.path.expanduser(path))


def is_remote(path: str) -> bool:
    """True for URLs with a protocol other than the local filesystem (``s3://``, ``gs://``, ...)."""
    protocol, _ = fsspec.core.split_protocol(str(path))
    return protocol not in (None, "file", "local")


# botocore retries every S3 request that fails transiently -- 503 SlowDown and other throttling,
# 500/502/503/504, connection errors and timeouts -- with exponential backoff and full jitter
# ("standard" mode), this many attempts in all. s3fs retries on top of it what botocore does not
# see (a body cut short mid-transfer: the range GET is repeated whole, so no byte is read twice),
# and :func:`with_retries` wraps whole operations (an upload and the check of its stored size).
# ``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS`` (or ``config_kwargs`` in ``storage_options``) override it.
S3_RETRIES = {"mode": "standard", "total_max_attempts": 5}


def filesystem(path: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``path`` and the path as that filesystem names it."""
    options = dict(storage_options or {})
    protocol, _ = fsspec.core.split_protocol(str(path))
    if protocol in ("s3", "s3a") and not ({"AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS"} & os.environ.keys()):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", dict(S3_RETRIES))
        options["config_kwargs"] = config
    return fsspec.core.url_to_fs(str(path), **options)


def join(base: str, *names: str) -> str:
    """Join path parts with ``/``, keeping a URL's protocol (``s3://b/p`` + ``x`` -> ``s3://b/p/x``)."""
    base = str(base)
    if is_remote(base):
        protocol, rest = fsspec.core.split_protocol(base)
        return f"{protocol}://" + posixpath.join(rest, *names)
    return os.path.join(base, *names)


def exists(path: str, storage_options: dict[str, Any] | None = None) -> bool:
    fs, fs_path = filesystem(path, storage_options)
    return fs.exists(fs_path)


def open_file(
    path: str,
    mode: str = "rb",
    storage_options: dict[str, Any] | None = None,
    *,
    block_size: int | None = None,
) -> IO[Any]:
    """Open ``path`` (local or URL) as a file object; remote reads use a read-ahead cache.

    Raises :class:`FileNotFoundError` naming the path when it does not exist.
    """
    fs, fs_path = filesystem(path, storage_options)
    kwargs: dict[str, Any] = {}
    if not isinstance(fs, LocalFileSystem) and "r" in mode:
        kwargs = {"block_size": block_size or READ_BLOCK_SIZE, "cache_type": "readahead"}
    try:
        return fs.open(fs_path, mode, **kwargs)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{path} does not exist") from error


def read_bytes(path: str, storage_options: dict[str, Any] | None = None) -> bytes:
    """The whole content of a (small) file, with retries on transient errors."""

    def read() -> bytes:
        with open_file(path, "rb", storage_options) as f:
            return f.read()

    return with_retries(read, what=f"reading {path}")


def write_bytes_atomic(path: str, data: bytes, storage_options: dict[str, Any] | None = None) -> None:
    """Write ``data`` so that readers see either no file or the whole file, never a prefix."""
    with atomic_write(path, storage_options) as f:
        f.write(data)


@contextlib.contextmanager
def atomic_write(path: str, storage_options: dict[str, Any] | None = None) -> Iterator[IO[bytes]]:
    """A binary file to write ``path`` through; it appears at ``path`` only once the block succeeds.

    Locally the data goes to a hidden temporary file beside the target, renamed into place at the
    end (a rename is atomic within one filesystem). For object storage it goes to a local temporary
    file that is then uploaded (an object only becomes visible once its upload completes) and the
    stored size is checked against the local one. If the block raises, nothing is published.
    """
    fs, fs_path = filesystem(path, storage_options)
    local = isinstance(fs, LocalFileSystem)
    if local:
        parent = os.path.dirname(os.path.abspath(fs_path))
        os.makedirs(parent, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(fs_path)}.", suffix=".tmp", dir=parent)
    else:
        fd, tmp = tempfile.mkstemp(prefix="vitray-upload-")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        if local:
            os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; published files are world-readable
            os.replace(tmp, fs_path)
        else:
            _upload_verified(fs, tmp, fs_path, what=path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def upload_file(local_path: str, path: str, storage_options: dict[str, Any] | None = None) -> None:
    """Copy a local file to `path` (local or s3://), retried, its stored size checked."""
    fs, fs_path = filesystem(path, storage_options)
    if not is_remote(path):  # object stores have no folders to make
        os.makedirs(os.path.dirname(fs_path) or ".", exist_ok=True)
    _upload_verified(fs, local_path, fs_path, what=path)


def _upload_verified(fs: fsspec.AbstractFileSystem, local_path: str, fs_path: str, *, what: str) -> None:
    size = os.path.getsize(local_path)

    def upload() -> None:
        fs.put_file(local_path, fs_path)
        stored = fs.info(fs_path)["size"]
        if stored != size:
            raise OSError(f"uploaded {what} has {stored} bytes, expected {size}")

    with_retries(upload, what=f"uploading {what}")


def remove(path: str, storage_options: dict[str, Any] | None = None) -> None:
    """Delete a file if it exists."""
    fs, fs_path = filesystem(path, storage_options)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(fs_path)


def list_names(folder: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Base names of the files directly inside ``folder`` (empty when it does not exist)."""
    fs, fs_path = filesystem(folder, storage_options)
    try:
        entries = fs.ls(fs_path, detail=False)
    except FileNotFoundError:
        return []
    return sorted(posixpath.basename(str(e).rstrip("/")) for e in entries)


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


# Whole-shard downloads into the local cache: ranges of this size, this many requested at once.
CACHE_PART_BYTES = 8 * 1024 * 1024
CACHE_PARALLEL_PARTS = 8


class ShardCache:
    """Whole shards copied from object storage into a local folder shared by the processes of a
    node, at most ``max_bytes`` in all; the least recently used shards are evicted first.

    A shard is fetched as parallel range GETs of :data:`CACHE_PART_BYTES` (:data:`CACHE_PARALLEL_PARTS`
    at a time, each part retried on transient errors, S3's 503 SlowDown included), written to a
    hidden temporary file and renamed into place once its size matches the store's, so a reader
    never opens a partial copy. Two processes that miss the same shard both fetch it; the second
    rename replaces the first, identical, copy. Eviction unlinks files that other processes may
    still read (they keep their open file). Local paths pass through unchanged.
    """

    def __init__(self, folder: str, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"the shard cache needs a positive size bound, got {max_bytes} bytes")
        self.folder, self.max_bytes = str(folder), int(max_bytes)
        os.makedirs(self.folder, exist_ok=True)

    def path_for(self, url: str) -> str:
        digest = hashlib.sha256(url.encode()).hexdigest()[:16]
        return os.path.join(self.folder, f"{digest}-{posixpath.basename(url)}")

    def open(self, url: str, storage_options: dict[str, Any] | None = None) -> IO[bytes]:
        """``url`` opened for reading: from the cache (fetched into it first if missing), or straight
        from storage when it is local or larger than the whole cache."""
        if not is_remote(url):
            return open_file(url, "rb", storage_options)
        path = self.path_for(url)
        try:
            cached = open(path, "rb")
        except FileNotFoundError:
            pass
        else:
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)  # recently used: evicted last
            return cached
        fs, fs_path = filesystem(url, storage_options)
        try:
            size = with_retries(lambda: fs.info(fs_path)["size"], what=f"asking the size of {url}")
        except FileNotFoundError:
            raise FileNotFoundError(f"{url} does not exist") from None
        if size > self.max_bytes:
            log.warning(
                "shard %s (%d bytes) is larger than the shard cache (%d bytes); reading it directly",
                url,
                size,
                self.max_bytes,
            )
            return open_file(url, "rb", storage_options)
        self._make_room(size)
        fetched = self._fetch(fs, fs_path, url, size, path)
        # Processes that missed shards at the same time each made room for their own only.
        self._make_room(0)
        return fetched

    def _fetch(self, fs: fsspec.AbstractFileSystem, fs_path: str, url: str, size: int, path: str) -> IO[bytes]:
        """The shard fetched into ``path``, opened before it is renamed there (so that eviction by
        another process cannot take it away between the two)."""
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".part", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as out:
                starts = list(range(0, size, CACHE_PART_BYTES))
                for group in range(0, len(starts), CACHE_PARALLEL_PARTS):
                    first = starts[group : group + CACHE_PARALLEL_PARTS]
                    ends = [min(s + CACHE_PART_BYTES, size) for s in first]

                    def fetch_parts(first: list[int] = first, ends: list[int] = ends) -> list[bytes]:
                        parts = fs.cat_ranges([fs_path] * len(first), first, ends)
                        for part in parts:
                            if isinstance(part, BaseException):  # cat_ranges returns errors in place
                                raise part
                        return parts

                    for part in with_retries(fetch_parts, what=f"fetching {url} into the shard cache"):
                        out.write(part)
            if os.path.getsize(tmp) != size:
                raise OSError(f"fetched {os.path.getsize(tmp)} bytes of {url}, expected {size}")
            fetched = open(tmp, "rb")
            os.replace(tmp, path)
            return fetched
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _make_room(self, incoming: int) -> None:
        entries = []
        with os.scandir(self.folder) as listing:
            for entry in listing:
                if entry.is_file() and not entry.name.startswith("."):
                    with contextlib.suppress(FileNotFoundError):  # another process may evict it meanwhile
                        stat = entry.stat()
                        entries.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total + incoming <= self.max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            total -= size
