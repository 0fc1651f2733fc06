"""`vitray pretrain`: one Ray Train V2 TorchTrainer per run.

Re-submitting the same run resumes it: the driver finds the newest complete checkpoint in the run
folder and announces it to the workers. Ray Train's own list of the run's checkpoints (its
snapshot file) is removed before each start: vitray deletes old checkpoints itself
(`checkpoint.keep`), and Ray refuses to start on a snapshot naming a folder that is gone.
`FailureConfig(max_failures)` restarts a failed worker group from Ray's latest checkpoint.

Before anything is written or started, `vitray.trainers.preflight` checks storage, datasets and
model, and under the lease whether the run's checkpoint can load into this config. Around `fit()`
the driver holds the run's lease (one driver per run, `vitray.runfolder.lease`), records the attempt
in the run folder (what `vitray runs` lists), says where it resumes from and why when it falls
back, and turns a SIGTERM or a Ctrl-C into a stop notice for the workers
(`vitray.trainers.preemption`): checkpoint at the next agreed step, stop, exit 75 (or 130 after
Ctrl-C; `vitray.common.exit_codes`). When Ray drains
a node that holds a worker (`cluster/drain.py`), the workers checkpoint and stop the same way and
the driver goes on with a new worker group placed away from that node.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray.train
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from ray.train.torch import TorchConfig, TorchTrainer

from vitray import storage
from vitray.cluster.drain import current_node, drain_watch, draining_nodes
from vitray.cluster.runtime import (
    LocalPathsOnCluster,
    NotEnoughResources,
    check_cluster_answers,
    check_local_resources,
    check_paths_reach_every_node,
    connect,
    node_resources,
    ray_storage,
    run_dir,
)
from vitray.runfolder.lease import RunLeaseHeld
from vitray.runfolder.progress import TrainingProgress
from vitray.trainers.checkpointer import remove_stale_staging
from vitray.trainers.collectives import broadcast_json
from vitray.trainers.config import TrainingConfig
from vitray.trainers.context import WorkerContext
from vitray.trainers.evals import VAL_TOP1
from vitray.trainers.preflight import PreflightError

# What `pretrain` raises when the run fails for good (each failed rank's traceback in its message).
__all__ = [
    "RESOURCE_SETTINGS",
    "AlreadyFinished",
    "Preempted",
    "TrainingFailedError",
    "build_trainer",
    "pretrain",
    "scaling_config",
    "train_worker",
]


def train_worker(loop_config: dict[str, Any]) -> None:
    """Runs in every Ray Train worker."""
    from ray.train import CheckpointUploadMode

    from vitray.trainers.loop import TrainingLoop

    cfg = TrainingConfig.model_validate(loop_config["config"])
    context = ray.train.get_context()

    # checkpoint.keep: rank 0 deletes what newer complete checkpoints superseded, off the training
    # thread, one prune at a time (see `prune_checkpoints` for why not Ray's num_to_keep).
    pruner = (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitray-prune") if context.get_world_rank() == 0 else None
    )

    def report(metrics: dict[str, Any], checkpoint_dir: Path) -> None:
        # Only checkpoints go to Ray Train (see `vitray.trainers.context.Reporter`): every report is
        # a barrier across the ranks that Ray holds until its controller collects it (every 2 s).
        # Uploads in the background; training goes on as soon as the local files are written.
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(str(checkpoint_dir)),
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
        )
        if pruner is not None:
            pruner.submit(_prune, loop_config["run_dir"], cfg.checkpoint.keep)

    with contextlib.ExitStack() as stack:
        rank, world = context.get_world_rank(), context.get_world_size()
        if context.get_local_rank() == 0:
            # Before the broadcast below, which every rank waits for: no rank of this attempt has
            # staged anything yet.
            stale = remove_stale_staging(cfg.checkpoint.staging_dir, loop_config["run_dir"])
            if stale:
                print(
                    f"vitray: removed {len(stale)} staging folder(s) of this run left by an earlier attempt "
                    f"on this node ({stale[0].parent})",
                    file=sys.stderr,
                    flush=True,
                )
        # Rank 0 picks the checkpoint (verifying it on storage once) and tells the others; each
        # rank then copies only the files it reads (`restore_files`).
        device = ray.train.torch.get_device()
        choice = broadcast_json(_choose_restore(ray.train.get_checkpoint(), loop_config) if rank == 0 else None, device)
        restore_dir, restore_state = _rank_copy(choice, cfg, rank, world, stack) if choice else (None, None)
        worker = WorkerContext(
            rank=rank,
            world_size=world,
            run_dir=loop_config["run_dir"],
            report=report,
            restore_dir=restore_dir,
            restore_state=restore_state,
            drain_notice=drain_watch(world),  # Ray's notice that a node will go
        )
        try:
            TrainingLoop(cfg, worker).run()
        finally:
            if pruner is not None:
                pruner.shutdown(wait=True)


def _prune(run_dir: str, keep: int) -> None:
    from vitray.runfolder.checkpoint_folders import prune_checkpoints

    try:
        prune_checkpoints(run_dir, keep)
    except Exception as error:
        print(
            f"vitray: could not delete old checkpoints of {run_dir} (checkpoint.keep): {error}",
            file=sys.stderr,
            flush=True,
        )


def _choose_restore(checkpoint: ray.train.Checkpoint | None, loop_config: dict[str, Any]) -> list | None:
    """[path, step] of the checkpoint to resume from, or None (from scratch); run on rank 0.

    At the start of an attempt (Ray has no checkpoint of its own yet), the one the driver chose with
    `resume_point` and verified, sent with its step: nothing is read again. After a restart inside
    the run (a lost worker: Ray hands back its latest checkpoint), `resume_point` again, knowing the
    driver's choice: only the checkpoints written since are read, and one whose files were lost or
    cut short after Ray registered it is never loaded."""
    from vitray.runfolder.checkpoint_folders import CheckpointInfo, resume_point

    run = loop_config["run_dir"]
    announced, step = loop_config.get("resume_from"), loop_config.get("resume_step")
    known = CheckpointInfo(announced, int(step), True) if announced and step is not None else None
    if checkpoint is None and (known is not None or not announced):
        return [known.path, known.step] if known is not None else None
    chosen, skipped = resume_point(run, known=known)
    for c in skipped:
        print(f"vitray: skipped newer checkpoint {c.path}: {c.problem}", flush=True)
    if chosen is None and checkpoint is not None:
        raise RuntimeError(f"Ray restarted the run {run} from a checkpoint, but it has no complete checkpoint")
    return [chosen.path, chosen.step] if chosen is not None else None


def _rank_copy(
    choice: list, cfg: TrainingConfig, rank: int, world: int, stack: contextlib.ExitStack
) -> tuple[Path, dict]:
    """This rank's local copy of the chosen checkpoint and its trainer state: only the files it
    reads for DeepSpeed on the same number of workers; otherwise the whole folder, which Ray
    downloads once per node."""
    from vitray.runfolder.checkpoint_folders import read_state
    from vitray.trainers.checkpoint_files import node_restore_dir, rank_copy

    path = choice[0]
    select = cfg.engine.restore_files(cfg, rank, world) or (lambda state, names: None)
    node_dir = stack.enter_context(node_restore_dir(path, cfg.checkpoint.staging_dir))
    copied = rank_copy(path, select, node_dir, rank)
    if copied is not None:
        return copied
    folder = _open(path, stack)
    return folder, read_state(folder)


def _open(checkpoint_path: str, stack: contextlib.ExitStack) -> Path:
    """A local copy of a whole checkpoint folder on the run's storage (one download per node)."""
    path, filesystem = ray_storage(checkpoint_path)
    return Path(stack.enter_context(ray.train.Checkpoint(path, filesystem=filesystem).as_directory()))


