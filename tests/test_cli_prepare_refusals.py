"""`vitray data prepare` refuses what it must not do, in one line, before Ray starts (issue 26):
a destination that holds someone else's files, zero-byte and undecodable images, storage that
cannot be reached. Through the CLI (typer's CliRunner), in-process, so that `ray.is_initialized()`
tells whether Ray was started."""

from __future__ import annotations

import io
import re
import socket
from pathlib import Path

import numpy as np
import pytest
import ray
from PIL import Image
from typer.testing import CliRunner

from vitray.cli.main import app
from vitray.data import BadImagesError, DestinationNotEmpty, prepare_dataset, read_dataset_info, read_manifest


def image_folder(root: Path, per_class: int = 3) -> Path:
    rng = np.random.default_rng(0)
    for name in ("ant", "bee"):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            buffer = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buffer, format="JPEG")
            (root / name / f"{i}.jpg").write_bytes(buffer.getvalue())
    return root


def with_bad_images(root: Path) -> list[Path]:
    bad = [root / "ant" / "empty.jpg", root / "bee" / "notes.jpg"]
    bad[0].write_bytes(b"")
    bad[1].write_text("this is text, not a JPEG")
    return bad


def prepare(*args: str):
    result = CliRunner().invoke(app, ["data", "prepare", *args])
    assert "Traceback" not in result.output, result.output
    return result


def refused(*args: str) -> str:
    """The one-line error of a refusal, which happened before Ray started."""
    result = prepare(*args)
    assert result.exit_code == 2, result.output
    assert not ray.is_initialized()
    lines = [line for line in result.output.splitlines() if line.strip()]
    if lines[0] == f"listing {args[0]} ...":  # what it was doing: an image folder's listing can take minutes
        lines = lines[1:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # rich would wrap the one line at 80 columns otherwise


def test_a_folder_of_someone_elses_files_is_refused_and_kept(tmp_path):
    src = image_folder(tmp_path / "src")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "train-000000.tar").write_bytes(b"the user's own shard")
    (dest / "notes.txt").write_text("mine")
    # Named like shards and manifests of splits this preparation does not write: never vitray's.
    (dest / "shard-000001.tar").write_bytes(b"another tool's webdataset shard")
    (dest / "foo.manifest.parquet").write_bytes(b"another tool's manifest")
    # Without --serial: the refusal comes before Ray would start.
    message = refused(f"imagefolder:{src}", str(dest))
    # Refused before the source's listing (a minute for a million files): nothing but the one line.
    assert prepare(f"imagefolder:{src}", str(dest)).output.strip() == message
    assert "is not empty and is not a vitray dataset" in message
    assert "train-000000.tar" in message and "notes.txt" in message and "--overwrite" in message
    assert (dest / "train-000000.tar").read_bytes() == b"the user's own shard"
    with pytest.raises(DestinationNotEmpty):
        prepare_dataset(f"imagefolder:{src}", str(dest))
    # --overwrite: the user asked for it; the same-named shard is replaced, their other files stay.
    result = prepare(f"imagefolder:{src}", str(dest), "--overwrite", "--serial")
    assert result.exit_code == 0, result.output
    assert read_dataset_info(str(dest)).splits["train"].num_samples == 6
    assert (dest / "notes.txt").read_text() == "mine"
    assert (dest / "shard-000001.tar").read_bytes() == b"another tool's webdataset shard"
    assert (dest / "foo.manifest.parquet").read_bytes() == b"another tool's manifest"


def stopped_after(shards: int, message: str = "simulated crash"):
    """A `map_fn` for `prepare_dataset` that writes `shards` shards and then raises KeyboardInterrupt
    (`message`): a preparation stopped part-way."""

    def map_fn(write, tasks):
        for i, task in enumerate(tasks):
            if i == shards:
                raise KeyboardInterrupt(message)
            yield write(task)

    return map_fn


