"""`vitray data prepare` on Ray: one Ray task per shard, a live progress bar, the same result.

The shards, manifests and ``dataset.json`` are byte-identical to the serial
:func:`vitray.data.prepare_dataset`: the plan is made here, tasks only write their shard, and the
manifest rows are put back in plan order before ``finalize`` writes the manifests and, last,
``dataset.json``. Bad images are refused, skipped or kept exactly as there (``settle_bad_images``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import ray

from vitray.cluster.runtime import connect
from vitray.cluster.stop_signals import ray_init_keeps_sigterm
from vitray.data import (
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_SAMPLES_PER_SHARD,
    DatasetInfo,
    Preparation,
    ShardResult,
    ShardTask,
    Source,
    opened,
    prepare_dataset,
    start_preparation,
)
from vitray.data.prepare import PREPARING_LEASE, MapFn
from vitray.data.shard_progress import ShardProgress
from vitray.runfolder.lease import LeaseRecord, RunLease
from vitray.storage import join

# Tasks in flight per CPU of the cluster: enough to keep every CPU busy while results come back,
# few enough that a huge dataset does not put millions of task arguments in the object store.
IN_FLIGHT_PER_CPU = 2


# Ray retries a task whose worker died (a node lost, the OOM killer), never one that raised: storage
# errors are already retried inside the task (storage/retries.py), so a Ray retry on top multiplied
# the uploads (5 x 4 per shard, minutes before an outage failed) and printed Ray's traceback of each
# attempt; a source image deleted meanwhile (FileNotFoundError) fails the same on every attempt.
@ray.remote(num_cpus=1, max_retries=3, retry_exceptions=False)
def _write_shard_task(write: Callable[[ShardTask], ShardResult], task: ShardTask) -> ShardResult:
    return write(task)


class _Stop:
    """The signal that asked the preparation to stop (SIGINT, SIGTERM), None until one came."""

    signum: int | None = None

    def check(self, dest: str) -> None:
        """Stop now if a signal came: KeyboardInterrupt after Ctrl-C (the command's line and exit
        130), exit 143 and its line after SIGTERM."""
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum == signal.SIGTERM:
            print(
                f"vitray: SIGTERM (pid {os.getpid()}): stopped preparing {dest}; no shard is left half-written, "
                "and the same command goes on from the shards written",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(128 + signal.SIGTERM)


@contextmanager
def _stop_noted() -> Iterator[_Stop]:
    """Ctrl-C and SIGTERM as a note the task loop checks between its waits. A KeyboardInterrupt
    raised inside Ray's own signal check (in `ray.wait`) can be lost there: on a loaded machine the
    preparation then ran to its end after a Ctrl-C; and Ray's C++ core answers SIGTERM with a stack
    dump and an abort."""
    stop = _Stop()
    if threading.current_thread() is not threading.main_thread():  # signal handlers: main thread only
        yield stop
        return

    def note(signum, frame) -> None:
        stop.signum = stop.signum or signum

    previous = {signum: signal.signal(signum, note) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def prepare_dataset_on_ray(
    source: str | Source,
    dest: str,
    *,
    samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    bad_images: str = "refuse",
    storage_options: dict[str, Any] | None = None,
    show_progress: bool = True,
) -> DatasetInfo:
    """Prepare ``source`` into ``dest`` with one Ray task per shard (see
    :func:`vitray.data.prepare_dataset` for the arguments) on the Ray this process is connected to
    (`runtime.connect`). Shards go straight from the tasks to ``dest``, so on a multi-node cluster ``dest``
    must be shared storage (``s3://...``) and the source readable from every node.
    """
    with _stop_noted() as stop:  # (over the planning too: a stop is the same wherever it comes)
        started = start_preparation(
            opened(source),
            dest,
            samples_per_shard=samples_per_shard,
            max_shard_bytes=max_shard_bytes,
            overwrite=overwrite,
            bad_images=bad_images,  # type: ignore[arg-type]
            storage_options=storage_options,
        )
        if isinstance(started, DatasetInfo):
            return started
        stop.check(dest)
        return _write_on_ray(started, stop, show_progress)


def _write_on_ray(started: Preparation, stop: _Stop, show_progress: bool) -> DatasetInfo:
    """The shards left to write, one Ray task each (a few in flight per CPU), then the manifests."""
    write = ray.put(started.writer())
    max_in_flight = max(2, IN_FLIGHT_PER_CPU * int(ray.cluster_resources().get("CPU", 1)))
    results: dict[str, ShardResult] = {}
    queue = list(reversed(started.remaining))
    running: dict[ray.ObjectRef, ShardTask] = {}
    total = sum(t.num_samples for t in started.remaining)
    with ShardProgress(f"preparing {started.source.name}", total, show=show_progress) as bar:
        while queue or running:
            while queue and len(running) < max_in_flight:
                task = queue.pop()
                running[_write_shard_task.remote(write, task)] = task
            done, _ = ray.wait(list(running), num_returns=1, timeout=0.5)
            stop.check(started.dest)
            for ref in done:
                task = running.pop(ref)
                try:
                    results[task.name] = ray.get(ref)
                except ray.exceptions.RayTaskError as error:
                    # The task's own error (a bad image, a label out of range), as the serial path
                    # raises it: one line, not Ray's wrapper with the worker's traceback.
                    if error.cause is None:
                        raise
                    raise error.cause from None
                bar.advance(task.num_samples)
    return started.finish(results.values())


class PreparationLease(RunLease):
    """The one command preparing `dest`: a second `vitray data prepare` into the same folder, while
    this one runs, is refused. (It took the running one for a stopped one: it removed the shards
    being written, and with other options both ended "whole" over a mix of their shards.) The run
    lease's guarantees (`vitray.runfolder.lease`): a file lock on local storage, conditional
    writes on S3, and a lease whose heartbeat stops (a kill -9 elsewhere) expires."""

    TIMEOUT_S = 120.0

    def __init__(self, dest: str):
        # (A store that ignores conditional writes is not refused here, as a run's is unless a setting
        # accepts it: the lease falls back to the read-back after a settle time.)
        super().__init__(
            dest,
            timeout_s=self.TIMEOUT_S,
            path=join(dest, PREPARING_LEASE),
            on_lost=self._taken,
            without_conditional_writes=True,
        )
        self.what = f"the preparation of {dest}"

    def held_message(self, held: LeaseRecord, age: float) -> str:
        return (
            f"{self.run_dir} is being prepared by {held.describe()} (its lease {self.path}, last heartbeat "
            f"{age:.0f} s ago): two preparations must not write one dataset. Wait for that one to end, or stop it "
            f"and re-run (the same command goes on from the shards it wrote); if it is gone, its lease expires "
            f"{self.timeout_s:g} s after its last heartbeat"
        )

    def _taken(self, holder: LeaseRecord) -> None:
        print(
            f"vitray: WARNING: {holder.describe()} took over the preparation of {self.run_dir} (this command's "
            "heartbeat had stopped): stop one of them",
            file=sys.stderr,
            flush=True,
        )


def prepare(
    source: Source,
    dest: str,
    *,
    address: str | None = None,
    serial: bool = False,
    show_progress: bool = True,
    **options,
) -> DatasetInfo:
    """What `vitray data prepare` runs once its input is checked: the shards written in this process
    (``serial``) or by one Ray task per shard on the cluster at ``address`` (an embedded local Ray when
    None), with the same progress bar. ``options`` are :func:`prepare_dataset_on_ray`'s."""
    with PreparationLease(dest):
        if serial:  # a stop (Ctrl-C, SIGTERM) is taken between shards, as the Ray path takes it
            with _stop_noted() as stop:
                shown = _map_shown(f"preparing {source.name}", show_progress, lambda: stop.check(dest))
                return prepare_dataset(source, dest, map_fn=shown, **options)
        # A stop while Ray starts (seconds) waits for its start, then stops as one in the task loop does:
        # Ray's own SIGTERM handler exited 15 mid-start, its agents left running, and said nothing.
        with _stop_noted() as stop:
            with ray_init_keeps_sigterm():
                connect(address)
            stop.check(dest)
        return prepare_dataset_on_ray(source, dest, show_progress=show_progress, **options)


def _map_shown(title: str, show: bool, between: Callable[[], None]) -> MapFn:
    """``map`` that advances the Ray path's progress bar after each shard (the serial path said
    nothing until its end: hours for ImageNet), calling ``between`` before each."""

    def map_fn(write: Callable[[ShardTask], ShardResult], tasks: Iterable[ShardTask]) -> Iterator[ShardResult]:
        tasks = list(tasks)
        with ShardProgress(title, sum(t.num_samples for t in tasks), show=show) as bar:
            for task in tasks:
                between()
                result = write(task)
                bar.advance(task.num_samples)
                yield result

    return map_fn
