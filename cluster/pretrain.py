"""`vitray pretrain`: one Ray Train V2 TorchTrainer per run.

`RunConfig(name=run.name, storage_path=run.storage)` is what makes re-submitting the same run
resume: Ray Train finds the run's checkpoint snapshot and hands the latest committed checkpoint
to the new workers. `FailureConfig(max_failures)` restarts a failed worker group the same way.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import ray.train
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from ray.train.torch import TorchConfig, TorchTrainer

from vitray.cluster.runtime import check_local_resources, connect, ray_storage, run_dir
from vitray.trainers.config import TrainingConfig
from vitray.trainers.context import WorkerContext
from vitray.trainers.progress import TrainingProgress

# What `pretrain` raises when the run fails for good (each failed rank's traceback in its message).
__all__ = ["RESOURCE_SETTINGS", "TrainingFailedError", "build_trainer", "pretrain", "scaling_config", "train_worker"]


def train_worker(loop_config: dict[str, Any]) -> None:
    """Runs in every Ray Train worker."""
    from ray.train import CheckpointUploadMode

    from vitray.trainers.loop import TrainingLoop

    cfg = TrainingConfig.model_validate(loop_config["config"])
    context = ray.train.get_context()

    def report(metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        if checkpoint_dir is None:
            ray.train.report(metrics)
            return
        # Uploads in the background; training goes on as soon as the local files are written.
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(str(checkpoint_dir)),
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
        )

    with contextlib.ExitStack() as stack:
        restore_dir = None
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:
            restore_dir = _complete_or_fallback(Path(stack.enter_context(checkpoint.as_directory())), loop_config["run_dir"], stack)
        worker = WorkerContext(
            rank=context.get_world_rank(),
            world_size=context.get_world_size(),
            run_dir=loop_config["run_dir"],
            report=report,
            restore_dir=restore_dir,
        )
        TrainingLoop(cfg, worker).run()


def _complete_or_fallback(restore_dir: Path, run_dir: str, stack: contextlib.ExitStack) -> Path:
    """Ray's latest checkpoint when it is complete; else the newest complete one in the run folder
    (a checkpoint whose files were lost or cut short after Ray registered it is never loaded)."""
    from vitray.trainers.checkpoint import IncompleteCheckpointError, latest_complete_checkpoint, verify_complete

    try:
        verify_complete(restore_dir)
        return restore_dir
    except IncompleteCheckpointError as err:
        fallback = latest_complete_checkpoint(run_dir)
        if fallback is None:
            raise RuntimeError(f"{err}; and the run {run_dir} has no other complete checkpoint") from None
        print(f"vitray: {err}; resuming from {fallback.path} (step {fallback.step}) instead", flush=True)
        path, filesystem = ray_storage(fallback.path)
        return Path(stack.enter_context(ray.train.Checkpoint(path, filesystem=filesystem).as_directory()))


# The config keys behind each resource a worker asks for (for error messages).
RESOURCE_SETTINGS = {"CPU": "cluster.cpus_per_worker", "GPU": "cluster.gpus_per_worker", "TPU": "cluster.tpu"}


def scaling_config(cfg: TrainingConfig) -> ScalingConfig:
    """GPU/CPU workers, or (cluster.tpu) one worker per host of a TPU slice, placed by Ray Train's
    TPU support (a slice placement group: all hosts of one slice, reserved together)."""
    cluster = cfg.cluster
    resources = {"CPU": cluster.cpus_per_worker, **cluster.resources_per_worker}
    if cluster.tpu is not None:
        from vitray.trainers.xla_slices import tpu_slice

        tpu = tpu_slice(cluster.tpu, cluster.tpu_topology)
        resources.setdefault("TPU", tpu.chips_per_host)
        return ScalingConfig(
            num_workers=tpu.hosts, use_tpu=True, topology=tpu.topology, accelerator_type=tpu.accelerator_type,
            resources_per_worker=resources,
        )  # fmt: skip
    use_gpu = cluster.gpus_per_worker > 0
    if use_gpu:
        resources["GPU"] = cluster.gpus_per_worker
    return ScalingConfig(num_workers=cluster.num_workers, use_gpu=use_gpu, resources_per_worker=resources)


def build_trainer(cfg: TrainingConfig) -> TorchTrainer:
    storage_path, storage_fs = ray_storage(cfg.run.storage)
    scaling = scaling_config(cfg)
    # DeepSpeed on GPUs joins an NCCL group. Under XLA the devices talk through XLA itself; the
    # gloo group only coordinates the hosts (checkpoint writes, metric reductions) on the CPU.
    # (Ray's TorchXLAConfig is for AWS Neuron, not TPUs.)
    backend = "nccl" if scaling.use_gpu and cfg.train.backend == "deepspeed" else "gloo"
    return TorchTrainer(
        train_worker,
        train_loop_config={"config": cfg.model_dump(mode="json"), "run_dir": run_dir(cfg.run.storage, cfg.run.name)},
        torch_config=TorchConfig(backend=backend),
        scaling_config=scaling,
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            failure_config=FailureConfig(max_failures=cfg.cluster.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
        ),
    )


def pretrain(cfg: TrainingConfig, *, show_progress: bool = True, verbose: bool = False):
    """Run (or resume) the pre-training run described by `cfg`; returns Ray Train's Result."""
    connect(cfg.cluster.address, verbose=verbose)
    trainer = build_trainer(cfg)
    scaling = scaling_config(cfg)
    check_local_resources(scaling.num_workers, scaling.resources_per_worker, RESOURCE_SETTINGS)
    progress = TrainingProgress(run_dir(cfg.run.storage, cfg.run.name), total_steps=cfg.train.steps)
    with progress if show_progress else contextlib.nullcontext():
        return trainer.fit()
