"""`vitray demo` / `make demo`: the whole path on built-in real data, on this machine
(:func:`vitray.cluster.demo.run_demo`: prepare -> pretrain -> evaluate -> report -> inspect)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from vitray.cli.app import VerboseOpt, app, fail, handled, table_console
from vitray.common import exit_codes


@app.command()
def demo(
    out: Annotated[str, typer.Option(help="Where the data, runs and report go.")] = "demo-output",
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="Override a value of the pre-training config (configs/demo.yaml): --set train.steps=100."
        ),
    ] = None,
    grid_set: Annotated[
        list[str] | None,
        typer.Option(
            "--grid-set",
            help="Override a value of the evaluation grid (configs/grid_digits.yaml): --grid-set finetune.steps=50.",
        ),
    ] = None,
    verbose: VerboseOpt = False,
):
    """The whole pipeline on built-in data: prepare -> pretrain -> evaluate -> report."""
    from vitray.storage import is_local_file

    if is_local_file(out):
        fail(f"--out {out} is a file: give a folder for the demo's data, runs and report")
    from vitray.cluster.demo import run_demo
    from vitray.trainers.driver_checks.preflight import PreflightError

    with handled((PreflightError,)):  # a bad --set: one line, exit 2
        result = run_demo(
            out,
            overrides=set_ or [],
            grid_overrides=grid_set or [],
            verbose=verbose,
            console=Console(soft_wrap=True),  # paths whole, to copy, whatever the width
            tables=table_console(),
        )
    grid = result["grid"]
    if grid.failed or grid.missing:  # the results above lack those cells' numbers: not a demo that worked
        fail(
            f"{grid.failed + grid.missing} of the demo's {grid.total} evaluation cells did not finish "
            f"(their errors are above, in the evaluation step); results: {result['report']}",
            code=exit_codes.FAILED,
        )
