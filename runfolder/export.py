"""`vitray export`: consolidated model weights from a checkpoint (or a run's latest one).

Formats: `npz` (the original ViT layout), `safetensors` (vitray's names and metadata), `onnx` (the
whole network, opset 18, a dynamic batch dimension) -- single files -- and `timm`, the folder that
`timm.create_model("local-dir:PATH", pretrained=True)` loads (`config.json` + `model.safetensors`,
see `vitray.runfolder.timm_folder`; its config.json is written last, so a folder an export stopped
part-way is no folder timm loads). An existing output is never replaced unless `overwrite` is set.
"""

from __future__ import annotations

import os
import tempfile

from vitray import storage
from vitray.runfolder.checkpoint_folders import CheckpointInfo, load_checkpoint, resolve_checkpoint
from vitray.runfolder.timm_folder import enlarged_side, eval_resize_of

FORMATS = ("npz", "safetensors", "timm", "onnx")
FOLDER_FORMATS = ("timm",)


def default_output(fmt: str) -> str:
    """Where `vitray export` writes without --out: the current folder's `model.<format>` (`model-timm/` for timm)."""
    return "model-timm" if fmt in FOLDER_FORMATS else f"model.{fmt}"


ONNX_OPSET = 18  # opset 17 added LayerNormalization; 18 is what torch's exporter emits best
# A single .onnx file is one protobuf message, which cannot exceed 2 GiB.
ONNX_MAX_BYTES = 2**31 - 2**24


class ExportRefused(ValueError):
    """The output path is unsuitable or would be overwritten."""


def export(path: str, fmt: str, out: str, *, overwrite: bool = False) -> CheckpointInfo:
    """Write the checkpoint's model (its EMA weights when it has them) to `out`; returns the
    checkpoint it came from (for a run folder: its latest complete one, with the newer ones passed
    over and why)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is not supported; expected one of: {', '.join(FORMATS)}")
    # Both ends checked before the weights are read (fail fast): the checkpoint first (its records
    # alone), so that a mistyped one is named, not an older output in the way.
    storage.check_remote_reachable(path, must_exist=True)  # a wrong key, endpoint or bucket: one line
    resolve_checkpoint(path)
    check_output(out, fmt, overwrite=overwrite)
    model, state = load_checkpoint(path, pin=True)
    model.eval()
    # How the checkpoint's evaluation resized images: what a timm or ONNX reader feeds the model
    eval_resize = eval_resize_of((state.get("config") or {}).get("evals"))
    # Made beside a local --out (on its disk, which the user chose for the weights): the system's
    # temporary folder may be a small one, and a full one failed naming neither it nor TMPDIR.
    beside = None if storage.is_remote(out) else os.path.dirname(os.path.abspath(out.rstrip("/")))
    if beside is not None:
        os.makedirs(beside, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".vitray-export-", dir=beside) as tmp:
        local = os.path.join(tmp, os.path.basename(out.rstrip("/")) or "weights")
        if fmt == "timm":
            from vitray.runfolder.timm_folder import write_timm_folder

            os.makedirs(local)
            write_timm_folder(model, local, eval_resize)
            _publish_timm_folder(local, out)
        else:
            _write_single_file(model, fmt, local, eval_resize)
            storage.publish_file(local, out)
    return CheckpointInfo(state["checkpoint"], int(state["step"]), True, passed_over=state["passed_over"])


def check_output(out: str, fmt: str, *, overwrite: bool) -> None:
    """Refuse (ExportRefused, one line) an output that exists, unless `overwrite`; a folder where a
    file is written, or a file where a folder is, always; a store that cannot be reached (credentials,
    endpoint, bucket) too, before the checkpoint is read; and an output named for another format
    (`--format safetensors --out model.npz`: a file whose name misleads every later reader)."""
    named = next((other for other in FORMATS if other != fmt and out.rstrip("/").endswith(f".{other}")), None)
    if named is not None:
        fix = f"--out {default_output(fmt)}" if fmt in FOLDER_FORMATS else f"--out NAME.{fmt}"
        raise ExportRefused(
            f"--out {out} is named as a .{named} file, but --format {fmt} is written: give --format {named}, or {fix}"
        )
    try:
        storage.check_remote_reachable(out, writable=True)
    except storage.StorageUnreachable as err:
        raise ExportRefused(f"--out {out}: {err}") from None
    fs, fs_path = storage.filesystem(out)
    if fmt in FOLDER_FORMATS:
        if fs.isfile(fs_path):
            raise ExportRefused(f"--out {out} is a file; --format {fmt} writes a folder: give a folder path")
        present = [name for name in _folder_files(fmt) if fs.exists(f"{fs_path.rstrip('/')}/{name}")]
        if present and not overwrite:
            raise ExportRefused(f"--out {out} already holds {', '.join(present)}; pass --overwrite to replace them")
        return
    if fs.isdir(fs_path):
        raise ExportRefused(f"--out {out} is a folder; --format {fmt} writes one file: give a file path inside it")
    if fs.exists(fs_path) and not overwrite:
        raise ExportRefused(f"--out {out} already exists; pass --overwrite to replace it")


def _publish_timm_folder(local: str, out: str) -> None:
    """The timm folder's files put in `out`, `config.json` (what makes it a folder timm loads) last
    and an earlier one's first removed: a stop part-way through leaves a folder without config.json,
    which timm refuses, never a new config.json beside the weights of the model exported before."""
    from vitray.runfolder.timm_folder import FILES

    marker = "config.json"
    storage.remove(storage.join(out, marker))
    for name in [*(name for name in FILES if name != marker), marker]:
        storage.publish_file(os.path.join(local, name), storage.join(out, name))


def _folder_files(fmt: str) -> tuple[str, ...]:
    from vitray.runfolder.timm_folder import FILES

    return FILES


def _write_single_file(model, fmt: str, local: str, eval_resize: dict) -> None:
    from vitray.models import save_npz, save_safetensors

    if fmt == "npz":
        save_npz(model, local)
    elif fmt == "safetensors":
        save_safetensors(model, local)
    else:
        export_onnx(model, local, eval_resize)


def onnx_metadata(model, eval_resize: dict) -> dict[str, str]:
    """What an ONNX file's reader needs to feed it (its `metadata_props`): the input and how the
    checkpoint's evaluation made it from an image (`vitray.data.transforms.eval_resize`)."""
    size = model.img_size
    if eval_resize["resize"] == "whole":
        resize = f"the whole image resized to {size}x{size} (bilinear)"
    else:
        enlarged = enlarged_side(size, eval_resize["resize_ratio"])
        resize = f"shorter side resized to {enlarged} (bilinear), then the central {size}x{size} crop"
    return {
        "images": f"float32 (batch, 3, {size}, {size}), RGB scaled to [-1, 1] (pixel / 127.5 - 1); "
        "not ImageNet's mean and std",
        "preprocessing": resize,
        "logits": f"float32 (batch, {model.num_classes}), before softmax or sigmoid",
        "model": f"vitray {model.name}, {model.head_type} head",
    }


