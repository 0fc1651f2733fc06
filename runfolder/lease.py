"""One driver per run: a lease object in the run folder, refreshed by a heartbeat.

`<run>/vitray/lease.json` names the driver that holds the run (owner id, host, pid, when it
started, its last heartbeat). A second `vitray pretrain` of the same run name and storage reads
it first and refuses while the heartbeat is fresh, naming the holder and the heartbeat's age, so
two drivers never write one run's checkpoints. A lease whose heartbeat is older than
`run.lease_timeout_s`, or whose holder was on this host and its process is gone (a kill -9), is
taken over with a warning; `--force` takes over a fresh one.

What is guaranteed, plainly:
- S3 (and S3-compatible stores with conditional writes): the first lease is created with
  `If-None-Match: *` and every later write -- a take-over, each heartbeat -- is a compare-and-swap
  on the ETag that was read (`If-Match`, `vitray.runfolder.lease_s3`). S3 itself lets exactly one of
  two racing writers through and refuses the other (412), whatever their timing, so of two drivers
  starting at once exactly one goes on, and a heartbeat that finds another ETag knows that it was
  taken over. No waiting is needed. A store that takes the headers and writes anyway (some
  S3-compatible stores and gateways do) would let every racing driver believe it won: the lease
  probes the store once per process (`lease_s3.ignored_conditions`) and refuses one that fails
  (UnsafeLeaseStore) unless `run.lease_without_conditional_writes` accepts the risk; the lease
  then works as on the other object stores below.
- Local storage (a local disk, or a shared file system such as NFS whose locks reach the other
  hosts): every read-judge-write of the lease -- taking it, each heartbeat, releasing it -- holds
  an exclusive lock on `lease.json.lock` beside it (filelock: `flock`), so no two of them
  interleave. Of two drivers starting at once, the second finds the first's lease; a take-over
  of a stale lease cannot land between the holder's heartbeat read and its write (which would
  let the holder overwrite it and both go on); a holder stopped while it holds the lock (a
  suspended VM) keeps the run until it lets go: a driver that cannot get the lock within
  `LOCK_WAIT_S` refuses, naming the lock file.
- Other object stores (no conditional writes through fsspec): plain whole-object writes and the
  read-back after `settle_s` (2 s): two drivers that write within one `settle_s` window both see the
  later writer's lease, so the earlier one refuses; a PUT slower than `settle_s` is not covered.
- Ages compare wall clocks of different hosts, so clocks must agree to well under the timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import filelock

from vitray import storage
from vitray.common.failures import NO_SPACE_ERRNOS
from vitray.runfolder import lease_s3

LEASE_FILE = "lease.json"


class RunLeaseHeld(RuntimeError):
    """Another driver holds the run (fresh heartbeat); `holder` is its record, where one was read."""

    def __init__(self, message: str, holder: LeaseRecord | None = None):
        super().__init__(message)
        self.holder = holder


class UnsafeLeaseStore(RunLeaseHeld):
    """The run's S3 store ignores conditional writes, so the lease cannot keep a second driver off
    the run (a RunLeaseHeld, so that it is refused the same way: before Ray, exit 2)."""

    SETTING = "run.lease_without_conditional_writes"


@dataclass
class LeaseRecord:
    owner: str
    host: str
    pid: int
    pid_started: float  # the process's start time: a reused pid is not the holder
    started: float
    heartbeat: float
    timeout_s: float = 120.0  # the holder's run.lease_timeout_s: older heartbeats mean it is gone

    @classmethod
    def of_this_process(cls, timeout_s: float) -> LeaseRecord:
        """A new holder's record: this process, its heartbeat now."""
        import psutil

        now = time.time()
        return cls(
            uuid.uuid4().hex[:12],
            socket.gethostname(),
            os.getpid(),
            psutil.Process().create_time(),
            now,
            now,
            timeout_s,
        )

    def fresh(self) -> bool:
        return self.age() <= self.timeout_s and not self.gone_from_this_host()

    def age(self, now: float | None = None) -> float:
        return (now or time.time()) - self.heartbeat

    def describe(self) -> str:
        return f"{self.owner} (host {self.host}, pid {self.pid})"

    def gone_from_this_host(self) -> bool:
        """The holder ran on this host and its process no longer exists (killed, crashed)."""
        if self.host != socket.gethostname():
            return False
        import psutil

        try:
            return abs(psutil.Process(self.pid).create_time() - self.pid_started) > 1.0
        except psutil.NoSuchProcess:
            return True


def read_lease(path: str) -> LeaseRecord | None:
    if not storage.exists(path):
        return None
    try:
        return _parse(storage.read_bytes(path))
    except FileNotFoundError:
        return None  # deleted meanwhile


