"""The transfer commands of the `vitray` CLI: `fewshot`, `finetune` and `evaluate`.

Like every vitray command they take `--config/-c FILE.yaml` and `--set dotted.key=value`; a bad
value fails before any Ray resources are taken. Each parses its arguments and calls one function of
`cluster/`: `fewshot` runs in this process (`cluster/fewshot_cells.py`), `finetune` (`cluster/finetune.py`)
and `evaluate` (`cluster/evaluate.py`) on Ray.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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
    handled,
    load,
    print_config,
    table_console,
)
from vitray.common.config import OptionValue
from vitray.data.config import TRAIN_CROPS


def _grid(config: list[Path] | None, overrides: list[str]):
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
    format_: Annotated[
        OutputFormat, typer.Option("--format", "-f", help="How the results go to stdout.")
    ] = OutputFormat.table,
):
    """Few-shot linear probe of a checkpoint on benchmarks: accuracy per shots, mean ± std over seeds.

    Exit code 1 when a benchmark's data is missing or a cell failed (the others are printed)."""
    overrides = []
    if benchmark:
        overrides.append(OptionValue(f"benchmarks=[{', '.join(benchmark)}]", " ".join(f"-b {b}" for b in benchmark)))
    if data_root:
        overrides.append(OptionValue(f"data_root={data_root}", f"--data-root {data_root}"))
    if shots:
        overrides.append(OptionValue(f"fewshot.shots={_as_list(shots, int, '--shots')}", f"--shots {shots}"))
    if seeds:
        overrides.append(OptionValue(f"fewshot.seeds={seeds}", f"--seeds {seeds}"))
    if l2:
        overrides.append(OptionValue(f"fewshot.l2_reg={l2}", f"--l2 {l2}"))
    if img_size:
        overrides.append(OptionValue(f"fewshot.img_size={img_size}", f"--img-size {img_size}"))
    grid = _grid(config, overrides + list(set_ or []))
    from vitray.cluster.fewshot_cells import fewshot_checkpoint

    with (
        handled((FileNotFoundError, ValueError, RuntimeError)),
        console.status("few-shot probes: features, then fits..."),
    ):
        summary = fewshot_checkpoint(checkpoint, grid)
    if format_ == OutputFormat.json:
        typer.echo(_fewshot_json(summary))
    else:
        _print_fewshot_table(summary)
    if summary.problems:
        fail("\n".join(summary.problems), code=1)


def _fewshot_json(summary) -> str:
    import json

    results = [
        {
            "benchmark": bench,
            "shots": k,
            "accuracy": shots.mean,
            "std": shots.std,
            "seeds": shots.seeds,
            "l2_reg": list(shots.l2),  # per seed: l2_reg=select's choices
        }
        for bench, k, shots in summary.rows
    ]
    return json.dumps(
        {
            "checkpoint": summary.checkpoint.path,
            "step": summary.checkpoint.step,
            "results": results,
            "problems": summary.problems,
        },
        indent=1,
    )


