"""`vitray export`: timm's local-dir folder loaded by timm itself, ONNX run by onnxruntime, and
outputs that are never replaced unless --overwrite -- from a checkpoint folder written here
(the layout a run writes; no training needed to export one)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
from pretrain_helpers import make_checkpoint, vitray_cmd

from vitray.runfolder.export import ExportRefused, export

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("run") / "checkpoint_2026-01-01_00-00-00.000001"
    return str(folder), make_checkpoint(folder)


IMAGES = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model", [{}, {"head": "gap"}, {"name": "R26+S/32", "img_size": 64}])
def test_timm_loads_the_exported_folder_with_the_same_logits(model, tmp_path):
    import timm

    net = make_checkpoint(tmp_path / "ckpt", **model)
    out = tmp_path / "timm-model"
    export(str(tmp_path / "ckpt"), "timm", str(out))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    images = IMAGES if net.img_size == 16 else torch.randn(2, 3, 64, 64)
    logits = net(images)
    assert logits.std() > 0.05  # random weights: a wrong load could not agree by chance
    torch.testing.assert_close(loaded(images), logits, atol=1e-5, rtol=1e-5)
    # timm's data config is vitray's input: [-1, 1] (mean = std = 0.5), the model's resolution.
    data = timm.data.resolve_data_config({}, model=loaded)
    assert data["input_size"] == (3, net.img_size, net.img_size) and data["mean"] == data["std"] == [0.5] * 3
    # config.json names the model's own family (Ti/4: timm's tiny; it registers no patch 4)
    architecture = json.loads((out / "config.json").read_text())["architecture"]
    expected = {"Ti/4": "vit_tiny_patch16_224", "R26+S/32": "vit_small_r26_s32_224"}[net.name]
    assert architecture == expected and architecture in timm.list_models()


@pytest.mark.parametrize(
    "evals, img_size, resize",
    [
        (None, 32, ("aspect", 256 / 224)),  # no val evaluator: its default (R = 37 where 32 / 0.875 floors to 36)
        ({"val": {"type": "val", "resize": "whole"}, "fewshot": {"type": "fewshot"}}, 16, ("whole", 256 / 224)),
        ({"test": {"type": "val", "resize": "aspect", "resize_ratio": 448 / 384}}, 24, ("aspect", 448 / 384)),
    ],
)
def test_timms_transform_of_the_export_is_the_checkpoints_evaluation(evals, img_size, resize, tmp_path):
    """timm's `resolve_data_config` + `create_transform` on the exported folder give the pixels the
    checkpoint's val evaluator scored: its resize (whole image or central crop) and its ratio, with
    vitray's rounding of the enlarged side (a fixed 0.875 crop was off for all but 224 px). The model
    `vitray.runfolder.load_checkpoint` gives carries the same data config for timm to read."""
    import timm
    from PIL import Image

    from vitray.data.config import EVAL_RESIZE_RATIO
    from vitray.data.transforms import eval_transform
    from vitray.runfolder import load_checkpoint
    from vitray.runfolder.timm_folder import DEFAULT_EVAL_RESIZE

    assert DEFAULT_EVAL_RESIZE == {"resize": "aspect", "resize_ratio": EVAL_RESIZE_RATIO}
    make_checkpoint(tmp_path / "ckpt", img_size=img_size, evals=evals)
    export(str(tmp_path / "ckpt"), "timm", str(tmp_path / "timm"))
    loaded = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True)
    data_config = timm.data.resolve_data_config({}, model=loaded)
    assert timm.data.resolve_data_config({}, model=load_checkpoint(str(tmp_path / "ckpt"))[0]) == data_config
    theirs = timm.data.create_transform(**data_config)
    ours = eval_transform(img_size, *resize)
    rng = np.random.default_rng(0)
    for height, width in [(37, 23), (23, 37), (64, 64), (101, 55), (img_size, img_size + 5)]:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        expected = ours(image).float() / 127.5 - 1  # vitray's model range
        torch.testing.assert_close(theirs(image), expected, atol=2 / 255 + 1e-5, rtol=0)  # (a level of 255)


def test_a_model_with_a_pre_logits_layer_is_refused_in_the_commands_words(tmp_path):
    make_checkpoint(tmp_path / "ckpt", representation_size=8)
    with pytest.raises(ValueError, match=r"has one \(representation_size=8.*export --format npz or safetensors"):
        export(str(tmp_path / "ckpt"), "timm", str(tmp_path / "timm"))
    assert not (tmp_path / "timm").exists()


@pytest.mark.parametrize(
    "name, img_size, architecture",
    [
        ("R50+S/16", 32, "vit_base_r50_s16_224"),
        ("R50+Ti/16", 32, "vit_base_r50_s16_224"),
        ("R26+Ti/32", 64, "vit_small_r26_s32_224"),
        ("R26+B/32", 32, "vit_base_r26_s32_224"),
        ("R50+S/32", 64, "vit_large_r50_s32_224"),
    ],
)
def test_every_hybrid_whose_resnet_timm_has_exports_with_the_same_logits(name, img_size, architecture, tmp_path):
    """timm's hybrid name only picks the ResNet (its `layers`); `model_args` sets the Transformer, so a
    hybrid of any size with R50/16, R26/32 or R50/32 loads in timm."""
    import timm

    from vitray.models import create_model
    from vitray.runfolder.timm_folder import DEFAULT_EVAL_RESIZE, write_timm_folder

    net = create_model(name, num_classes=10, img_size=img_size, depth=1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    write_timm_folder(net.eval(), str(tmp_path), DEFAULT_EVAL_RESIZE)
    assert json.loads((tmp_path / "config.json").read_text())["architecture"] == architecture
    loaded = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    assert loaded.embed_dim == net.width and len(loaded.blocks) == 1
    images = torch.randn(2, 3, img_size, img_size, generator=generator)
    logits = net(images)
    assert logits.std() > 0.05
    # timm's StdConv and GroupNorm epsilons differ from the authors' (docs/models.md)
    torch.testing.assert_close(loaded(images), logits, atol=1e-4, rtol=1e-4)


def test_a_hybrid_whose_resnet_timm_lacks_is_refused_naming_the_layout():
    from vitray.models import create_model
    from vitray.runfolder.timm_folder import DEFAULT_EVAL_RESIZE, timm_config

    with pytest.raises(
        ValueError, match=r"stages \(2, 2, 4\) of R26\+Ti/16 .*ResNets R26/32, R50/16, R50/32\. Export npz"
    ):
        timm_config(create_model("R26+Ti/16", num_classes=10, img_size=32, depth=1), DEFAULT_EVAL_RESIZE)


def test_the_timm_architecture_name_is_the_models_family_patch_and_resolution():
    from vitray.runfolder.timm_folder import plain_architecture

    assert plain_architecture("B/16", 16, 384) == "vit_base_patch16_384"
    assert plain_architecture("S/8", 8, 224) == "vit_small_patch8_224"
    assert plain_architecture("L/16", 16, 512) == "vit_large_patch16_224"  # timm has no 512
    assert plain_architecture("H/14", 14, 224) == "vit_huge_patch14_224"
    assert plain_architecture("Ti/4", 4, 16) == "vit_tiny_patch16_224"


def test_onnx_export_gives_the_pytorch_logits_in_onnxruntime(checkpoint, tmp_path):
    import onnx
    import onnxruntime

    folder, net = checkpoint
    out = tmp_path / "model.onnx"
    export(folder, "onnx", str(out))
    graph = onnx.load(str(out))
    assert max(op.version for op in graph.opset_import if op.domain in ("", "ai.onnx")) >= 17
    # What its reader needs to feed it, in the file (the checkpoint has no val evaluator: the default's)
    props = {p.key: p.value for p in graph.metadata_props}
    assert props["images"].startswith("float32 (batch, 3, 16, 16), RGB scaled to [-1, 1] (pixel / 127.5 - 1)")
    assert props["preprocessing"] == "shorter side resized to 18 (bilinear), then the central 16x16 crop"
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for batch in (IMAGES, IMAGES[:1]):  # the batch dimension is dynamic
        (logits,) = session.run(["logits"], {"images": batch.numpy()})
        np.testing.assert_allclose(logits, net(batch).detach().numpy(), atol=1e-4, rtol=1e-4)


def test_an_existing_output_is_refused_unless_overwrite(checkpoint, tmp_path):
    folder, _ = checkpoint
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"keep me")
    with pytest.raises(ExportRefused, match="already exists; pass --overwrite"):
        export(folder, "safetensors", str(target))
    assert target.read_bytes() == b"keep me"
    export(folder, "safetensors", str(target), overwrite=True)
    assert target.stat().st_size > 1000
    with pytest.raises(ExportRefused, match="is a folder; --format npz writes one file"):
        export(folder, "npz", str(tmp_path), overwrite=True)  # never a folder replaced by a file
    timm_dir = tmp_path / "timm"
    export(folder, "timm", str(timm_dir))
    config = (timm_dir / "config.json").read_text()
    with pytest.raises(ExportRefused, match=r"already holds config.json, model.safetensors; pass --overwrite"):
        export(folder, "timm", str(timm_dir))
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"keep me")
    with pytest.raises(ExportRefused, match="is a file; --format timm writes a folder"):
        export(folder, "timm", str(a_file), overwrite=True)
    export(folder, "timm", str(timm_dir), overwrite=True)
    assert json.loads((timm_dir / "config.json").read_text()) == json.loads(config)


@pytest.mark.parametrize(
    "fmt, out, fix",
    [
        ("safetensors", "model.npz", "give --format npz, or --out NAME.safetensors"),
        ("npz", "out/vit.onnx", "give --format onnx, or --out NAME.npz"),
        ("timm", "model.safetensors", "give --format safetensors, or --out model-timm"),
    ],
)
def test_an_output_named_for_another_format_is_refused(checkpoint, tmp_path, fmt, out, fix):
    # Weights in one format under another's name: every later reader (np.load, timm) is misled.
    folder, _ = checkpoint
    with pytest.raises(ExportRefused, match=f"is named as a .* file, but --format {fmt} is written: {fix}$"):
        export(folder, fmt, str(tmp_path / out))
    assert list(tmp_path.iterdir()) == []


def test_a_timm_export_stopped_part_way_leaves_no_folder_timm_would_load(checkpoint, tmp_path, monkeypatch):
    """`--overwrite` of a timm folder stopped while the weights were copied (a Ctrl-C in a multi-GB copy)
    left the new config.json beside the weights exported before: a folder that looked whole and loaded
    the other model. config.json goes first and comes back last."""
    import vitray.storage
    import vitray.storage.files

    folder, _ = checkpoint
    timm_dir = tmp_path / "timm"
    export(folder, "timm", str(timm_dir))
    published = vitray.storage.files.publish_file

    def stopped_at_the_weights(local, path, *args, **kwargs):
        if str(path).endswith("model.safetensors"):
            raise KeyboardInterrupt
        return published(local, path, *args, **kwargs)

    for module in (vitray.storage, vitray.storage.files):
        monkeypatch.setattr(module, "publish_file", stopped_at_the_weights)
    with pytest.raises(KeyboardInterrupt):
        export(folder, "timm", str(timm_dir), overwrite=True)
    assert not (timm_dir / "config.json").exists()
    monkeypatch.undo()
    export(folder, "timm", str(timm_dir), overwrite=True)
    assert sorted(p.name for p in timm_dir.iterdir()) == ["config.json", "model.safetensors"]


def test_cli_refuses_an_existing_output_in_one_line(checkpoint, tmp_path):
    folder, _ = checkpoint
    target = tmp_path / "m.npz"
    target.write_bytes(b"keep me")
    out = subprocess.run(
        vitray_cmd("export", folder, "--format", "npz", "--out", str(target)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    message = " ".join((out.stdout + out.stderr).split())
    assert f"error: --out {target} already exists; pass --overwrite to replace it" in message
    assert target.read_bytes() == b"keep me"
    done = subprocess.run(
        vitray_cmd("export", folder, "--format", "npz", "--out", str(target), "--overwrite"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert np.load(target)["head/kernel"].shape == (192, 10)


def test_without_out_the_output_is_named_for_its_format(checkpoint, tmp_path):
    folder, _ = checkpoint
    for fmt, name in [("safetensors", "model.safetensors"), ("timm", "model-timm")]:
        done = subprocess.run(
            vitray_cmd("export", folder, "--format", fmt), cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"wrote {name} ({fmt})" in " ".join((done.stdout + done.stderr).split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-timm", "model.safetensors"]
    assert (tmp_path / "model-timm" / "config.json").is_file()


@pytest.mark.parametrize(
    ("model", "suggested"),
    [
        ({"name": "Ti/4"}, "--format timm --out pre-timm"),
        ({"name": "R50+B/16"}, "--format timm --out pre-timm"),
        (
            {"name": "B/16", "representation_size": 768},
            "--format safetensors --out pre.safetensors (timm's ViT has no pre-logits layer; fine-tuning drops it)",
        ),
        (
            {"name": "R26+Ti/16"},
            "--format safetensors --out pre.safetensors (timm has no hybrid with the ResNet of R26+Ti/16)",
        ),
    ],
)
def test_the_end_of_a_run_suggests_an_export_that_works(model, suggested, tmp_path):
    """It suggested --format timm for every run, which `vitray export` refuses for a pre-logits layer
    (the paper's pre-training recipes) and for a ResNet timm lacks."""
    from vitray.runfolder.run_report import _export_command

    assert _export_command(str(tmp_path / "pre"), model).startswith(f"vitray export {tmp_path / 'pre'} {suggested}")


def test_exporting_a_live_runs_checkpoint_pins_it_while_it_is_read(tmp_path, monkeypatch):
    """`vitray export RUN` while the run trains: a prune of the run (checkpoint.keep=1, after a newer
    checkpoint) while the export reads the resolved one left half a folder ("cannot be derived from
    its deepspeed shards"): the export pins it while it reads, and the prune leaves it for later."""
    from vitray.runfolder import checkpoint_folders as ckpt

    run = tmp_path / "runs" / "live"
    first = run / "checkpoint_2026-01-01_00-00-00.000001"
    make_checkpoint(first)
    (run / "vitray").mkdir()
    read = ckpt.load_model
    pruned: list[list[str]] = []

    def the_run_goes_on_meanwhile(*args, **kwargs):
        make_checkpoint(run / "checkpoint_2026-01-01_00-05-00.000001")
        pruned.append(ckpt.prune_checkpoints(str(run), keep=1))
        return read(*args, **kwargs)

    monkeypatch.setattr(ckpt, "load_model", the_run_goes_on_meanwhile)
    export(str(run), "safetensors", str(tmp_path / "model.safetensors"))
    assert pruned == [[]] and (tmp_path / "model.safetensors").stat().st_size > 1000
    assert ckpt.prune_checkpoints(str(run), keep=1) == [str(first)]


def test_a_local_export_is_made_beside_its_out_not_in_the_temporary_folder(checkpoint, tmp_path, monkeypatch):
    """A full system temporary folder (TMPDIR) failed an export to a disk with room, naming neither."""
    import tempfile

    folder, _ = checkpoint
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmp"))  # unusable: nothing may go there
    for fmt, out in (("safetensors", tmp_path / "out" / "model.safetensors"), ("timm", tmp_path / "out" / "timm")):
        export(folder, fmt, str(out))
        assert out.exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors", "timm"]  # nothing left


def test_load_checkpoint_gives_the_model_of_a_run_or_checkpoint_folder_and_refuses_an_incomplete_one(tmp_path):
    """`vitray.runfolder.load_checkpoint`, the Python API's loader of what a run wrote: the model
    built from the checkpoint's own record, from a run folder (its latest complete checkpoint) or a
    checkpoint folder; pinned while it is read (the pin gone after); a checkpoint that does not
    count refused, where a `load_weights` of the file inside it took it."""
    from vitray.runfolder import load_checkpoint
    from vitray.runfolder.checkpoint_folders import IncompleteCheckpointError, completion_record
    from vitray.runfolder.pins import pinned_checkpoints

    run = tmp_path / "runs" / "mine"
    folder = run / "checkpoint_2026-01-01_00-00-00.000001"
    net = make_checkpoint(folder, depth=2)
    (run / "vitray").mkdir()
    for path in (run, folder):
        model, info = load_checkpoint(str(path))
        assert (info["checkpoint"], info["step"], info["num_classes"], model.depth) == (str(folder), 4, 10, 2)
        assert torch.equal(model.eval()(IMAGES), net(IMAGES))
    assert pinned_checkpoints(str(run)) == set()
    (folder / completion_record(0)).unlink()
    with pytest.raises(IncompleteCheckpointError, match="rank 0 never finished writing it"):
        load_checkpoint(str(folder))
    with pytest.raises(FileNotFoundError, match="nor a run folder with a complete checkpoint"):
        load_checkpoint(str(run))
