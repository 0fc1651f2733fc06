"""An object on an S3 store written as a stream: each part goes up as soon as it is full.

What a checkpoint file on S3 needs: its bytes leave while the rest is still being serialised, as
the parts of one multipart upload, UPLOAD_CONCURRENCY of them in flight (boto3 TransferManager's
defaults), with only those parts in memory. The object exists, whole, once `close` returns; an
error or an exception in the `with` block aborts the upload, and nothing is left at the path.
Each request rides out an outage of the store (`ride_out`, the process's outage budget: a run's
`run.storage_outage_s`).

A small object (one part or less) is one PUT; a store that is not S3 gets the whole object at
close (fsspec's `pipe_file`).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import fsspec.asyn

from .files import filesystem
from .retries import ride_out

# Measured on a SeaweedFS here: s3fs's own `pipe_file` sends its parts in batches and waits for
# each batch's slowest before the next (1 GB at 105-136 MB/s); parts kept in flight this way went
# up at 157-161 MB/s, as TransferManager's (156-164).
UPLOAD_PART_BYTES = 8 * 2**20
UPLOAD_CONCURRENCY = 10


class UploadStream(io.RawIOBase):
    """A write-only object at `path` (an S3 URL; another fsspec URL is written at close). `what`
    names it in an outage's console line. `on_bytes`, if given, sees every byte written, in order,
    once: a part at a time, on the caller's thread."""

    def __init__(self, path: str, *, what: str, on_bytes: Callable[[memoryview], None] | None = None):
        super().__init__()
        self.fs, self.fs_path = filesystem(path)
        self.what, self._on_bytes = what, on_bytes
        self.size = 0
        self._part = bytearray()
        self._s3 = hasattr(self.fs, "_call_s3")
        if self._s3:
            bucket, key, _ = self.fs.split_path(self.fs_path)
            self._bucket_key = {"Bucket": bucket, "Key": key}
        self._upload_id: str | None = None
        self._in_flight: deque[tuple[int, bytes, Future]] = deque()  # part number, body, its upload
        self._sent: list[dict[str, Any]] = []
        self._whole = io.BytesIO()  # a store that is not S3: the object, PUT at close

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if not self._s3:
            self._whole.write(view)
            if self._on_bytes is not None:
                self._on_bytes(view)
        else:
            taken = 0
            while taken < view.nbytes:
                n = min(UPLOAD_PART_BYTES - len(self._part), view.nbytes - taken)
                self._part += view[taken : taken + n]
                taken += n
                if len(self._part) == UPLOAD_PART_BYTES:
                    self._send_part()
        self.size += view.nbytes
        return view.nbytes

    def _send_part(self) -> None:
        body, self._part = bytes(self._part), bytearray()
        if self._on_bytes is not None:
            self._on_bytes(memoryview(body))
        if self._upload_id is None:
            self._upload_id = self._request("create_multipart_upload", **self._bucket_key)["UploadId"]
        if len(self._in_flight) >= UPLOAD_CONCURRENCY:
            self._finish_oldest()
        number = len(self._sent) + len(self._in_flight) + 1
        upload = asyncio.run_coroutine_threadsafe(self._call("upload_part", number, body), self.fs.loop)
        self._in_flight.append((number, body, upload))

    def _call(self, method: str, number: int, body: bytes):
        return self.fs._call_s3(method, **self._bucket_key, UploadId=self._upload_id, PartNumber=number, Body=body)

    def _finish_oldest(self) -> None:
        """The oldest part's upload is done; one that failed (an outage) is sent again until it
        goes up or the outage budget is spent."""
        number, body, upload = self._in_flight.popleft()
        try:
            sent = upload.result()
        except Exception:
            sent = ride_out(
                lambda: fsspec.asyn.sync(self.fs.loop, self._call, "upload_part", number, body),
                what=f"{self.what} (part {number})",
            )
        self._sent.append({"PartNumber": number, "ETag": sent["ETag"]})

    def _request(self, method: str, **kwargs) -> dict[str, Any]:
        return ride_out(lambda: fsspec.asyn.sync(self.fs.loop, self.fs._call_s3, method, **kwargs), what=self.what)

    def close(self) -> None:
        """The rest goes up; the object exists, whole, once this returns."""
        if self.closed:
            return
        try:
            if not self._s3:
                data = self._whole.getvalue()
                ride_out(lambda: self.fs.pipe_file(self.fs_path, data), what=self.what)
            elif self._upload_id is None:  # one part or less: one PUT
                body = bytes(self._part)
                if self._on_bytes is not None:
                    self._on_bytes(memoryview(body))
                ride_out(lambda: self.fs.pipe_file(self.fs_path, body), what=self.what)
            else:
                if self._part:
                    self._send_part()
                while self._in_flight:
                    self._finish_oldest()
                parts = {"Parts": self._sent}
                self._request(
                    "complete_multipart_upload", **self._bucket_key, UploadId=self._upload_id, MultipartUpload=parts
                )
            self.fs.invalidate_cache(self.fs_path)
        except BaseException:
            self._abort()
            raise
        finally:
            super().close()

    def __exit__(self, kind, error, traceback) -> None:
        if error is None:
            self.close()
        else:
            self._abort()
            super().close()

    def _abort(self) -> None:
        """Drop the parts sent so far (best effort: a store that is away keeps them until its
        lifecycle rule for incomplete uploads, as after any crash)."""
        for _, _, upload in self._in_flight:
            upload.cancel()
        self._in_flight.clear()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            with contextlib.suppress(Exception):  # the caller's error is the one to see
                fsspec.asyn.sync(
                    self.fs.loop, self.fs._call_s3, "abort_multipart_upload", **self._bucket_key, UploadId=upload_id
                )
