"""The `vitray` app and what its commands share: the options every command takes, the one
console for messages and :func:`fail`.

Every command takes `--config/-c FILE.yaml` and `--set key=value` overrides; a bad value fails here,
before any Ray resources are taken. The command modules (`cli/pretrain.py`, `cli/data.py`, ...)
import this module and add their commands to :data:`app`; `cli/main.py` imports them all.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, NoReturn, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape

from vitray.common.config import ConfigError, dump_config, load_config

M = TypeVar("M", bound=BaseModel)

app = typer.Typer(
    name="vitray",
    help="Pre-train Vision Transformers on Ray and transfer them to the ViT paper's benchmarks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
data_app = typer.Typer(help="Prepare datasets as webdataset shards.", no_args_is_help=True)
app.add_typer(data_app, name="data")

# Progress and messages (never wrapped: paths and commands stay copyable); result tables go to stdout.
console = Console(stderr=True, soft_wrap=True)

# Without a terminal (a pipe, a file, a CI log) rich would cut tables to 80 columns, truncating
# paths and metric names; there is no screen to fit, so tables get all the width they need.
UNLIMITED_WIDTH = 10_000


class OutputFormat(str, Enum):
    """How a command prints its result: a table for people, JSON for scripts (`--format`)."""

    table = "table"
    json = "json"


def table_console() -> Console:
    """A console on stdout for result tables: the terminal's width, or unlimited when stdout is
    not a terminal."""
    return Console() if sys.stdout.isatty() else Console(width=UNLIMITED_WIDTH)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"vitray {version('vitray')}")
        except PackageNotFoundError:  # running from a checkout that was never installed
            typer.echo("vitray (not installed: pip install -e .)")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Pre-train Vision Transformers on Ray and transfer them to the ViT paper's benchmarks."""


ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file.")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a config value: --set train.steps=100 (repeatable).")
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the resolved config and exit.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show Ray's and the workers' logs.")]
DataRootOpt = Annotated[
    str | None, typer.Option("--data-root", help="Folder (local or s3://) with the prepared benchmark datasets.")
]
CheckpointArg = Annotated[
    str, typer.Argument(help="A checkpoint folder, or a run folder (its latest complete checkpoint).")
]

# Config keys that a command-line option also sets: a config error about one names the option.
OPTION_HINTS = {"data_root": "give --data-root ROOT, or `data_root:` in the -c file"}


def fail(message: str, code: int = 2) -> NoReturn:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(code)


def load(schema: type[M], config: Path | None, overrides: list[str] | None) -> M:
    """`load_config`, failing with the config's problems (and the options that set those keys)."""
    try:
        return load_config(schema, config, overrides or [])
    except ConfigError as err:
        hints = "".join(f"\n  ({key}: {hint})" for key, hint in OPTION_HINTS.items() if f"{key}:" in str(err))
        fail(str(err) + hints)


def print_config(config: BaseModel) -> None:
    """What `--dry-run` prints: the resolved config as YAML, credentials masked."""
    typer.echo(dump_config(config), nl=False)
