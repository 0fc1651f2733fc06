"""`vitray pretrain`: the run driver, one Ray Train V2 TorchTrainer per worker group.

Re-submitting the same run resumes it: the driver finds the newest complete checkpoint in the run
folder and announces it to the workers (`cluster/torch_trainer.py`, `cluster/train_worker.py`).

Before anything is written or started, `vitray.trainers.driver_checks.preflight` checks storage, datasets and
model, and under the lease whether the run's checkpoint can load into this config. Around the
training the driver holds the run's lease (one driver per run, `vitray.runfolder.lease`), records
each attempt in the run folder (`cluster/run_attempts.py`, what `vitray runs` lists), says where it
resumes from and why when it falls back, and turns a SIGTERM or a Ctrl-C into a stop notice for the
workers (`cluster/stop_signals.py`): checkpoint at the next agreed step, stop, exit 75 (or 130
after Ctrl-C). When Ray drains a node that holds a worker (`cluster/drain.py`), the workers
checkpoint and stop the same way and the driver goes on with a new worker group placed away from
that node.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

from ray.train import TrainingFailedError

from vitray import storage
from vitray.cluster.drain import current_node, draining_nodes, stopped_for_drain
from vitray.cluster.run_attempts import RunAttempts
from vitray.cluster.runtime import (
    LocalPathsOnCluster,
    NotEnoughResources,
    check_cluster_answers,
    check_paths_reach_every_node,
    connect,
    node_resources,
)
from vitray.cluster.stop_signals import StopOnSignal, StoppedBeforeTraining, ray_init_keeps_sigterm
from vitray.cluster.torch_trainer import RunWrittenElsewhere, check_workers_fit, fit
from vitray.cluster.train_worker import prune
from vitray.evaluation.evaluators import VAL_TOP1
from vitray.evaluation.methods.finetune import is_operational
from vitray.runfolder.checkpoint_folders import (
    CheckpointInfo,
    describe_resume,
    latest_complete_checkpoint,
    resume_point,
)
from vitray.runfolder.files import RunFiles, run_dir
from vitray.runfolder.lease import RunLease, RunLeaseHeld
from vitray.runfolder.pins import CheckpointPins
from vitray.runfolder.progress import TrainingProgress
from vitray.trainers.config import TrainingConfig
from vitray.trainers.driver_checks.preflight import (
    PreflightError,
    ResumePlan,
    check_inputs,
    check_resume,
    init_changes,
)

# What `pretrain` raises when the run fails for good (each failed rank's traceback in its message).
__all__ = ["REFUSED", "AlreadyFinished", "Preempted", "TrainingFailedError", "latest_complete", "pretrain"]

# What `pretrain` raises when it refuses a run before the workers start (the CLI's exit 2): a config or
# input pre-flight rejects, resources the cluster lacks, local paths the nodes cannot see, a run that
# another driver holds.
REFUSED = (PreflightError, NotEnoughResources, LocalPathsOnCluster, RunLeaseHeld, RunWrittenElsewhere)


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


def pretrain(cfg: TrainingConfig, *, show_progress: bool = True, verbose: bool = False, force: bool = False):
    """Run (or resume) the pre-training run described by `cfg`; returns Ray Train's Result.

    Refuses a run that cannot start (`PreflightError`: storage, datasets, model, a resume whose
    checkpoint would not load) before the lease or Ray is touched, and raises AlreadyFinished for a
    finished run, RunLeaseHeld when another driver runs it, and Preempted after a SIGTERM or Ctrl-C
    once the workers have checkpointed and stopped.
    """
    info = check_inputs(cfg)  # seconds, before anything is written or started
    _say_warmup_default(cfg)
    check_cluster_answers(cfg.cluster.address)  # a cluster that is not there: no lease, no attempt
    folder = run_dir(cfg.run.storage, cfg.run.name)
    with (
        # Signals are taken before the lease is: a SIGTERM just after the lease was written killed the
        # driver at once (exit -15), the lease and an open attempt left behind. Past the grace period
        # the driver exits at once, its attempt and lease settled first (both held by then).
        StopOnSignal(
            folder,
            cfg.run.preemption_grace_s,
            before_exit=lambda why: (attempts.end("stopped", why), lease.release()),
        ) as stop,
        _held_lease(folder, cfg, force) as lease,
        # A fine-tune's init.checkpoint in a run still training: not pruned by it while this run starts
        CheckpointPins([cfg.init.checkpoint] if cfg.init.checkpoint else []),
        RunAttempts(folder, lease.owner) as attempts,
    ):
        try:  # a stop while the run starts is taken between these steps (`stop.check`)
            plan = check_resume(cfg, folder, info)
            if plan.finished:
                _refuse_other_settings(cfg, plan)
                raise AlreadyFinished(plan.chosen)
            _announce_resume(cfg, folder, plan)
            stop.check()
            with ray_init_keeps_sigterm():
                cfg = _on_the_cluster(cfg, verbose=verbose)
            if plan.chosen is None:
                _say_num_slots_default(cfg)
            stop.take_signals()  # back from Ray's C++ core, which set its own SIGTERM handler
            stop.check()
            check_workers_fit(cfg)  # refused before an attempt is recorded: nothing was tried
            attempts.start(plan.chosen, plan.skipped)
            stop.check()
            cfg.engine.prepare_resume(cfg, plan.chosen)  # e.g. DeepSpeed's conversion for a new world size
            stop.workers_started()  # from here a signal is a stop notice for the workers
        except (StoppedBeforeTraining, SystemExit) as error:  # a pre-emption while starting: nothing to checkpoint
            early = stop.early_stop(error)
            if early is None:
                raise
            attempts.end("stopped", str(early))
            raise Preempted(None, str(early), by_user=early.by_user) from None
        progress = TrainingProgress(
            folder,
            total_steps=cfg.train.steps,
            headline=VAL_TOP1,
            label="val top-1",
            outage_s=cfg.run.storage_outage_s,
            resumed_from=plan.chosen.step if plan.chosen else 0,
            attempt_started=time.time(),
        )
        with progress if show_progress else contextlib.nullcontext():
            result = fit(cfg, plan.chosen, _worker_failures_to(attempts, cfg))
            while stop.reason is None and (drained := stopped_for_drain(folder)) is not None:
                result = _new_worker_group_after_drain(cfg, folder, attempts, drained, result)
        prune(folder, cfg.checkpoint.keep)  # every upload is done now: the last one counts too
        if stop.reason is not None:
            attempts.end("stopped", stop.reason)
            raise Preempted(result, stop.reason, by_user=stop.by_user)
        attempts.end("finished")
        return result


@contextlib.contextmanager
def _held_lease(folder: str, cfg: TrainingConfig, force: bool) -> Iterator[RunLease]:
    """The run's lease, taken before any Ray resources are (released on leaving)."""
    lease = RunLease(
        folder,
        timeout_s=cfg.run.lease_timeout_s,
        force=force,
        on_lost=_lease_lost,
        without_conditional_writes=cfg.run.lease_without_conditional_writes,
        outage_s=cfg.run.storage_outage_s,
    )
    warning = lease.acquire()
    try:
        if warning:
            print(f"vitray: {warning}", file=sys.stderr, flush=True)
        yield lease
    finally:
        lease.release()


