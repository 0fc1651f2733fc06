"""`vitray data prepare` on the mistakes users of real datasets make (a stray folder beside the split
folders, HF's unlabelled test splits, zero-byte files, a DEST inside the source, tables sorted by
label): each is refused or said in one line before Ray starts and before any shard is written, or
handled as a user of the format expects."""

from __future__ import annotations

import io
import json
import pickle
import struct
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from PIL import Image
from test_cli_prepare_refusals import image_folder, prepare, refused

from vitray.data import BadImagesError, open_source, prepare_dataset, read_dataset_info


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # rich would wrap the one line at 80 columns otherwise


def jpeg(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


def classes_under(root: Path, names: tuple[str, ...], per_class: int = 2) -> Path:
    for name in names:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            (root / name / f"{i}.jpg").write_bytes(jpeg(i))
    return root


# ------------------------------------------------------------------ image folders


def test_split_folders_beside_another_folder_are_refused_not_taken_for_classes(tmp_path):
    """PATH/{train/CLASS, val/CLASS, previews/}: the splits became the classes "train" and "val" (the
    validation images trained on, labelled "val"), with exit 0."""
    root = classes_under(tmp_path / "inet", ("train/n01", "train/n02", "val/n01", "val/n02", "previews"))
    message = refused(f"imagefolder:{root}", str(tmp_path / "out"))
    assert message == (
        f"error: imagefolder source {root} mixes split folders [train, val] (holding class folders) with other "
        f"folders [previews]: move those out of {root}, or give one split as the source (imagefolder:{root}/train)"
    )
    assert not (tmp_path / "out").exists()
    # The fix it names works; so does moving the extra folder out.
    assert open_source(f"imagefolder:{root}/train").classes == ["n01", "n02"]
    (root / "previews").rename(tmp_path / "previews")
    assert open_source(f"imagefolder:{root}").split_sizes() == {"train": 4, "val": 4}


def test_classes_named_like_splits_that_hold_their_images_are_still_classes(tmp_path):
    """CIFAR-100's "train" and VOC's "train" are classes: a class folder with its images is never a
    split folder, even beside a split-named folder."""
    root = classes_under(tmp_path / "vehicles", ("bus", "test", "train"))
    (root / "train" / "side view").mkdir()  # nested images under a class are still that class's
    (root / "train" / "side view" / "9.jpg").write_bytes(jpeg(9))
    source = open_source(f"imagefolder:{root}")
    assert source.classes == ["bus", "test", "train"] and source.split_sizes() == {"train": 7}


def test_zero_byte_images_are_refused_when_listed_before_ray_and_any_shard(tmp_path):
    src = image_folder(tmp_path / "src")
    (src / "ant" / "empty.jpg").write_bytes(b"")
    dest = tmp_path / "dest"
    message = refused(f"imagefolder:{src}", str(dest))  # without --serial: before Ray would start
    assert message == (
        f"error: 1 image cannot be read (zero-byte or undecodable): {src}/ant/empty.jpg: empty file (0 bytes): "
        "fix or remove it, or pass --skip-bad to leave it out"
    )
    assert not dest.exists()

    def no_shard_may_be_written(fn, tasks):
        raise AssertionError("a shard was written before the zero-byte image was refused")

    with pytest.raises(BadImagesError):
        prepare_dataset(f"imagefolder:{src}", str(dest), map_fn=no_shard_may_be_written)
    assert not dest.exists()
    result = prepare(f"imagefolder:{src}", str(dest), "--serial", "--skip-bad")
    assert result.exit_code == 0, result.output
    assert f"skipped 1 bad image: {src}/ant/empty.jpg: empty file (0 bytes)" in result.output
    assert read_dataset_info(str(dest)).splits["train"].num_samples == 6


def test_a_broken_link_in_a_class_folder_is_named_with_its_fix(tmp_path):
    src = image_folder(tmp_path / "src")
    (src / "bee" / "moved.jpg").symlink_to(tmp_path / "gone.jpg")
    message = refused(f"imagefolder:{src}", str(tmp_path / "dest"))
    assert message == (
        f"error: {src}/bee/moved.jpg is a link to a missing file ({tmp_path}/gone.jpg): remove the link, "
        "or restore its target"
    )


@pytest.mark.parametrize("where", ["prepared", "."])
def test_a_dest_inside_the_source_folder_is_refused_before_listing(tmp_path, where):
    """Accepted, it gave a prepared dataset, and the next run read its shards as a class."""
    src = tmp_path / "src"
    src.mkdir()  # empty: listing it would refuse it for another reason
    dest = src / where
    message = refused(f"imagefolder:{src}", str(dest))
    assert message == (
        f"error: {dest} is inside the source folder {src}: a later listing of imagefolder:{src} would read the "
        "prepared files as its own; choose a DEST outside it"
    )
    table = tmp_path / "table"
    table.mkdir()
    assert "is inside the source folder" in refused(f"unlabelled:parquet:{table}", str(table / "out"))
    assert "is inside the source folder" in refused(f"vtab:dtd:{table}", str(table / "out"))


# ------------------------------------------------------------------ Parquet / Hugging Face tables


def write_table(path: Path, labels: list, names: list[str] | None = ("a", "b", "c")) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = None
    if names:
        features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": list(names)}}
        metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    schema = pa.schema(
        [("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("label", pa.int64())],
        metadata=metadata,
    )
    rows = [{"image": {"bytes": jpeg(i), "path": f"{i}.jpg"}, "label": label} for i, label in enumerate(labels)]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=4)


def test_an_unlabelled_test_split_is_left_out_and_said(tmp_path):
    """Hugging Face publishes test splits with every label -1 (imagenet-1k): the whole preparation
    aborted mid-write on its first row, after Ray started and shards were written, and the train split
    was lost with it."""
    root = tmp_path / "inet"
    write_table(root / "data" / "train-00000-of-00001.parquet", [0, 1, 2, 0, 1, 2])
    write_table(root / "data" / "test-00000-of-00001.parquet", [-1] * 5)
    dest = tmp_path / "out"
    result = prepare(f"hf:{root}", str(dest), "--serial")
    assert result.exit_code == 0, result.output
    assert (
        f"leaving out split 'test' (5 rows): every label is -1, an unlabelled test split as Hugging Face "
        f"publishes them (unlabelled:hf:{root} keeps it, without any labels)"
    ) in result.output
    assert list(read_dataset_info(str(dest)).splits) == ["train"]
    # unlabelled: keeps every split, as it says
    both = open_source(f"unlabelled:hf:{root}")
    assert both.split_sizes() == {"train": 6, "test": 5} and both.label_kind == "none" and not both.notes
    # Every split unlabelled: refused, naming the way.
    only_test = tmp_path / "only_test"
    write_table(only_test / "test-00000-of-00001.parquet", [-1] * 3)
    message = refused(f"parquet:{only_test}", str(tmp_path / "out2"))
    assert message == (
        f"error: parquet:{only_test}: every label of the splits ['test'] is -1 (no labels published): to pre-train "
        f"on the images without labels, prepare unlabelled:parquet:{only_test}"
    )
    assert open_source(f"unlabelled:parquet:{only_test}").split_sizes() == {"test": 3}


@pytest.mark.parametrize("names", [("a", "b", "c"), None])
def test_labels_outside_the_classes_are_refused_when_the_table_is_opened(tmp_path, names):
    root = tmp_path / "table"
    write_table(root / "train-00000-of-00002.parquet", [0, 1, 2, 0, 1], names)
    write_table(root / "train-00001-of-00002.parquet", [2, -1, 0, -3], names)
    write_table(root / "validation-00000-of-00001.parquet", [0, 1], names)
    message = refused(f"parquet:{root}", str(tmp_path / "out"))
    assert message == (
        f"error: parquet:{root}: split 'train' has 2 of 9 rows with labels outside the classes 0..2 (e.g. -1): fix "
        "the labels, or move the split's files (train-00000-of-00002.parquet ...) out of the source"
    )
    assert not (tmp_path / "out").exists()
    if names:  # a label past the class names, found from the statistics alone
        write_table(root / "validation-00000-of-00001.parquet", [0, 3, 4], names)
        write_table(root / "train-00001-of-00002.parquet", [2, 0], names)
        with pytest.raises(
            ValueError, match=r"split 'validation' has 2 of 3 rows with labels outside the classes 0..2"
        ):
            open_source(f"parquet:{root}")
    assert open_source(f"unlabelled:parquet:{root}").label_kind == "none"  # unlabelled: does not need them


def test_a_multi_label_table_counts_rows_with_a_label_outside(tmp_path):
    root = tmp_path / "multi"
    root.mkdir()
    features = {
        "image": {"_type": "Image"},
        "label": {"_type": "Sequence", "feature": {"_type": "ClassLabel", "names": ["a", "b"]}},
    }
    schema = pa.schema(
        [("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("label", pa.list_(pa.int64()))],
        metadata={b"huggingface": json.dumps({"info": {"features": features}}).encode()},
    )
    rows = [
        {"image": {"bytes": jpeg(i), "path": f"{i}.jpg"}, "label": label}
        for i, label in enumerate([[0, 1], [1, 5, 7], [0], [9]])
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), root / "train.parquet")
    with pytest.raises(
        ValueError, match=r"split 'train' has 2 of 4 rows with labels outside the classes 0..1 \(e.g. 5\)"
    ):
        open_source(f"parquet:{root}")


def test_a_parquet_shard_reads_only_its_own_files(tmp_path, monkeypatch):
    """Every shard's task opened the metadata of every file of its split: 91,200 opens for 300 files
    and 300 shards (most of the time of a preparation)."""
    root = tmp_path / "many"
    for f in range(20):
        write_table(root / f"train-{f:05d}-of-00020.parquet", [f % 3, (f + 1) % 3])
    source = open_source(f"parquet:{root}")
    chunk = source.chunk("train", list(range(9, 13)))  # rows of files 4, 5 and 6
    assert [Path(path).name for path, _, _ in chunk.files] == [f"train-{f:05d}-of-00020.parquet" for f in (4, 5, 6)]
    opened = []
    real = pq.ParquetFile

    def counting(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", counting)
    labels = [sample.label for sample in pickle.loads(pickle.dumps(chunk))]
    assert labels == [(4 + 1) % 3, 5 % 3, (5 + 1) % 3, 6 % 3]
    assert len(opened) == 3  # one per file read, to read it


# ------------------------------------------------------------------ stops, restarts and Ray


def test_ctrl_c_before_the_shards_says_what_a_rerun_does(tmp_path, monkeypatch):
    src = image_folder(tmp_path / "src")

    import vitray.cluster.prepare

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(vitray.cluster.prepare, "prepare", interrupted)
    result = prepare(f"imagefolder:{src}", str(tmp_path / "other"))
    assert result.exit_code == 130
    assert result.output.strip().splitlines() == [
        f"listing imagefolder:{src} ...",  # what it is doing before each silent phase (the listing, Ray's start)
        f"imagefolder:{src}: 6 images in 2 classes (train: 6)",
        "starting a local Ray instance ...",
        "stopped by user (Ctrl-C): vitray data prepare did not finish; the same command goes on preparing "
        f"{tmp_path / 'other'} from the shards written",
    ]
    assert not ray.is_initialized()


def test_ray_retries_a_shard_only_when_its_worker_died():
    """Ray retried a shard task that raised an OSError 3 times, each running vitray's own 5 storage
    attempts again (20 uploads per shard, 4 minutes before an S3 outage failed, Ray's traceback of
    each attempt on the console); a source image deleted meanwhile was read 4 times."""
    from vitray.cluster.prepare import _write_shard_task

    options = _write_shard_task._default_options
    assert options["max_retries"] >= 1  # a lost worker (a node gone) is still retried
    assert not options.get("retry_exceptions")  # an error the task raised is not


@pytest.mark.parametrize("row_group_size", [4, 100])  # several row groups (their statistics say), or one (read)
def test_a_table_sorted_by_label_is_warned_of(tmp_path, row_group_size):
    """Parquet keeps the table's order: a class-sorted table gave shards of a few classes each and a
    `train[98%:]` held-out slice of only the last classes, silently."""
    root = tmp_path / "sorted"
    labels = sorted([0, 1, 2] * 4)
    write_table(root / "train-00000-of-00002.parquet", labels[:6])
    write_table(root / "train-00001-of-00002.parquet", labels[6:])
    shuffled = [labels[i] for i in np.random.default_rng(0).permutation(len(labels))]
    write_table(root / "validation-00000-of-00001.parquet", shuffled)
    if row_group_size == 100:
        for path in root.iterdir():
            pq.write_table(pq.read_table(path), path, row_group_size=100)
    result = prepare(f"parquet:{root}", str(tmp_path / "out"), "--serial")
    assert result.exit_code == 0, result.output
    warning = (
        f"warning: split 'train' of parquet:{root} is sorted by label: each shard will hold a few classes, and a "
        "held-out slice such as train[98%:] only the last ones; shuffle the table before preparing it"
    )
    assert warning in result.output and "split 'validation'" not in result.output


# ------------------------------------------------------------------ images too large for Pillow


def solid_png(width: int, height: int) -> bytes:
    """A valid black 1-bit PNG of ``width x height``, made row by row: 400 megapixels in ~40 KB."""
    chunk = lambda kind, data: (  # noqa: E731
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    )
    packer = zlib.compressobj(9)
    row = bytes(1 + (width + 7) // 8)  # filter byte 0, then the row's bits
    pixels = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def test_an_image_over_pillows_limit_is_said_too_large_with_its_fix(tmp_path):
    """A valid 20000 x 20000 image was "undecodable (DecompressionBombError: ...)", as if damaged. The
    readers cannot read it either (they open every image with Pillow): refused, with its own cause
    and fix, or left out with --skip-bad."""
    from vitray.data.image_check import image_problem
    from vitray.data.transforms import CorruptSample, decode_image

    huge = solid_png(20_000, 20_000)
    assert image_problem(huge) == "too large: 400 megapixels, over Pillow's limit of 179 megapixels"
    with pytest.raises(CorruptSample, match="DecompressionBombError"):  # so the check must not let it in
        decode_image(huge)
    assert image_problem(solid_png(10_000, 10_000)) is None  # over Pillow's warning, under its limit: readable

    src = image_folder(tmp_path / "src")
    (src / "ant" / "huge.png").write_bytes(huge)
    result = prepare(f"imagefolder:{src}", str(tmp_path / "dest"), "--serial")
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == (
        f"error: 1 image cannot be read: {src}/ant/huge.png: too large: 400 megapixels, over Pillow's limit of "
        "179 megapixels: resize it below the limit, or pass --skip-bad to leave it out"
    )
    (src / "bee" / "notes.jpg").write_text("text, not a JPEG")
    result = prepare(f"imagefolder:{src}", str(tmp_path / "dest"), "--serial")
    error = next(line for line in result.output.splitlines() if line.startswith("error: "))
    assert error.startswith("error: 2 images cannot be read (zero-byte, undecodable or too large): ")
    assert error.endswith(": fix or remove them (resize the ones too large), or pass --skip-bad to leave them out")
    result = prepare(f"imagefolder:{src}", str(tmp_path / "dest"), "--serial", "--skip-bad")
    assert result.exit_code == 0, result.output
    assert f"{src}/ant/huge.png: too large: 400 megapixels" in result.output
    assert read_dataset_info(str(tmp_path / "dest")).splits["train"].num_samples == 6


# ------------------------------------------------------------------ a source changed since


def test_a_source_changed_since_it_was_prepared_is_refused_not_taken_as_prepared(tmp_path):
    """Images added after a preparation: the same command said "already prepared ... nothing to do"
    with the old counts, since only the spec was compared."""
    src = image_folder(tmp_path / "src")
    dest = tmp_path / "dest"
    assert prepare(f"imagefolder:{src}", str(dest), "--serial").exit_code == 0
    assert "nothing to do" in prepare(f"imagefolder:{src}", str(dest)).output  # unchanged: as before

    (src / "ant" / "new.jpg").write_bytes(jpeg(7))
    assert refused(f"imagefolder:{src}", str(dest)) == (
        f"error: imagefolder:{src} changed since {dest} was prepared from it (samples train: 6 then, 7 now): pass "
        "--overwrite to prepare it again, or choose another DEST"
    )
    with pytest.raises(ValueError, match="changed since"):  # the Python API says so too
        prepare_dataset(f"imagefolder:{src}", str(dest))
    (src / "ant" / "new.jpg").unlink()
    (src / "bee" / "0.jpg").unlink()
    assert "(samples train: 6 then, 5 now)" in refused(f"imagefolder:{src}", str(dest))
    assert prepare(f"imagefolder:{src}", str(dest), "--serial", "--overwrite").exit_code == 0
    assert read_dataset_info(str(dest)).splits["train"].num_samples == 5


def test_bad_images_left_out_are_not_taken_for_a_changed_source(tmp_path):
    """With --skip-bad the shards hold fewer samples than the source lists: the manifests record
    what was listed, so the same command is still "already prepared"."""
    src = image_folder(tmp_path / "src")
    (src / "bee" / "notes.jpg").write_text("text, not a JPEG")
    dest = tmp_path / "dest"
    assert prepare(f"imagefolder:{src}", str(dest), "--serial", "--skip-bad").exit_code == 0
    assert read_dataset_info(str(dest)).splits["train"].num_samples == 6
    again = prepare(f"imagefolder:{src}", str(dest), "--skip-bad")
    assert again.exit_code == 0 and "nothing to do" in again.output, again.output
    (src / "bee" / "more.jpg").write_bytes(jpeg(8))
    assert "(samples train: 7 then, 8 now)" in refused(f"imagefolder:{src}", str(dest), "--skip-bad")


# ------------------------------------------------------------------ what it is doing


def test_the_serial_path_shows_progress_as_plain_lines_in_a_log(tmp_path, monkeypatch):
    """--serial printed nothing until its end (hours for ImageNet); and without a terminal the Ray
    path's bar came out once, cut at 80 columns ("25000/25… images")."""
    from vitray.data.shard_progress import ShardProgress

    src = image_folder(tmp_path / "src")
    result = prepare(f"imagefolder:{src}", str(tmp_path / "dest"), "--serial", "--samples-per-shard", "2")
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[:2] == [f"listing imagefolder:{src} ...", f"imagefolder:{src}: 6 images in 2 classes (train: 6)"]
    shown = [line for line in lines if line.startswith("preparing src: ")]
    assert len(shown) == 1 and shown[0].startswith("preparing src: 6/6 images (100%)  ")  # the pass's end
    assert "…" not in result.output

    monkeypatch.setattr(ShardProgress, "line_every_s", 0.0)  # a line after each shard: as a long pass does
    result = prepare(f"imagefolder:{src}", str(tmp_path / "dest2"), "--serial", "--samples-per-shard", "2")
    shown = [line.split("  ")[0] for line in result.output.splitlines() if line.startswith("preparing src: ")]
    assert shown == [f"preparing src: {n}/6 images ({n / 6:.0%})" for n in (2, 4, 6)]


def test_the_progress_is_a_bar_on_a_terminal():
    from rich.console import Console

    from vitray.data.shard_progress import ShardProgress

    out = io.StringIO()
    with ShardProgress("preparing x", 10, console=Console(file=out, force_terminal=True, width=100)) as bar:
        assert not bar.lines
        bar.advance(10)
    assert "preparing x" in out.getvalue() and "10/10" in out.getvalue() and "━" in out.getvalue()
    quiet = io.StringIO()
    with ShardProgress("preparing x", 10, show=False, console=Console(file=quiet)) as bar:
        bar.advance(10)
    assert quiet.getvalue() == ""
