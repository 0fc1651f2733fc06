"""`vitray data verify DEST`: a prepared dataset checked against its manifests (audit finding 16: the
manifests' bytes and sha256 were never read, so a copy cut short was noticed only as samples
skipped at training time). Every damage is named on a line of its own, exit 1; a whole dataset exits
0; a DEST that is not a prepared dataset is refused in one line, exit 2."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vitray.cli.main import app
from vitray.data import prepare_dataset, read_manifest, verify_dataset


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # rich would wrap the one line at 80 columns otherwise


def verify(*args: str):
    result = CliRunner().invoke(app, ["data", "verify", *args])
    assert "Traceback" not in result.output, result.output
    return result


def digits(dest: Path, storage_options: dict | None = None) -> str:
    """builtin:digits in 8 train and 2 test shards."""
    prepare_dataset("builtin:digits", str(dest), samples_per_shard=200, storage_options=storage_options)
    return str(dest)


def test_a_whole_dataset_passes_and_every_damage_is_named(tmp_path):
    dest = Path(digits(tmp_path / "digits"))
    whole = verify(str(dest))
    assert whole.exit_code == 0, whole.output
    assert f"{dest}: whole (test: 2 shards, train: 8 shards; " in whole.output

    sizes = {row.name: row.bytes for row in read_manifest(str(dest), "train")}
    cut = dest / "train-000001.tar"
    cut.write_bytes(cut.read_bytes()[:-1024])  # a copy cut short
    flipped = dest / "train-000002.tar"
    data = bytearray(flipped.read_bytes())
    data[700] ^= 0xFF  # a byte changed, the size kept
    flipped.write_bytes(bytes(data))
    (dest / "train-000003.tar").unlink()
    shutil.copy(dest / "train-000000.tar", dest / "train-000008.tar")  # left over from a larger preparation
    shutil.copy(dest / "train-000000.tar", dest / "train-1000000.tar")  # shard names grow past six digits
    shutil.copy(dest / "test-000000.tar", dest / "val-000000.tar")  # a split dataset.json does not have
    (dest / "notes.txt").write_text("not a shard: not a problem")

    result = verify(str(dest))
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    problems = [line for line in lines if not line.startswith("verifying ")]  # the progress line of a log
    size = sizes["train-000001.tar"]
    assert problems[:-1] == [
        f"train-000001.tar: {size - 1024:,} bytes, the manifest says {size:,} (cut short)",
        problems[1],
        "train-000003.tar: missing (listed in train.manifest.parquet)",
        "train-000008.tar: not in train.manifest.parquet (a shard it does not list)",
        "train-1000000.tar: not in train.manifest.parquet (a shard it does not list)",
        "val-000000.tar: not in any manifest (dataset.json has no split 'val')",
    ]
    assert problems[1].startswith("train-000002.tar: content differs: sha256 ")
    assert problems[1].endswith("...") and ", the manifest says " in problems[1]
    assert problems[-1] == (
        f"{dest}: 6 problems (test: 2 shards, train: 8 shards listed): copy the shards named again from where the "
        "dataset was prepared, or prepare it again (vitray data prepare ... --overwrite)"
    )

    # One split asked for: only its shards count (the test split is whole).
    only_test = verify(str(dest), "--split", "test")
    assert only_test.exit_code == 0, only_test.output
    assert f"{dest}: whole (test: 2 shards; " in only_test.output


def test_a_missing_manifest_is_a_problem_of_the_dataset(tmp_path):
    dest = Path(digits(tmp_path / "digits"))
    (dest / "test.manifest.parquet").unlink()
    result = verify(str(dest))
    assert result.exit_code == 1, result.output
    assert "test.manifest.parquet: missing (dataset.json lists the split)" in result.output.splitlines()
    # Its shards are then listed by no manifest that was read: said once, by the manifest's line.
    assert "test-000000.tar" not in result.output


@pytest.mark.parametrize("what", ["empty", "missing", "file", "split", "stopped", "cut"])
def test_a_dest_that_is_not_a_prepared_dataset_is_refused_in_one_line(tmp_path, what):
    dest = tmp_path / "dest"
    args = [str(dest)]
    if what == "empty":
        dest.mkdir()
    elif what == "file":
        dest.write_text("not a folder")
    elif what == "split":
        digits(dest)
        args += ["--split", "validation"]
    elif what == "stopped":  # a preparation that stopped part-way: its marker, no dataset.json
        dest.mkdir()
        (dest / ".vitray-preparing").write_text("{}")
    elif what == "cut":  # a copy onto a full disk: dataset.json of 0 bytes (a pydantic dump was said)
        digits(dest)
        (dest / "dataset.json").write_bytes(b"")
    result = verify(*args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    expected = {
        "empty": f"no dataset.json at {dest}: not prepared or still being written",
        "missing": f"{dest} does not exist",
        "file": f"{dest} is a file, not a prepared dataset",
        "split": f"{dest} has no split 'validation'; it has test, train",
        "cut": f"{dest / 'dataset.json'} is empty (a copy cut short?): copy it again from where the dataset was prepared",
        "stopped": f"no dataset.json at {dest}: a preparation began there and has not finished (it stopped, or is "
        "still writing); run the same `vitray data prepare` command again to go on from its shards",
    }[what]
    assert expected in lines[0]


def test_shards_are_hashed_a_bounded_number_at_a_time(tmp_path, monkeypatch):
    import vitray.data.verify as verify_module

    dest = digits(tmp_path / "digits")
    running, most, lock = 0, 0, threading.Lock()
    hash_one = verify_module._sha256

    def counted(path, storage_options):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)
        try:
            return hash_one(path, storage_options)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(verify_module, "_sha256", counted)
    result = verify_dataset(dest, threads=3)
    assert result.whole and result.shards == {"test": 2, "train": 8}
    assert 1 < most <= 3


def test_an_s3_copy_is_verified_too(seaweed_s3):
    dest = seaweed_s3.url("digits")
    digits(dest)  # type: ignore[arg-type]
    assert verify(dest).exit_code == 0
    import fsspec

    fs = fsspec.filesystem("s3", **seaweed_s3.storage_options)
    fs.rm(dest.removeprefix("s3://") + "/train-000004.tar")
    result = verify(dest)
    assert result.exit_code == 1, result.output
    assert "train-000004.tar: missing (listed in train.manifest.parquet)" in result.output.splitlines()