# The config keys behind each resource a worker asks for (for error messages).
RESOURCE_SETTINGS = {"CPU": "cluster.cpus_per_worker", "GPU": "cluster.gpus_per_worker", "TPU": "cluster.tpu"}


def scaling_config(cfg: TrainingConfig) -> ScalingConfig:
    """GPU/CPU workers, or (cluster.tpu) one worker per host of a TPU slice, placed by Ray Train's
    TPU support (a slice placement group: all hosts of one slice, reserved together)."""
    cluster = cfg.cluster
    resources = {"CPU": cluster.cpus_per_worker, **cluster.resources_per_worker}
    if cluster.tpu is not None:
        from vitray.trainers.engines.xla.slices import tpu_slice

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


def build_trainer(cfg: TrainingConfig, resume_from: str | None = None, resume_step: int | None = None) -> TorchTrainer:
    storage_path, storage_fs = ray_storage(cfg.run.storage)
    scaling = scaling_config(cfg)
    backend = cfg.engine.process_group(scaling.use_gpu)
    return TorchTrainer(
        train_worker,
        train_loop_config={
            "config": cfg.settings(),
            "run_dir": run_dir(cfg.run.storage, cfg.run.name),
            "resume_from": resume_from,
            "resume_step": resume_step,
        },
        torch_config=TorchConfig(backend=backend),
        scaling_config=scaling,
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            failure_config=FailureConfig(max_failures=cfg.cluster.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=None),  # vitray prunes (checkpoint.keep)
        ),
    )


