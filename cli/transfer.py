"""The transfer commands of the `vitray` CLI: `fewshot`, `finetune` and `evaluate`.

Like every vitray command they take `--config/-c FILE.yaml` and `--set dotted.key=value`; a bad
value fails before any Ray resources are taken. `fewshot` runs in this process
(:func:`fewshot_on_checkpoint`); `finetune` and `evaluate` run on Ray (`cluster/`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from vitray.cli.app import (
    CheckpointArg,
    ConfigOpt,
    DataRootOpt,
    DryRunOpt,
    OutputFormat,
    SetOpt,
    VerboseOpt,
    app,
    console,
    fail,
    load,
    print_config,
    table_console,
)
from vitray.common import exit_codes
from vitray.common.config import ConfigError
from vitray.common.failures import describe_failure

if TYPE_CHECKING:
    from vitray.evaluation.config import FewShotGrid
    from vitray.evaluation.grid import CheckpointRef
    from vitray.evaluation.suite import Benchmark
    from vitray.evaluation.transfer import CellOutcome


def _grid(config: Path | None, overrides: list[str]):
    from vitray.evaluation.config import GridConfig

    return load(GridConfig, config, overrides)


def _as_list(text: str, kind: type, option: str) -> list:
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"{option} {text!r}: expected comma-separated {kind.__name__}s, e.g. 1,5,10,25")


# ---------------------------------------------------------------------------------------------
# vitray fewshot
# ---------------------------------------------------------------------------------------------


@app.command()
def fewshot(
    checkpoint: CheckpointArg,
    benchmark: Annotated[
        list[str] | None, typer.Option("--benchmark", "-b", help="Benchmark name (repeatable).")
    ] = None,
    data_root: DataRootOpt = None,
    shots: Annotated[
        str | None, typer.Option(help="Shots per class, e.g. 1,5,10,25 (the protocol's by default).")
    ] = None,
    seeds: Annotated[
        int | None, typer.Option(help="Seeds per shots value (the protocol's, 3, by default).", min=1)
    ] = None,
    l2: Annotated[str | None, typer.Option("--l2", help='Ridge strength (default 1024) or "select".')] = None,
    img_size: Annotated[int | None, typer.Option(help="Probe resolution (the checkpoint's by default).", min=1)] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
):
    """Few-shot linear probe of a checkpoint on benchmarks: accuracy per shots, mean ± std over seeds."""
    overrides = []
    if benchmark:
        overrides.append(f"benchmarks=[{', '.join(benchmark)}]")
    if data_root:
        overrides.append(f"data_root={data_root}")
    if shots:
        overrides.append(f"fewshot.shots={_as_list(shots, int, '--shots')}")
    if seeds:
        overrides.append(f"fewshot.seeds={seeds}")
    if l2:
        overrides.append(f"fewshot.l2_reg={l2}")
    if img_size:
        overrides.append(f"fewshot.img_size={img_size}")
    grid = _grid(config, overrides + list(set_ or []))

    from vitray.cluster.transfer import resolve_checkpoints
    from vitray.evaluation.suite import MissingDataset
    from vitray.evaluation.transfer import summarize_scores

    try:
        (ref,) = resolve_checkpoints(checkpoint)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        fail(str(err))
    table = Table(title=f"few-shot linear probe: {ref.path} (step {ref.step})")
    for name, justify in [
        ("benchmark", "left"),
        ("shots", "right"),
        ("accuracy", "right"),
        ("± std", "right"),
        ("seeds", "right"),
    ]:
        table.add_column(name, justify=justify)
    problems = []
    for bench in grid.resolved_benchmarks():
        try:
            outcomes = fewshot_on_checkpoint(
                ref, bench, grid.data_root, grid.fewshot, storage_options=grid.storage_options
            )
        except (MissingDataset, ValueError) as err:
            problems.append(str(err))
            continue
        for k, (mean, std, n) in summarize_scores(outcomes).items():
            table.add_row(bench.name, str(k), f"{mean:.4f}", f"{std:.4f}", str(n))
        problems += [
            f"{bench.name} {o.cell.settings['shots']}-shot seed {o.cell.seed}: {describe_failure(o.error).one_line()}"
            for o in outcomes
            if not o.ok
        ]
    table_console().print(table)
    if problems:
        fail("\n".join(problems), code=1)


# ---------------------------------------------------------------------------------------------
# vitray finetune
# ---------------------------------------------------------------------------------------------


@app.command()
def finetune(
    checkpoint: Annotated[
        str | None, typer.Argument(help="Checkpoint (or run folder) to start from; sets init.checkpoint.")
    ] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    benchmark: Annotated[
        str | None, typer.Option("--benchmark", "-b", help="Build the recipe from this benchmark's protocol.")
    ] = None,
    data_root: DataRootOpt = None,
    lr: Annotated[float | None, typer.Option(help="Learning rate (with --benchmark; its first by default).")] = None,
    steps: Annotated[
        int | None, typer.Option(help="Steps (with --benchmark; the protocol's by default).", min=1)
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed (with --benchmark).", min=0)] = 0,
    storage: Annotated[str, typer.Option(help="Run storage (with --benchmark): local folder or s3://.")] = "./runs",
    name: Annotated[str | None, typer.Option(help="Run name (with --benchmark; derived from the settings).")] = None,
    dry_run: DryRunOpt = False,
    verbose: VerboseOpt = False,
):
    """Fine-tune a checkpoint on one worker group and print its top-1.

    From a fine-tune config (a pretrain YAML with init.checkpoint): vitray finetune -c configs/finetune_digits.yaml
    prints the top-1 on data.val_split at the end.
    From a benchmark's protocol: vitray finetune CHECKPOINT --benchmark digits --data-root ROOT --lr 0.01
    trains on the protocol's train slice (e.g. train[:90%]) and prints the top-1 on the held-out slice and on
    the test split (VTAB-1k: trains on train[:1000], prints the test top-1).
    Re-running the same command resumes the run.
    """
    overrides = list(set_ or [])
    bench = None
    if benchmark is not None:
        if config is not None:
            fail("give either -c FILE (a fine-tune config) or --benchmark (the protocol's recipe), not both")
        if checkpoint is None or data_root is None:
            fail("--benchmark needs the CHECKPOINT argument and --data-root")
        try:
            cfg, bench = _benchmark_recipe(checkpoint, benchmark, data_root, lr, steps, seed, storage, name, overrides)
        except ConfigError as err:
            fail(str(err))
        except (FileNotFoundError, ValueError, RuntimeError) as err:
            fail(str(err))
    else:
        if checkpoint is not None:
            overrides.insert(0, f"init.checkpoint={checkpoint}")
        from vitray.trainers.config import TrainingConfig
        from vitray.trainers.evals import VAL, ValEvalConfig

        cfg = load(TrainingConfig, config, overrides)
        if cfg.init.checkpoint is None:
            fail("fine-tuning starts from a checkpoint: give CHECKPOINT or --set init.checkpoint=PATH")
        if VAL not in cfg.evals:  # the test top-1 this command reports, at the end
            cfg.evals = {**cfg.evals, VAL: ValEvalConfig(type="val", every=cfg.train.steps)}
    if dry_run:
        print_config(cfg)
        return
    from vitray.cluster.runtime import run_dir
    from vitray.cluster.transfer import run_finetune, top1_on_test_split
    from vitray.evaluation.suite import locate
    from vitray.trainers.preflight import PreflightError

    try:
        top1 = run_finetune(cfg, show_progress=True, verbose=verbose)
        # A protocol run that validated on a held-out slice is scored on the test split too.
        held_out = bench is not None and cfg.data.val_split != bench.test_split
        test = top1_on_test_split(cfg, bench, data_root, verbose=verbose) if held_out else None
    except PreflightError as err:  # refused before Ray started
        fail(str(err), exit_codes.INPUT_ERROR)
    except Exception as err:
        cause = describe_failure(err)
        fail(
            f"fine-tuning failed: {cause.one_line()}\n  {cause.advice()} (the full traceback: --verbose)",
            exit_codes.FAILED,
        )
    console.print(f"run folder: {run_dir(cfg.run.storage, cfg.run.name)}")
    if test is not None:
        typer.echo(f"val top-1 ({cfg.data.val_path} split {cfg.data.val_split}): {top1:.4f}")
        typer.echo(f"test top-1 ({locate(bench, data_root)} split {bench.test_split}): {test:.4f}")
    else:
        typer.echo(f"top-1 ({cfg.data.val_path} split {cfg.data.val_split}): {top1:.4f}")


def _benchmark_recipe(
    checkpoint: str,
    benchmark: str,
    data_root: str,
    lr: float | None,
    steps: int | None,
    seed: int,
    storage: str,
    name: str | None,
    overrides: list[str],
) -> tuple[Any, Any]:
    from vitray.cluster.transfer import finetune_training_config, resolve_checkpoints
    from vitray.evaluation.config import FinetuneGrid
    from vitray.evaluation.grid import finetune_settings
    from vitray.evaluation.results import Cell
    from vitray.evaluation.suite import get_benchmark, require_prepared
    from vitray.evaluation.transfer import finetune_run_name

    bench = get_benchmark(benchmark)
    options = FinetuneGrid(learning_rates=[lr] if lr else None, steps=steps)
    settings = finetune_settings(bench, options)[0]
    (ref,) = resolve_checkpoints(checkpoint)
    require_prepared(bench, data_root)
    cell = Cell(ref.path, bench.name, "finetune", settings, seed, ref.step)
    cfg = finetune_training_config(
        bench,
        settings,
        overrides=overrides,
        checkpoint=ref.path,
        model=ref.model,
        data_root=data_root,
        run_name=name or finetune_run_name(cell),
        run_storage=storage,
        seed=seed,
        options=options,
    )
    return cfg, bench


# ---------------------------------------------------------------------------------------------
# vitray evaluate
# ---------------------------------------------------------------------------------------------


@app.command()
def evaluate(
    checkpoint: Annotated[str, typer.Argument(help="A checkpoint folder or a run folder (local or s3://).")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    data_root: DataRootOpt = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="Results folder (sets `output`).")] = None,
    all_checkpoints: Annotated[
        bool, typer.Option("--all-checkpoints", help="Evaluate every complete checkpoint of the run (vs step).")
    ] = False,
    watch: Annotated[
        bool, typer.Option("--watch", help="Keep evaluating new checkpoints of a training run until it finishes.")
    ] = False,
    watch_timeout: Annotated[float, typer.Option(help="Stop watching after this many seconds.", min=0)] = 24 * 3600.0,
    poll: Annotated[float, typer.Option(help="Seconds between looks for new checkpoints (--watch).", min=0)] = 60.0,
    progress: Annotated[bool, typer.Option(help="Show a progress bar over the cells.")] = True,
    dry_run: DryRunOpt = False,
    verbose: VerboseOpt = False,
    format_: Annotated[
        OutputFormat, typer.Option("--format", "-f", help="How the summary goes to stdout.")
    ] = OutputFormat.table,
):
    """Evaluate CHECKPOINT on a grid of benchmarks x few-shot shots / fine-tune lrs x seeds over Ray.

    Results are appended to <output>/results cell by cell; a re-run skips finished cells, retries the rest.
    Prints the table and writes <output>/report (Markdown + PNG plots).
    Exit code 1 when a cell failed or a benchmark's data is missing.
    """
    overrides = ([f"data_root={data_root}"] if data_root else []) + ([f"output={output}"] if output else [])
    grid = _grid(config, overrides + list(set_ or []))
    if dry_run:
        print_config(grid)
        return
    from vitray.cluster.evaluate import report_grid, run_grid, watch_run
    from vitray.cluster.transfer import resolve_checkpoints
    from vitray.trainers.preflight import PreflightError

    if watch:
        try:
            # The report follows the run: accuracy vs step is up to date after every new checkpoint.
            watched = watch_run(
                checkpoint,
                grid,
                poll_seconds=poll,
                timeout_seconds=watch_timeout,
                console=console,
                show_progress=progress,
                verbose=verbose,
                on_grid=lambda _: report_grid(grid, show=False),
            )
        except ValueError as err:
            fail(str(err))
        summaries = watched.grids
        if not watched.finished:
            console.print(f"[yellow]stopped watching after {watch_timeout:g} s: the run has not finished[/]")
    else:
        try:
            refs = resolve_checkpoints(checkpoint, all_checkpoints=all_checkpoints)
        except (FileNotFoundError, ValueError, RuntimeError) as err:
            fail(str(err))
        try:
            summaries = [run_grid(grid, refs, console=console, show_progress=progress, verbose=verbose)]
        except PreflightError as err:  # refused before Ray started
            fail(str(err), exit_codes.INPUT_ERROR)
    files = report_grid(grid, table_console(), show=format_ == OutputFormat.table)
    if format_ == OutputFormat.json:
        from vitray.evaluation.report import summary_json
        from vitray.evaluation.results import ResultsTable

        typer.echo(summary_json(ResultsTable(grid.results_path, storage_options=grid.storage_options)))
    failed, missing = sum(s.failed for s in summaries), sum(s.missing for s in summaries)
    ok, skipped = sum(s.ok for s in summaries), sum(s.skipped for s in summaries)
    console.print(f"cells: {ok} ok, {skipped} already finished, {failed} failed, {missing} missing data")
    waiting = sum(s.waiting for s in summaries)
    if waiting:
        console.print(f"{waiting} final fine-tune run(s) wait for a failed cell of their learning-rate sweep")
    console.print(f"results: {grid.results_path}\nreport:  {files}")
    if failed or missing:
        raise typer.Exit(1)


# ---------------------------------------------------------------------------------------------
# Few-shot in this process (what `vitray fewshot` runs)
# ---------------------------------------------------------------------------------------------


def fewshot_on_checkpoint(
    checkpoint: CheckpointRef,
    benchmark: Benchmark,
    data_root: str,
    settings: FewShotGrid,
    *,
    storage_options: dict[str, Any] | None = None,
    device: Any = "cpu",
) -> list[CellOutcome]:
    """Every (shots, seed) few-shot cell of one benchmark on one checkpoint, without Ray.

    Raises :class:`vitray.evaluation.suite.MissingDataset` (whose message is the prepare
    command) when the benchmark's data is not prepared.
    """
    from vitray.evaluation.grid import fewshot_group
    from vitray.evaluation.suite import require_prepared
    from vitray.evaluation.transfer import run_fewshot_group
    from vitray.runfolder.checkpoints import load_checkpoint

    require_prepared(benchmark, data_root, storage_options=storage_options)
    group = fewshot_group(checkpoint, benchmark, settings)
    model, _ = load_checkpoint(checkpoint.path)
    return run_fewshot_group(
        model,
        group,
        data_root,
        batch_size=settings.batch_size,
        num_workers=settings.data_workers,
        storage_options=storage_options,
        device=device,
    )
