"""A checkpoint's inspection figures (`vitray inspect`, and the demo's report): the paper's
patch-embedding filter PCA, position-embedding similarity, mean attention distance per head and
layer, and attention rollout maps (section 4.5, Fig. 6, 7, 11), each as a PNG with the numbers
behind it (:mod:`vitray.evaluation.inspection_figures` draws them from
:mod:`vitray.evaluation.inspection_math`'s numbers), of the checkpoint's own validation images or
given ones.

:func:`inspect_checkpoint` does it all; :func:`add_to_report` appends the figures to a report.md.
Nothing here needs Ray.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from vitray import storage
from vitray.common.redact import unmasked
from vitray.data import EvalLoader, eval_transform
from vitray.data.transforms import CorruptSample, decode_image
from vitray.evaluation.inspection_figures import InspectionFiles, inspect_model
from vitray.runfolder.checkpoint_folders import IncompleteCheckpointError, load_checkpoint

PAPER_NUM_IMAGES = 128  # the paper's Fig. 11 averages over 128 images
REPORT_FOLDER = "inspection"  # beside report.md


class InspectionInputError(ValueError):
    """Images for the inspection cannot be found or read; the message says what to give instead."""


# What :func:`inspect_checkpoint` raises for a checkpoint or images it cannot use (`vitray inspect`: exit 2).
REFUSED = (InspectionInputError, FileNotFoundError, IncompleteCheckpointError, ValueError)


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


def load_image_files(paths: list[str], img_size: int):
    """Image files (local or s3://) with the evaluation transform -> uint8 ``(n, 3, img_size,
    img_size)`` and their names as captions."""
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
            # recorded with their credentials masked: the environment's stand in for them
            storage_options=unmasked(data.get("storage_options")),
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
        key if not classes else f"{key} · {_class_name(batch, classes, label)}"
        for key, label in zip(batch.keys, batch.labels)
    ]
    return batch.images, captions


def _class_name(batch, classes: list[str], label) -> str:
    return classes[int(label)] if labels_are_single(batch) else "multi-label"


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
    num_images: int = PAPER_NUM_IMAGES,
    rollout_images: int = 8,
    num_components: int = 28,
    batch_size: int = 32,
    overwrite: bool = False,
) -> InspectionFiles:
    """Writes the inspection figures of ``checkpoint`` (a checkpoint or run folder, local or
    s3://) into ``out`` (local or s3://); returns :class:`InspectionFiles` (local paths; for a
    remote ``out`` those of the temporary copy, already uploaded). The figures of another
    checkpoint in ``out`` are replaced only with ``overwrite``."""
    storage.check_remote_reachable(checkpoint, must_exist=True)  # a wrong key, endpoint or bucket: one line
    storage.check_remote_reachable(out, writable=True)
    model, state = load_checkpoint(checkpoint, pin=True)
    if not overwrite:
        _refuse_another_checkpoints_figures(out, state["checkpoint"])
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
        storage.publish_folder(local, out)
    return files


def _refuse_another_checkpoints_figures(out: str, checkpoint: str) -> None:
    """``out`` holding the figures of another checkpoint (its inspection.json says which): they were
    replaced without a word, where `vitray export` refuses to replace a file."""
    try:
        held = json.loads(storage.read_bytes(storage.join(out, "inspection.json"))).get("checkpoint")
    except (FileNotFoundError, NotADirectoryError, ValueError, AttributeError):
        return
    if held and held != checkpoint:
        raise InspectionInputError(
            f"--out {out} holds the figures of another checkpoint ({held}): give another --out, or pass "
            "--overwrite to replace them"
        )


def add_to_report(checkpoint: str, report: Path) -> InspectionFiles:
    """Writes the inspection figures of `checkpoint` (on its own validation images) next to the
    report and appends them to `report` (report.md) as a section; returns the InspectionFiles."""
    files = inspect_checkpoint(checkpoint, str(report.parent / REPORT_FOLDER), overwrite=True)  # the report's own
    with report.open("a") as markdown:
        markdown.write("\n" + files.markdown(link_prefix=f"{REPORT_FOLDER}/"))
    return files
