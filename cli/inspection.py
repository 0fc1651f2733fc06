"""`vitray inspect CHECKPOINT [IMAGES...] --out DIR`: the paper's inspection figures of a checkpoint.

Patch-embedding filter PCA, position-embedding similarity, mean attention distance per head and
layer, and attention rollout maps (paper section 4.5, Fig. 6, 7, 11), each as a PNG with the
numbers behind it (see :mod:`vitray.evaluation.inspect_plots`). The attention comes from the
model's own inspection path. Without IMAGES the checkpoint's own validation data is used (its
config's ``data.val`` or ``data.train``, split ``data.val_split``).

:func:`inspect_checkpoint` is the same thing as a function (the demo uses it). Nothing here needs Ray.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from vitray.cli.app import CheckpointArg, app, console, fail

DEFAULT_NUM_IMAGES = 128  # the paper's Fig. 11 averages over 128 images


class InspectionInputError(ValueError):
    """Images for the inspection cannot be found or read; the message says what to give instead."""


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


def load_image_files(paths: list[str], img_size: int):
    """Image files (local or s3://) with the evaluation transform -> uint8 ``(n, 3, img_size,
    img_size)`` and their names as captions."""
    import torch

    from vitray.data import eval_transform, storage
    from vitray.data.transforms import CorruptSample, decode_image

    transform = eval_transform(img_size)
    images, captions = [], []
    for path in paths:
        try:
            data = storage.read_bytes(path)
        except (FileNotFoundError, IsADirectoryError, PermissionError) as err:
            raise InspectionInputError(f"image {path!r} cannot be read: {err}") from None
        try:
            images.append(transform(decode_image(data)))
        except CorruptSample as err:
            raise InspectionInputError(f"image {path!r} is not a readable PNG/JPEG image ({err})") from None
        captions.append(Path(path).name)
    return torch.stack(images), captions


def validation_images(state: dict[str, Any], img_size: int, count: int):
    """The first ``count`` images of the checkpoint's validation split, uint8, with captions
    ``key · class``. Raises InspectionInputError when the data cannot be located."""
    from vitray.data import EvalLoader

    data = (state.get("config") or {}).get("data") or {}
    path = data.get("val") or data.get("train")
    split = data.get("val_split", "test")
    if not path:
        raise InspectionInputError("the checkpoint's trainer_state.json names no data.val / data.train: give IMAGES")
    try:
        loader = EvalLoader(
            path,
            split,
            batch_size=count,
            img_size=img_size,
            num_workers=0,
            storage_options=data.get("storage_options"),
            float_images=False,
        )
        batch = next(iter(loader))
    except (FileNotFoundError, KeyError, ValueError, StopIteration) as err:
        raise InspectionInputError(
            f"the checkpoint's validation data ({path}, split {split!r}) cannot be read ({type(err).__name__}: "
            f"{err}); give IMAGES (image files) instead"
        ) from None
    classes = loader.info.classes
    captions = [
        f"{key} · {classes[int(label)] if labels_are_single(batch) else 'multi-label'}"
        for key, label in zip(batch.keys, batch.labels)
    ]
    return batch.images, captions


def labels_are_single(batch) -> bool:
    return batch.labels.ndim == 1


# ---------------------------------------------------------------------------------------------
# The whole inspection of a checkpoint
# ---------------------------------------------------------------------------------------------


def inspect_checkpoint(
    checkpoint: str,
    out: str,
    images: list[str] | None = None,
    *,
    num_images: int = DEFAULT_NUM_IMAGES,
    rollout_images: int = 8,
    num_components: int = 28,
    batch_size: int = 32,
):
    """Writes the inspection figures of ``checkpoint`` (a checkpoint or run folder, local or
    s3://) into ``out`` (local or s3://); returns :class:`InspectionFiles` (local paths; for a
    remote ``out`` those of the temporary copy, already uploaded)."""
    from vitray.data import storage
    from vitray.evaluation.inspect_plots import inspect_model
    from vitray.runfolder.checkpoints import load_checkpoint

    model, state = load_checkpoint(checkpoint)
    if images:
        pixels, captions = load_image_files(images, model.img_size)
        source = f"{len(images)} given image(s)"
    else:
        pixels, captions = validation_images(state, model.img_size, num_images)
        data = state["config"]["data"]
        source = f"{len(captions)} images of {data.get('val') or data.get('train')} split {data.get('val_split')}"
    label = f"{model.name} (step {state.get('step')})"
    metadata = {"checkpoint": state["checkpoint"], "step": state.get("step"), "images": source}
    kwargs = {
        "captions": captions,
        "label": label,
        "num_components": num_components,
        "rollout_images": rollout_images,
        "batch_size": batch_size,
        "metadata": metadata,
    }
    if not storage.is_remote(out):
        return inspect_model(model, pixels, out, **kwargs)
    with tempfile.TemporaryDirectory() as local:
        files = inspect_model(model, pixels, local, **kwargs)
        for path in sorted(Path(local).iterdir()):
            storage.write_bytes_atomic(storage.join(out, path.name), path.read_bytes())
    return files


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


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
    ] = DEFAULT_NUM_IMAGES,
    rollout_images: Annotated[int, typer.Option(help="Images shown with their attention rollout.", min=1)] = 8,
    components: Annotated[int, typer.Option(help="Principal components of the embedding filters.", min=1)] = 28,
    batch_size: Annotated[int, typer.Option(help="Images per forward pass.", min=1)] = 32,
):
    """Paper figures of a checkpoint: embedding-filter PCA, position-embedding similarity, mean attention
    distance per head and layer, attention rollout maps. Writes PNGs and the numbers behind them (JSON/Parquet)."""
    from vitray.runfolder.checkpoints import IncompleteCheckpointError

    try:
        files = inspect_checkpoint(
            checkpoint,
            out,
            images,
            num_images=num_images,
            rollout_images=rollout_images,
            num_components=components,
            batch_size=batch_size,
        )
    except (InspectionInputError, FileNotFoundError, IncompleteCheckpointError, ValueError) as err:
        fail(str(err))
    for name, reason in files.skipped.items():
        console.print(f"[yellow]skipped {name}:[/] {escape(reason)}")
    for name, path in files.figures.items():
        console.print(f"{name}: {path.name} + {files.numbers[name].name}")
    console.print(f"written to {out}")
