"""Fine-tune runs on Ray Train: one grid cell (`cluster/evaluate.py`) or `vitray finetune`.

- :func:`finetune_config` / :func:`benchmark_config`: the cell's typed recipe
  (:class:`vitray.evaluation.finetune_recipe.FinetuneRecipe`) + dotted overrides, validated once as
  the run's TrainingConfig (:func:`training_config`), whose `val` evaluator reports the run's top-1
  at its last step and -- a selection cell, which validates on a held-out slice -- whose `test`
  evaluator (the same type on the benchmark's test split) reports the test top-1 then too;
- :func:`run_finetune`: runs it as a TorchTrainer (`pretrain`), resumed when the run already
  exists, not started again when it already logged its top-1s (:func:`final_top1`), and returns
  them (:class:`FinetuneResult`);
- :func:`finetune_cell_metrics`: a grid cell's numbers, read off its run (`vitray finetune` prints
  :func:`run_finetune`'s): the run is the cell's only trip through the training code.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from vitray import storage
from vitray.cluster.checkpoint_inputs import resolve_checkpoints
from vitray.cluster.run_attempts import stopped_while_waiting
from vitray.common.config import validate_config
from vitray.evaluation.config import GridConfig
from vitray.evaluation.evaluators import TEST, TEST_TOP1, VAL, VAL_TOP1
from vitray.evaluation.evaluators.val import ValEvalConfig
from vitray.evaluation.finetune_recipe import FinetuneRecipe, finetune_run_name, run_name_cell
from vitray.evaluation.methods import METRIC
from vitray.evaluation.methods.finetune import (
    VAL_METRIC,
    FinetuneGrid,
    FinetuneJob,
    finetune_settings,
    is_operational,
    is_selection,
)
from vitray.evaluation.results import Cell
from vitray.evaluation.suite import data_digest, get_benchmark, require_prepared
from vitray.runfolder.checkpoint_folders import latest_complete_checkpoint
from vitray.runfolder.files import RunFiles, run_dir
from vitray.runfolder.lease import RunLeaseHeld, UnsafeLeaseStore
from vitray.trainers.config import TrainingConfig
from vitray.trainers.driver_checks.preflight import PreflightError, changes_since, init_changes

# ---------------------------------------------------------------------------------------------
# The run's config
# ---------------------------------------------------------------------------------------------


def training_config(
    recipe: FinetuneRecipe, overrides: Mapping[str, Any] | Sequence[str] = (), *, source: str = "the fine-tune recipe"
) -> TrainingConfig:
    """The recipe + dotted overrides as a validated TrainingConfig (see `validate_config`) whose
    evaluator :data:`~vitray.evaluation.evaluators.VAL` reports the run's top-1 at its last step (and, a
    selection cell's, :data:`~vitray.evaluation.evaluators.TEST` its top-1 on the test split)."""
    return validate_config(TrainingConfig, recipe.config(VAL, TEST), overrides, source=source)


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
    crop: str | None = None,
    flip: bool | None = None,
    seed: int = 0,
    storage: str = "./runs",
    name: str | None = None,
    overrides: Sequence[str] = (),
) -> TrainingConfig:
    """`vitray finetune CHECKPOINT --benchmark NAME`: the protocol's first cell (or `lr`, `steps`,
    training `crop` and `flip`) of the benchmark on the checkpoint (or a run folder's latest), as a run
    under `storage`. Where the protocol validates on a held-out slice, the run scores the test split
    too (its `test` evaluator)."""
    bench = get_benchmark(benchmark)
    given = {
        "learning_rates": ("--lr", lr),
        "steps": ("--steps", steps),
        "crop": ("--crop", crop),
        "flip": ("--flip", flip),
    }
    try:
        options = FinetuneGrid.model_validate(
            {"learning_rates": None if lr is None else [lr], "steps": steps, "crop": crop, "flip": flip}
        )
    except ValidationError as err:  # the option as the user gave it, not the grid's field
        problem = err.errors()[0]
        option, value = given[problem["loc"][0]]
        raise ValueError(f"{option} {value}: {problem['msg'].removeprefix('Value error, ')}") from None
    settings = finetune_settings(bench, options)[0]
    (ref,) = resolve_checkpoints(checkpoint)
    require_prepared(bench, data_root)
    # The data's digest is in the run's name: data prepared again is a new run, not the finished one.
    cell = Cell(ref.path, bench.name, "finetune", settings, seed, ref.step, data_digest(bench, data_root) or "")
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
    return training_config(recipe, overrides, source=f"the {bench.name} fine-tune recipe")


