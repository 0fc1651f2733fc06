"""`vitray inspect CHECKPOINT [IMAGES...] --out DIR`: the paper's inspection figures of a checkpoint
(:mod:`vitray.evaluation.checkpoint_inspection` makes them). Nothing here needs Ray.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from vitray.cli.app import CheckpointArg, app, console, fail, handled


@app.command("inspect")
def inspect(
    checkpoint: CheckpointArg,
    images: Annotated[
        list[str] | None,
        typer.Argument(help="Image files (PNG/JPEG); the checkpoint's validation images when none."),
    ] = None,
    out: Annotated[str, typer.Option("--out", "-o", help="Output folder (local or s3://).")] = "inspection",
    num_images: Annotated[
        int, typer.Option(help="Validation images for the attention distance (without IMAGES).", min=1)
    ] = 128,  # the paper's Fig. 11 (evaluation.checkpoint_inspection.PAPER_NUM_IMAGES)
    rollout_images: Annotated[int, typer.Option(help="Images shown with their attention rollout.", min=1)] = 8,
    components: Annotated[int, typer.Option(help="Principal components of the embedding filters.", min=1)] = 28,
    batch_size: Annotated[int, typer.Option(help="Images per forward pass.", min=1)] = 32,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace the figures of another checkpoint in --out.")
    ] = False,
):
    """Paper figures of a checkpoint: embedding-filter PCA, position-embedding similarity, mean attention
    distance per head and layer, attention rollout maps. Writes PNGs and the numbers behind them (JSON/Parquet)."""
    from vitray.evaluation.checkpoint_inspection import REFUSED, inspect_checkpoint
    from vitray.storage import is_local_file

    if is_local_file(out):
        fail(f"--out {out} is a file: give a folder for the figures")
    with handled(REFUSED), console.status("computing the figures (the model over the images)..."):
        files = inspect_checkpoint(
            checkpoint,
            out,
            images,
            num_images=num_images,
            rollout_images=rollout_images,
            num_components=components,
            batch_size=batch_size,
            overwrite=overwrite,
        )
    for name, reason in files.skipped.items():
        console.print(f"[yellow]skipped {name}:[/] {escape(reason)}")
    for name, path in files.figures.items():
        console.print(f"{name}: {path.name} + {files.numbers[name].name}")
    console.print(f"written to {out}")
