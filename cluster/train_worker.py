"""The entry point of every Ray Train worker of a `vitray pretrain` run: Ray in, a `WorkerContext`
out, then the training loop (`vitray.trainers.loop`), which knows nothing of Ray.

What the worker takes from Ray: its ranks, its device, the checkpoint the driver announced and
whether Ray restarted the worker group (which checkpoint that makes it is the trainers'
`checkpoint_restore`'s answer); what it gives back: each checkpoint, reported with its metrics.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray.train
import ray.train.torch
from pydantic import ValidationError
from ray.train import CheckpointUploadMode

from vitray.cluster.drain import drain_watch
from vitray.common.config import ConfigError
from vitray.common.failures import RestartCannotFix, describe_failure
from vitray.runfolder.checkpoint_folders import prune_checkpoints
from vitray.trainers.config import TrainingConfig
from vitray.trainers.context import WorkerContext


def train_worker(loop_config: dict[str, Any]) -> None:
    """Runs in every Ray Train worker; `loop_config` is what `torch_trainer.build_trainer` sends.
    An error that a restart cannot fix is raised as RestartCannotFix (its cause's one line), which
    the driver's failure policy does not retry (`torch_trainer.build_trainer`)."""
    try:
        _train(loop_config)
    except Exception as error:
        if isinstance(error, _not_fixed_by_a_restart()):
            raise RestartCannotFix(describe_failure(error).one_line()) from error
        raise


def _not_fixed_by_a_restart() -> tuple[type[BaseException], ...]:
    """Errors that a new worker group would meet again: data missing from storage or unreadable (a
    batch of only damaged samples), a config value only the worker finds wrong (it validates the
    config again), a non-finite loss or gradient (`train.nonfinite=stop`: a step is a function of the
    seed and the checkpoint, so it recurs). Imported here: the driver imports this module, and the
    data side imports torch."""
    from vitray.data.batch import UnreadableData
    from vitray.data.reader import ShardMissing

    return (ShardMissing, UnreadableData, ConfigError, ValidationError, FloatingPointError)


def _train(loop_config: dict[str, Any]) -> None:
    from vitray.trainers.loop import TrainingLoop  # the worker's heavy imports, not the driver's

    cfg = TrainingConfig.model_validate(loop_config["config"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    # checkpoint.keep: rank 0 deletes what newer complete checkpoints superseded, off the training
    # thread, one prune at a time (see `prune_checkpoints` for why not Ray's num_to_keep).
    pruner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitray-prune") if rank == 0 else None

    def report(metrics: dict[str, Any], checkpoint_dir: str) -> None:
        # Only checkpoints go to Ray Train (see `vitray.trainers.context.Reporter`): every report is
        # a barrier across the ranks that Ray holds until its controller collects it (every 2 s).
        # The ranks wrote the checkpoint straight into the run folder: Ray is handed it where it
        # lies, on its own filesystem, and copies nothing.
        name = checkpoint_dir.rstrip("/").rsplit("/", 1)[-1]
        run_storage = ray.train.get_context().get_storage()
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint(
                path=f"{run_storage.experiment_fs_path}/{name}", filesystem=run_storage.storage_filesystem
            ),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )
        if pruner is not None:
            pruner.submit(prune, loop_config["run_dir"], cfg.checkpoint.keep)

    worker = WorkerContext(
        rank=rank,
        world_size=world,
        run_dir=loop_config["run_dir"],
        report=report,
        resume_from=loop_config["resume_from"],
        resume_step=loop_config["resume_step"],
        restarted=ray.train.get_checkpoint() is not None,  # Ray hands back its latest one after a restart
        device=ray.train.torch.get_device(),
        drain_notice=drain_watch(world),  # Ray's notice that a node will go
    )
    try:
        TrainingLoop(cfg, worker).run()
    finally:
        if pruner is not None:
            pruner.shutdown(wait=True)


def prune(run_dir: str, keep: int) -> None:
    """`checkpoint.keep`, best effort: a prune that fails is said, and training goes on."""
    try:
        prune_checkpoints(run_dir, keep)
    except Exception as error:
        print(
            f"vitray: could not delete old checkpoints of {run_dir} (checkpoint.keep): {error}",
            file=sys.stderr,
            flush=True,
        )
