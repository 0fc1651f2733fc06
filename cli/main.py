"""`vitray`: the app with every command (each command module adds its own when imported)."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import traceback

import typer
from rich.markup import escape

# Importing a command module adds its commands to `app`.
from vitray.cli import data, demo, inspection, pretrain, runs, submit, transfer  # noqa: F401
from vitray.cli.app import app, command_line, console, data_app, handled, reflow_help, say_stopped_by_user
from vitray.cluster.runtime import enable_token_auth_if_available
from vitray.common import exit_codes, redact
from vitray.common.failures import describe_failure, environment_problem

reflow_help(app)
reflow_help(data_app)

# `vitray --help` lists the commands in the order of the work, in these panels.
HELP_PANELS = {
    "Start here": ["demo"],
    # `data` is a group: Typer lists groups after the commands (of its panel, and all panels)
    "Data and pre-training": ["pretrain", "runs", "inspect", "export", "data"],
    "Transfer to benchmarks": ["fewshot", "finetune", "evaluate"],
    "On a Ray cluster": ["submit"],
}


def _arrange_help() -> None:
    order = [name for names in HELP_PANELS.values() for name in names]
    panel = {name: title for title, names in HELP_PANELS.items() for name in names}
    for infos, name_of in (
        (app.registered_commands, lambda info: info.name or info.callback.__name__),
        (app.registered_groups, lambda info: info.name),
    ):
        infos.sort(key=lambda info: order.index(name_of(info)))
        for info in infos:
            info.rich_help_panel = panel[name_of(info)]


_arrange_help()

__all__ = ["app", "main"]


# A config value given as an argument of its own, as Hydra (`optim.lr=0.1`) and ml_collections
# (`--config.optim.lr=0.1`, big_vision's flags) take them.
_CONFIG_VALUE = re.compile(r"^(?:--config\.)?([a-z_]+(?:\.[a-z_0-9]+)+)=(.*)$", re.DOTALL)


def config_value_without_set(argv: list[str]) -> str | None:
    """The refusal of `vitray pretrain ... optim.lr=0.1`, which click answers "unexpected extra
    argument" (or "no such option"): the fix is `--set`, said with the value (masked if secret)."""
    commands = getattr(typer.main.get_command(app), "commands", {})
    command = commands.get(argv[1]) if len(argv) > 1 else None
    if command is None or not any("--set" in param.opts for param in command.params):
        return None
    # The options whose next argument is their value: `--name optim.lr=0.1` names a run so.
    valued = {
        opt for param in command.params if param.param_type_name == "option" and not param.is_flag for opt in param.opts
    }
    args = argv[2:]
    for before, arg in zip(["", *args], args):
        if arg == "--":
            break
        match = _CONFIG_VALUE.match(arg)
        if match and (arg.startswith("--config.") or before not in valued):
            key, value = match.groups()
            shown = f"{key}={value}" if redact.redact_at(key.split("."), value) == value else f"{key}=***"
            given = f"--config.{shown}" if arg.startswith("--config.") else shown
            return f"unexpected argument {given}: a config value is given with --set (--set {shown})"
    return None


def main() -> None:
    # Ray reads its auth mode when first imported, so this comes before any command runs.
    enable_token_auth_if_available()
    refusal = config_value_without_set(sys.argv)
    if refusal is not None:
        console.print(f"[bold red]error:[/] {escape(refusal)}", highlight=False)
        sys.exit(exit_codes.INPUT_ERROR)
    try:
        # What a command did not handle itself: one line, not a traceback.
        with handled():
            app()
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except SystemExit as done:
        if _ctrl_c_outside_handled(done):
            say_stopped_by_user()
        raise
    except Exception as err:  # what no command foresaw: one line here, the traceback in a file
        sys.exit(_unforeseen(err))


def _unforeseen(err: Exception) -> int:
    """An error no command turned into its own message: `error: COMMAND failed: CAUSE`, and the whole
    traceback in a file named on that line (for a bug report), not on the console. A full disk, a
    read-only file system or a permission refused is no bug: one line naming the place and the fix."""
    refused = environment_problem(err)
    if refused is not None:
        console.print(f"[bold red]error:[/] {escape(command_line())} failed: {escape(refused)}", highlight=False)
        return exit_codes.FAILED
    try:
        # Credentials (a --set of a secret, a URL's password, the shell's secret values) are masked:
        # the file is for a bug report. Made anew, readable by its user alone (the shared /tmp), never
        # through a link another user left at a name this process could have been known to take.
        handle, name = tempfile.mkstemp(prefix=f"vitray-error-{os.getpid()}-", suffix=".txt")
        command = " ".join(redact.redact_args(sys.argv))
        with os.fdopen(handle, "w") as file:
            file.write(f"{command}\n\n{redact.redact_text(''.join(traceback.format_exception(err)))}")
        where = f"the traceback: {name}"
    except OSError:
        where = "no traceback file could be written"
    cause = " ".join(redact.redact_text(describe_failure(err).one_line()).split())
    console.print(f"[bold red]error:[/] {escape(command_line())} failed: {escape(cause)} ({where})", highlight=False)
    return exit_codes.FAILED


def _ctrl_c_outside_handled(done: SystemExit) -> bool:
    """Whether Typer turned a Ctrl-C into this exit itself: it answers a KeyboardInterrupt raised
    outside a command's `handled` (the seconds a command spends importing its modules and loading
    its config) with a silent `Exit(130)`; `handled`'s own exit says its line and is not chained."""
    exit_ = done.__context__
    return isinstance(exit_, typer.Exit) and isinstance(exit_.__cause__, KeyboardInterrupt)


if __name__ == "__main__":
    main()
