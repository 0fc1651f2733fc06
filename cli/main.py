"""`vitray`: the app with every command (each command module adds its own when imported)."""

from __future__ import annotations

import sys

import typer

# In `vitray --help` order; importing a command module adds its commands to `app`.
from vitray.cli import data, demo, inspection, pretrain, runs, submit, transfer  # noqa: F401
from vitray.cli.app import app, handled
from vitray.cluster.runtime import enable_token_auth_if_available

__all__ = ["app", "main"]


def main() -> None:
    # Ray reads its auth mode when first imported, so this comes before any command runs.
    enable_token_auth_if_available()
    try:
        with handled():  # what a command did not handle itself: one line, not a traceback
            app()
    except typer.Exit as done:
        sys.exit(done.exit_code)


if __name__ == "__main__":
    main()