# What `pretrain` raises when it refuses a run before the workers start (the CLI's exit 2): a config or
# input pre-flight rejects, resources the cluster lacks, local paths the nodes cannot see, a run that
# another driver holds.
REFUSED = (PreflightError, NotEnoughResources, LocalPathsOnCluster, RunLeaseHeld)


class Preempted(Exception):
    """The run stopped on a notice (SIGTERM, a node drain, or Ctrl-C when `by_user`) after the
    workers checkpointed; `result` is Ray Train's Result."""

    def __init__(self, result, reason: str, *, by_user: bool = False):
        super().__init__(reason)
        self.result, self.by_user = result, by_user


class AlreadyFinished(Exception):
    """The run's latest complete checkpoint is at (or past) train.steps: nothing to train."""

    def __init__(self, checkpoint):
        super().__init__(f"step {checkpoint.step} ({checkpoint.path})")
        self.checkpoint = checkpoint


def _with_worker_cpus(cfg: TrainingConfig) -> TrainingConfig:
    """`cluster.cpus_per_worker` (and `data.num_workers`) resolved from the cluster's nodes where
    left unset on an accelerator run, said once on the console."""
    resolved = cfg.with_worker_cpus(node_resources())
    if resolved is not cfg:
        print(
            f"vitray: {resolved.cluster.cpus_per_worker:g} CPUs per training worker (cluster.cpus_per_worker unset: "
            f"a {'TPU host' if cfg.cluster.tpu else 'GPU node'}'s CPUs but one"
            f"{'' if cfg.cluster.tpu else ' per GPU'}), {resolved.data.num_workers} loader workers each",
            file=sys.stderr,
            flush=True,
        )
    return resolved


