"""The `vitray` command line. Every command takes `--config/-c FILE.yaml` and `--set key=value`
overrides; a bad value fails here, before any Ray resources are taken."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from vitray.cluster.config import ConfigError, dump_config, load_config

app = typer.Typer(
    name="vitray",
    help="Pre-train Vision Transformers on Ray and transfer them to the ViT paper's benchmarks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
data_app = typer.Typer(help="Prepare datasets as webdataset shards.", no_args_is_help=True)
app.add_typer(data_app, name="data")

console = Console(stderr=True)

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config file.")]
SetOpt = Annotated[
    Optional[list[str]], typer.Option("--set", help="Override a config value: --set train.steps=100 (repeatable).")
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the resolved config and exit.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show Ray's and the workers' logs.")]


def _fail(message: str, code: int = 2) -> None:
    # soft_wrap: long paths and commands in messages stay copyable when stderr is not a terminal.
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _load(schema, config: Optional[Path], overrides: Optional[list[str]]):
    try:
        return load_config(schema, config, overrides or [])
    except ConfigError as err:
        _fail(str(err))


@app.command()
def pretrain(config: ConfigOpt = None, set_: SetOpt = None, dry_run: DryRunOpt = False, verbose: VerboseOpt = False):
    """Pre-train a ViT on a Ray cluster (an embedded local Ray when cluster.address is empty).

    Re-running with the same run.name and run.storage resumes from the latest complete checkpoint.
    """
    from vitray.trainers.config import TrainingConfig

    cfg = _load(TrainingConfig, config, set_)
    if dry_run:
        typer.echo(dump_config(cfg), nl=False)
        return
    from ray.train import TrainingFailedError

    from vitray.cluster.pretrain import pretrain as run_pretrain
    from vitray.cluster.runtime import NotEnoughResources, run_dir

    try:
        result = run_pretrain(cfg, verbose=verbose)
    except NotEnoughResources as err:
        _fail(str(err))
    except TrainingFailedError as err:
        # Ray's message carries each failed rank's traceback; no driver traceback on top of it.
        _fail(f"pre-training failed (re-run the same command to resume):\n{err}", code=1)
    console.print(f"run folder: {run_dir(cfg.run.storage, cfg.run.name)}")
    if result.checkpoint is not None:
        console.print(f"latest checkpoint: {result.checkpoint.path}")


@data_app.command("prepare")
def data_prepare(
    source: Annotated[
        str, typer.Argument(help="imagefolder:PATH | cifar10:PATH | cifar100:PATH | parquet:PATH | builtin:digits")
    ],
    dest: Annotated[str, typer.Argument(help="Output folder: a local path or s3://bucket/prefix.")],
    samples_per_shard: Annotated[int, typer.Option(help="Samples per tar shard.", min=1)] = 1000,
    overwrite: Annotated[bool, typer.Option(help="Redo a destination that is already prepared.")] = False,
    address: Annotated[
        Optional[str], typer.Option(help="Ray cluster address; an embedded local Ray when unset.")
    ] = None,
    serial: Annotated[bool, typer.Option(help="Write the shards in this process, without Ray.")] = False,
):
    """Write webdataset shards, per-split manifests and dataset.json from SOURCE into DEST."""
    from vitray.data import open_source

    try:
        src = open_source(source)
    except (ValueError, FileNotFoundError) as err:
        _fail(str(err))
    if serial:
        from vitray.data import prepare_dataset

        info = prepare_dataset(src, dest, samples_per_shard=samples_per_shard, overwrite=overwrite)
    else:
        from vitray.cluster.prepare import prepare_dataset_on_ray
        from vitray.cluster.runtime import connect

        connect(address)
        info = prepare_dataset_on_ray(src, dest, samples_per_shard=samples_per_shard, overwrite=overwrite)
    splits = ", ".join(f"{name}: {split.num_samples} samples in {split.num_shards} shards" for name, split in info.splits.items())
    console.print(f"{dest}: {info.name}, {info.num_classes} classes ({info.label_kind}-label); {splits}")


@app.command()
def runs(storage: Annotated[str, typer.Argument(help="A run storage folder (local or s3://).")]):
    """List the runs under STORAGE with their latest step, checkpoints and status."""
    from rich.table import Table

    from vitray.cluster.run_listing import list_runs

    table = Table("run", "latest step", "checkpoints", "latest complete checkpoint", "status")
    found = list_runs(storage)
    for run in found:
        table.add_row(run.name, str(run.latest_step or "-"), str(run.num_checkpoints), run.latest_checkpoint or "-", run.status)
    Console().print(table)
    if not found:
        console.print(f"no runs under {storage}")


@app.command()
def export(
    checkpoint: Annotated[str, typer.Argument(help="A checkpoint folder, or a run folder (its latest checkpoint).")],
    format_: Annotated[str, typer.Option("--format", "-f", help="npz | safetensors | timm")] = "npz",
    out: Annotated[str, typer.Option("--out", "-o", help="Output file (local or s3://).")] = "model.npz",
):
    """Write consolidated model weights: the original ViT .npz layout, safetensors or a timm state dict."""
    from vitray.cluster.export import FORMATS, export as run_export

    if format_ not in FORMATS:
        _fail(f"--format {format_!r} is not supported; expected one of: {', '.join(FORMATS)}")
    try:
        source = run_export(checkpoint, format_, out)
    except (FileNotFoundError, ValueError) as err:
        _fail(str(err))
    console.print(f"wrote {out} ({format_}) from {source}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def submit(
    ctx: typer.Context,
    address: Annotated[
        str, typer.Option("--address", envvar="RAY_ADDRESS", help="Ray dashboard / Jobs API address, e.g. http://HOST:8265.")
    ],
    working_dir: Annotated[
        Optional[str], typer.Option("--working-dir", help="Folder uploaded as the job's working dir (default: none).")
    ] = None,
    env: Annotated[Optional[list[str]], typer.Option("--env", help="NAME=VALUE for the job (repeatable).")] = None,
    no_follow: Annotated[bool, typer.Option("--no-follow", help="Print the job id and return.")] = False,
):
    """Submit `vitray ARGS...` as a Ray job: vitray submit --address http://HOST:8265 -- pretrain -c run.yaml"""
    from vitray.cluster.submit import submit as run_submit

    args = list(ctx.args)
    if not args:
        _fail("nothing to submit: give the vitray command after --, e.g. -- pretrain -c configs/demo.yaml")
    env_vars = {}
    for item in env or []:
        name, sep, value = item.partition("=")
        if not sep:
            _fail(f"--env {item!r}: expected NAME=VALUE")
        env_vars[name] = value
    run_submit(address, args, working_dir=working_dir, env=env_vars, follow=not no_follow)


@app.command()
def demo(
    out: Annotated[str, typer.Option(help="Where the data, runs and report go.")] = "demo-output",
    set_: SetOpt = None,
    verbose: VerboseOpt = False,
):
    """The whole pipeline on built-in data: prepare -> pretrain -> evaluate -> report."""
    from vitray.cluster.demo import run_demo

    try:
        run_demo(out, overrides=set_ or [], verbose=verbose)
    except ConfigError as err:
        _fail(str(err))


# fewshot, finetune, evaluate
from vitray.cluster.cli_evaluation import register_evaluation_commands  # noqa: E402
from vitray.cluster.cli_inspect import register_inspect_command  # noqa: E402

register_evaluation_commands(app)
register_inspect_command(app)


def main() -> None:
    from vitray.cluster.runtime import enable_token_auth_if_available

    # Ray reads its auth mode when first imported, so this comes before any command runs.
    enable_token_auth_if_available()
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)



if __name__ == "__main__":
    main()