class DriverGone(RuntimeError):
    """The driver that started a run's workers no longer holds the run's lease (it exited, or another
    driver took the run over): its workers must not make another checkpoint count."""


def holder_check(path: str) -> Callable[[], None] | None:
    """For a run's workers: a check, to run before a checkpoint is made to count, that the driver
    holding the lease at `path` now still holds it; it raises DriverGone when the lease is gone or
    another's. A driver that exits at once (a second Ctrl-C, `kill -9`) releases the lease or stops
    its heartbeat while Ray is still ending its workers: they must not complete a checkpoint
    meanwhile, nor while a re-run's workers write theirs. None where no lease is held (a training
    loop run without a driver: tests, benchmarks). A store that does not answer is not taken for a
    gone driver."""
    try:
        held = read_lease(path)
    except Exception as error:  # (a store's own errors are not all OSErrors)
        print(f"vitray: the run's lease could not be read ({error}): checkpoints go unchecked against the driver")
        return None
    if held is None:
        return None
    owner = held.describe()

    def check() -> None:
        try:
            now = read_lease(path)
        except Exception:
            return
        # (not fresh: its heartbeat older than its timeout, or its process gone from this host: what
        # lets a re-run take the run over)
        if now is None or now.owner != held.owner or not now.fresh():
            by = (
                "released it"
                if now is None
                else "is gone"
                if now.owner == held.owner
                else f"lost it to {now.describe()}"
            )
            raise DriverGone(f"the run's driver ({owner}) {by}: this worker stops without completing its checkpoint")

    return check


def _parse(data: bytes) -> LeaseRecord | None:
    try:
        return LeaseRecord(**json.loads(data))
    except (ValueError, TypeError):
        return None  # not a lease this version wrote: treated as absent


