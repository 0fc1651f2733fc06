"""The Ray Train call of a `vitray pretrain` run: its `TorchTrainer` (workers, process group,
run folder, failures) and `fit()` on a thread of its own.

Ray Train's own list of the run's checkpoints (its snapshot file) is removed before each start:
vitray deletes old checkpoints itself (`checkpoint.keep`) and announces the one to resume from,
and Ray refuses to start on a snapshot naming a folder that is gone. `FailureConfig(max_failures)`
restarts a failed worker group from Ray's latest checkpoint, unless a worker failed with an error that
a restart cannot fix (`RestartCannotFix`): then the run fails at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, UserCallback
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME  # see _forget_ray_snapshot
from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy  # see _Trainer
from ray.train.v2.api.exceptions import WorkerGroupError

from vitray import storage
from vitray.cluster.process_group import NodeBoundTorchConfig
from vitray.cluster.runtime import check_local_resources, check_ray_alive, ray_storage
from vitray.cluster.train_worker import train_worker
from vitray.common.failures import describe_failure, restart_cannot_fix
from vitray.common.leftovers import remove_stale
from vitray.runfolder.checkpoint_folders import CheckpointInfo, resume_point
from vitray.runfolder.files import run_dir
from vitray.trainers.config import TrainingConfig
from vitray.trainers.driver_checks.tpu_slices import tpu_slice

# The config keys behind each resource a worker asks for (for error messages).
RESOURCE_SETTINGS = {"CPU": "cluster.cpus_per_worker", "GPU": "cluster.gpus_per_worker", "TPU": "cluster.tpu"}


def scaling_config(cfg: TrainingConfig) -> ScalingConfig:
    """GPU/CPU workers, or (cluster.tpu) one worker per host of a TPU slice, placed by Ray Train's
    TPU support (a slice placement group: all hosts of one slice, reserved together)."""
    cluster = cfg.cluster
    resources = {"CPU": cluster.cpus_per_worker, **cluster.resources_per_worker}
    if cluster.tpu is not None:
        tpu = tpu_slice(cluster.tpu, cluster.tpu_topology)
        resources.setdefault("TPU", tpu.chips_per_host)
        return ScalingConfig(
            num_workers=tpu.hosts,
            use_tpu=True,
            topology=tpu.topology,
            accelerator_type=tpu.accelerator_type,
            resources_per_worker=resources,
        )
    use_gpu = cluster.gpus_per_worker > 0
    if use_gpu:
        resources["GPU"] = cluster.gpus_per_worker
    return ScalingConfig(num_workers=cluster.num_workers, use_gpu=use_gpu, resources_per_worker=resources)


def check_workers_fit(cfg: TrainingConfig) -> None:
    """On an embedded local Ray: the workers' resources are there (`NotEnoughResources`)."""
    scaling = scaling_config(cfg)
    check_local_resources(scaling.num_workers, scaling.resources_per_worker, RESOURCE_SETTINGS)


# Under unlimited restarts (`cluster.max_failures=-1`, every paper recipe: pre-emptible nodes) a
# failure that is no lost worker, node or connection and comes back word for word this many times in
# a row, the run's latest checkpoint the same each time, is not waited out: a bug or a value only the
# workers find wrong restarted every few seconds for good, and an unattended run held its nodes. (A
# bounded max_failures is the user's own budget; an error that recurs after progress is restarted.)
SAME_FAILURE_LIMIT = 3


class SameFailureAgain:
    """The worker group failures seen so far, one call each: whether this one ends the run."""

    def __init__(self, max_failures: int, run_dir: str | None):
        self.unlimited, self.run_dir = max_failures < 0, run_dir
        self._last: tuple[list[str], object] | None = None
        self._times = 0

    def final(self, errors: list[BaseException]) -> bool:
        failures = [describe_failure(error) for error in errors]
        if not self.unlimited or not failures or any(failure.transient for failure in failures):
            self._last, self._times = None, 0
            return False
        seen = (sorted({failure.one_line(limit=300) for failure in failures}), self._latest_checkpoint())
        self._times = self._times + 1 if seen == self._last else 1
        self._last = seen
        return self._times >= SAME_FAILURE_LIMIT

    def _latest_checkpoint(self) -> object:
        """The run's latest complete checkpoint; where it cannot be read, a value equal to no other
        (progress unknown: counted as progress)."""
        try:
            chosen, _ = resume_point(self.run_dir) if self.run_dir else (None, [])
        except Exception:
            return object()
        return chosen.path if chosen is not None else None


