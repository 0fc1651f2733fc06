"""One rank's side of the run's checkpoints: when to save, the background write, the hand-over
to the run, and restoring.

The checkpointer collects state from the components that own it, each with `state_dict()` /
`load_state_dict()`: small state (the data loader's position) goes into `trainer_state.json`
under its name, tensor state (the EMA weights) into a safetensors file of its own. The backend
writes and reads its shards itself (DeepSpeed and XLA each have their own format); the checkpointer
adds the consolidated weights (`model.safetensors`) and the trainer's step. The folder layout is
`vitray.runfolder.checkpoint_folders`'s (this rank writes its files with
`vitray.trainers.checkpoint.rank_files`).

Saving costs training little more than a snapshot: at a save step every rank snapshots its share
and goes on training while a background thread writes the files and, last, the rank's completion
record. The folder is handed to the run (`report`, which uploads it) at the first step at which
every rank has finished writing. Whether that is now is decided jointly (one small all-reduce per
step while a write is in flight), so all ranks report it at the same step, as Ray Train requires.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vitray.trainers.checkpoint import rank_files as ckpt
from vitray.trainers.collectives import all_reduce
from vitray.trainers.context import Reporter
from vitray.trainers.engines.seam import PendingSave, TrainBackend


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# Errors that mean "the staging disk cannot take the checkpoint" (full, over quota, over a file-size limit).
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class CheckpointDiskFull(OSError):
    """The local staging folder could not hold this rank's share of a checkpoint."""


def _disk_error(error: BaseException) -> OSError | None:
    while error is not None:
        if isinstance(error, OSError) and error.errno in _NO_SPACE:
            return error
        error = error.__cause__ or error.__context__
    return None


def staging_prefix(run_dir: str) -> str:
    """The name prefix of a run's local staging folders (``PREFIX<step>-r<rank>-<random>``). It
    carries a digest of the run folder, so that a run removes its own partial or stale files (on
    a full disk, or left by a killed attempt) and never another run's."""
    digest = hashlib.sha1(run_dir.encode()).hexdigest()[:10] if run_dir else ""
    return f"vitray-ckpt-{digest}-" if digest else "vitray-ckpt-"


def remove_stale_staging(staging_dir: str | None, run_dir: str) -> list[Path]:
    """Remove the run's staging folders on this host and return them. Ray deletes a folder once it
    has uploaded it; an attempt that was killed (a node lost, kill -9, a driver stopped mid-upload)
    leaves its folders behind, each a whole share of a checkpoint, and a run restarted many
    times would fill the local disk. What they held is either in the run folder (uploaded) or
    lost with the attempt, so a new attempt never reads them. Call once per host, before any rank
    of the new attempt saves."""
    if not run_dir:
        return []
    stale = sorted(Path(staging_dir or tempfile.gettempdir()).glob(f"{staging_prefix(run_dir)}*"))
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return stale