def test_an_unfinished_preparation_and_a_prepared_dataset_are_vitrays_own(tmp_path):
    src = image_folder(tmp_path / "src")
    dest = tmp_path / "dest"

    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(f"imagefolder:{src}", str(dest), samples_per_shard=2, map_fn=stopped_after(1))
    prepare_dataset(f"imagefolder:{src}", str(dest), samples_per_shard=2)  # its own leftovers: no refusal
    assert sorted(p.name for p in dest.iterdir())[0] == "dataset.json"  # the marker is gone once finished
    # Already prepared: said at once, without starting Ray, with the layout it has (a different
    # --samples-per-shard is not silently taken for done).
    result = prepare(f"imagefolder:{src}", str(dest), "--samples-per-shard", "1000")
    assert result.exit_code == 0 and "already prepared" in result.output and not ray.is_initialized()
    assert re.search(r"\(\w+: \d+ samples? in \d+ shards?", result.output), result.output
    # ... but not from another source: never taken for the dataset asked for.
    other = image_folder(tmp_path / "other")
    message = refused(f"imagefolder:{other}", str(dest))
    assert message == (
        f"error: {dest} holds a dataset prepared from imagefolder:{src}, not from imagefolder:{other}: "
        "choose another DEST, or pass --overwrite to replace it"
    )


def test_bad_images_are_refused_with_their_names(tmp_path):
    src = image_folder(tmp_path / "src")
    bad = with_bad_images(src)
    # The zero-byte file is known from the listing: refused at once, before Ray and any shard.
    message = refused(f"imagefolder:{src}", str(tmp_path / "dest"))
    assert "1 image cannot be read" in message and "--skip-bad" in message
    assert str(bad[0]) in message and "empty file" in message
    assert not (tmp_path / "dest").exists()
    # An undecodable one is found as its shard is written: every one named, in one line.
    (src / "bee" / "notes2.jpg").write_bytes(b"\xff\xd8\xff not a JPEG after all")
    bad[0].unlink()
    result = prepare(f"imagefolder:{src}", str(tmp_path / "dest"), "--serial")
    assert result.exit_code == 2, result.output
    message = result.output.strip().splitlines()[-1]  # after the listing's count and the pass's progress
    assert message.startswith("error: ")
    assert "2 images cannot be read" in message and "--skip-bad" in message
    assert str(bad[1]) in message and "not an image" in message
    assert not (tmp_path / "dest" / "dataset.json").exists()
    with pytest.raises(BadImagesError) as caught:
        prepare_dataset(f"imagefolder:{src}", str(tmp_path / "lib"), samples_per_shard=2)
    assert sorted(entry.split(":")[0] for entry in caught.value.bad) == sorted(
        [str(bad[1]), str(src / "bee" / "notes2.jpg")]
    )


def test_bad_images_are_skipped_with_skip_bad(tmp_path):
    src = image_folder(tmp_path / "src")
    bad = with_bad_images(src)
    dest = tmp_path / "dest"
    result = prepare(f"imagefolder:{src}", str(dest), "--serial", "--skip-bad", "--samples-per-shard", "100")
    assert result.exit_code == 0, result.output
    assert "skipped 2 bad images" in result.output and bad[0].name in result.output
    # Counts are pluralised by their number: one shard here.
    assert "6 samples in 1 shard" in result.output and "1 shards" not in result.output
    assert "2 classes" in result.output
    assert [row.num_samples for row in read_manifest(str(dest), "train")] == [6]
    # Every image left out is listed in the dataset's folder (the message names the first five only)
    listed = (dest / "skipped-images.txt").read_text().splitlines()
    assert sorted(line.split(": ")[0] for line in listed) == sorted(str(path) for path in bad)
    assert f"(all in {dest / 'skipped-images.txt'})" in " ".join(result.output.split())
    # ... and a preparation that skips none leaves no list of an earlier one behind
    for path in bad:
        path.unlink()
    result = prepare(f"imagefolder:{src}", str(dest), "--serial", "--overwrite")
    assert result.exit_code == 0, result.output
    assert not (dest / "skipped-images.txt").exists()