class _NoRestartForWhatARestartCannotFix(FailurePolicy):
    """Ray Train's own failure policy (`max_failures` restarts), except that a worker group failing
    with a RestartCannotFix (`train_worker`: data missing from storage, a config value only the
    worker finds wrong), or under unlimited restarts with the same failure again and again
    (`SameFailureAgain`), fails the run at once: a new group would meet the same error."""

    def __init__(self, default: FailurePolicy, run_dir: str | None = None):
        super().__init__(default.failure_config)
        self.default = default
        self.again = SameFailureAgain(default.failure_config.max_failures, run_dir)

    def make_decision(self, training_failed_error) -> FailureDecision:
        if isinstance(training_failed_error, WorkerGroupError):
            errors = list(dict(getattr(training_failed_error, "worker_failures", None) or {}).values())
            # (both asked: the repeats are counted at every failure of the group)
            again = self.again.final(errors)
            if restart_cannot_fix(training_failed_error) or again:
                return FailureDecision.RAISE
        return self.default.make_decision(training_failed_error)


class _Trainer(TorchTrainer):
    """TorchTrainer with vitray's failure policy. Private on purpose: Ray Train takes no failure
    policy of one's own (only `FailureConfig`'s counts); `fit()` hands the controller the one it
    builds through this method, whose absence in another Ray fails loudly here (below)."""

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        policy = controller_init_kwargs["failure_policy"]
        run_folder = (self.train_loop_config or {}).get("run_dir")
        controller_init_kwargs["failure_policy"] = _NoRestartForWhatARestartCannotFix(policy, run_folder)
        return super()._initialize_and_run_controller(**controller_init_kwargs)


assert callable(getattr(TorchTrainer, "_initialize_and_run_controller", None)), "Ray Train's controller start moved"


class _WorkerGroupFailures(UserCallback):
    """Each failure of the worker group (a worker that raised, died or lost its node), as a JSON line
    in a local file the driver follows (`fit`): Ray Train restarts the group in silence otherwise.
    It runs on Ray Train's controller, which Ray pins to the driver's node: the file is the driver's."""

    def __init__(self, path: str, max_failures: int, run_dir: str):
        self.path = path
        self.again = SameFailureAgain(max_failures, run_dir)  # counted as the failure policy counts them

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        errors = sorted(worker_exceptions.items())
        causes = [f"rank {rank}: {describe_failure(error).one_line(limit=300)}" for rank, error in errors]
        again = self.again.final([error for _, error in errors])
        final = again or any(restart_cannot_fix(error) for _, error in errors)  # the failure policy ends the run
        # A note that cannot be written (a driver elsewhere, through ray://) is no reason to fail the
        # controller, whose failure handling runs next.
        with contextlib.suppress(OSError), open(self.path, "a") as notes:
            notes.write(json.dumps({"time": time.time(), "causes": causes, "final": final}) + "\n")


