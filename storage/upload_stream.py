"""An object on an S3 store written as a stream: each part goes up as soon as it is full.

What a checkpoint file on S3 needs: its bytes leave while the rest is still being serialised, as
the parts of one multipart upload, UPLOAD_CONCURRENCY of them in flight on threads of their own
(boto3 TransferManager's defaults) through a blocking botocore client (`s3_client`: s3fs's single
event-loop thread, which signs and sends every request, held uploads to 0.72-0.84x
TransferManager's rate), with only those parts in memory. The object exists, whole, once `close`
returns; an error or an exception in the `with` block aborts the upload, and nothing is left at
the path. Each request rides out an outage of the store (`ride_out`, the process's outage budget:
a run's `run.storage_outage_s`).

A small object (one part or less) is one PUT; a store that is not S3 gets the whole object at
close (fsspec's `pipe_file`).
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Callable
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from . import s3_client
from .files import filesystem
from .retries import ride_out

# Measured on a SeaweedFS here: s3fs's own `pipe_file` sends its parts in batches and waits for
# each batch's slowest before the next (1 GB at 105-136 MB/s); parts kept in flight, each on a
# thread of its own, as TransferManager keeps them, go up at its rate.
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
        self._part, self._filled = bytearray(), 0  # the part being filled, and how much of it is
        self._s3 = s3_client.is_s3(self.fs)
        if self._s3:
            bucket, key, _ = self.fs.split_path(self.fs_path)
            self._bucket_key = {"Bucket": bucket, "Key": key}
            self._client = s3_client.sync_client(self.fs, connections=UPLOAD_CONCURRENCY)
        self._upload_id: str | None = None
        self._senders: ThreadPoolExecutor | None = None
        self._parts = 0  # parts handed to the senders so far
        self._in_flight: dict[Future, int] = {}  # a part's upload -> its number
        self._sent: dict[int, str] = {}  # part number -> its ETag
        self._aborted = threading.Event()
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
                if not self._part:
                    self._part = bytearray(UPLOAD_PART_BYTES)  # the bytes' one copy goes here
                n = min(UPLOAD_PART_BYTES - self._filled, view.nbytes - taken)
                self._part[self._filled : self._filled + n] = view[taken : taken + n]
                self._filled += n
                taken += n
                if self._filled == UPLOAD_PART_BYTES:
                    self._send_part()
        self.size += view.nbytes
        return view.nbytes

    def _send_part(self) -> None:
        body = self._part if self._filled == len(self._part) else self._part[: self._filled]
        self._part, self._filled = bytearray(), 0  # `body` is the sender's now
        if self._on_bytes is not None:
            self._on_bytes(memoryview(body))
        if self._upload_id is None:
            self._upload_id = self._request("create_multipart_upload")["UploadId"]
            self._senders = ThreadPoolExecutor(UPLOAD_CONCURRENCY, thread_name_prefix="vitray-upload")
        if len(self._in_flight) >= UPLOAD_CONCURRENCY:
            self._collect(FIRST_COMPLETED)  # whichever part ends first: a slow one holds no others up
        self._parts += 1
        self._in_flight[self._senders.submit(self._upload_part, self._parts, body)] = self._parts

    def _upload_part(self, number: int, body: bytearray) -> dict[str, Any]:
        """On a sender thread: one part, sent again after a failure until it goes up, the outage
        budget is spent or the stream is aborted."""
        return ride_out(
            lambda: self._call("upload_part", UploadId=self._upload_id, PartNumber=number, Body=body),
            what=f"{self.what} (part {number})",
            stop=self._aborted,
        )

    def _collect(self, until: str) -> None:
        """Wait for the parts in flight (the first to end, or all of them) and note their ETags;
        a part that failed for good raises its error here."""
        done, _ = wait(self._in_flight, return_when=until)
        for upload in done:
            self._sent[self._in_flight.pop(upload)] = upload.result()["ETag"]

    def _call(self, method: str, **kwargs) -> dict[str, Any]:
        return s3_client.call(self.fs, self._client, method, **self._bucket_key, **kwargs)

    def _request(self, method: str, **kwargs) -> dict[str, Any]:
        return ride_out(lambda: self._call(method, **kwargs), what=self.what)

    def close(self) -> None:
        """The rest goes up; the object exists, whole, once this returns."""
        if self.closed:
            return
        try:
            if not self._s3:
                data = self._whole.getvalue()
                ride_out(lambda: self.fs.pipe_file(self.fs_path, data), what=self.what)
            elif self._upload_id is None:  # one part or less: one PUT
                body = self._part[: self._filled]
                if self._on_bytes is not None:
                    self._on_bytes(memoryview(body))
                self._request("put_object", Body=body)
            else:
                if self._filled:
                    self._send_part()
                self._collect(ALL_COMPLETED)
                parts = [{"PartNumber": n, "ETag": self._sent[n]} for n in sorted(self._sent)]
                self._request("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": parts})
                self._senders.shutdown()
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
        """Drop the parts sent so far, once those under way have ended (a part that lands after the
        abort would open the upload again on some stores). Best effort: a store that is away keeps
        them until its lifecycle rule for incomplete uploads, as after any crash."""
        self._aborted.set()
        if self._senders is not None:
            self._senders.shutdown(wait=True, cancel_futures=True)
        self._in_flight.clear()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            with contextlib.suppress(Exception):  # the caller's error is the one to see
                self._call("abort_multipart_upload", UploadId=upload_id)