def pretrain(cfg: TrainingConfig, *, show_progress: bool = True, verbose: bool = False, force: bool = False):
    """Run (or resume) the pre-training run described by `cfg`; returns Ray Train's Result.

    Refuses a run that cannot start (`PreflightError`: storage, datasets, model, a resume whose
    checkpoint would not load) before the lease or Ray is touched, and raises AlreadyFinished for a
    finished run, RunLeaseHeld when another driver runs it, and Preempted after a SIGTERM or Ctrl-C
    once the workers have checkpointed and stopped.
    """
    from vitray.runfolder.checkpoint_folders import describe_resume, resume_point
    from vitray.runfolder.files import RunFiles
    from vitray.runfolder.lease import RunLease
    from vitray.trainers.preemption import clear_stop
    from vitray.trainers.preflight import check_inputs, check_resume

    info = check_inputs(cfg)  # seconds, before anything is written or started
    check_cluster_answers(cfg.cluster.address)  # a cluster that is not there: no lease, no attempt
    folder = run_dir(cfg.run.storage, cfg.run.name)
    lease = RunLease(folder, timeout_s=cfg.run.lease_timeout_s, force=force, on_lost=_lease_lost)
    warning = lease.acquire()  # before any Ray resources are taken
    files = RunFiles(folder)
    attempt = None
    try:
        if warning:
            print(f"vitray: {warning}", file=sys.stderr, flush=True)
        plan = check_resume(cfg, folder, info)
        chosen = plan.chosen
        if plan.finished:
            raise AlreadyFinished(chosen)
        clear_stop(folder)
        print(describe_resume(cfg.run.name, chosen, plan.skipped), file=sys.stderr, flush=True)
        for change in plan.changes:
            print(f"  changed since the checkpoint: {change}", file=sys.stderr, flush=True)
        attempt = files.new_attempt(
            lease.owner,
            resumed_from_step=chosen.step if chosen else None,
            resumed_from=chosen.path if chosen else None,
            skipped=[f"{c.path}: {c.problem}" for c in plan.skipped],
        )
        connect(cfg.cluster.address, verbose=verbose)
        cfg = _with_worker_cpus(cfg)
        check_paths_reach_every_node(
            {
                "run.storage": cfg.run.storage,
                "data.train": cfg.data.train,
                "data.val": cfg.data.val,
                "init.checkpoint": cfg.init.checkpoint,
            },
            shared_filesystem=cfg.cluster.shared_filesystem,
        )
        cfg.engine.prepare_resume(cfg, chosen)
        _forget_ray_snapshot(folder)
        trainer = build_trainer(
            cfg, resume_from=chosen.path if chosen else None, resume_step=chosen.step if chosen else None
        )
        scaling = scaling_config(cfg)
        check_local_resources(scaling.num_workers, scaling.resources_per_worker, RESOURCE_SETTINGS)
        progress = TrainingProgress(folder, total_steps=cfg.train.steps, headline=VAL_TOP1, label="val top-1")
        with (
            _StopOnSignal(folder, cfg.run.preemption_grace_s) as stop,
            progress if show_progress else contextlib.nullcontext(),
        ):
            result = _fit(trainer)
            while stop.reason is None and (drained := _stopped_for_drain(folder)) is not None:
                # The workers checkpointed because Ray is draining one of their nodes: go on
                # with a new worker group, which Ray places away from it.
                files.end_attempt(attempt, "stopped", drained, **_last_step(folder))
                if current_node() in draining_nodes():
                    raise Preempted(result, f"{drained}; this driver's node is draining too")
                print(
                    f"vitray: {drained}: the workers checkpointed and stopped; starting a new worker group "
                    "away from that node",
                    file=sys.stderr,
                    flush=True,
                )
                clear_stop(folder)
                chosen, _ = resume_point(folder)
                attempt = files.new_attempt(
                    lease.owner,
                    resumed_from_step=chosen.step if chosen else None,
                    resumed_from=chosen.path if chosen else None,
                    skipped=[],
                )
                _forget_ray_snapshot(folder)
                result = _fit(
                    build_trainer(
                        cfg,
                        resume_from=chosen.path if chosen else None,
                        resume_step=chosen.step if chosen else None,
                    )
                )
        _prune(folder, cfg.checkpoint.keep)  # every upload is done now: the last one counts too
        if stop.reason is not None:
            files.end_attempt(attempt, "stopped", stop.reason, **_last_step(folder))
            raise Preempted(result, stop.reason, by_user=stop.by_user)
        files.end_attempt(attempt, "finished", **_last_step(folder))
        return result
    except (Preempted, AlreadyFinished):
        raise
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, without a new checkpoint
        if attempt is not None:
            files.end_attempt(
                attempt, "stopped", "stopped by user (a second Ctrl-C: no new checkpoint)", **_last_step(folder)
            )
        raise
    except BaseException as error:
        if attempt is not None:
            # The whole traceback text for the record (and `vitray runs --verbose`); consoles show its last line.
            files.end_attempt(
                attempt, "failed", "".join(traceback.format_exception_only(error)).strip()[-4000:], **_last_step(folder)
            )
        raise
    finally:
        lease.release()