def test_s3_destination_without_credentials_is_one_line(seaweed_s3, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    message = refused("builtin:digits", seaweed_s3.url("digits"))
    assert "no credentials for" in message and "AWS_ACCESS_KEY_ID" in message


def test_s3_destination_unreachable_is_one_line(seaweed_s3, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    message = refused("builtin:digits", seaweed_s3.url("digits"))
    assert "cannot reach the S3 endpoint" in message and closed in message


def test_files_that_are_not_images_are_counted_as_left_out(tmp_path):
    src = image_folder(tmp_path / "src")
    (src / "ant" / "labels.csv").write_text("a,b")
    (src / "bee" / "README.txt").write_text("bees")
    (src / "bee" / ".DS_Store").write_bytes(b"\0")  # hidden: not the user's data
    result = prepare(f"imagefolder:{src}", str(tmp_path / "dest"), "--serial")
    assert result.exit_code == 0, result.output
    assert (
        f"leaving out 2 files (not PNG/JPEG images, or outside the class folders), e.g. {src / 'ant' / 'labels.csv'}"
        in " ".join(result.output.split())
    )
    assert read_dataset_info(str(tmp_path / "dest")).splits["train"].num_samples == 6
    clean = prepare(f"imagefolder:{image_folder(tmp_path / 'clean')}", str(tmp_path / "dest2"), "--serial")
    assert clean.exit_code == 0 and "leaving out" not in clean.output
    assert f"{tmp_path / 'dest2'}: clean, 2 classes (single-label); train: 6 samples" in " ".join(clean.output.split())
    # Without its labels: the summary says so (not "0 classes (none-label)").
    unlabelled = prepare(f"unlabelled:imagefolder:{tmp_path / 'clean'}", str(tmp_path / "dest3"), "--serial")
    assert unlabelled.exit_code == 0, unlabelled.output
    assert f"{tmp_path / 'dest3'}: clean, unlabelled; train: 6 samples" in " ".join(unlabelled.output.split())


def test_a_second_preparation_into_a_dest_being_prepared_is_refused_before_the_source_is_listed(tmp_path):
    """Two `vitray data prepare` into one DEST at once: the second took the first for a stopped one
    and removed the shards it was writing (the first then failed), or, with other options, both ended
    "whole" over a mix of their shards. The command preparing DEST holds a lease there; a second is
    refused while it is held, with --overwrite too, naming the holder; once released DEST is free,
    and the finished dataset is taken for one (the lease's lock file beside it does not count)."""
    from vitray.cluster.prepare import PreparationLease

    source, dest = image_folder(tmp_path / "images"), tmp_path / "dest"
    holder = PreparationLease(str(dest))
    holder.acquire()
    try:
        for extra in ([], ["--overwrite"]):
            line = refused(f"imagefolder:{source}", str(dest), "--serial", *extra)
            assert line.startswith(f"error: {dest} is being prepared by {holder.owner} (host "), line
            assert "two preparations must not write one dataset" in line
        assert sorted(p.name for p in dest.iterdir()) == [
            ".vitray-preparing.lease.json",
            ".vitray-preparing.lease.json.lock",
        ]
        # Taken meanwhile (after the early check): refused as it starts, before any file is written.
        from vitray.cluster.prepare import prepare as prepare_here
        from vitray.data import open_source
        from vitray.runfolder.lease import RunLeaseHeld

        with pytest.raises(RunLeaseHeld, match="is being prepared by"):
            prepare_here(open_source(f"imagefolder:{source}"), str(dest), serial=True, show_progress=False)
    finally:
        holder.release()
    assert prepare(f"imagefolder:{source}", str(dest), "--serial").exit_code == 0
    assert ".vitray-preparing.lease.json" not in {p.name for p in dest.iterdir()}
    again = prepare(f"imagefolder:{source}", str(dest), "--serial")
    assert again.exit_code == 0 and "is already prepared" in again.output, again.output