class Checkpointer:
    """Saves every `every` steps and at `last_step`; restores from a complete checkpoint folder.

        `states`: name in `trainer_state.json` -> component (JSON-able state); `weights`: file name ->
        component (tensor state: its `state_dict()` is collective and gives whole CPU tensors on rank 0,
    as `Ema`'s does through `backend.to_host`); `record`:
        what `trainer_state.json` also says about the run (classes, architecture, config).
    """

    def __init__(
        self,
        backend: TrainBackend,
        *,
        rank: int,
        world_size: int,
        every: int,
        last_step: int,
        report: Reporter,
        states: dict[str, Stateful],
        weights: dict[str, Stateful],
        record: dict[str, Any],
        staging_dir: str | None = None,
        run_dir: str = "",
    ):
        self.backend, self.rank, self.world = backend, rank, world_size
        self.every, self.last_step = every, last_step
        self.report = report
        self.states, self.weights, self.record = states, weights, record
        self.staging_dir = staging_dir
        self._prefix = staging_prefix(run_dir)
        self._in_flight: _InFlight | None = None
        self._costs: dict[str, float] = {}
        # Called by rank 0 at each save; the background write waits on the handle it returns
        # (`wait()`) before the completion record: the loop sets it to the metrics upload, so a
        # checkpoint never counts before the lines logged up to its step are in the run folder.
        self.before_complete: Callable[[], Any] | None = None

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last_step

    def save(self, step: int, metrics: dict[str, Any]) -> None:
        """Snapshot this rank's share of the checkpoint at `step` and write it in the background;
        `metrics` go to the run with the folder when it is handed over."""
        if self.staging_dir is not None:
            Path(self.staging_dir).mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            folder = Path(tempfile.mkdtemp(prefix=f"{self._prefix}{step:08d}-r{self.rank}-", dir=self.staging_dir))
            shards = self.backend.save(folder)
        except OSError as error:
            self._raise_if_disk_full(error, step, locals().get("folder"))
            raise
        # Collectives: every rank takes part; rank 0 gets the whole tensors.
        files = {ckpt.MODEL_FILE: self.backend.full_state_dict()}
        files.update((name, part.state_dict()) for name, part in self.weights.items())
        state = {
            "step": step,
            "world_size": self.world,
            "backend": self.backend.name,
            **{name: part.state_dict() for name, part in self.states.items()},
            **self.record,
        }
        lead = self.rank == 0
        also = self.before_complete() if lead and self.before_complete is not None else None
        writer = _Writer(folder, self.rank, shards, files if lead else {}, state if lead else None, also)
        self._in_flight = _InFlight(folder, step, metrics, writer, snapshot_s=time.perf_counter() - t0)

    def finish(self, wait: bool) -> None:
        """Hand the checkpoint in flight to the run once every rank has written its share
        (`wait`: block until then). Call it on every rank at every step."""
        flight = self._in_flight
        if flight is None:
            return
        if not wait:
            done = all_reduce([float(flight.writer.done())], average=[False], device=self.backend.device)[0]
            if done < self.world:
                return
        t0 = time.perf_counter()
        try:
            flight.writer.wait()
        except RuntimeError as error:
            self._in_flight = None
            self._raise_if_disk_full(error, flight.step, flight.folder)
            raise
        waited = time.perf_counter() - t0
        self._in_flight = None
        written = flight.writer.seconds
        self.report({**flight.metrics, "step": flight.step, "checkpoint_write_s": written}, flight.folder)
        handed_over = time.perf_counter() - t0 - waited
        # What the save cost, for the next logged step (the driver and benchmarks read it): the
        # background write's duration and how long training actually stood still for it (the
        # snapshot, any wait for the writer, and handing the folder to the uploader).
        self._costs = {
            "checkpoint_write_s": written,
            "checkpoint_blocked_s": flight.snapshot_s + waited + handed_over,
            "checkpoint_snapshot_s": flight.snapshot_s,
            "checkpoint_wait_s": waited,
            "checkpoint_report_s": handed_over,
        }

    def _raise_if_disk_full(self, error: BaseException, step: int, folder: Path | None) -> None:
        """A full staging disk: remove this save's partial files (so the disk is not left full) and
        stop with what to free. Nothing of it was handed to the run, so the run's latest complete
        checkpoint is untouched and a re-run resumes from it."""
        cause = _disk_error(error)
        if cause is None:
            return
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        # The other ranks on this host share the disk and may be stopped before they clean up.
        self._remove_staged(f"{self._prefix}{step:08d}-r*")
        where = self.staging_dir or tempfile.gettempdir()
        usage = shutil.disk_usage(where)
        raise CheckpointDiskFull(
            cause.errno,
            f"rank {self.rank} could not write the checkpoint of step {step} to its staging folder {where} "
            f"({cause.strerror or cause}; {usage.free / 2**20:.0f} MiB free of {usage.total / 2**20:.0f} MiB). "
            "Training stops here; the run's latest complete checkpoint is intact and re-running the same command "
            f"resumes from it. Free space in {where} (each worker needs room for one checkpoint's share there; "
            "vitray-ckpt-* folders are removed once uploaded) or point checkpoint.staging_dir at a larger disk",
        ) from error

    def _remove_staged(self, pattern: str) -> None:
        for stale in Path(self.staging_dir or tempfile.gettempdir()).glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)

    def take_costs(self) -> dict[str, float]:
        """The cost of the last checkpoint handed over, once (empty until the next one)."""
        costs, self._costs = self._costs, {}
        return costs

    def restore(self, folder: Path, state: dict[str, Any]) -> int:
        """Load every component from a complete checkpoint (`state`: its trainer_state.json);
        returns the step to go on from."""
        from safetensors.torch import load_file

        self.backend.load(folder, state)
        for name, part in self.weights.items():
            if (folder / name).is_file():
                part.load_state_dict(load_file(str(folder / name)))
        for name, part in self.states.items():
            part.load_state_dict(state[name])
        return int(state["step"])


class _Writer:
    """Writes one rank's checkpoint files on a background thread: waits for the backend's shards,
    writes rank 0's weight files and trainer state, and the completion record last."""

    def __init__(
        self, folder: Path, rank: int, shards: PendingSave, files: dict[str, dict], state: dict | None, also_wait=None
    ):
        self.seconds = 0.0
        self._error: BaseException | None = None
        self._args = (folder, rank, shards, files, state, also_wait)
        self._thread = threading.Thread(target=self._run, name=f"vitray-ckpt-r{rank}", daemon=True)
        self._started = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        folder, rank, shards, files, state, also_wait = self._args
        try:
            from safetensors.torch import save_file

            shards.wait()
            if also_wait is not None:
                also_wait.wait()
            for name, tensors in files.items():
                save_file(tensors, str(folder / name))
            if state is not None:
                ckpt.write_state(folder, state)
            ckpt.mark_complete(folder, rank, ckpt.files_under(folder))
        except BaseException as error:  # surfaced by wait() on the training thread
            self._error = error
        finally:
            self.seconds = time.perf_counter() - self._started
            self._args = None

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"writing the checkpoint failed: {self._error}") from self._error


@dataclass
class _InFlight:
    folder: Path
    step: int
    metrics: dict[str, Any]
    writer: _Writer
    snapshot_s: float  # how long the snapshot held training up
