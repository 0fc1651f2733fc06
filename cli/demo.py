"""`vitray demo` / `make demo`: the whole path on built-in real data, on this machine
(:func:`vitray.cluster.demo.run_demo`: prepare -> pretrain -> evaluate -> report -> inspect)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from vitray.cli.app import SetOpt, VerboseOpt, app, handled, table_console


@app.command()
def demo(
    out: Annotated[str, typer.Option(help="Where the data, runs and report go.")] = "demo-output",
    set_: SetOpt = None,
    verbose: VerboseOpt = False,
):
    """The whole pipeline on built-in data: prepare -> pretrain -> evaluate -> report."""
    from vitray.cluster.demo import run_demo

    with handled():  # a bad --set: one line, exit 2
        run_demo(out, overrides=set_ or [], verbose=verbose, console=Console(), tables=table_console())
