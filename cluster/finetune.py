"""Fine-tune runs on Ray Train: one grid cell (`cluster/evaluate.py`) or `vitray finetune`.

- :func:`finetune_config` / :func:`benchmark_config`: the cell's typed recipe
  (:class:`vitray.evaluation.finetune_recipe.FinetuneRecipe`) + dotted overrides, validated once as
  the run's TrainingConfig (:func:`training_config`), whose `val` evaluator reports the run's top-1
  at its last step;
- :func:`run_finetune`: runs it as a TorchTrainer (`pretrain`), resumed when the run already
  exists, not started again when it already logged its top-1 (:func:`final_top1`);
- :func:`top1_on_test_split`: the test top-1 of a selection cell's final weights, in a Ray task with
  one worker's resources (`vitray.evaluation.top1`);
- :func:`finetune_cell_metrics` (a grid cell) and :func:`finetune_and_score` (`vitray finetune`) put
  them together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitray.cluster.checkpoint_inputs import load_on_device, resolve_checkpoints
from vitray.common.config import validate_config
from vitray.evaluation.config import FinetuneGrid, GridConfig
from vitray.evaluation.finetune_recipe import FinetuneRecipe, finetune_run_name
from vitray.evaluation.grid import METRIC, VAL_METRIC, FinetuneJob, finetune_settings, is_selection
from vitray.evaluation.results import Cell
from vitray.evaluation.suite import Benchmark, get_benchmark, locate, require_prepared
from vitray.evaluation.top1 import split_top1
from vitray.runfolder import checkpoints as ckpt
from vitray.runfolder.files import RunFiles
from vitray.trainers.config import TrainingConfig
from vitray.trainers.evals import VAL, VAL_TOP1, ValEvalConfig

# ---------------------------------------------------------------------------------------------
# The run's config
# ---------------------------------------------------------------------------------------------


def training_config(
    recipe: FinetuneRecipe, overrides: Mapping[str, Any] | Sequence[str] = (), *, source: str = "the fine-tune recipe"
) -> TrainingConfig:
    """The recipe + dotted overrides as a validated TrainingConfig (see `validate_config`) whose
    evaluator :data:`~vitray.trainers.evals.VAL` reports the run's top-1 at its last step."""
    return validate_config(TrainingConfig, recipe.config(VAL), overrides, source=source)


def finetune_config(job: FinetuneJob, grid: GridConfig) -> TrainingConfig:
    """The fine-tune run of one grid cell; its run lives under `<output>/finetune_runs`."""
    recipe = FinetuneRecipe.for_cell(
        job.benchmark,
        job.cell.settings,
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
    return training_config(recipe, grid.finetune.overrides, source=f"fine-tune recipe of {job.benchmark.name}")


def benchmark_config(
    checkpoint: str,
    benchmark: str,
    data_root: str,
    *,
    lr: float | None = None,
    steps: int | None = None,
    seed: int = 0,
    storage: str = "./runs",
    name: str | None = None,
    overrides: Sequence[str] = (),
) -> tuple[TrainingConfig, Benchmark]:
    """`vitray finetune CHECKPOINT --benchmark NAME`: the protocol's first cell (or `lr`, `steps`) of
    the benchmark on the checkpoint (or a run folder's latest), as a run under `storage`."""
    bench = get_benchmark(benchmark)
    options = FinetuneGrid(learning_rates=[lr] if lr else None, steps=steps)
    settings = finetune_settings(bench, options)[0]
    (ref,) = resolve_checkpoints(checkpoint)
    require_prepared(bench, data_root)
    cell = Cell(ref.path, bench.name, "finetune", settings, seed, ref.step)
    recipe = FinetuneRecipe.for_cell(
        bench,
        settings,
        checkpoint=ref.path,
        model=ref.model,
        data_root=data_root,
        run_name=name or finetune_run_name(cell),
        run_storage=storage,
        seed=seed,
        options=options,
    )
    return training_config(recipe, overrides, source=f"the {bench.name} fine-tune recipe"), bench


def reporting_top1(cfg: TrainingConfig) -> TrainingConfig:
    """A fine-tune config (`vitray finetune -c FILE`) with the `val` evaluator at its last step
    added unless it has one: the top-1 the command reports."""
    if VAL in cfg.evals:
        return cfg
    cfg.evals = {**cfg.evals, VAL: ValEvalConfig(type="val", every=cfg.train.steps)}
    return cfg


# ---------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------


def run_finetune(cfg: TrainingConfig, *, show_progress: bool = False, verbose: bool = False) -> float:
    """Runs (or resumes) a fine-tune run and returns its top-1 on `data.val_split` at the last step.

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


def final_top1(metrics: Iterable[Mapping[str, Any]], steps: int, metric: str = VAL_TOP1) -> float | None:
    """The top-1 on its `data.val_split` a fine-tune run logged at its last step as `metric` (the
    held-out slice of a selection cell, the test split of a final run), or None if it has not."""
    found = None
    for record in metrics:
        if record.get("step") == steps and metric in record:
            found = float(record[metric])
    return found


def finetune_cell_metrics(job: FinetuneJob, grid: GridConfig, *, verbose: bool = False) -> dict[str, float]:
    """Runs (or resumes) one fine-tune cell: ``{"val_accuracy": ..., "accuracy": test top-1}`` for a
    selection cell, ``{"accuracy": test top-1}`` for a final run."""
    cfg = finetune_config(job, grid)
    top1 = run_finetune(cfg, verbose=verbose)
    if not is_selection(job.cell.settings):
        return {METRIC: top1}
    test = top1_on_test_split(cfg, job.benchmark, grid.data_root, verbose=verbose)
    return {VAL_METRIC: top1, METRIC: test}


@dataclass(frozen=True)
class FinetuneResult:
    """`vitray finetune`'s numbers: the run's top-1 on `data.val_split`, and for a protocol run that
    validated on a held-out slice, the test split's."""

    top1: float
    test: float | None = None


def finetune_and_score(
    cfg: TrainingConfig,
    benchmark: Benchmark | None = None,
    data_root: str | None = None,
    *,
    show_progress: bool = False,
    verbose: bool = False,
) -> FinetuneResult:
    """Runs (or resumes) one fine-tune run; a protocol run (`benchmark`) that validated on a
    held-out slice is scored on the test split too."""
    top1 = run_finetune(cfg, show_progress=show_progress, verbose=verbose)
    held_out = benchmark is not None and cfg.data.val_split != benchmark.test_split
    test = top1_on_test_split(cfg, benchmark, data_root, verbose=verbose) if held_out else None
    return FinetuneResult(top1, test)


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
    model, device = load_on_device(checkpoint, use_gpu=use_gpu)
    return split_top1(
        model,
        path,
        split,
        batch_size=batch_size,
        num_workers=data_workers,
        storage_options=storage_options,
        device=device,
    )