def reporting_top1(cfg: TrainingConfig) -> TrainingConfig:
    """A fine-tune config (`vitray finetune -c FILE`) with the `val` evaluator at its last step
    added unless it has one: the top-1 the command reports (and a `test` evaluator of type val, when
    the file has one, the test top-1 it reports too)."""
    if VAL in cfg.evals:
        return cfg
    cfg.evals = {**cfg.evals, VAL: ValEvalConfig(type="val", every=cfg.train.steps)}
    return cfg


# ---------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FinetuneResult:
    """A fine-tune run's numbers at its last step: its top-1 on `data.val_split` (evaluator `val`)
    and, when it has a `test` evaluator (a selection cell, a protocol run that validated on a
    held-out slice), the top-1 on that evaluator's split (the benchmark's test split)."""

    top1: float
    test: float | None = None


def run_finetune(cfg: TrainingConfig, *, show_progress: bool = False, verbose: bool = False) -> FinetuneResult:
    """Runs (or resumes) a fine-tune run and returns the top-1s its evaluators `val` and (when it has
    one) `test` logged at the last step.

    A run that already logged them and completed its last checkpoint is not started again; one that
    stopped halfway resumes from its latest checkpoint (same run.name and run.storage). Logged
    top-1s alone do not make a run finished: a worker that outlives its Ray node for a moment (a
    kill) may log the last step's evaluations and not complete its checkpoint, and that step's
    weights would then be in no checkpoint that counts.
    """
    from vitray.cluster.pretrain import AlreadyFinished, pretrain

    files = RunFiles(run_dir(cfg.run.storage, cfg.run.name))
    metrics = files.read_metrics()
    latest = latest_complete_checkpoint(files.run_dir) if metrics else None
    finished = latest is not None and latest.step >= cfg.train.steps
    top1 = final_top1(metrics, cfg.train.steps, VAL_TOP1) if finished else None
    if top1 is not None:
        _refuse_other_settings(cfg, files.run_dir, latest.state or {})
    if top1 is None and latest is None:
        _say_earlier_runs_of_the_cell(cfg)
    if top1 is None:
        with contextlib.suppress(AlreadyFinished):  # trained to the end; its top-1 is checked just below
            pretrain(cfg, show_progress=show_progress, verbose=verbose)  # raises TrainingFailedError on failure
        metrics = files.read_metrics()
        top1 = final_top1(metrics, cfg.train.steps, VAL_TOP1)
    if top1 is None:
        raise RuntimeError(
            f"fine-tune run {files.run_dir} ended without {VAL_TOP1} at step {cfg.train.steps} "
            f"(it needs an evaluator named {VAL!r} of type val: it always runs at the last step)"
        )
    if TEST not in cfg.evals or cfg.evals[TEST].type != "val":
        return FinetuneResult(top1)
    # Both evaluators run at the last step and are logged in one record: a run that has the one
    # and not the other was made without the test evaluator (before the test split was scored in
    # the run), and its weights at the last step are all that is left of it.
    test = final_top1(metrics, cfg.train.steps, TEST_TOP1)
    if test is None:
        raise RuntimeError(
            f"fine-tune run {files.run_dir} finished without {TEST_TOP1} at step {cfg.train.steps}: it was "
            f"made without the {TEST!r} evaluator (before the test split was scored in the run). Delete the run "
            f"folder {files.run_dir} to re-run the cell"
        )
    return FinetuneResult(top1, test)


