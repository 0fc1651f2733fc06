"""Pre-training with data and checkpoints on S3 (SeaweedFS on 127.0.0.1), then listing,
exporting and re-running against the same storage."""

from __future__ import annotations

import subprocess

import pytest
from pretrain_helpers import assert_same_weights, pretrain_args, run, vitray_cmd
from safetensors.torch import load, load_file

from vitray.data import prepare_dataset
from vitray.models.io_safetensors import read_safetensors_metadata
from vitray.runfolder.checkpoint_folders import find_checkpoints
from vitray.storage import read_bytes
from vitray.trainers.checkpoint import rank_files as ckpt

pytestmark = pytest.mark.slow


def test_pretrain_on_s3_lists_exports_and_resumes(seaweed_s3, tmp_path):
    data = seaweed_s3.url("datasets", "digits")
    storage = seaweed_s3.url("runs")
    prepare_dataset("builtin:digits", data, samples_per_shard=200)
    args = pretrain_args(
        data, storage, "s3run", "train.steps=8", "checkpoint.every=4", "evals.val={type: val, every: 8}"
    )
    run(args)

    run_dir = f"{storage}/s3run"
    checkpoints = find_checkpoints(run_dir)
    assert [c.step for c in checkpoints] == [4, 8] and all(c.complete for c in checkpoints)

    listing = run(vitray_cmd("runs", storage))
    text = " ".join(listing.stdout.split())
    assert "s3run" in text and "finished" in text

    out = tmp_path / "model.safetensors"
    run(vitray_cmd("export", run_dir, "--format", "safetensors", "--out", str(out)))
    weights = load_file(str(out))
    assert read_safetensors_metadata(out) == {
        "format": "vitray",
        "name": "Ti/4",
        "depth": "2",
        "img_size": "16",
        "head": "token",
        "num_classes": "10",
        "representation_size": "",
    }
    assert_same_weights(weights, load(read_bytes(f"{checkpoints[-1].path}/{ckpt.MODEL_FILE}")))  # step 8's

    # The same command again: the run is already complete, so it says so and stops, without Ray.
    again = run(args)
    assert [c.step for c in find_checkpoints(run_dir)] == [4, 8]
    said = " ".join(again.stderr.split())
    assert f"s3run is finished: its latest checkpoint is at step 8 of train.steps=8 ({checkpoints[-1].path})" in said


def test_export_refuses_a_folder_without_checkpoints(tmp_path):
    out = subprocess.run(
        vitray_cmd("export", str(tmp_path), "--format", "npz", "--out", str(tmp_path / "m.npz")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "neither a checkpoint folder" in " ".join(out.stderr.split())
