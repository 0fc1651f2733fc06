"""`vitray demo` / `make demo`: the whole path on built-in real data, on this machine.

prepare (scikit-learn's handwritten digits -> webdataset shards) -> pre-train a small ViT on an
embedded local Ray with 2 workers and DeepSpeed (held-out top-1 and a 10-shot probe as it goes)
-> an evaluation grid (few-shot probes + fine-tuning at a higher resolution) -> table and report
-> the paper's inspection figures of the checkpoint (`vitray inspect`), added to the report.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from vitray import storage
from vitray.cluster.checkpoint_inputs import resolve_checkpoints
from vitray.cluster.evaluate import report_grid, run_grid
from vitray.cluster.grid_checks import check_models
from vitray.cluster.prepare import prepare_dataset_on_ray
from vitray.cluster.pretrain import AlreadyFinished, latest_complete, pretrain
from vitray.cluster.runtime import connect
from vitray.common.config import load_config, packaged_config
from vitray.data.layout import read_dataset_info
from vitray.evaluation.checkpoint_inspection import add_to_report
from vitray.evaluation.config import GridConfig
from vitray.evaluation.evaluators import VAL_TOP1
from vitray.evaluation.grid import plan_grid
from vitray.evaluation.methods.base import CheckpointRef
from vitray.evaluation.reference import in_context, pixel_linear_top1
from vitray.evaluation.report import summarize
from vitray.evaluation.results import ResultsTable
from vitray.runfolder.files import RunFiles, run_dir
from vitray.trainers.config import TrainingConfig
from vitray.trainers.driver_checks.preflight import PreflightError, check_resume

# The demo keeps one fine-tune learning rate of the digits grid to stay within a few minutes: 0.03,
# the better of the two from the demo's run (0.81 test top-1 against 0.78 for 0.01, 100 steps at 24 px).
DEMO_GRID = ["finetune.learning_rates=[0.03]"]
DIGITS_SIZE = 8  # scikit-learn's digits are 8x8 pixels


def _check_the_earlier_run(cfg: TrainingConfig, data: str) -> None:
    """A demo run earlier into the same output that this one cannot go on with (another model, say)
    is refused now, not after Ray started and the data step ran (what `pretrain` would say then)."""
    try:
        info = read_dataset_info(data)
    except FileNotFoundError:  # no data yet: no run on it either
        return
    try:  # (without a checkpoint in the run folder: nothing to go on with, and one listing)
        check_resume(cfg, run_dir(cfg.run.storage, cfg.run.name), info)
    except PreflightError as err:
        raise PreflightError(f"{err}; for the demo: give another --out, or the earlier run's settings") from None


def run_demo(
    out_dir: str = "demo-output",
    overrides: list[str] | None = None,
    grid_overrides: list[str] | None = None,
    verbose: bool = False,
    *,
    console: Console | None = None,
    tables: Console | None = None,
) -> dict:
    """The demo into `out_dir`: progress and results on `console` (stdout by default), the results
    table on `tables` (`console` by default); returns what it made (top-1, run folder, checkpoint,
    report, the grid's summary, the inspection files). `overrides` are the pre-training config's,
    `grid_overrides` the evaluation grid's (after the demo's own: one fine-tune learning rate).
    Raises ConfigError for a bad override, PreflightError for a grid the run's model cannot be
    evaluated in (before anything starts), TrainingFailedError when pre-training fails."""
    console = console or Console()
    out = Path(out_dir).absolute()
    data = out / "data" / "digits"
    cfg = load_config(
        TrainingConfig,
        packaged_config("demo.yaml"),
        [
            f"data.train={data}",
            f"run.storage={out / 'runs'}",
            f"evals.fewshot={{type: fewshot, every: 100, datasets: {{digits: {data}}}}}",
            *(overrides or []),
        ],
    )
    grid = load_config(
        GridConfig,
        packaged_config("grid_digits.yaml"),
        [f"data_root={out / 'data'}", f"output={out / 'eval'}", *DEMO_GRID, *(grid_overrides or [])],
        flag="--grid-set",
    )
    # The grid's models at their sizes, with the model the run will train: a size its patch or
    # ResNet does not divide (--set model.name=Ti/16: 24 px) is refused now, not after pre-training.
    planned = CheckpointRef(run_dir(cfg.run.storage, cfg.run.name), cfg.train.steps, cfg.model.model_dump(mode="json"))
    try:
        check_models(list(plan_grid(grid, [planned]).work))
    except PreflightError as err:
        raise PreflightError(f"{err} (the grid's fine-tune size: --grid-set finetune.resolution=N)") from None
    _check_the_earlier_run(cfg, str(data))
    console.rule("[bold]1/4 prepare: builtin:digits -> webdataset shards")
    connect(cfg.cluster.address, num_cpus=os.cpu_count(), verbose=verbose)
    prepare_dataset_on_ray("builtin:digits", str(data), samples_per_shard=200)

    console.rule(
        f"[bold]2/4 pretrain {cfg.model.name} at {cfg.model.img_size}px on {cfg.cluster.num_workers} Ray workers (DeepSpeed ZeRO-{cfg.train.zero_stage})"
    )
    try:
        pretrain(cfg, verbose=verbose)  # raises TrainingFailedError when the run fails
    except AlreadyFinished as done:
        console.print(f"{cfg.run.name} was already trained to step {done.checkpoint.step}: going on with it")
    run = run_dir(cfg.run.storage, cfg.run.name)
    files = RunFiles(run)
    metrics = files.read_metrics()
    top1 = next((m[VAL_TOP1] for m in reversed(metrics) if VAL_TOP1 in m), None)
    checkpoint = latest_complete(run)

    console.rule("[bold]3/4 evaluate: few-shot probes and fine-tuning on digits (vitray evaluate)")
    summary = run_grid(grid, resolve_checkpoints(run), console=console)
    report = report_grid(grid, console=tables or console)
    # The numbers in context: a linear classifier on the digits' own 8x8 pixels, fitted now.
    reference = pixel_linear_top1(str(data), img_size=DIGITS_SIZE)
    context = _context_rows(cfg, top1, metrics, grid, checkpoint.path if checkpoint else None)
    if report and not storage.is_remote(report):
        with open(report, "a") as markdown:
            markdown.write("\n" + in_context(context, reference))

    console.rule("[bold]4/4 inspect: the paper's figures of the checkpoint (vitray inspect)")
    inspection = add_to_report(checkpoint.path, Path(report)) if checkpoint else None

    console.rule("[bold]results")
    if top1 is not None:
        console.print(f"held-out top-1 after {metrics[-1]['step']} steps: [bold]{top1:.3f}[/] (chance: 0.100)")
    for what, value in context[1:]:
        console.print(f"{what}: [bold]{value:.3f}[/]")
    console.print(f"reference, {reference.name}: [bold]{reference.top1:.3f}[/]")
    console.print(f"run folder:   {run}")
    console.print(f"checkpoint:   {checkpoint.path if checkpoint else '-'}")
    console.print(f"metrics:      {files.metrics_path} (TensorBoard: {files.root}/tensorboard)")
    console.print(f"evaluation:   {grid.results_path} (parquet)")
    console.print(f"report/plots: {report}")
    if inspection is not None:
        console.print(f"inspection:   {inspection.out_dir} (figures in the report)")
    return {
        "top1": top1,
        "run_dir": run,
        "checkpoint": checkpoint.path if checkpoint else None,
        "report": report,
        "grid": summary,
        "inspection": inspection,
        "reference": reference,
        "context": context,
    }


def _context_rows(
    cfg: TrainingConfig, top1: float | None, metrics: list[dict], grid: GridConfig, checkpoint: str | None
) -> list[tuple[str, float]]:
    """(what, test top-1) of the demo's own numbers: the pre-trained run's held-out top-1 (on the
    test split, `data.val_split`) and every row of the evaluation grid of its `checkpoint` (fine-tune,
    few-shot; the results table may hold earlier checkpoints' too)."""
    rows = []
    if top1 is not None:
        rows.append(
            (
                f"pre-trained ViT-{cfg.model.name} ({metrics[-1]['step']} steps at {cfg.model.img_size} px), its run's top-1",
                float(top1),
            )
        )
    results = ResultsTable(grid.results_path, storage_options=grid.storage_options)
    summary = summarize(results, metric="accuracy")
    for row in summary[summary["checkpoint"] == checkpoint].itertuples():
        rows.append((f"{row.label} (mean of {row.seeds} seeds)" if row.seeds > 1 else row.label, float(row.mean)))
    return rows