def export_onnx(model, path: str, eval_resize: dict) -> None:
    """The network as ONNX: input `images` (batch, 3, H, W) float32 in [-1, 1] (vitray's input
    range), output `logits` (batch, classes); the batch dimension is dynamic. The file's
    `metadata_props` say so, and how the evaluation resized the images (:func:`onnx_metadata`)."""
    import torch

    try:
        import onnx
        import onnxscript  # noqa: F401 - torch's ONNX exporter builds the graph with it
    except ImportError:
        raise ExportRefused(
            "--format onnx needs the onnx and onnxscript packages: pip install onnx onnxscript"
        ) from None
    size = sum(t.numel() * 4 for t in model.state_dict().values())
    if size > ONNX_MAX_BYTES:
        raise ExportRefused(
            f"{model.name} has {size / 2**30:.1f} GiB of fp32 weights; a single .onnx file holds "
            "at most 2 GiB: export safetensors or timm instead"
        )
    example = torch.zeros(2, 3, model.img_size, model.img_size)
    torch.onnx.export(
        model,
        (example,),
        path,
        dynamo=True,
        opset_version=ONNX_OPSET,
        external_data=False,
        input_names=["images"],
        output_names=["logits"],
        dynamic_shapes=({0: torch.export.Dim("batch")},),
        verbose=False,
    )
    graph = onnx.load(path)
    for key, value in onnx_metadata(model, eval_resize).items():
        graph.metadata_props.add(key=key, value=value)
    graph.doc_string = "vitray export: see metadata_props for the input"
    onnx.save(graph, path)