def _fit(trainer: TorchTrainer):
    """`trainer.fit()` on a thread of its own. On the main thread Ray Train installs a SIGINT
    handler that aborts the workers without a checkpoint; here the driver's own handler
    (`_StopOnSignal`) keeps Ctrl-C, and treats it like a pre-emption notice."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=fit, name="vitray-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)  # short waits: the main thread runs signal handlers in between
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _forget_ray_snapshot(folder: str) -> None:
    """Remove Ray Train's snapshot of the run's checkpoints: the driver announces the checkpoint to
    resume from, and the snapshot may name checkpoints that `checkpoint.keep` has deleted since."""
    # Private on purpose: Ray Train has no public way to forget a run's checkpoint list (no
    # `RunConfig` or `CheckpointConfig` option, no API over the snapshot file); the file's name is
    # taken from Ray rather than copied, so a rename in Ray breaks loudly here, not silently.
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    storage.remove(storage.join(folder, CHECKPOINT_MANAGER_SNAPSHOT_FILENAME))


def _stopped_for_drain(folder: str) -> str | None:
    """The reason the workers gave when they stopped for a node drain (`cluster/drain.py`), else None."""
    from vitray.trainers.preemption import read_stop

    notice = read_stop(folder)
    return notice["reason"] if notice and notice.get("kind") == "drain" else None


def _lease_lost(holder) -> None:
    # Only `--force` (or a heartbeat stalled past the timeout) gets here; this driver is not stopped
    # (a stop notice in the run folder would stop the new holder's workers too), but it says so.
    print(
        f"vitray: WARNING: {holder.describe()} took over this run's lease; two drivers may now write its "
        "checkpoints: stop one of them",
        file=sys.stderr,
        flush=True,
    )


def latest_complete(folder: str):
    """The run folder's newest complete checkpoint (what a re-run or `vitray export` takes), not
    Ray's last reported one, which a failed upload could leave incomplete; from a fresh listing
    (this process listed the folder before training, and s3fs caches listings)."""
    from vitray.runfolder.checkpoint_folders import latest_complete_checkpoint

    storage.filesystem(folder)[0].invalidate_cache()
    return latest_complete_checkpoint(folder)


def _last_step(folder: str) -> dict:
    from vitray.runfolder.checkpoint_folders import latest_complete_checkpoint

    try:
        latest = latest_complete_checkpoint(folder)
    except Exception:
        return {}
    return {"checkpoint_step": latest.step if latest else None}


class _StopOnSignal:
    """While training: SIGTERM (a pre-emption) or Ctrl-C (SIGINT) writes a stop notice for the
    workers, which checkpoint at their next check step and stop. If they have not stopped when the
    grace period is over, the driver exits (143 after SIGTERM, 130 after Ctrl-C) without a new
    checkpoint; a second Ctrl-C stops at once (KeyboardInterrupt)."""

    def __init__(self, folder: str, grace_s: float):
        self.folder, self.grace_s = folder, grace_s
        self.reason: str | None = None
        self.by_user = False
        self._timer: threading.Timer | None = None

    def __enter__(self) -> _StopOnSignal:
        # Only a main thread may take signals (`vitray evaluate` runs fine-tunes from a thread pool).
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._timer is not None:
            self._timer.cancel()

    def _on_signal(self, signum, frame) -> None:
        if self.reason is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # the second Ctrl-C: at once
            return
        self.by_user = signum == signal.SIGINT
        self.reason = "stopped by user (Ctrl-C)" if self.by_user else f"SIGTERM to the driver (pid {os.getpid()})"
        again = "; Ctrl-C again to stop at once, without one" if self.by_user else ""
        print(
            f"vitray: {self.reason}: the workers checkpoint at their next check step and stop "
            f"(grace {self.grace_s:g} s, run.preemption_grace_s){again}",
            file=sys.stderr,
            flush=True,
        )
        from vitray.trainers.preemption import request_stop

        # Storage writes do not belong in a signal handler's frame (it may interrupt one).
        threading.Thread(target=request_stop, args=(self.folder, self.reason, self.grace_s), daemon=True).start()
        self._timer = threading.Timer(self.grace_s, self._out_of_time, args=(128 + signum,))
        self._timer.daemon = True
        self._timer.start()

    def _out_of_time(self, code: int) -> None:
        print(
            f"vitray: grace period of {self.grace_s:g} s over before the workers stopped: exiting without a new "
            "checkpoint (a re-run resumes from the latest complete one)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(code)
