"""One S3 object written only under a condition: create-if-absent and compare-and-swap on its ETag.

S3 has conditional writes (PutObject with `If-None-Match: *` creates only when no object has the
key; with `If-Match: <etag>` it replaces only the version that was read). The run lease
(`vitray.runfolder.lease`) is built on them, so that of two drivers writing at once exactly one
succeeds and the other is told so by S3 itself, whatever the timing.

Not every store that takes the headers honours them: `ignored_conditions` probes a store once (a
create over an existing object, a replace of a version that is not there) and says what it let
through, and the lease refuses such a store (`vitray.runfolder.lease`).

The calls go through s3fs's client (the filesystem `vitray.storage` opens, with its
endpoint, credentials and retries), as its own open() cannot say "replace only this version".
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from fsspec.asyn import sync

from vitray import storage

# What S3 answers when the condition does not hold: 412 (the object exists, or has another ETag),
# 409 (another conditional write to the key is in flight), 404 (If-Match on a deleted object).
_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409", "404"}


class WriteConflict(Exception):
    """The object was created or changed by another writer since it was read."""


# Stores (endpoint, bucket) whose conditional writes were probed in this process: what each ignored.
_probed: dict[tuple[str, str], str | None] = {}
_probe_lock = threading.Lock()


def supports(path: str) -> bool:
    """True for paths on S3 (or an S3-compatible store), where the conditional writes are used."""
    return storage.is_remote(path) and str(path).split("://", 1)[0] in ("s3", "s3a")


def _conflict(error: BaseException) -> bool:
    """Whether `error` (s3fs wraps botocore's ClientError; the cause is kept) is S3 refusing a condition."""
    seen: BaseException | None = error
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            return response.get("Error", {}).get("Code") in _CONFLICT_CODES
        seen = seen.__cause__
    return isinstance(error, FileExistsError)  # s3fs's translation of If-None-Match's 412


class ConditionalObject:
    def __init__(self, path: str):
        self.path = path
        self.fs, fs_path = storage.filesystem(path)
        self.bucket, self.key, _ = self.fs.split_path(fs_path)

    def _call(self, method: str, **kwargs: Any) -> dict:
        return self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)

    def get(self) -> tuple[bytes, str] | None:
        """The object's bytes and the ETag of exactly those bytes, or None when there is none."""

        async def read() -> tuple[bytes, str]:
            response = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            try:
                return await response["Body"].read(), response["ETag"]
            finally:
                response["Body"].close()

        try:
            return sync(self.fs.loop, read)
        except FileNotFoundError:
            return None

    def create(self, data: bytes) -> str:
        """Write `data` only if no object exists; returns its ETag, or raises WriteConflict."""
        return self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, etag: str) -> str:
        """Write `data` only over the version `etag`; returns the new ETag, or raises WriteConflict."""
        return self._put(data, IfMatch=etag)

    def delete(self, if_match: str | None = None) -> None:
        """Delete the object; with `if_match`, only the version of that ETag (else WriteConflict)."""
        try:
            self._call("delete_object", **({"IfMatch": if_match} if if_match else {}))
        except Exception as error:
            if if_match and _conflict(error):
                raise WriteConflict(f"{self.path} was written by another driver since") from error
            raise

    def ignored_conditions(self) -> str | None:
        """Writes this (absent) object under conditions that cannot hold; what the store let
        through anyway, or None. The object is deleted again."""
        # Unconditional: a retried PUT whose first attempt landed must not read as a conflict here.
        first = self._call("put_object", Body=b"probe")["ETag"]
        try:
            ignored = []
            if not _expect_conflict(lambda: self.create(b"created twice")):
                ignored.append("If-None-Match on create")
            if not _expect_conflict(lambda: self.replace(b"replaced", _other_etag(first))):
                ignored.append("If-Match on replace")
            return " and ".join(ignored) or None
        finally:
            self.delete()

    def _put(self, data: bytes, **condition: str) -> str:
        try:
            return self._call("put_object", Body=data, **condition)["ETag"]
        except Exception as error:
            if _conflict(error):
                raise WriteConflict(f"{self.path} was written by another driver first") from error
            raise


def ignored_conditions(folder: str) -> str | None:
    """What the store under `folder` ignores of the conditional writes ("If-None-Match on create",
    "If-Match on replace"), or None when it honours both; probed once per store and bucket in this
    process, on a throwaway object in `folder`. Some S3-compatible stores and gateways accept the
    headers and write anyway: the lease would then let every racing driver believe it won."""
    probe = ConditionalObject(f"{folder.rstrip('/')}/lease-probe-{uuid.uuid4().hex[:12]}")
    key = (str(probe.fs.s3.meta.endpoint_url), probe.bucket)
    with _probe_lock:
        if key not in _probed:
            _probed[key] = probe.ignored_conditions()
        return _probed[key]


def _expect_conflict(write: Any) -> bool:
    """True when `write()` was refused as a condition that does not hold."""
    try:
        write()
    except WriteConflict:
        return True
    return False


def _other_etag(etag: str) -> str:
    """An ETag of the same form that is not `etag`."""
    inner = etag.strip('"')
    return f'"{"0" * len(inner) if inner != "0" * len(inner) else "1" * len(inner)}"'