def _say_warmup_default(cfg: TrainingConfig) -> None:
    """A run shorter than the default warm-up (the paper's 10,000 steps) that never named its own
    warms up for the whole run and never decays: allowed (the schedule clips it), but said."""
    warmup, steps = cfg.schedule.warmup_steps, cfg.train.steps
    if "warmup_steps" not in cfg.schedule.model_fields_set and warmup >= steps:
        print(
            f"vitray: note: schedule.warmup_steps is unset, and its default ({warmup:,} steps, the paper's) spans the "
            f"whole run (train.steps={steps:,}): the learning rate rises until the last step and never decays; "
            "set schedule.warmup_steps to decay after it",
            file=sys.stderr,
            flush=True,
        )


def _say_num_slots_default(cfg: TrainingConfig) -> None:
    """A new run's `data.num_slots` left unset comes from its cluster (workers x loader workers):
    said, because the sample order is a function of it (with the seed), and a resume can only
    take numbers of workers that divide it."""
    if cfg.data.num_slots is None:
        slots, workers = cfg.new_run_num_slots(), cfg.cluster.num_workers
        print(
            f"vitray: note: data.num_slots is unset: {slots} ({workers} worker{'s' if workers > 1 else ''} x "
            f"{slots // workers} loader slot{'s' if slots // workers > 1 else ''}); the order of the samples "
            f"depends on it, and a resume takes a number of workers that divides it. Set data.num_slots (the "
            "paper's recipes: 1024) to keep the order when the cluster changes",
            file=sys.stderr,
            flush=True,
        )


