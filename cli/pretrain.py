"""`vitray pretrain`."""

from __future__ import annotations

from typing import Annotated

import typer

from vitray.cli.app import ConfigOpt, DryRunOpt, SetOpt, VerboseOpt, app, console, fail, load, print_config


@app.command()
def pretrain(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    dry_run: DryRunOpt = False,
    verbose: VerboseOpt = False,
    force: Annotated[bool, typer.Option("--force", help="Take over the run's lease even if its holder's heartbeat is fresh.")] = False,
):
    """Pre-train a ViT on a Ray cluster (an embedded local Ray when cluster.address is empty).

    Re-running with the same run.name and run.storage resumes from the latest complete checkpoint.
    A second start of a run that is running refuses (the run's lease); SIGTERM checkpoints and stops.
    """
    from vitray.trainers.config import TrainingConfig

    cfg = load(TrainingConfig, config, set_)
    if dry_run:
        print_config(cfg)
        return
    from vitray.cluster.pretrain import Preempted, TrainingFailedError, pretrain as run_pretrain
    from vitray.cluster.runtime import LocalPathsOnCluster, NotEnoughResources, run_dir
    from vitray.trainers.lease import RunLeaseHeld

    try:
        run_pretrain(cfg, verbose=verbose, force=force)
    except (NotEnoughResources, LocalPathsOnCluster, RunLeaseHeld) as err:
        fail(str(err))
    except Preempted as stopped:
        latest = _latest_complete(run_dir(cfg.run.storage, cfg.run.name))
        where = f"step {latest.step} ({latest.path})" if latest else "no checkpoint"
        console.print(f"stopped on a pre-emption notice ({stopped}); latest complete checkpoint: {where}; "
                      "re-run the same command to resume")  # fmt: skip
        return
    except TrainingFailedError as err:
        # Ray's message carries each failed rank's traceback; no driver traceback on top of it.
        fail(f"pre-training failed (re-run the same command to resume):\n{err}", code=1)
    folder = run_dir(cfg.run.storage, cfg.run.name)
    console.print(f"run folder: {folder}")
    latest = _latest_complete(folder)
    if latest is not None:
        console.print(f"latest checkpoint: {latest.path} (step {latest.step})")


def _latest_complete(folder: str):
    """The run folder's newest complete checkpoint (what a re-run or `vitray export` takes), not
    Ray's last reported one, which a failed upload could leave incomplete; from a fresh listing
    (this process listed the folder before training, and s3fs caches listings)."""
    from vitray.data import storage
    from vitray.trainers.checkpoint import latest_complete_checkpoint

    storage.filesystem(folder)[0].invalidate_cache()
    return latest_complete_checkpoint(folder)

