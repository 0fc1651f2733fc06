"""`vitray`: the app with every command (each command module adds its own when imported)."""

from __future__ import annotations

import sys

from rich.markup import escape

# In `vitray --help` order; importing a command module adds its commands to `app`.
from vitray.cli import data, demo, inspection, pretrain, runs, submit, transfer  # noqa: F401
from vitray.cli.app import app, console

__all__ = ["app", "main"]


def main() -> None:
    from vitray.cluster.runtime import RayUnavailable, enable_token_auth_if_available

    # Ray reads its auth mode when first imported, so this comes before any command runs.
    enable_token_auth_if_available()
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)
    except RayUnavailable as err:  # from any command that starts or joins Ray: one line, not Ray's traceback
        console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
