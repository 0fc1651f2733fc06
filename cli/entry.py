"""The `vitray` console script and `python -m vitray.cli`: imports the commands, then runs them.

Importing them (typer, torch, Ray...) takes a second or two, before `cli/app.py`'s `handled` can
catch anything: Ctrl-C in that window is answered here, in the same one line, instead of a
traceback through the imports. This module imports only the exit codes (constants) for that reason.
"""

from __future__ import annotations

import sys

from vitray.common.exit_codes import STOPPED_BY_USER


def main() -> None:
    try:
        from vitray.cli.main import main as run
    except KeyboardInterrupt:
        print("stopped by user (Ctrl-C): vitray's start-up did not finish", file=sys.stderr)
        sys.exit(STOPPED_BY_USER)
    run()


if __name__ == "__main__":
    main()
