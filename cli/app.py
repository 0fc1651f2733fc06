"""The `vitray` app and what its commands share: the options every command takes, the one
console for messages, and :func:`handled`, the one place where an error becomes a message and an
exit status (common/exit_codes.py; docs/resuming-and-faults.md, "Exit codes").

Every command takes `--config/-c FILE.yaml` and `--set key=value` overrides; a bad value fails here,
before any Ray resources are taken. The command modules (`cli/pretrain.py`, `cli/data.py`, ...)
import this module and add their commands to :data:`app`; `cli/main.py` imports them all.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, NoReturn, TypeVar

import click
import typer
import typer.rich_utils
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape

from vitray.cluster.runtime import RayLost, RayUnavailable  # light: Ray itself is imported when a command connects
from vitray.common import exit_codes
from vitray.common.config import ConfigError, dump_config, load_config
from vitray.common.failures import describe_failure
from vitray.common.redact import redact_text

M = TypeVar("M", bound=BaseModel)
HELP_WIDTH_WITHOUT_TERMINAL = 100
log = logging.getLogger("vitray.cli")

# Help written to a file or a pipe (`vitray data prepare --help | less`, docs) has no terminal to
# take its width from; rich's default of 80 columns cut the longest option names ("--samples-per-sha…").
if typer.rich_utils.MAX_WIDTH is None and not sys.stdout.isatty():
    typer.rich_utils.MAX_WIDTH = HELP_WIDTH_WITHOUT_TERMINAL


def _plainly_named(params: list) -> list:
    """Parameters named in help and usage lines as the docs name them (`SOURCE DEST`, not Typer's
    `{source} {dest}`), with no value type beside a flag: Typer's `<bool>` beside `--overwrite`
    (and `--help`) read as if the flag took a value (`--overwrite true`)."""
    for param in params:  # (Typer's own click, vendored: not `click`'s classes)
        if isinstance(param, typer.core.TyperArgument) and param.metavar is None:
            param.metavar = param.name.upper()
        elif isinstance(param, typer.core.TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params


class _PlainCommand(typer.core.TyperCommand):
    def get_params(self, ctx):
        return _plainly_named(super().get_params(ctx))


class _PlainGroup(typer.core.TyperGroup):
    def get_params(self, ctx):
        return _plainly_named(super().get_params(ctx))


app = typer.Typer(
    name="vitray",
    cls=_PlainGroup,
    help="Pre-train Vision Transformers on Ray and transfer them to the ViT paper's benchmarks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
data_app = typer.Typer(cls=_PlainGroup, help="Prepare datasets as webdataset shards.", no_args_is_help=True)
app.add_typer(data_app, name="data")


def reflow_help(typer_app: typer.Typer) -> None:
    """Each command's help with every paragraph on one line, for the terminal to wrap. Typer's rich
    help keeps a docstring's line breaks in the command list and in every paragraph after the first,
    so `vitray --help` showed lines broken where the source was; a paragraph starting with \\b
    keeps its lines (click's convention). Each command names its parameters as `_plainly_named` says."""
    for command in typer_app.registered_commands:
        text = inspect.cleandoc(command.help or (command.callback.__doc__ if command.callback else None) or "")
        paragraphs = text.split("\n\n")
        command.help = "\n\n".join(p if p.startswith("\b") else " ".join(p.split("\n")) for p in paragraphs)
        if command.cls in (None, typer.core.TyperCommand):  # (Typer's own, unless a command chose another)
            command.cls = _PlainCommand


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


def _one_config(given: list[Path] | None) -> list[Path] | None:
    """-c given twice took the last file alone, without a word: one config file per command (a
    list of at most one, which `load` reads)."""
    if given and len(given) > 1:
        raise typer.BadParameter(
            f"given {len(given)} times ({', '.join(map(str, given))}): a command reads one config file; "
            "put what the others change in --set KEY=VALUE, or in a copy of the file"
        )
    return given


# (a list, so that a second -c is seen and refused)
ConfigOpt = Annotated[
    list[Path] | None, typer.Option("--config", "-c", help="YAML config file.", metavar="FILE", callback=_one_config)
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", help="Override a config value: --set KEY=VALUE, KEY dotted as in the config file (repeatable)."
    ),
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


def fail(message: str, code: int = exit_codes.INPUT_ERROR) -> NoReturn:
    """`error: MESSAGE` on the console (stderr) and exit with `code` (by default: refused, 2); a URL's
    password or a secret of the environment quoted in it is masked (`common.redact`)."""
    console.print(f"[bold red]error:[/] {escape(redact_text(message))}", highlight=False)
    raise typer.Exit(code)


Errors = tuple[type[BaseException], ...]


@contextmanager
def handled(
    refused: Errors = (),
    *,
    failed: Errors = (),
    doing: str | None = None,
    traceback_at: str = "",
    after_stop: str = "",
) -> Iterator[None]:
    """The one wrapper that turns what a command raises into one line on the console and the exit
    status of common/exit_codes.py; a traceback goes to the log (`vitray.cli` at debug level), never
    to the console. Around a command's work (`with handled(...):`) or on the command function itself
    (below `@app.command()`: `@handled((ValueError,))`).

    - a config error (ConfigError), no Ray cluster at the address (RayUnavailable) and ``refused``
      (a config or input refused before Ray started): `error: MESSAGE`, exit 2;
    - Ray's GCS or raylet gone under the work (RayLost): its one line, exit 1;
    - ``failed`` (the work failed): `error: DOING failed: ROOT CAUSE` (:func:`describe_failure`),
      the advice that fits the cause and ``traceback_at`` (where the whole traceback is), exit 1;
    - Ctrl-C: `stopped by user (Ctrl-C): DOING did not finish` (by default DOING is the command line's
      command, `vitray data prepare`; then ``after_stop``, what a re-run does), exit 130 (a command
      that checkpoints first catches it itself);
    - `typer.Exit` (a command's own :func:`fail`) and anything else: as raised.
    """
    try:
        yield
    except KeyboardInterrupt:
        say_stopped_by_user(doing, after_stop)
        raise typer.Exit(exit_codes.STOPPED_BY_USER) from None
    except (typer.Exit, typer.Abort, click.ClickException):
        raise
    except Exception as err:
        if isinstance(err, ConfigError):
            fail(config_message(err), exit_codes.INPUT_ERROR)
        if isinstance(err, RayLost):  # its one line says what happened and what to do
            log.debug("Ray went away", exc_info=err)
            fail(str(err), exit_codes.FAILED)
        if isinstance(err, (RayUnavailable, *refused)):
            log.debug("refused", exc_info=err)
            fail(str(err), exit_codes.INPUT_ERROR)
        if isinstance(err, failed):
            log.debug("%s failed", doing, exc_info=err)
            cause = describe_failure(err)
            fail(
                f"{doing or command_line()} failed: {cause.one_line()}\n  {cause.advice()}{traceback_at}",
                exit_codes.FAILED,
            )
        raise


def say_stopped_by_user(doing: str | None = None, after_stop: str = "") -> None:
    """Ctrl-C's one line on the console: `stopped by user (Ctrl-C): DOING did not finish` (by default
    DOING is the command line's command), and ``after_stop``: what running it again does."""
    then = f"; {after_stop}" if after_stop else ""
    typer.echo(f"stopped by user (Ctrl-C): {doing or command_line()} did not finish{then}", err=True)


def command_line() -> str:
    """`vitray` and the command words of this process's command line (`vitray data prepare`)."""
    words, group = ["vitray"], typer.main.get_command(app)
    for arg in sys.argv[1:]:
        command = getattr(group, "commands", {}).get(arg)
        if command is None:
            break
        words.append(arg)
        group = command
    return " ".join(words)


def load(schema: type[M], config: list[Path] | Path | None, overrides: list[str] | None) -> M:
    """`load_config`, failing with the config's problems (and the options that set those keys);
    `config`: -c's file (`ConfigOpt`: a list of at most one)."""
    if isinstance(config, list):
        config = config[0] if config else None
    try:
        return load_config(schema, config, overrides or [])
    except ConfigError as err:
        fail(config_message(err))


def config_message(err: ConfigError) -> str:
    """A config error's text, and the command-line options that set the keys it names."""
    text = str(err)
    # A key the config lacks, not one it holds wrongly (a training config's `data_root: unknown key`).
    lacks = lambda key: f"{key}: Field required" in text or re.search(rf"must set .*\b{key}\b", text)  # noqa: E731
    return text + "".join(f"\n  ({key}: {hint})" for key, hint in OPTION_HINTS.items() if lacks(key))


def print_config(config: BaseModel) -> None:
    """What `--dry-run` prints: the resolved config as YAML, credentials masked."""
    typer.echo(dump_config(config), nl=False)
