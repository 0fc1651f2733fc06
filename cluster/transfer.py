"""One transfer run: checkpoints as grid inputs, a fine-tune run on Ray Train, a few-shot probe.

The pieces `vitray finetune`, `vitray fewshot` and the grid (`cluster/evaluate.py`) share:

- :func:`resolve_checkpoints`: a checkpoint folder, or a run folder's latest / every complete one,
  as grid inputs (found and opened by :mod:`vitray.runfolder.checkpoints`);
- :func:`finetune_training_config` / :func:`finetune_config` + :func:`run_finetune`: the paper's
  fine-tune recipe for one cell, validated as a TrainingConfig and run as a TorchTrainer (`pretrain`), resumed when the run
  already exists, skipped when it already finished; :func:`finetune_cell_metrics` adds the test
  top-1 of a selection cell's final weights (:func:`top1_on_test_split`, a Ray task);
- :func:`fewshot_on_checkpoint`: the few-shot probe of one benchmark, in this process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from vitray.common.config import validate_config
from vitray.data import storage
from vitray.evaluation.config import GridConfig
from vitray.evaluation.grid import METRIC, VAL_METRIC, CheckpointRef, FinetuneJob, is_selection
from vitray.evaluation.suite import Benchmark, locate
from vitray.evaluation.transfer import final_top1, finetune_recipe, finetune_run_name, split_top1
from vitray.runfolder import checkpoints as ckpt
from vitray.runfolder.files import RunFiles
from vitray.trainers.config import TrainingConfig
from vitray.trainers.evals import VAL, VAL_TOP1

# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def absolute(path: str) -> str:
    """Local paths made absolute (they are part of cell ids); URLs unchanged."""
    return str(path).rstrip("/") if storage.is_remote(path) else os.path.abspath(path)


def checkpoint_ref(path: str) -> CheckpointRef:
    """A complete checkpoint folder as a grid input (raises IncompleteCheckpointError otherwise)."""
    path = absolute(path)
    state = ckpt.checkpoint_state(path)
    target = state.get("config", {}).get("train", {}).get("steps")
    return CheckpointRef(path, int(state["step"]), dict(state["model"]), int(target) if target else None)


def resolve_checkpoints(path: str, *, all_checkpoints: bool = False) -> list[CheckpointRef]:
    """The checkpoint folder `path`, or the latest (`all_checkpoints`: every) complete checkpoint
    of the run folder `path`, oldest first. Local or s3://."""
    path = absolute(path)
    if all_checkpoints and not ckpt.is_checkpoint(path):
        complete = [c.path for c in ckpt.find_checkpoints(path) if c.complete]
        if complete:
            return [checkpoint_ref(c) for c in complete]
    return [checkpoint_ref(ckpt.resolve_checkpoint(path))]


# ---------------------------------------------------------------------------------------------
# Fine-tuning
# ---------------------------------------------------------------------------------------------


def validate_recipe(
    raw: Mapping[str, Any], overrides: Mapping[str, Any] | Sequence[str] = (), *, source: str = "the fine-tune recipe"
) -> TrainingConfig:
    """A recipe dict + dotted overrides -> a validated TrainingConfig (see `validate_config`)."""
    return validate_config(TrainingConfig, raw, overrides, source=source)


def finetune_training_config(
    benchmark: Benchmark,
    settings: Mapping[str, Any],
    *,
    overrides: Mapping[str, Any] | Sequence[str] = (),
    source: str | None = None,
    **recipe: Any,
) -> TrainingConfig:
    """The paper's fine-tune recipe for one cell (`vitray.evaluation.transfer.finetune_recipe`, whose
    keyword arguments `recipe` takes) + dotted overrides, as a validated TrainingConfig whose `val`
    evaluator reports the run's top-1 at its last step."""
    raw = finetune_recipe(benchmark, settings, val_evaluator=VAL, **recipe)
    return validate_recipe(raw, overrides, source=source or f"the {benchmark.name} fine-tune recipe")