class _FailureNotes:
    """The driver's side of `_WorkerGroupFailures`: the file, and what is new in it."""

    PREFIX = "vitray-worker-failures-"

    def __init__(self):
        remove_stale(self.PREFIX)  # the notes of drivers killed before they removed theirs
        fd, self.path = tempfile.mkstemp(prefix=self.PREFIX, suffix=".jsonl")
        os.close(fd)
        self._read = 0

    def new(self) -> list[dict[str, Any]]:
        """Each failure noted since the last call: its `causes` (a line a rank) and whether it is
        `final` (a restart would meet it again)."""
        with open(self.path, "rb") as notes:
            notes.seek(self._read)
            data = notes.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line being written waits for the next call
        self._read += len(whole)
        return [json.loads(line) for line in whole.decode().splitlines() if line.strip()]

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def build_trainer(
    cfg: TrainingConfig, resume: CheckpointInfo | None = None, failure_notes: str | None = None
) -> TorchTrainer:
    """The run's TorchTrainer; its workers resume from `resume` (the driver's choice, announced with
    its step), or start from scratch. Each worker group failure is noted in `failure_notes` (a local file)."""
    storage_path, storage_fs = ray_storage(cfg.run.storage, cfg.run.storage_outage_s)
    scaling = scaling_config(cfg)
    folder = run_dir(cfg.run.storage, cfg.run.name)
    return _Trainer(
        train_worker,
        train_loop_config={
            "config": cfg.settings(),
            "run_dir": folder,
            "resume_from": resume.path if resume else None,
            "resume_step": resume.step if resume else None,
        },
        torch_config=NodeBoundTorchConfig(backend=cfg.engine.process_group(scaling.use_gpu)),
        scaling_config=scaling,
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            failure_config=FailureConfig(max_failures=cfg.cluster.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=None),  # vitray prunes (checkpoint.keep)
            callbacks=[_WorkerGroupFailures(failure_notes, cfg.cluster.max_failures, folder)] if failure_notes else [],
        ),
    )


def fit(
    cfg: TrainingConfig,
    resume: CheckpointInfo | None,
    on_worker_failure: Callable[[int, list[str], bool], None] | None = None,
):
    """Train (a new worker group, resuming from `resume`) until the workers end; Ray Train's Result.
    `on_worker_failure(n, causes, final)` hears of the n-th failure of the worker group as it
    happens (Ray Train then starts a new one from the latest checkpoint, up to `cluster.max_failures`
    times, unless it is `final`: a restart would meet it again).

    `trainer.fit()` runs on a thread of its own. On the main thread Ray Train installs a SIGINT
    handler that aborts the workers without a checkpoint; here the driver's own handler
    (`cluster/stop_signals.py`) keeps Ctrl-C, and treats it like a pre-emption notice. Ray's GCS or
    raylet going away raises RayLost (`runtime.check_ray_alive`), so that the driver's attempt
    record and lease are closed before Ray ends the process."""
    _forget_ray_snapshot(run_dir(cfg.run.storage, cfg.run.name))
    notes = _FailureNotes()
    trainer = build_trainer(cfg, resume, notes.path)
    outcome: dict[str, Any] = {}
    failures = 0

    def tell() -> None:
        nonlocal failures
        for note in notes.new():
            failures += 1
            if on_worker_failure is not None:
                on_worker_failure(failures, note["causes"], note["final"])

    def run() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, name="vitray-fit", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)  # short waits: the main thread runs signal handlers in between
            check_ray_alive(f"the run {cfg.run.name}")  # Ray would end this process in silence
            tell()
        tell()
    finally:
        notes.close()
    if "error" in outcome:
        error = outcome["error"]
        if describe_failure(error).kind == "CheckpointManagerInitializationError":
            # Ray's own words blame a "corrupted run directory" and advise deleting it, every checkpoint
            # with it; the snapshot was removed above, so another driver wrote it meanwhile.
            raise RunWrittenElsewhere(
                f"another driver is writing the run {cfg.run.name}: Ray Train's list of its checkpoints changed while "
                "this driver started (the take-over of a live run with --force?). Stop the other driver, then re-run "
                "the same command; the run folder is intact: do not delete it"
            ) from error
        raise error
    return outcome["result"]


class RunWrittenElsewhere(RuntimeError):
    """Another driver wrote the run's checkpoints while this one started its workers."""


def _forget_ray_snapshot(folder: str) -> None:
    """Remove Ray Train's snapshot of the run's checkpoints: the driver announces the checkpoint to
    resume from, and the snapshot may name checkpoints that `checkpoint.keep` has deleted since."""
    # Private on purpose: Ray Train has no public way to forget a run's checkpoint list (no
    # `RunConfig` or `CheckpointConfig` option, no API over the snapshot file); the file's name is
    # taken from Ray rather than copied, so a rename in Ray breaks loudly here, not silently.
    storage.remove(storage.join(folder, CHECKPOINT_MANAGER_SNAPSHOT_FILENAME))
