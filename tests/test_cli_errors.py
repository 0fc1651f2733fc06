"""cli/app.py's `handled`: the one wrapper that turns what a command raises into one line on the
console and an exit status (common/exit_codes.py), on a throwaway Typer app (nothing of vitray runs)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from vitray.cli.app import handled
from vitray.cluster.runtime import RayUnavailable
from vitray.common import exit_codes
from vitray.common.config import ConfigError


class Refusal(ValueError):
    pass


class WorkFailed(RuntimeError):
    pass


def run(error: BaseException):
    app = typer.Typer()

    @app.command()
    @handled((Refusal,), failed=(WorkFailed,), doing="frobbing", traceback_at=" (the full traceback: --verbose)")
    def frob(name: str = "x"):
        """Raises `error`."""
        raise error

    @app.command()
    def other():  # a second command, so that `frob` is named on the command line
        pass

    return CliRunner().invoke(app, ["frob", "--name", "y"])


def test_a_refusal_is_one_line_and_exit_2():
    result = run(Refusal("run.storage 's3://nope' cannot be reached"))
    assert result.exit_code == exit_codes.INPUT_ERROR
    assert result.output.strip() == "error: run.storage 's3://nope' cannot be reached"


@pytest.mark.parametrize("error", [ConfigError("train.steps: expected an integer"), RayUnavailable("no Ray at x")])
def test_config_errors_and_no_ray_are_refusals_of_every_command(error):
    result = run(error)
    assert result.exit_code == exit_codes.INPUT_ERROR
    assert result.output.strip() == f"error: {error}"


def test_a_failure_is_its_root_cause_and_advice_and_exit_1():
    try:
        raise WorkFailed("the workers died") from ConnectionResetError("peer went away")
    except WorkFailed as err:
        result = run(err)
    assert result.exit_code == exit_codes.FAILED
    lines = result.output.strip().splitlines()
    assert lines[0] == "error: frobbing failed: ConnectionResetError: peer went away"
    assert lines[1] == (
        "  re-run the same command: it resumes from the run's latest complete checkpoint, or starts over where it "
        "has none (the full traceback: --verbose)"
    )
    assert "Traceback" not in result.output


def test_ctrl_c_is_one_line_and_exit_130():
    result = run(KeyboardInterrupt())
    assert result.exit_code == exit_codes.STOPPED_BY_USER
    assert result.output.strip() == "stopped by user (Ctrl-C): frobbing did not finish"


def test_anything_else_is_raised_as_it_is():
    result = run(ZeroDivisionError("a bug"))
    assert isinstance(result.exception, ZeroDivisionError)


def test_the_command_keeps_its_options():
    """Typer reads the wrapped function's signature: --help lists its options."""
    app = typer.Typer()

    @app.command()
    @handled()
    def frob(name: str = "x"):
        typer.echo(f"hello {name}")

    assert CliRunner().invoke(app, ["--name", "y"]).output == "hello y\n"


def test_ctrl_c_while_the_commands_are_imported_is_one_line_and_exit_130(monkeypatch, capsys):
    """Before `handled` exists (the commands' modules still importing, the first fraction of a
    second) Ctrl-C is answered by the console script itself, in one line."""
    import importlib.abc
    import sys

    from vitray.cli import entry

    class CtrlCDuringTheImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "vitray.cli.main":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "vitray.cli.main", raising=False)
    monkeypatch.setattr(sys, "meta_path", [CtrlCDuringTheImport(), *sys.meta_path])
    with pytest.raises(SystemExit) as stopped:
        entry.main()
    assert stopped.value.code == exit_codes.STOPPED_BY_USER
    assert capsys.readouterr().err == "stopped by user (Ctrl-C): vitray's start-up did not finish\n"


def test_ctrl_c_before_a_command_is_handled_is_one_line_and_exit_130(monkeypatch, capsys):
    """A Ctrl-C while a command imports its modules or loads its config (before its `handled`):
    Typer answers it with a silent exit 130 of its own; the console script says the one line."""
    import sys

    from vitray.cli import app as cli_app
    from vitray.cli import main as cli_main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "enable_token_auth_if_available", lambda: None)  # Ray's auth: not here
    monkeypatch.setattr(cli_app, "load_config", interrupted)  # the config load of `vitray pretrain`
    monkeypatch.setattr(sys, "argv", ["vitray", "pretrain", "--set", "train.steps=4"])
    with pytest.raises(SystemExit) as stopped:
        cli_main.main()
    assert stopped.value.code == exit_codes.STOPPED_BY_USER
    assert capsys.readouterr().err == "stopped by user (Ctrl-C): vitray pretrain did not finish\n"
