"""`vitray pretrain`."""

from __future__ import annotations

from typing import Annotated

import typer

from vitray.cli.app import ConfigOpt, DryRunOpt, SetOpt, VerboseOpt, app, console, fail, load, print_config
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
    from vitray.trainers.config import TrainingConfig

    cfg = load(TrainingConfig, config, set_)
    if dry_run:  # the config and the model it builds; the data is checked when the run starts
        from vitray.trainers.preflight import PreflightError, check_model

        try:
            check_model(cfg.model)
        except PreflightError as err:
            fail(str(err), exit_codes.INPUT_ERROR)
        print_config(cfg)
        return
    from vitray.cluster.pretrain import AlreadyFinished, Preempted, TrainingFailedError
    from vitray.cluster.pretrain import pretrain as run_pretrain
    from vitray.cluster.runtime import LocalPathsOnCluster, NotEnoughResources, run_dir
    from vitray.common.failures import describe_failure
    from vitray.trainers.lease import RunLeaseHeld
    from vitray.trainers.preflight import PreflightError

    folder = run_dir(cfg.run.storage, cfg.run.name)
    try:
        run_pretrain(cfg, verbose=verbose, force=force)
    except (PreflightError, NotEnoughResources, LocalPathsOnCluster, RunLeaseHeld) as err:
        fail(str(err), exit_codes.INPUT_ERROR)  # refused before the workers started
    except AlreadyFinished as done:
        console.print(
            f"{cfg.run.name} is finished: its latest checkpoint is at step {done.checkpoint.step} of "
            f"train.steps={cfg.train.steps} ({done.checkpoint.path}); raise train.steps to train further"
        )
        return
    except Preempted as stopped:
        what = "stopped by user" if stopped.by_user else f"stopped on a pre-emption notice ({stopped})"
        console.print(f"{what}; latest complete checkpoint: {_latest_text(folder)}; re-run the same command to resume")
        raise typer.Exit(exit_codes.STOPPED_BY_USER if stopped.by_user else exit_codes.PREEMPTED) from None
    except KeyboardInterrupt:
        console.print(
            f"stopped by user at once (no new checkpoint); latest complete checkpoint: {_latest_text(folder)}"
        )
        raise typer.Exit(exit_codes.STOPPED_BY_USER) from None
    except TrainingFailedError as err:
        # One line: the root cause and the advice that fits it; the tracebacks are in the run's
        # attempt record and Ray's logs (`--verbose` shows the workers' output).
        cause = describe_failure(err)
        fail(
            f"pre-training failed: {cause.one_line()}\n  {cause.advice()}; the full traceback is in the "
            f"attempt record ({folder}/vitray/attempts) and with --verbose",
            exit_codes.FAILED,
        )
    console.print(f"run folder: {folder}")
    latest = _latest_complete(folder)
    if latest is not None:
        console.print(f"latest checkpoint: {latest.path} (step {latest.step})")


def _latest_text(folder: str) -> str:
    latest = _latest_complete(folder)
    return f"step {latest.step} ({latest.path})" if latest else "no checkpoint"


def _latest_complete(folder: str):
    """The run folder's newest complete checkpoint (what a re-run or `vitray export` takes), not
    Ray's last reported one, which a failed upload could leave incomplete; from a fresh listing
    (this process listed the folder before training, and s3fs caches listings)."""
    from vitray.data import storage
    from vitray.trainers.checkpoint import latest_complete_checkpoint

    storage.filesystem(folder)[0].invalidate_cache()
    return latest_complete_checkpoint(folder)
