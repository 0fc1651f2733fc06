"""Paths and the files at them, local or remote, through fsspec: the filesystem for a path, joining,
opening, whole-file reads, atomic writes and verified uploads, removal and listing.

S3 endpoint and credentials come from the standard AWS configuration: environment variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL`` /
``AWS_ENDPOINT_URL_S3``, ``AWS_DEFAULT_REGION``), ``~/.aws/config`` profiles or an instance role.
s3fs passes them to botocore, which reads ``AWS_ENDPOINT_URL[_S3]`` by itself, so an S3-compatible
store (MinIO, moto, Ceph) works without extra options. ``storage_options`` (the keyword arguments of
the fsspec filesystem, e.g. ``{"endpoint_url": ...}``) override them.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from . import s3_client
from .reachable import check_path_form
from .retries import with_retries

# Streamed shard reads fetch this much per request: large enough that skipping small tar members
# stays inside the read-ahead buffer instead of costing one request per member.
READ_BLOCK_SIZE = 8 * 1024 * 1024


def absolute(path: str) -> str:
    """``path`` with a local path made absolute against this process's working directory (``~``
    expanded); a URL (``s3://...``, ``file://...``) as given. A config's paths are resolved where
    the config is read: Ray's workers run in working directories of their own, where a relative
    path names another folder (or none)."""
    check_path_form(path)  # (`s3:/bucket` is no local path to make absolute, nor `gs://` one vitray reads)
    if fsspec.core.split_protocol(str(path))[0] is not None:
        return path
    return os.path.abspath(os.path.expanduser(path))


def is_remote(path: str) -> bool:
    """True for URLs with a protocol other than the local filesystem (``s3://``, ``gs://``, ...)."""
    protocol, _ = fsspec.core.split_protocol(str(path))
    return protocol not in (None, "file", "local")


def is_local_file(path: str) -> bool:
    """A local path (not a URL) where a file stands: given where a folder belongs, a mistake to refuse."""
    return not is_remote(path) and os.path.isfile(path)


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
    check_path_form(path)
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


def holds_files(folder: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether any file lies under ``folder``. An object store may list a prefix with nothing under
    it -- a folder deleted a moment ago, for minutes on SeaweedFS -- and s3fs answers one as an
    existing folder (``exists``, ``isdir``, and ``find`` naming the folder itself)."""
    fs, fs_path = filesystem(folder, storage_options)
    try:
        return any(
            info.get("type") == "file" and not _folder_entry(info, fs_path)
            for info in fs.find(fs_path, detail=True).values()
        )
    except FileNotFoundError:
        return False


def _folder_entry(info: dict[str, Any], fs_path: str) -> bool:
    """An object store's entry for a folder rather than a file in it: a zero-byte key ending in "/"
    (the AWS console's "Create folder" makes one; SeaweedFS leaves one for a prefix whose last object
    was deleted), listed by s3fs as a file named like the folder."""
    name = str(info.get("name", ""))
    return name.endswith("/") or name.rstrip("/") == fs_path.rstrip("/")


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


def read_range(fs: fsspec.AbstractFileSystem, fs_path: str, start: int, end: int, *, threads: int = 1) -> bytes:
    """Bytes ``start`` to ``end`` (exclusive) of a file of ``fs``, for callers that read many
    ranges on ``threads`` threads of their own: on S3 each is a ranged GET through a blocking
    botocore client (:mod:`.s3_client`; s3fs's would send every thread's request from its single
    event-loop thread), elsewhere ``fs.cat_file``. Not retried (see :func:`with_retries`)."""
    if s3_client.is_s3(fs):
        return s3_client.read_range(fs, fs_path, start, end, connections=threads)
    return fs.cat_file(fs_path, start=start, end=end)


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

    Locally the data goes to a hidden temporary file beside the target, fsynced and renamed into
    place at the end (a rename is atomic within one filesystem), the folder fsynced after. For
    object storage it goes to a local temporary file that is then uploaded (an object only becomes
    visible once its upload completes) and the stored size is checked against the local one. If the
    block raises, nothing is published.
    """
    fs, fs_path = filesystem(path, storage_options)
    local = isinstance(fs, LocalFileSystem)
    if local:
        parent = os.path.dirname(os.path.abspath(fs_path))
        os.makedirs(parent, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(fs_path)}.", suffix=".tmp", dir=parent)
    else:
        fd, tmp = _upload_staging_file()
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if local:  # on disk before its name is: a crash never leaves an empty file under the name
                f.flush()
                os.fsync(f.fileno())
        if local:
            os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; published files are world-readable
            os.replace(tmp, fs_path)
            fsync_folder(parent)  # and the rename itself
        else:
            _upload_verified(fs, tmp, fs_path, what=path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


UPLOAD_STAGING_PREFIX = "vitray-upload-"
_orphans_removed = False


def _upload_staging_file() -> tuple[int, str]:
    """A local file to stage an upload in (a whole shard or checkpoint file), named by this process's
    id. Those of processes that no longer run -- killed before they could remove theirs -- are
    removed at this process's first upload: nothing else would empty them from the temp folder."""
    global _orphans_removed
    folder = tempfile.gettempdir()
    if not _orphans_removed:
        _orphans_removed = True
        _remove_orphaned_staging_files(folder)
    return tempfile.mkstemp(prefix=f"{UPLOAD_STAGING_PREFIX}{os.getpid()}-", dir=folder)


def _remove_orphaned_staging_files(folder: str) -> None:
    uid = os.getuid()
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            name = entry.name
            pid = name[len(UPLOAD_STAGING_PREFIX) :].split("-", 1)[0] if name.startswith(UPLOAD_STAGING_PREFIX) else ""
            if not pid.isdigit():  # not ours, or an older vitray's (no process id to go by)
                continue
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False) and entry.stat().st_uid == uid and not _running(int(pid)):
                    os.unlink(entry.path)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def publish_file(local_path: str | os.PathLike, path: str, storage_options: dict[str, Any] | None = None) -> None:
    """Copy a finished local file to `path` so that readers never see a part of it: uploaded as it
    is to object storage (:func:`upload_file`: an object appears once whole), streamed through
    :func:`atomic_write` locally."""
    if is_remote(path):
        upload_file(os.fspath(local_path), path, storage_options)
        return
    with open(local_path, "rb") as src, atomic_write(path, storage_options) as dst:
        shutil.copyfileobj(src, dst, 16 * 2**20)


def publish_folder(local_dir: str | os.PathLike, folder: str, storage_options: dict[str, Any] | None = None) -> None:
    """:func:`publish_file` each file of the local folder `local_dir` (not its sub-folders) into
    `folder`: a report, figures or a model folder made locally and then put where it goes."""
    for entry in sorted(os.scandir(local_dir), key=lambda e: e.name):
        if entry.is_file():
            publish_file(entry.path, join(folder, entry.name), storage_options)


def fsync_folder(path: str | os.PathLike) -> None:
    """Make a local folder's entries (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def remove_all(paths: list[str], storage_options: dict[str, Any] | None = None) -> None:
    """Delete the files ``paths`` (those that exist), all in one folder's filesystem: on S3 in
    batched requests (a thousand keys each), not one request per file."""
    if not paths:
        return
    fs, _ = filesystem(paths[0], storage_options)
    fs_paths = [filesystem(path, storage_options)[1] for path in paths]
    if isinstance(fs, LocalFileSystem):
        for fs_path in fs_paths:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(fs_path)
        return
    with_retries(lambda: fs.rm(fs_paths), what=f"removing {len(paths)} files beside {paths[0]}")


def read_all(paths: list[str], storage_options: dict[str, Any] | None = None) -> dict[str, bytes]:
    """The content of each of the (small) files ``paths`` that exists, by path: on S3 fetched
    concurrently, not one request after the other."""
    if not paths:
        return {}
    fs, _ = filesystem(paths[0], storage_options)
    if isinstance(fs, LocalFileSystem):
        found_here = {}
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                found_here[path] = fs.cat_file(filesystem(path, storage_options)[1])
        return found_here
    by_fs_path = {filesystem(path, storage_options)[1]: path for path in paths}
    found = with_retries(lambda: fs.cat(list(by_fs_path), on_error="omit"), what=f"reading {paths[0]} and others")
    return {by_fs_path[fs_path]: data for fs_path, data in found.items() if fs_path in by_fs_path}


def file_sizes(folder: str, storage_options: dict[str, Any] | None = None) -> dict[str, int]:
    """Base name -> size of the files directly inside ``folder`` (empty when it does not exist), from
    one fresh listing (s3fs keeps listings: a process that listed before would not see a change)."""
    fs, fs_path = filesystem(folder, storage_options)
    fs.invalidate_cache(fs_path)
    try:
        entries = fs.ls(fs_path, detail=True)
    except FileNotFoundError:
        return {}
    return {
        posixpath.basename(str(entry["name"]).rstrip("/")): int(entry.get("size") or 0)
        for entry in entries
        if entry.get("type") == "file" and not _folder_entry(entry, fs_path)
    }


def list_names(folder: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Base names of the files directly inside ``folder`` (empty when it does not exist)."""
    fs, fs_path = filesystem(folder, storage_options)
    try:
        entries = fs.ls(fs_path, detail=True)
    except FileNotFoundError:
        return []
    return sorted(posixpath.basename(str(e["name"]).rstrip("/")) for e in entries if not _folder_entry(e, fs_path))
