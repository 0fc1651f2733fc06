"""Pre-training with data and checkpoints on S3 (SeaweedFS on 127.0.0.1), then listing,
exporting, re-running a finished run and resuming one against the same storage."""

from __future__ import annotations

import subprocess

import pytest
from pretrain_helpers import assert_same_weights, pretrain_args, run, vitray_cmd
from safetensors.torch import load, load_file

from vitray.data import prepare_dataset
from vitray.models.io_safetensors import read_safetensors_metadata
from vitray.runfolder.checkpoint_folders import find_checkpoints, latest_complete_checkpoint
from vitray.storage import filesystem, read_bytes
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

    # Its last checkpoint as a kill during its upload leaves it (rank 1's part never recorded): the
    # same command resumes from step 4 on S3 and trains step 8 again, to the same weights bit for bit.
    fs, path = filesystem(checkpoints[-1].path)
    fs.rm(f"{path}/complete-rank-0001.json")
    resumed = run(args)
    assert "resuming s3run from step 4 (" in " ".join(resumed.stderr.split()), resumed.stderr[-3000:]
    latest = latest_complete_checkpoint(run_dir)
    assert latest.step == 8 and latest.path != checkpoints[-1].path
    assert_same_weights(load(read_bytes(f"{latest.path}/{ckpt.MODEL_FILE}")), weights)


def test_export_refuses_a_folder_without_checkpoints(tmp_path):
    out = subprocess.run(
        vitray_cmd("export", str(tmp_path), "--format", "npz", "--out", str(tmp_path / "m.npz")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "neither a checkpoint folder" in " ".join(out.stderr.split())