class RunLease:
    """Holds `<run_dir>/vitray/lease.json` from `acquire()` to `release()`, refreshing it every
    `timeout_s / 4` on a background thread. `on_lost` is called (from that thread) when another
    driver took the lease over; this driver takes it back once that one has released it or stopped
    beating."""

    # On S3, taking over a lease (stale, gone or --force) replaces the very version judged; a write
    # that the holder's heartbeat beat to it is judged again on the new version, this many times.
    TAKE_OVER_RETRIES = 50
    # Local storage: the lock is held for one read and one write of a small file; a driver that
    # cannot get it in this time finds its holder stopped mid-write and refuses to take the run.
    LOCK_WAIT_S = 30.0

    def __init__(
        self,
        run_dir: str,
        *,
        timeout_s: float,
        force: bool = False,
        settle_s: float | None = None,
        on_lost: Callable[[LeaseRecord], None] | None = None,
        without_conditional_writes: bool = False,
        outage_s: float = storage.retries.OUTAGE_S,
        path: str | None = None,
    ):
        """`without_conditional_writes` (run.lease_without_conditional_writes): an S3 store that
        ignores conditional writes is used with the read-back after `settle_s` instead of refused.
        `outage_s` (run.storage_outage_s): how long a heartbeat waits for storage that does not
        answer (`storage.ride_out`: one console line when the outage starts, one when it ends).
        `path`: the lease's file, if not the run folder's (a subclass holding something else)."""
        from vitray.runfolder.files import RunFiles

        self.path = path or RunFiles(run_dir).lease_path
        self.run_dir = run_dir
        self.what = f"run {run_dir}"  # what the lease holds, in its messages
        self.timeout_s, self.force = timeout_s, force
        self.settle_s = settle_s if settle_s is not None else 2.0  # other object stores: the read-back's wait
        self.on_lost = on_lost
        # S3: conditional writes, with the ETag of the version this driver last wrote.
        self._object = lease_s3.ConditionalObject(self.path) if lease_s3.supports(self.path) else None
        self.without_conditional_writes = without_conditional_writes
        self.outage_s = outage_s
        # Local storage: the lock every read-judge-write holds.
        self.lock_path = None if storage.is_remote(self.path) else f"{storage.filesystem(self.path)[1]}.lock"
        self._etag: str | None = None
        self.record = LeaseRecord.of_this_process(timeout_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False
        self._said_disk_full = False

    @property
    def owner(self) -> str:
        return self.record.owner

    def acquire(self) -> str | None:
        """Take the lease or raise RunLeaseHeld; returns a warning when a lease was taken over."""
        if self._object is not None and self._store_honours_conditions():
            warning = self._acquire_conditional()
        elif self.lock_path is not None:
            warning = self._acquire_locked()
        else:
            warning = self._acquire_settled()
        self._thread = threading.Thread(target=self._heartbeat, name="vitray-lease", daemon=True)
        self._thread.start()
        return warning

    def _store_honours_conditions(self) -> bool:
        """Whether the S3 store honours conditional writes (probed once per process); one that
        does not is refused, or, with the risk accepted, the lease goes on without them."""
        ignored = lease_s3.ignored_conditions(self.path.rsplit("/", 1)[0])
        if ignored is None:
            return True
        if not self.without_conditional_writes:
            raise UnsafeLeaseStore(
                f"{self.what}: the S3 store ignores conditional writes ({ignored} were not refused), so the "
                "run lease cannot keep a second driver of this run from writing its checkpoints too; use a store "
                f"that honours them (AWS S3, MinIO, SeaweedFS) or accept the risk with {UnsafeLeaseStore.SETTING}=true"
            )
        self._object = None  # plain writes and the read-back after settle_s, heartbeats too
        return False

    def _acquire_locked(self) -> str | None:
        with self._locked():
            held = read_lease(self.path)
            warning = self._may_take_over(held) if held is not None else None
            self.record.heartbeat = time.time()
            self._write()
        return warning

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Holds the lease's file lock on local storage; on object storage there is none to hold."""
        if self.lock_path is None:
            yield
            return
        os.makedirs(os.path.dirname(self.lock_path), exist_ok=True)
        try:
            with filelock.FileLock(self.lock_path, timeout=self.LOCK_WAIT_S, thread_local=False):
                yield
        except filelock.Timeout:
            raise RunLeaseHeld(
                f"{self.what}: {self.lock_path} has been locked for over {self.LOCK_WAIT_S:g} s by another "
                "driver that is reading or writing the lease (a process stopped in the middle, or a hung file "
                "system). Stop that process or wait for it; if no driver of this run exists on any host, the "
                "file system's lock is stale: delete the lock file"
            ) from None

    def _acquire_settled(self) -> str | None:
        held = read_lease(self.path)
        warning = None
        if held is not None:
            warning = self._may_take_over(held)
        self.record.heartbeat = time.time()
        self._write()
        time.sleep(self.settle_s)
        now_held = read_lease(self.path)
        if now_held is None or now_held.owner != self.owner:
            self._raise_raced(now_held)
        return warning

    def _acquire_conditional(self) -> str | None:
        for _ in range(self.TAKE_OVER_RETRIES):
            current = self._object.get()
            held = _parse(current[0]) if current else None
            warning = self._may_take_over(held) if held is not None else None
            self.record.heartbeat = time.time()
            try:
                if current is None:
                    self._etag = self._object.create(self._data())
                else:  # replaces exactly the version judged above (stale, gone, forced, or unreadable)
                    self._etag = self._object.replace(self._data(), current[1])
                return warning
            except lease_s3.WriteConflict:
                now_held = read_lease(self.path)
                if held is None or now_held is None or now_held.owner != held.owner:
                    self._raise_raced(now_held)  # another driver took it in the meantime
                # Only the holder judged above wrote since (its heartbeat): judge its new version.
        self._raise_raced(read_lease(self.path))

    def _raise_raced(self, now_held: LeaseRecord | None) -> None:
        other = f"{now_held.describe()}" if now_held else "another driver (it has since released it)"
        raise RunLeaseHeld(
            f"{self.what} was taken by {other} while this driver was taking it: two runs started at "
            f"once; this one stops so that only one writes the run's checkpoints"
        )

    def _may_take_over(self, held: LeaseRecord) -> str | None:
        age = held.age()
        if held.owner == self.owner:
            return None
        if age > self.timeout_s:
            return (
                f"taking over the lease of {held.describe()}: its last heartbeat is {age:.0f} s old "
                f"(run.lease_timeout_s={self.timeout_s:g})"
            )
        if held.gone_from_this_host():
            return f"taking over the lease of {held.describe()}: that process is gone from this host"
        if self.force:
            return (
                f"--force: taking over the lease of {held.describe()} although its heartbeat is only "
                f"{age:.0f} s old; make sure that run is stopped"
            )
        raise RunLeaseHeld(self.held_message(held, age), held)

    def refuse_if_held(self) -> None:
        """Refuses now (RunLeaseHeld) while another driver holds the lease with a fresh heartbeat;
        takes nothing: a check before slow work that `acquire` would refuse after it."""
        held = read_lease(self.path)
        if held is not None and held.owner != self.owner and held.fresh() and not self.force:
            raise RunLeaseHeld(self.held_message(held, held.age()), held)

    def held_message(self, held: LeaseRecord, age: float) -> str:
        """The refusal of a start while `held` holds the lease, its heartbeat `age` s old."""
        return (
            f"run {self.run_dir} is already running: {held.describe()} holds {self.path}, last heartbeat "
            f"{age:.0f} s ago. Two runs must not write one run's checkpoints. Wait for it to end or stop it; if it "
            f"is gone, the lease expires {self.timeout_s:g} s after its last heartbeat (run.lease_timeout_s), or "
            "re-run with --force to take it over now"
        )

    def _data(self) -> bytes:
        return json.dumps(asdict(self.record), indent=1).encode()

    def _write(self) -> None:
        storage.write_bytes_atomic(self.path, self._data())

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            beat = self._beat_conditional if self._object is not None else self._beat
            try:
                # `stop`: a release ends a beat that waits for the store, which would otherwise write the
                # lease back after release() removed it (and keep the next run out for run.lease_timeout_s).
                held = storage.ride_out(
                    beat, what=f"the lease heartbeat ({self.path})", within_s=self.outage_s, stop=self._stop
                )
                # A driver whose lease was taken (`--force`) goes on beating: once the driver that took
                # it ends, or stops beating, this one holds the run again. (It stopped beating for
                # good: a later plain start of the run, finding no lease, trained beside it.)
                if held is not None and not self.lost:
                    self.lost = True
                    if self.on_lost is not None:
                        self.on_lost(held)
                elif held is None and self.lost and not self._stop.is_set():
                    self.lost = False
                    print(
                        f"vitray: the driver that took over the lease of {self.what} has ended or stopped "
                        "beating: this driver holds the run again",
                        flush=True,
                    )
            except Exception as error:
                if self._stop.is_set():
                    continue
                if getattr(error, "errno", None) in NO_SPACE_ERRNOS:
                    if not self._said_disk_full:  # once, until a beat gets through again
                        self._said_disk_full = True
                        print(
                            f"vitray: no space left on the disk of {self.path} ({error}): free space there now, or "
                            f"what {self.what} writes there next (a checkpoint, a shard) fails",
                            flush=True,
                        )
                    continue
                print(f"vitray: lease heartbeat failed ({error}); retrying", flush=True)
            else:
                self._said_disk_full = False

    def _beat(self) -> LeaseRecord | None:
        """Refresh the lease; returns the other driver's record while another holds it (fresh); a
        lease gone or gone stale is written back."""
        with self._locked():
            held = read_lease(self.path)
            if held is not None and held.owner != self.owner and held.fresh():
                return held
            if self._stop.is_set():
                return None  # released meanwhile: the lease is not written back
            self.record.heartbeat = time.time()
            self._write()
        return None

    def _beat_conditional(self) -> LeaseRecord | None:
        if self._stop.is_set():
            return None  # released meanwhile: the lease is not written back
        self.record.heartbeat = time.time()
        try:
            self._etag = self._object.replace(self._data(), self._etag)
            return None
        except lease_s3.WriteConflict:
            pass
        # Not the version this driver wrote: someone else's lease, or none (deleted), or ours after
        # all (a retried PUT whose first attempt had landed).
        current = self._object.get()
        held = _parse(current[0]) if current else None
        if held is not None and held.owner != self.owner and held.fresh():
            return held
        try:
            if current is None and not self._stop.is_set():
                self._etag = self._object.create(self._data())
            elif held is not None and held.owner != self.owner and not self._stop.is_set():
                self._etag = self._object.replace(self._data(), current[1])  # that driver stopped beating
            else:
                self._etag = current[1]
        except lease_s3.WriteConflict:  # another driver wrote it meanwhile: judged again at the next beat
            now_held = read_lease(self.path)
            return now_held if now_held is not None and now_held.owner != self.owner else None
        return None

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            with self._locked():
                held = read_lease(self.path)
                if held is not None and held.owner == self.owner:
                    held = self._remove_ours()
                if held is not None and held.owner != self.owner and not self.lost and self.on_lost is not None:
                    self.lost = True  # taken over since the last heartbeat: said now, not never
                    self.on_lost(held)
        except RunLeaseHeld as stuck:  # left to expire after run.lease_timeout_s
            print(f"vitray: the lease was not released: {stuck}", flush=True)

    def _remove_ours(self) -> LeaseRecord | None:
        """Delete the lease this driver holds; on S3 only the version it wrote (`If-Match`): a take-over
        landing between the read and the delete keeps its lease. Returns the other driver's record
        in that case, else None."""
        if self._object is None or self._etag is None:
            storage.remove(self.path)  # local: under the file lock, nothing lands in between
            return None
        try:
            self._object.delete(if_match=self._etag)
        except lease_s3.WriteConflict:
            current = self._object.get()
            return _parse(current[0]) if current else None
        return None

    def __enter__(self) -> RunLease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