def _lease_lost(holder) -> None:
    # Only `--force` (or a heartbeat stalled past the timeout) gets here; this driver is not stopped
    # (a stop notice in the run folder would stop the new holder's workers too), but it says so.
    print(
        f"vitray: WARNING: {holder.describe()} took over this run's lease; two drivers may now write its "
        "checkpoints: stop one of them",
        file=sys.stderr,
        flush=True,
    )


def _refuse_other_settings(cfg: TrainingConfig, plan: ResumePlan) -> None:
    """A finished run is this command's only when it computed what this config would: a sweep that
    reuses a run name (other lr, other data flags) must not take the old run for its result. How a
    run goes (`is_operational`, debug) and its length may differ."""
    computed = init_changes(cfg, plan.chosen.state or {}) + [
        c for c in plan.changes if not (is_operational(c) or c.startswith(("debug.", "train.steps:")))
    ]
    if computed:
        raise PreflightError(
            f"run {cfg.run.name} is finished (step {plan.chosen.step}, {plan.chosen.path}) with other settings than "
            f"this command's: {'; '.join(computed)}. Give another run.name to train them, or raise train.steps to "
            f"go on from step {plan.chosen.step} with them"
        )


def _announce_resume(cfg: TrainingConfig, folder: str, plan: ResumePlan) -> None:
    """Where the run resumes from (and why not from a newer checkpoint), after any earlier stop
    notice is cleared: a new attempt starts unstopped."""
    RunFiles(folder).clear_stop()
    print(
        describe_resume(cfg.run.name, plan.chosen, plan.skipped, init=cfg.init.checkpoint), file=sys.stderr, flush=True
    )
    for change in plan.changes:
        print(f"  changed since the checkpoint: {change}", file=sys.stderr, flush=True)


def _on_the_cluster(cfg: TrainingConfig, *, verbose: bool) -> TrainingConfig:
    """Connected to Ray: the config with the workers' CPUs resolved from the cluster's nodes, once
    every path the workers read or write is known to reach every node."""
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
    return cfg


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


def _new_worker_group_after_drain(cfg: TrainingConfig, folder: str, attempts: RunAttempts, drained: str, result):
    """The workers checkpointed because Ray is draining one of their nodes: go on with a new worker
    group, which Ray places away from it (unless this driver's own node is draining too)."""
    attempts.end("stopped", drained)
    if current_node() in draining_nodes():
        raise Preempted(result, f"{drained}; this driver's node is draining too")
    print(
        f"vitray: {drained}: the workers checkpointed and stopped; starting a new worker group away from that node",
        file=sys.stderr,
        flush=True,
    )
    RunFiles(folder).clear_stop()
    resume, _ = resume_point(folder)
    attempts.start(resume)
    return fit(cfg, resume, _worker_failures_to(attempts, cfg))


def _worker_failures_to(attempts: RunAttempts, cfg: TrainingConfig):
    return lambda count, causes, final: attempts.worker_group_failed(count, causes, cfg.cluster.max_failures, final)


def latest_complete(folder: str) -> CheckpointInfo | None:
    """The run folder's newest complete checkpoint (what a re-run or `vitray export` takes), not
    Ray's last reported one, which a failed upload could leave incomplete; from a fresh listing
    (this process listed the folder before training, and s3fs caches listings)."""
    storage.filesystem(folder)[0].invalidate_cache()
    return latest_complete_checkpoint(folder)