def finetune_config(job: FinetuneJob, grid: GridConfig) -> TrainingConfig:
    """The fine-tune run of one grid cell; its run lives under `<output>/finetune_runs`."""
    return finetune_training_config(
        job.benchmark,
        job.cell.settings,
        overrides=grid.finetune.overrides,
        source=f"fine-tune recipe of {job.benchmark.name}",
        checkpoint=job.checkpoint.path,
        model=job.checkpoint.model,
        data_root=grid.data_root,
        run_name=finetune_run_name(job.cell),
        run_storage=grid.finetune_storage,
        seed=job.cell.seed,
        options=grid.finetune,
        address=grid.cluster.address,
        storage_options=grid.storage_options,
    )


def run_finetune(cfg: TrainingConfig, *, show_progress: bool = False, verbose: bool = False) -> float:
    """Runs (or resumes) a fine-tune run and returns its test top-1 at the last step.

    A run that already logged its final top-1 is not started again; one that stopped halfway
    resumes from its latest checkpoint (same run.name and run.storage).
    """
    from vitray.cluster.pretrain import AlreadyFinished, pretrain
    from vitray.cluster.runtime import run_dir

    files = RunFiles(run_dir(cfg.run.storage, cfg.run.name))
    top1 = final_top1(files.read_metrics(), cfg.train.steps, VAL_TOP1)
    if top1 is None:
        with contextlib.suppress(AlreadyFinished):  # trained to the end; its top-1 is checked just below
            pretrain(cfg, show_progress=show_progress, verbose=verbose)  # raises TrainingFailedError on failure
        top1 = final_top1(files.read_metrics(), cfg.train.steps, VAL_TOP1)
    if top1 is None:
        raise RuntimeError(
            f"fine-tune run {files.run_dir} ended without {VAL_TOP1} at step {cfg.train.steps} "
            f"(it needs an evaluator named {VAL!r} of type val: it always runs at the last step)"
        )
    return top1


def finetune_cell_metrics(job: FinetuneJob, grid: GridConfig, *, verbose: bool = False) -> dict[str, float]:
    """Runs (or resumes) one fine-tune cell: ``{"val_accuracy": ..., "accuracy": test top-1}`` for a
    selection cell, ``{"accuracy": test top-1}`` for a final run."""
    cfg = finetune_config(job, grid)
    top1 = run_finetune(cfg, verbose=verbose)
    if not is_selection(job.cell.settings):
        return {METRIC: top1}
    test = top1_on_test_split(cfg, job.benchmark, grid.data_root, verbose=verbose)
    return {VAL_METRIC: top1, METRIC: test}


def top1_on_test_split(cfg: TrainingConfig, benchmark: Benchmark, data_root: str, *, verbose: bool = False) -> float:
    """The test top-1 of a finished fine-tune run's last checkpoint, computed in a Ray task with one
    of the run's workers' resources (a GPU when its workers have one)."""
    from vitray.cluster.runtime import connect, run_dir

    path = run_dir(cfg.run.storage, cfg.run.name)
    checkpoint = ckpt.latest_complete_checkpoint(path)
    if checkpoint is None or checkpoint.step != cfg.train.steps:
        found = "none" if checkpoint is None else f"step {checkpoint.step}"
        raise RuntimeError(
            f"fine-tune run {path} has no complete checkpoint at its last step {cfg.train.steps} "
            f"(found {found}) to score on the test split"
        )
    connect(cfg.cluster.address, verbose=verbose)  # before Ray is imported (token auth), see runtime.connect
    import ray

    cluster = cfg.cluster
    task = ray.remote(num_cpus=cluster.cpus_per_worker, num_gpus=cluster.gpus_per_worker)(_test_top1_task)
    ref = task.remote(
        checkpoint.path,
        locate(benchmark, data_root),
        benchmark.test_split,
        cfg.evals[VAL].batch_size,
        cfg.data.num_workers,
        cfg.data.storage_options,
        cluster.gpus_per_worker > 0,
    )
    return float(ray.get(ref))


def _test_top1_task(
    checkpoint: str,
    path: str,
    split: str,
    batch_size: int,
    data_workers: int,
    storage_options: dict[str, Any] | None,
    use_gpu: bool,
) -> float:
    import torch

    model, _ = ckpt.load_checkpoint(checkpoint)
    device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
    return split_top1(
        model,
        path,
        split,
        batch_size=batch_size,
        num_workers=data_workers,
        storage_options=storage_options,
        device=device,
    )
