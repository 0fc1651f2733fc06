"""`vitray pretrain`."""

from __future__ import annotations

import time
from typing import Annotated, NoReturn

import typer

from vitray.cli.app import ConfigOpt, DryRunOpt, SetOpt, VerboseOpt, app, console, handled, load, print_config
from vitray.common import exit_codes


@app.command()
def pretrain(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    dry_run: DryRunOpt = False,
    verbose: VerboseOpt = False,
    force: Annotated[
        bool, typer.Option("--force", help="Take over the run's lease even if its holder's heartbeat is fresh.")
    ] = False,
):
    """Pre-train a ViT on a Ray cluster (an embedded local Ray when cluster.address is empty).

    Re-running with the same run.name and run.storage resumes from the latest complete checkpoint.
    A second start of a run that is running refuses (the run's lease). SIGTERM checkpoints and stops (exit 75);
    Ctrl-C does the same (exit 130), a second Ctrl-C stops at once.
    """
    started = time.monotonic()
    from vitray.trainers.config import TrainingConfig

    cfg = load(TrainingConfig, config, set_)
    if dry_run:  # the config and the model it builds; the data is checked when the run starts
        from vitray.trainers.driver_checks.preflight import PreflightError, check_model

        with handled((PreflightError,)):
            check_model(cfg.model)
        print_config(cfg)
        return
    from vitray.cluster import pretrain as training
    from vitray.runfolder.files import run_dir

    folder = run_dir(cfg.run.storage, cfg.run.name)
    # Refused before the workers started: exit 2. Failed: one line, the root cause and the advice that
    # fits it; the tracebacks are in the run's attempt record and Ray's logs (`--verbose`: the workers').
    failed_at = f"; the full traceback is in the attempt record ({folder}/vitray/attempts) and with --verbose"
    with handled(
        training.REFUSED, failed=(training.TrainingFailedError,), doing="pre-training", traceback_at=failed_at
    ):
        try:
            training.pretrain(cfg, verbose=verbose, force=force)
        except training.AlreadyFinished as done:
            console.print(
                f"{cfg.run.name} is finished: its latest checkpoint is at step {done.checkpoint.step} of "
                f"train.steps={cfg.train.steps} ({done.checkpoint.path}); raise train.steps to train further"
            )
            return
        except training.Preempted as stopped:
            exit_stopped(stopped, folder, cfg.train.steps)
        except KeyboardInterrupt:
            console.print(
                f"stopped by user at once; latest complete checkpoint: {_latest_text(training.latest_complete(folder))} (one the "
                "workers were writing may still complete); re-run the same command to resume from the latest"
            )
            raise typer.Exit(exit_codes.STOPPED_BY_USER) from None
    from vitray.runfolder.run_report import run_report

    console.print(f"run folder:  {folder}", soft_wrap=True)
    for line in run_report(folder, total_steps=cfg.train.steps, wall_s=time.monotonic() - started):
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def exit_stopped(stopped, folder: str, total_steps: int) -> NoReturn:
    """A run stopped by a SIGTERM (exit 75) or Ctrl-C (130) once its workers checkpointed: one line,
    with where a re-run resumes, or that the run had finished (the stop came after its last step)."""
    from vitray.cluster import pretrain as training

    what = "stopped by user" if stopped.by_user else f"stopped on a pre-emption notice ({stopped})"
    latest = training.latest_complete(folder)
    then = (
        "the run had finished: nothing to resume"
        if latest is not None and latest.step >= total_steps
        else "re-run the same command to resume"
    )
    console.print(f"{what}; latest complete checkpoint: {_latest_text(latest)}; {then}")
    raise typer.Exit(exit_codes.STOPPED_BY_USER if stopped.by_user else exit_codes.PREEMPTED) from None


def _latest_text(latest) -> str:
    return f"step {latest.step} ({latest.path})" if latest else "no checkpoint"
