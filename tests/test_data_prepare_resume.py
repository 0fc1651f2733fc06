"""A stopped `vitray data prepare` goes on from the shards it wrote (data/prepare_resume.py): the same
command keeps every whole shard of the same plan and writes the others, and the dataset is byte for
byte what one uninterrupted run writes; any other plan starts over, and so does a shard whose record
does not stand for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from PIL import Image
from test_cli_prepare_refusals import image_folder, prepare, stopped_after

from vitray.data import open_source, plan_shards, prepare_dataset
from vitray.data.prepare_resume import plan_fingerprint


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # rich would wrap the one line at 80 columns otherwise


def files_of(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def writes_counted(written: list[str]):
    """A `map_fn` that notes the name of each shard it writes."""

    def map_fn(write, tasks):
        for task in tasks:
            written.append(task.name)
            yield write(task)

    return map_fn


def shards(*indices: int) -> list[str]:
    return [f"train-{i:06d}.tar" for i in indices]


def test_a_stopped_preparation_goes_on_and_writes_what_one_run_writes(tmp_path, capsys):
    spec = f"imagefolder:{image_folder(tmp_path / 'src')}"
    whole = tmp_path / "whole"
    prepare_dataset(spec, str(whole), samples_per_shard=2)
    dest = tmp_path / "dest"

    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(spec, str(dest), samples_per_shard=2, map_fn=stopped_after(2))
    assert sorted(p.name for p in dest.glob(".*.done")) == [f".{name}.done" for name in shards(0, 1)]
    capsys.readouterr()

    written: list[str] = []
    prepare_dataset(spec, str(dest), samples_per_shard=2, map_fn=writes_counted(written))
    assert written == shards(2)
    assert capsys.readouterr().out.splitlines() == [
        f"{dest}: going on with the preparation stopped earlier: 2 of 3 shards (4 images) already written"
    ]
    # The same shards, manifests and dataset.json; no record and no marker left.
    assert files_of(dest) == files_of(whole)


def replace_an_image(src: Path) -> None:
    image = src / "ant" / "0.jpg"
    Image.new("RGB", (16, 16), (200, 10, 10)).save(image, format="JPEG")  # another size than the 8x8 noise


@pytest.mark.parametrize(
    "change",
    ["samples_per_shard", "skip_bad", "an image replaced", "an image added", "an older vitray"],
)
def test_another_plan_starts_over(tmp_path, capsys, change):
    src = image_folder(tmp_path / "src")
    spec, dest = f"imagefolder:{src}", tmp_path / "dest"
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(spec, str(dest), samples_per_shard=2, map_fn=stopped_after(2))
    options = {"samples_per_shard": 2}
    if change == "samples_per_shard":
        options["samples_per_shard"] = 3
    elif change == "skip_bad":
        options["bad_images"] = "skip"
    elif change == "an image replaced":
        replace_an_image(src)
    elif change == "an older vitray":  # its marker held no plan, and its shards no records
        (dest / ".vitray-preparing").write_text("")
        for record in dest.glob(".*.tar.done"):
            record.unlink()
    else:
        (src / "bee" / "9.jpg").write_bytes((src / "bee" / "0.jpg").read_bytes())
    capsys.readouterr()

    written: list[str] = []
    prepare_dataset(spec, str(dest), map_fn=writes_counted(written), **options)
    why = (
        "by an older vitray (its shards carry no records)"
        if change == "an older vitray"
        else "with other options or of the source as it was then"
    )
    assert capsys.readouterr().out.splitlines() == [
        f"{dest} holds an unfinished preparation (2 shards written) {why}: starting over"
    ]
    fresh = tmp_path / "fresh"
    prepare_dataset(spec, str(fresh), **options)
    assert written == sorted(name for name in files_of(fresh) if name.endswith(".tar"))
    assert files_of(dest) == files_of(fresh)


def test_only_shards_their_records_stand_for_are_kept(tmp_path):
    """A record is written after its shard: a shard without one, or whose size is not the record's,
    or a record cut short or of another plan, is written again."""
    spec = f"imagefolder:{image_folder(tmp_path / 'src')}"
    dest = tmp_path / "dest"
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(spec, str(dest), samples_per_shard=1, map_fn=stopped_after(5))

    def record(i: int) -> Path:
        return dest / f".train-{i:06d}.tar.done"

    (dest / "train-000000.tar").write_bytes(b"another shard, of another size")
    record(1).write_text(record(1).read_text()[:20])  # cut short
    other = json.loads(record(2).read_text())
    record(2).write_text(json.dumps({**other, "plan": "0" * 64}))
    record(3).unlink()  # the shard was published, the process killed before its record
    (dest / ".train-000004.tar.x1y2z3.tmp").write_bytes(b"a shard being written when the process was killed")

    written: list[str] = []
    prepare_dataset(spec, str(dest), samples_per_shard=1, map_fn=writes_counted(written))
    assert written == shards(0, 1, 2, 3, 5)  # shard 4 kept
    fresh = tmp_path / "fresh"
    prepare_dataset(spec, str(fresh), samples_per_shard=1)
    assert files_of(dest) == files_of(fresh)


def test_a_preparation_stopped_again_and_again_gets_there(tmp_path):
    spec = f"imagefolder:{image_folder(tmp_path / 'src', per_class=5)}"
    dest = tmp_path / "dest"
    for _ in range(3):
        with pytest.raises(KeyboardInterrupt):
            prepare_dataset(spec, str(dest), samples_per_shard=1, map_fn=stopped_after(2))
    written: list[str] = []
    prepare_dataset(spec, str(dest), samples_per_shard=1, map_fn=writes_counted(written))
    assert written == shards(6, 7, 8, 9)
    fresh = tmp_path / "fresh"
    prepare_dataset(spec, str(fresh), samples_per_shard=1)
    assert files_of(dest) == files_of(fresh)


FINGERPRINT = """
import sys
from vitray.data import open_source, plan_shards
from vitray.data.prepare_resume import plan_fingerprint
source = open_source(sys.argv[1])
print(plan_fingerprint(source, plan_shards(source, samples_per_shard=2), "refuse"))
"""


def test_the_plan_fingerprint_is_the_same_in_another_process(tmp_path, parquet_dataset_source):
    """The re-run is another process (another hash seed): the same plan must give the same print."""
    specs = [f"imagefolder:{image_folder(tmp_path / 'src')}", parquet_dataset_source, "builtin:digits"]
    for spec in specs:
        source = open_source(spec)
        here = plan_fingerprint(source, plan_shards(source, samples_per_shard=2), "refuse")
        there = subprocess.run(
            [sys.executable, "-c", FINGERPRINT, spec], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert here == there, spec


@pytest.fixture
def parquet_dataset_source(tmp_path) -> str:
    from test_data_prepare_mistakes import write_table

    root = tmp_path / "table"
    write_table(root / "train-00000-of-00001.parquet", [0, 1, 2, 1, 0])
    return f"parquet:{root}"


def test_the_command_line_goes_on_after_ctrl_c(tmp_path, monkeypatch):
    """Through `vitray data prepare --serial`: the stop's line and the re-run's say what happens."""
    import vitray.data.prepare as prepare_module

    src = image_folder(tmp_path / "src")
    dest = tmp_path / "dest"
    real = prepare_module.prepare_dataset

    def stopped(*args, **kwargs):
        return real(*args, **{**kwargs, "map_fn": stopped_after(1)})

    monkeypatch.setattr("vitray.cluster.prepare.prepare_dataset", stopped)
    result = prepare(f"imagefolder:{src}", str(dest), "--serial", "--samples-per-shard", "2")
    assert result.exit_code == 130
    assert result.output.strip().splitlines()[-1] == (
        "stopped by user (Ctrl-C): vitray data prepare did not finish; the same command goes on preparing "
        f"{dest} from the shards written"
    )
    monkeypatch.undo()
    monkeypatch.setenv("COLUMNS", "1000")
    result = prepare(f"imagefolder:{src}", str(dest), "--serial", "--samples-per-shard", "2")
    assert result.exit_code == 0, result.output
    assert f"{dest}: going on with the preparation stopped earlier: 1 of 3 shards (2 images) already written" in (
        result.output
    )


def test_on_s3_a_stopped_preparation_goes_on(seaweed_s3, digits_dataset, capsys):
    """The records are read (concurrently) and removed (in one batch) through s3fs."""
    dest = seaweed_s3.url("datasets", "digits")
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset("builtin:digits", dest, samples_per_shard=100, map_fn=stopped_after(7))
    capsys.readouterr()
    written: list[str] = []
    prepare_dataset("builtin:digits", dest, samples_per_shard=100, map_fn=writes_counted(written))
    assert "7 of 19 shards (700 images) already written" in capsys.readouterr().out
    assert len(written) == 12 and "train-000000.tar" not in written

    s3 = boto3.client("s3", endpoint_url=seaweed_s3.endpoint_url)
    listed = s3.list_objects_v2(Bucket=seaweed_s3.bucket, Prefix="datasets/digits/")["Contents"]
    assert {o["Key"].rsplit("/", 1)[1] for o in listed} == {p.name for p in digits_dataset.iterdir()}
    for name, data in files_of(digits_dataset).items():
        assert s3.get_object(Bucket=seaweed_s3.bucket, Key=f"datasets/digits/{name}")["Body"].read() == data, name
