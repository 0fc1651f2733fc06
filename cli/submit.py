"""`vitray submit -- ARGS...`."""

from __future__ import annotations

import os
import shlex
from typing import Annotated

import typer

from vitray.cli.app import app, fail, handled


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    options_metavar="[OPTIONS] -- COMMAND [ARGS]...",
)
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
    no_follow: Annotated[
        bool, typer.Option("--no-follow", help="Print the job id (alone on stdout) and return.")
    ] = False,
):
    """Submit `vitray ARGS...` as a Ray job: vitray submit --address http://HOST:8265 -- pretrain -c run.yaml"""
    args = list(ctx.args)
    if not args:
        fail("nothing to submit: give the vitray command after --, e.g. -- pretrain -c configs/demo.yaml")
    # Refused here, not met on the cluster: `ray job submit -- vitray ...`'s habit, a misspelt command.
    if args[0] == "vitray":
        fail(f"the command after -- is without `vitray`: vitray submit ... -- {shlex.join(args[1:])}")
    commands = sorted(
        [info.name or info.callback.__name__ for info in app.registered_commands]
        + [info.name for info in app.registered_groups]
    )
    if args[0] not in commands:
        fail(f"{args[0]!r} is not a vitray command; the commands are: {', '.join(commands)}")
    if working_dir is not None and not os.path.isdir(working_dir):
        fail(f"--working-dir {working_dir}: no such folder (the folder uploaded as the job's working dir)")
    env_vars = {}
    for item in env or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            fail(f"--env {item!r}: expected NAME=VALUE")
        env_vars[name] = value
    from vitray.cluster import submit as jobs

    with handled((jobs.NotSubmitted,)):  # the command's own --dry-run refused it here
        jobs.submit(address, args, working_dir=working_dir, env=env_vars, follow=not no_follow)