def _print_fewshot_table(summary) -> None:
    out = table_console()
    # A line of its own, not the table's title: rich wraps a title to the table's width, mid-path.
    out.print(
        f"few-shot linear probe: {summary.checkpoint.path} (step {summary.checkpoint.step})",
        soft_wrap=True,
        markup=False,
        highlight=False,
    )
    table = Table()
    for name, justify in [
        ("benchmark", "left"),
        ("shots", "right"),
        ("accuracy", "right"),
        ("± std", "right"),
        ("seeds", "right"),
        ("l2_reg", "right"),
    ]:
        table.add_column(name, justify=justify)
    for bench, k, shots in summary.rows:
        # One value when every seed had it (a fixed l2_reg); l2_reg=select's choice of each seed
        l2 = f"{shots.l2[0]:g}" if len(set(shots.l2)) == 1 else " ".join(f"{v:g}" for v in shots.l2)
        table.add_row(bench, str(k), f"{shots.mean:.4f}", f"{shots.std:.4f}", str(shots.seeds), l2)
    out.print(table)


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
    crop: Annotated[
        str | None,
        typer.Option(
            help="Training crop (with --benchmark; the benchmark's by default): " + ", ".join(TRAIN_CROPS) + "."
        ),
    ] = None,
    flip: Annotated[
        bool | None,
        typer.Option("--flip/--no-flip", help="Random flips (with --benchmark; the benchmark's by default)."),
    ] = None,
    storage: Annotated[str, typer.Option(help="Run storage (with --benchmark): local folder or s3://.")] = "./runs",
    name: Annotated[str | None, typer.Option(help="Run name (with --benchmark; derived from the settings).")] = None,
    format_: Annotated[
        OutputFormat, typer.Option("--format", "-f", help="How the top-1s go to stdout.")
    ] = OutputFormat.table,
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
    from vitray.cluster.finetune import benchmark_config, reporting_top1, run_finetune

    overrides = list(set_ or [])
    if benchmark is not None:
        if config is not None:
            fail("give either -c FILE (a fine-tune config) or --benchmark (the protocol's recipe), not both")
        if checkpoint is None or data_root is None:
            fail("--benchmark needs the CHECKPOINT argument and --data-root")
        if crop is not None and crop not in TRAIN_CROPS:
            fail(f"--crop {crop!r}: expected one of {', '.join(TRAIN_CROPS)}")
        with handled((FileNotFoundError, ValueError, RuntimeError)):
            cfg = benchmark_config(
                checkpoint,
                benchmark,
                data_root,
                lr=lr,
                steps=steps,
                crop=crop,
                flip=flip,
                seed=seed,
                storage=storage,
                name=name,
                overrides=overrides,
            )
    else:
        recipe_only = {
            "--data-root": data_root,
            "--lr": lr,
            "--steps": steps,
            "--crop": crop,
            "--flip": flip,
            "--name": name,
            "--storage": None if storage == "./runs" else storage,
            "--seed": seed or None,
        }
        given = [option for option, value in recipe_only.items() if value is not None]
        if given:  # they would be ignored: the config file holds the run's settings
            fail(
                f"{', '.join(given)} only go with --benchmark; with a fine-tune config, set those values in it "
                "or with --set (e.g. --set optim.lr=0.01 --set train.steps=500)"
            )
        if checkpoint is not None:
            set_too = [o for o in overrides if o.partition("=")[0].strip() == "init.checkpoint"]
            if set_too:  # (the --set took the argument's place without a word)
                fail(f"give the checkpoint once: CHECKPOINT ({checkpoint}) or --set {set_too[-1]}, not both")
            overrides.insert(0, f"init.checkpoint={checkpoint}")
        from vitray.trainers.config import TrainingConfig

        cfg = load(TrainingConfig, config, overrides)
        if cfg.init.checkpoint is None:
            fail("fine-tuning starts from a checkpoint: give CHECKPOINT or --set init.checkpoint=PATH")
        cfg = reporting_top1(cfg)  # the top-1 this command reports, at the end
    if dry_run:  # the config, with the model it trains: the checkpoint's at the run's size, where it is here
        from vitray.trainers.driver_checks.preflight import PreflightError, model_to_train

        with handled((PreflightError,)):  # (touches no data: a checkpoint that is not here is not refused)
            model = model_to_train(cfg, elsewhere_ok=True)
        print_config(cfg.model_copy(update={"model": model}))
        return
    from vitray.cli.pretrain import exit_stopped
    from vitray.cluster import pretrain as training
    from vitray.evaluation.evaluators import TEST
    from vitray.runfolder.files import run_dir

    folder = run_dir(cfg.run.storage, cfg.run.name)
    # Refused before Ray started (a bad input, a run another driver holds): exit 2; stopped by SIGTERM
    # or Ctrl-C: 75 or 130, as `vitray pretrain` (it was "fine-tuning failed", exit 1); else failed: 1
    with handled(
        training.REFUSED, failed=(Exception,), doing="fine-tuning", traceback_at=" (the full traceback: --verbose)"
    ):
        try:
            # JSON mode: stdout is for the JSON alone (the progress lines go to stdout)
            result = run_finetune(cfg, show_progress=format_ == OutputFormat.table, verbose=verbose)
        except training.Preempted as stopped:
            exit_stopped(stopped, folder, cfg.train.steps)
    scored = [("val" if result.test is not None else "top1", (cfg.data.val_path, cfg.data.val_split), result.top1)]
    if result.test is not None:
        scored.append(("test", cfg.evals[TEST].dataset(cfg.data), result.test))
    if format_ == OutputFormat.json:
        import json

        top1s = {what: {"top1": top1, "path": path, "split": split} for what, (path, split), top1 in scored}
        typer.echo(json.dumps({"run": folder, "step": cfg.train.steps, **top1s}, indent=1))
        return
    console.print(f"run folder: {folder}")
    for what, (path, split), top1 in scored:
        label = "top-1" if what == "top1" else f"{what} top-1"
        typer.echo(f"{label} ({path} split {split}): {top1:.4f}")


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
    overrides = [OptionValue(f"data_root={data_root}", f"--data-root {data_root}")] if data_root else []
    overrides += [OptionValue(f"output={output}", f"--output {output}")] if output else []
    grid = _grid(config, overrides + list(set_ or []))
    if dry_run:
        print_config(grid)
        return
    from vitray.cluster.evaluate import evaluate_checkpoint, report_grid

    # A checkpoint that is not there, or a grid its model cannot run (pre-flight, before Ray): exit 2;
    # the grid itself failing (not one of its cells: those are in the table): exit 1
    with handled(
        (FileNotFoundError, ValueError, RuntimeError),
        failed=(Exception,),
        doing="evaluation",
        after_stop="the same command goes on: finished cells are kept, fine-tunes resume from their checkpoints",
    ):
        watched = evaluate_checkpoint(
            checkpoint,
            grid,
            all_checkpoints=all_checkpoints,
            watch=watch,
            poll_seconds=poll,
            timeout_seconds=watch_timeout,
            console=console,
            show_progress=progress,
            verbose=verbose,
        )
    summaries = watched.grids
    if not watched.finished:
        console.print(f"[yellow]stopped watching after {watch_timeout:g} s: the run has not finished[/]")
    # This grid's cells: a failure of a cell no longer planned is not reported (its success is, on
    # the data as it is now)
    scope = {"cells": watched.cell_ids, "data": watched.data}
    files = report_grid(grid, table_console(), show=format_ == OutputFormat.table, **scope)
    if format_ == OutputFormat.json:
        from vitray.cluster.evaluate import reported_results
        from vitray.evaluation.report import summary_json

        typer.echo(summary_json(reported_results(grid, **scope)))
    failed, missing = sum(s.failed for s in summaries), sum(s.missing for s in summaries)
    ok, skipped = sum(s.ok for s in summaries), sum(s.skipped for s in summaries)
    console.print(f"cells: {ok} ok, {skipped} already finished, {failed} failed, {missing} missing data")
    waiting = sum(s.waiting for s in summaries)
    if waiting:
        console.print(f"{waiting} final fine-tune run(s) wait for a failed cell of their learning-rate sweep")
    console.print(f"results: {grid.results_path}\nreport:  {files}")
    if failed or missing:
        raise typer.Exit(1)