def _say_earlier_runs_of_the_cell(cfg: TrainingConfig) -> None:
    """A fine-tune starting anew beside a run of the same benchmark, learning rate and seed under
    another id (other settings, other data, or the id an older vitray gave: a re-run after an upgrade
    trained again without a word): one line each naming it and how its settings differ."""
    cell = run_name_cell(cfg.run.name)
    if cell is None:
        return
    with contextlib.suppress(Exception):  # (a note: nothing it meets stops the fine-tune)
        for name in storage.list_names(cfg.run.storage):  # (folders too)
            if name == cfg.run.name or run_name_cell(name) != cell:
                continue
            earlier = latest_complete_checkpoint(run_dir(cfg.run.storage, name))
            if earlier is None:
                continue
            changes = [c for c in changes_since(cfg, earlier.state or {}) if not is_operational(c)]
            differs = "; ".join(changes[:3]) + ("; ..." if len(changes) > 3 else "") if changes else "its data"
            version = (earlier.state or {}).get("vitray_version")
            writer = f"vitray {version}" if version else "an earlier vitray"
            print(
                f"note: {name} beside this fine-tune is the same benchmark, learning rate and seed (step "
                f"{earlier.step}, written by {writer}); it differs in {differs}, so {cfg.run.name} trains anew",
                file=sys.stderr,
                flush=True,
            )


class FinishedWithOtherSettings(PreflightError):
    """The run folder holds a finished fine-tune of other settings: its top-1 is not this config's."""


def _refuse_other_settings(cfg: TrainingConfig, run_dir: str, state: dict[str, Any]) -> None:
    """Refuse to report a finished run's top-1 for a config that would compute another one (a
    --set, a recipe's value changed since): only how a run goes (`is_operational`) may differ."""
    if not state.get("config"):
        return  # nothing recorded to compare with (every run's checkpoint records it)
    changes = init_changes(cfg, state) + [c for c in changes_since(cfg, state) if not is_operational(c)]
    if changes:
        raise FinishedWithOtherSettings(
            f"fine-tune run {run_dir} finished with other settings ({'; '.join(changes)}): its top-1 is not "
            "this config's. Give the run another name (--name, run.name) or storage to train these settings"
        )


def final_top1(metrics: Iterable[Mapping[str, Any]], steps: int, metric: str = VAL_TOP1) -> float | None:
    """The top-1 a fine-tune run logged at its last step as `metric` (:data:`VAL_TOP1`: on its
    `data.val_split`, the held-out slice of a selection cell or the test split of a final run;
    :data:`TEST_TOP1`: a selection cell's on the test split), or None if it has not."""
    found = None
    for record in metrics:
        if record.get("step") == steps and metric in record:
            found = float(record[metric])
    return found


# How often a grid's cell whose fine-tune run another driver trains looks whether it has ended.
HELD_POLL_S = 30.0


def finetune_cell_metrics(
    job: FinetuneJob, grid: GridConfig, *, verbose: bool = False, poll_s: float = HELD_POLL_S
) -> dict[str, float]:
    """Runs (or resumes) one fine-tune cell: ``{"val_accuracy": ..., "accuracy": test top-1}`` for a
    selection cell, ``{"accuracy": test top-1}`` for a final run; both read off the run's metrics at
    its last step. A cell whose run another driver trains now (another grid into the same output)
    waits for it and reads its result: it was tried three times within seconds and reported failed."""
    cfg = finetune_config(job, grid)
    waiting = False
    while True:
        try:
            result = run_finetune(cfg, verbose=verbose)
            break
        except RunLeaseHeld as held:
            if isinstance(held, UnsafeLeaseStore):
                raise
            if not waiting:
                holder = held.holder.describe() if held.holder is not None else "another driver"
                print(
                    f"{cfg.run.name}: {holder} trains this fine-tune now; waiting for it to end, to read its result",
                    file=sys.stderr,
                    flush=True,
                )
                waiting = True
            if stopped_while_waiting(poll_s):
                raise
    if not is_selection(job.cell.settings):
        return {METRIC: result.top1}
    # The recipe gives a selection cell's run a test evaluator unless it validates on the test split itself.
    return {VAL_METRIC: result.top1, METRIC: result.top1 if result.test is None else result.test}
