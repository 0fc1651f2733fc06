"""`vitray runs` and `vitray export`: what is in a run folder, read from the files alone (no Ray)."""

from __future__ import annotations

import json
import posixpath
from typing import Annotated

import typer
from rich.markup import escape

from vitray.cli.app import CheckpointArg, OutputFormat, app, console, handled, table_console


@app.command()
def runs(
    storage: Annotated[str, typer.Argument(help="A run storage folder (local or s3://).")],
    format_: Annotated[
        OutputFormat, typer.Option("--format", "-f", help="json: one object per run.")
    ] = OutputFormat.table,
):
    """List the runs under STORAGE with their latest step, checkpoints and status, and why any
    checkpoint does not count (an unfinished write, a cut-short upload)."""
    from rich.table import Table

    from vitray.runfolder.listing import list_runs, run_summary
    from vitray.storage import check_reachable, is_local_file

    # A mistyped path, missing credentials or an unreachable endpoint: one line, at once.
    with handled((ValueError, FileNotFoundError, PermissionError)):
        check_reachable(storage, must_exist=True)
        if is_local_file(storage):
            raise ValueError(f"{storage} is a file: give the folder that holds the runs (a run.storage)")
        found = list_runs(storage)
        itself = None if found else run_summary(storage)
    if itself is not None:  # a run folder, not the storage the runs live in: show it
        found = [itself]
        console.print(f"{storage} is a run; the runs beside it: vitray runs {posixpath.dirname(storage.rstrip('/'))}")
    if format_ == OutputFormat.json:
        typer.echo(json.dumps([run.as_dict() for run in found], indent=1))
        return
    table = Table("run", "latest step", "checkpoints", "latest complete checkpoint", "status", "attempts")
    for run in found:
        table.add_row(
            *(
                escape(text)
                for text in (
                    run.name,
                    str(run.latest_step or "-"),
                    str(run.num_checkpoints),
                    run.latest_checkpoint or "-",
                    # the status, then each checkpoint that does not count and why, one a line
                    "\n".join([run.status, *(f"  ignored {line}" for line in run.incomplete_lines)]),
                    run.attempts_summary,
                )
            )
        )
    if found:
        table_console().print(table)
    else:  # (not an empty table above it)
        console.print(f"no runs under {storage}{_what_it_is_instead(storage)}")


def _what_it_is_instead(storage: str) -> str:
    """A folder given for STORAGE that is something else vitray writes (a dataset, a run, a
    checkpoint): said, with the STORAGE to give."""
    from vitray import storage as stores
    from vitray.data.layout import is_prepared_dataset
    from vitray.runfolder.checkpoint_folders import STATE_FILE

    parent = storage.rstrip("/").rsplit("/", 1)[0] or "/"
    try:
        if is_prepared_dataset(storage):
            return ": it is a prepared dataset (dataset.json); give the folder of the runs (run.storage)"
        if stores.exists(stores.join(storage, STATE_FILE)):
            return f": it is a checkpoint folder; its run's storage is {parent.rsplit('/', 1)[0] or '/'}"
        if any(name.startswith("checkpoint_") for name in stores.list_names(storage)):
            return f": it is a run folder; its storage is {parent}"
    except (OSError, ValueError):
        pass
    return ""


@app.command()
def export(
    checkpoint: CheckpointArg,
    format_: Annotated[str, typer.Option("--format", "-f", help="npz | safetensors | timm | onnx")] = "npz",
    out: Annotated[
        str | None,
        typer.Option(
            "--out",
            "-o",
            help="Output file (local or s3://); a folder for --format timm. "
            "Default: model.FORMAT here (model-timm for timm).",
            show_default=False,
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output.")] = False,
):
    """Write consolidated model weights: the original ViT .npz layout, safetensors, a folder timm
    loads (timm.create_model("local-dir:OUT", pretrained=True)), or the network as ONNX."""
    from vitray.runfolder.checkpoint_folders import IncompleteCheckpointError
    from vitray.runfolder.export import default_output
    from vitray.runfolder.export import export as run_export

    # An unknown --format, an output in the way, a checkpoint that is not there or not complete:
    # one line, exit 2
    with handled((FileNotFoundError, ValueError, IncompleteCheckpointError)):
        out = out or default_output(format_)
        source = run_export(checkpoint, format_, out, overwrite=overwrite)
    for newer in source.passed_over:  # a run folder's newer checkpoints that do not count
        console.print(f"skipped newer checkpoint {newer.path}: {newer.problem}", soft_wrap=True)
    console.print(f"wrote {out} ({format_}) from {source.path} (step {source.step})", soft_wrap=True)
