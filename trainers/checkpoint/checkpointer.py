"""One rank's side of the run's checkpoints: when to save, the background write, the hand-over
to the run, and restoring.

The checkpointer collects state from the components that own it, each with `state_dict()` /
`load_state_dict()`: small state (the data loader's position) goes into `trainer_state.json`
under its name, tensor state (the EMA weights) into a safetensors file of its own. The backend
writes and reads its shards itself (DeepSpeed and XLA each have their own format); the checkpointer
adds the consolidated weights (`model.safetensors`, at the checkpoints `checkpoint.model_weights`
asks for) and the trainer's step. The folder layout is `vitray.runfolder.checkpoint_folders`'s.

Every file is written once, straight into the run folder (local or s3://), and durably: each
rank writes its share with `vitray.trainers.checkpoint.rank_files` and, last, its completion
record; the folder handed to Ray Train is already in storage (nothing is staged or copied).

Saving costs training little more than a snapshot: at a save step every rank snapshots its share
into host buffers and goes on training while a background thread serialises and writes the files
and, last, the rank's completion record. The folder is handed to the run (`report`) at the first
step at which every rank has finished writing. Whether that is now is decided jointly (one small
all-reduce per step while a write is in flight), so all ranks report it at the same step, as Ray
Train requires.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vitray import storage
from vitray.trainers.checkpoint import rank_files as ckpt
from vitray.trainers.collectives import all_reduce, broadcast_json
from vitray.trainers.context import Reporter
from vitray.trainers.engines.seam import PendingSave, TrainBackend, Written


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# Errors that mean "the disk cannot take the checkpoint" (full, over quota, over a file-size limit).
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class CheckpointDiskFull(OSError):
    """The run folder's disk could not hold this rank's share of a checkpoint."""


def _disk_error(error: BaseException) -> OSError | None:
    while error is not None:
        if isinstance(error, OSError) and error.errno in _NO_SPACE:
            return error
        error = error.__cause__ or error.__context__
    return None


# `checkpoint.model_weights`: which checkpoints carry the consolidated model.safetensors.
MODEL_WEIGHTS_CHOICES = ("every", "last", "none")


class Checkpointer:
    """Saves every `every` steps and at `last_step`; restores from a complete checkpoint folder.

    `states`: name in `trainer_state.json` -> component (JSON-able state); `weights`: file name ->
    component (tensor state: its `state_dict()` is collective and gives whole CPU tensors on rank 0,
    as `Ema`'s does through `backend.to_host`); `record`: what `trainer_state.json` also says about
    the run (classes, architecture, config); `run_dir`: the run folder (local or s3://) the
    checkpoint folders are written into; `model_weights`: which checkpoints carry the consolidated
    `model.safetensors` ("every", "last": the run's last step only, "none").
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
        run_dir: str,
        model_weights: str = "last",
        record_delay_s: float = 0.0,
    ):
        if model_weights not in MODEL_WEIGHTS_CHOICES:
            raise ValueError(f"checkpoint.model_weights must be one of {MODEL_WEIGHTS_CHOICES}, got {model_weights!r}")
        self.backend, self.rank, self.world = backend, rank, world_size
        self.every, self.last_step = every, last_step
        self.report = report
        self.states, self.weights, self.record = states, weights, record
        self.run_dir = str(run_dir).rstrip("/")
        self.model_weights = model_weights
        self.record_delay_s = record_delay_s  # tests (debug.checkpoint_record_delay_s)
        self._in_flight: _InFlight | None = None
        self._costs: dict[str, float] = {}
        # Called by rank 0 at each save; the background write waits on the handle it returns
        # (`wait()`) before the completion record: the loop sets it to the metrics upload, so a
        # checkpoint never counts before the lines logged up to its step are in the run folder.
        self.before_complete: Callable[[], Any] | None = None
        # Called by rank 0's writer just before its completion record: raises where the checkpoint
        # must not count (the loop sets it to `vitray.runfolder.lease.holder_check`: the driver gone).
        self.before_record: Callable[[], None] | None = None

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last_step

    def save(self, step: int, metrics: dict[str, Any]) -> None:
        """Snapshot this rank's share of the checkpoint at `step` and write it in the background,
        straight into its folder in the run folder; `metrics` go to the run with the folder when it
        is handed over."""
        t0 = time.perf_counter()
        # One name for all ranks (rank 0's clock), which sorts in the run's order.
        name = broadcast_json(ckpt.checkpoint_name(step) if self.rank == 0 else None, self.backend.device)
        folder = storage.join(self.run_dir, name)
        try:
            shards = self.backend.save(folder)
        except OSError as error:
            self._raise_if_disk_full(error, step, folder)
            raise
        # Collectives: every rank takes part; rank 0 gets the whole tensors.
        files = {ckpt.MODEL_FILE: self.backend.full_state_dict()} if self._with_model_weights(step) else {}
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
        writer = _Writer(
            folder,
            self.rank,
            shards,
            files if lead else {},
            state if lead else None,
            also,
            self.record_delay_s,
            self.before_record if lead else None,
        )
        self._in_flight = _InFlight(folder, step, metrics, writer, snapshot_s=time.perf_counter() - t0)

    def _with_model_weights(self, step: int) -> bool:
        """Whether the checkpoint of `step` carries model.safetensors: as `model_weights` says, and
        always where the backend's shards do not give the weights (evaluation reads them)."""
        if not getattr(self.backend, "weights_in_shards", False):
            return True
        return self.model_weights == "every" or (self.model_weights == "last" and step == self.last_step)

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
        # snapshot, any wait for the writer, and handing the folder to the run).
        self._costs = {
            "checkpoint_write_s": written,
            "checkpoint_bytes": float(flight.writer.bytes),
            "checkpoint_blocked_s": flight.snapshot_s + waited + handed_over,
            "checkpoint_snapshot_s": flight.snapshot_s,
            "checkpoint_wait_s": waited,
            "checkpoint_report_s": handed_over,
        }

    def _raise_if_disk_full(self, error: BaseException, step: int, folder: str) -> None:
        """A full disk: remove this save's partial folder (so the disk is not left full; it never
        gets this rank's completion record, so it would never count) and stop with what to free.
        The run's latest complete checkpoint is untouched and a re-run resumes from it."""
        cause = _disk_error(error)
        if cause is None:
            return
        with contextlib.suppress(Exception):
            fs, fs_path = storage.filesystem(folder)
            fs.rm(fs_path, recursive=True)
        where = self.run_dir
        space = ""
        if not storage.is_remote(where):
            usage = shutil.disk_usage(where)
            space = f"; {usage.free / 2**20:.0f} MiB free of {usage.total / 2**20:.0f} MiB"
        raise CheckpointDiskFull(
            cause.errno,
            f"rank {self.rank} could not write the checkpoint of step {step} into the run folder {where} "
            f"({cause.strerror or cause}{space}). "
            "Training stops here; the run's latest complete checkpoint is intact and re-running the same command "
            f"resumes from it. Free space in {where} (it needs room for one more checkpoint than checkpoint.keep) "
            "or lower checkpoint.keep",
        ) from error

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
            if name in state or not getattr(part, "optional", False):
                part.load_state_dict(state[name])
        return int(state["step"])


class _Writer:
    """Writes one rank's checkpoint files on a background thread: waits for the backend's shards,
    writes rank 0's weight files and trainer state, makes the folders' entries durable, and writes
    the completion record last."""

    def __init__(
        self,
        folder: str,
        rank: int,
        shards: PendingSave,
        files: dict[str, dict],
        state: dict | None,
        also_wait=None,
        record_delay_s: float = 0.0,
        before_record: Callable[[], None] | None = None,
    ):
        self.seconds = 0.0
        self.bytes = 0
        self._error: BaseException | None = None
        self._args = (folder, rank, shards, files, state, also_wait, record_delay_s, before_record)
        self._thread = threading.Thread(target=self._run, name=f"vitray-ckpt-r{rank}", daemon=True)
        self._started = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        folder, rank, shards, files, state, also_wait, record_delay_s, before_record = self._args
        try:
            from safetensors.torch import save

            written: list[Written] = []
            for name, tensors in files.items():
                written.append(ckpt.write_bytes(folder, name, save(tensors)))
            written += shards.wait()
            if also_wait is not None:
                also_wait.wait()
            if state is not None:
                written.append(ckpt.write_state(folder, state))
            ckpt.sync_folders(folder, written)
            time.sleep(record_delay_s)  # tests: a checkpoint whose files are written, its record not yet
            if before_record is not None:
                before_record()
            ckpt.mark_complete(folder, rank, written)
            self.bytes = sum(w.size for w in written)
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
    folder: str
    step: int
    metrics: dict[str, Any]
    writer: _Writer
    snapshot_s: float  # how long the snapshot held training up
