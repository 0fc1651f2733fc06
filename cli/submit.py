"""`vitray submit -- ARGS...`."""

from __future__ import annotations

from typing import Annotated

import typer

from vitray.cli.app import app, fail
from vitray.common import exit_codes


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def submit(
    ctx: typer.Context,
    address: Annotated[
        str,
        typer.Option(
            "--address", envvar="RAY_ADDRESS", help="Ray dashboard / Jobs API address, e.g. http://HOST:8265."
        ),
    ],
    working_dir: Annotated[
        str | None, typer.Option("--working-dir", help="Folder uploaded as the job's working dir (default: none).")
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option(
            "--env",
            help="NAME=VALUE for the job (repeatable). Stored in the job record, which anyone "
            "who can list jobs reads: never a credential (the cluster's nodes have their own).",
        ),
    ] = None,
    no_follow: Annotated[bool, typer.Option("--no-follow", help="Print the job id and return.")] = False,
):
    """Submit `vitray ARGS...` as a Ray job: vitray submit --address http://HOST:8265 -- pretrain -c run.yaml"""
    from vitray.cluster.submit import submit as run_submit

    args = list(ctx.args)
    if not args:
        fail("nothing to submit: give the vitray command after --, e.g. -- pretrain -c configs/demo.yaml")
    env_vars = {}
    for item in env or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            fail(f"--env {item!r}: expected NAME=VALUE")
        env_vars[name] = value
    _check_here(args, working_dir)
    run_submit(address, args, working_dir=working_dir, env=env_vars, follow=not no_follow)


# Commands whose --dry-run validates the config (and, for pretrain, that the model builds).
_DRY_RUNNABLE = ("pretrain", "finetune", "evaluate")


def _check_here(args: list[str], working_dir: str | None) -> None:
    """The submitted command's own --dry-run, here and in seconds, so that a config mistake is
    refused before the job reaches the cluster. Only with --working-dir: then the job sees the
    same files (without it, paths are the cluster image's, which this machine may not have)."""
    import subprocess
    import sys

    if working_dir is None or args[0] not in _DRY_RUNNABLE or "--dry-run" in args:
        return
    checked = subprocess.run(
        [sys.executable, "-m", "vitray.cli", *args, "--dry-run"], cwd=working_dir, capture_output=True, text=True
    )
    if checked.returncode != 0:
        said = [line for line in checked.stderr.splitlines() if line.strip()]
        reason = "\n".join(said[-5:]).removeprefix("error: ") or f"exit code {checked.returncode}"
        fail(f"not submitted: `vitray {' '.join(args)}` would fail: {reason}", exit_codes.INPUT_ERROR)
