"""Mirrors rank 0's local metrics folder (JSONL + TensorBoard events) to the run folder on a
background thread, so that a training step never waits for storage.

Object storage has no append, so each upload replaces a file whole. What keeps that cheap and
the files right for readers:

- Coalescing: the training thread only records, after each write, how many bytes of each file
  are complete; the uploader sends the latest state, so however many steps were logged while an
  upload ran, the next upload is one per changed file.
- A pace: at most one upload every `every_s` seconds, and never more than a fifth of the time
  uploading (a long run's growing files are sent less often, not more slowly per step).
- Whole records only: a file is uploaded up to the size recorded after a flush, never a record
  being written; each upload is atomic (`storage.write_bytes_atomic`), so a reader of the run
  folder (pandas, pyarrow, `vitray runs`, the driver's progress bar) sees a complete file.
- A store that does not answer is waited for (`storage.ride_out`, up to `run.storage_outage_s`):
  the console says once when the outage starts and once when it ends; only an outage longer
  than that fails an upload.
- `flush()` asks for an upload now and returns a handle to wait on: a checkpoint's background
  write waits on it before its completion record, so a resume never misses a logged line of
  the steps it continues from. `close()` uploads the last state and waits for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from vitray import storage

log = logging.getLogger(__name__)

# Between two uploads at least this many times the last upload's duration passes.
_PACE_FACTOR = 4.0


class MetricsUploadError(RuntimeError):
    """The metrics could not be uploaded to the run folder (after the storage layer's retries)."""


class UploadHandle:
    """What `BackgroundMirror.flush` returns: `wait()` blocks until everything written before
    the flush is on storage, or raises `MetricsUploadError` if that upload failed."""

    def __init__(self, mirror: BackgroundMirror, generation: int):
        self._mirror, self._generation = mirror, generation

    def wait(self) -> None:
        self._mirror._wait_for(self._generation)


class BackgroundMirror:
    """`put(relative_name, data)` publishes one file's content in the run folder; `every_s` is
    the least time between two uploads (0: as often as uploads finish); `outage_s` how long one
    upload waits for storage that does not answer."""

    def __init__(
        self,
        local_dir: Path,
        put: Callable[[str, bytes], None],
        *,
        every_s: float,
        outage_s: float = storage.retries.OUTAGE_S,
    ):
        self.local_dir = Path(local_dir)
        self._put = put
        self.every_s, self.outage_s = every_s, outage_s
        self._cond = threading.Condition()
        self._generation = 0  # bumped by every `changed()`
        self._sizes: dict[str, int] = {}  # relative name -> bytes complete at the latest generation
        self._uploaded_generation = 0
        self._uploaded_sizes: dict[str, int] = {}
        self._attempted_generation = 0
        self._error: BaseException | None = None  # the last attempt's failure, cleared by a success
        self._urgent = 0  # a flush asked for this generation now
        self._next_upload_at = 0.0  # monotonic time before which no paced upload starts
        self._closing = False
        self.uploads = 0  # uploads done (one per changed file), for tests and reports
        self._thread = threading.Thread(target=self._run, name="vitray-metrics-upload", daemon=True)
        self._thread.start()

    # -- the training thread ------------------------------------------------------------------------
    def changed(self) -> None:
        """Record that the local files are complete as they are now (call after flushing them)."""
        sizes = local_sizes(self.local_dir)
        with self._cond:
            self._sizes = sizes
            self._generation += 1
            self._cond.notify_all()

    def flush(self) -> UploadHandle:
        """Upload what was written so far as soon as the uploader is free; never blocks."""
        with self._cond:
            self._urgent = self._generation
            self._cond.notify_all()
            return UploadHandle(self, self._generation)

    def close(self, *, raise_errors: bool = True) -> bool:
        """Upload the last state and stop the thread; raise if that final upload failed (unless
        `raise_errors` is false: closing on the way out of a failed run must not hide its error).
        Returns whether the last state is on storage."""
        handle = self.flush()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        if raise_errors:
            handle.wait()
        return self._uploaded_generation >= handle._generation

    # -- the uploader thread ------------------------------------------------------------------------
    def _due(self) -> bool:
        if self._generation == self._uploaded_generation:
            return False
        if self._closing:
            return True
        # A flush is served at once, unless its upload just failed: then it waits for the pace.
        failed = self._error is not None and self._attempted_generation >= self._urgent
        return (self._urgent > self._uploaded_generation and not failed) or time.monotonic() >= self._next_upload_at

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due():
                    if self._closing:
                        return
                    pending = self._generation > self._uploaded_generation
                    self._cond.wait(timeout=max(0.01, self._next_upload_at - time.monotonic()) if pending else None)
                generation, sizes = self._generation, dict(self._sizes)
                closing = self._closing
            started = time.monotonic()
            try:
                self._upload(sizes)
                error = None
            except Exception as failure:
                error = failure
                log.warning("uploading the metrics to the run folder failed (%s); trying again later", failure)
            with self._cond:
                self._attempted_generation = max(self._attempted_generation, generation)
                self._error = error
                if error is None:
                    self._uploaded_generation = generation
                    self._uploaded_sizes.update(sizes)
                elapsed = time.monotonic() - started
                self._next_upload_at = time.monotonic() + max(self.every_s, _PACE_FACTOR * elapsed)
                self._cond.notify_all()
                if closing and (error is not None or generation == self._generation):
                    return  # the final upload is done (or failed: close() reports it)

    def _upload(self, sizes: dict[str, int]) -> None:
        for name, size in sorted(sizes.items()):
            if self._uploaded_sizes.get(name) == size:
                continue
            with open(self.local_dir / name, "rb") as f:
                data = f.read(size)  # only the bytes complete at the last flush
            storage.ride_out(
                lambda: self._put(name, data),  # noqa: B023 (called at once)
                what=f"uploading the metrics file {name}",
                within_s=self.outage_s,
            )
            self.uploads += 1

    def _wait_for(self, generation: int) -> None:
        with self._cond:
            while self._uploaded_generation < generation:
                if self._error is not None and self._attempted_generation >= generation:
                    raise MetricsUploadError(f"uploading the metrics to the run folder failed: {self._error}")
                if not self._thread.is_alive():
                    raise MetricsUploadError("the metrics uploader stopped before uploading everything")
                self._cond.wait(timeout=1.0)


def local_sizes(folder: str | os.PathLike) -> dict[str, int]:
    """Relative name -> size of every file under `folder` (what an upload would publish)."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
