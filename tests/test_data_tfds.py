"""TFDS builds on disk (``tfds:PATH``) and VTAB-1k tasks cut from them (``vtab:TASK:PATH``): TFRecord
framing and checksums, tf.train.Example parsing without TensorFlow, TFDS order kept, VTAB's
train800val200 split made exactly as task_adaptation defines it (800 + 200 examples, the full test
split), its derived labels, and a grid run end to end on a prepared VTAB-shaped task."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from tfds_helpers import png, write_tfds_build

from vitray.data import prepare_dataset, read_labels
from vitray.data.sources import open_source
from vitray.data.sources.tfds import TfdsSource
from vitray.data.sources.tfrecord import (
    CorruptRecord,
    count_records,
    crc32c,
    iter_records,
    make_example,
    masked_crc32c,
    parse_example,
    write_records,
)
from vitray.data.sources.vtab import VTAB_TASKS, VtabSource
from vitray.evaluation.suite import get_benchmark, prepare_command


# -- TFRecord framing and tf.train.Example ---------------------------------------------------------
def test_crc32c_and_the_masked_form_match_the_reference_values():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    assert crc32c(b"") == 0
    assert masked_crc32c(b"") == 0xA282EAD8  # rot15(0) + the TFRecord mask delta


# RFC 3720 (iSCSI), appendix B.4: CRC-32C of 32-byte patterns, and the check value.
CRC32C_VECTORS = [
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


def test_the_c_crc32c_is_used_and_agrees_with_the_python_fallback():
    from vitray.data.sources import tfrecord

    # google-crc32c is a dependency: the fast path is the one that runs (decided once, at import).
    assert tfrecord._crc32c_impl is tfrecord._crc32c_c, "google_crc32c's C extension is not installed"
    for data, expected in CRC32C_VECTORS:
        assert tfrecord._crc32c_c(data) == expected, data
        assert tfrecord._crc32c_python(data) == expected, data
    payload = np.random.default_rng(0).bytes(100_003)  # an odd length: no whole-word shortcut hides a tail
    assert tfrecord._crc32c_c(payload) == tfrecord._crc32c_python(payload)
    assert tfrecord._crc32c_c(memoryview(payload)[5:]) == tfrecord._crc32c_python(payload[5:])


def test_records_round_trip_and_corruption_is_a_clear_error(tmp_path):
    path = str(tmp_path / "x.tfrecord")
    records = [make_example({"image": png(i), "label": i, "objects/location": [0.5, -1.0, 3.25]}) for i in range(5)]
    write_records(path, records)
    assert count_records(path) == 5
    assert list(iter_records(path)) == records
    assert list(iter_records(path, 2, 4)) == records[2:4]
    parsed = parse_example(records[3])
    assert parsed["label"] == [3] and parsed["image"] == [png(3)] and parsed["objects/location"] == [0.5, -1.0, 3.25]

    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:-7])  # truncated inside the last record
    with pytest.raises(CorruptRecord, match="record 4 is truncated"):
        list(iter_records(path))
    with pytest.raises(CorruptRecord, match="truncated"):
        count_records(path)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01  # a bit flipped in some record's data
    Path(path).write_bytes(bytes(flipped))
    with pytest.raises(CorruptRecord, match="bad data checksum"):
        list(iter_records(path))
    Path(path).write_bytes(b"this is not a tfrecord file at all")
    with pytest.raises(CorruptRecord, match="length checksum"):
        list(iter_records(path))


# -- tfds:PATH -------------------------------------------------------------------------------------
def _pets_like(folder: Path) -> Path:
    names = ["abyssinian", "beagle", "chihuahua"]
    splits = {
        "train": [{"image": png(i), "label": (i * 2) % 3, "file_name": f"{i}.png".encode()} for i in range(23)],
        "test": [{"image": png(100 + i), "label": i % 3} for i in range(7)],
    }
    return write_tfds_build(
        folder / "oxford_iiit_pet" / "4.0.0", "oxford_iiit_pet", splits, shards=3, class_names={"label": names}
    )


def test_a_tfds_build_prepares_with_its_splits_order_and_class_names(tmp_path):
    build = _pets_like(tmp_path / "tfds")
    source = open_source(f"tfds:{build}")
    assert isinstance(source, TfdsSource) and source.name == "oxford_iiit_pet"
    assert source.split_sizes() == {"train": 23, "test": 7}
    assert source.classes == ["abyssinian", "beagle", "chihuahua"]
    info = prepare_dataset(source, str(tmp_path / "out"), samples_per_shard=5)
    assert {s: v.num_samples for s, v in info.splits.items()} == {"train": 23, "test": 7}
    _, labels = read_labels(str(tmp_path / "out"), "train")
    assert labels.tolist() == [(i * 2) % 3 for i in range(23)]  # TFDS order, across its 3 shard files
    _, labels = read_labels(str(tmp_path / "out"), "test[2:5]")
    assert labels.tolist() == [2, 0, 1]


def test_tfds_sources_refuse_what_they_cannot_read(tmp_path):
    build = _pets_like(tmp_path / "tfds")
    with pytest.raises(FileNotFoundError, match="dataset_info.json"):
        open_source(f"tfds:{build.parent}")
    with pytest.raises(ValueError, match="no feature 'species'"):
        open_source(f"tfds:{build}?label=species")
    with pytest.raises(ValueError, match="allowed: image=KEY, label=KEY"):
        open_source(f"tfds:{build}?lable=label")
    info = json.loads((build / "dataset_info.json").read_text())
    (build / "dataset_info.json").write_text(json.dumps({**info, "fileFormat": "array_record"}))
    with pytest.raises(ValueError, match="only 'tfrecord' builds"):
        open_source(f"tfds:{build}")
    (build / "dataset_info.json").write_text(json.dumps(info))
    (build / "oxford_iiit_pet-train.tfrecord-00001-of-00003").unlink()
    with pytest.raises(FileNotFoundError, match="lacks shard files"):
        open_source(f"tfds:{build}")


# -- vtab:TASK:PATH --------------------------------------------------------------------------------
def _train_label(i: int) -> int:
    return i % 47


def _val_label(i: int) -> int:
    return (7 * i + 3) % 47


def _dtd_like(folder: Path, train: int = 830, validation: int = 260, test: int = 94) -> Path:
    splits = {
        "train": [{"image": png(i), "label": _train_label(i)} for i in range(train)],
        "validation": [{"image": png(5000 + i), "label": _val_label(i)} for i in range(validation)],
        "test": [{"image": png(9000 + i), "label": i % 47} for i in range(test)],
    }
    return write_tfds_build(
        folder / "dtd" / "3.0.1", "dtd", splits, shards=3, class_names={"label": [f"texture{i}" for i in range(47)]}
    )


def test_vtab_train800val200_is_train800_then_val200_and_test_is_whole(tmp_path):
    build = _dtd_like(tmp_path / "tfds")
    source = open_source(f"vtab:dtd:{build}")
    assert isinstance(source, VtabSource) and source.name == "vtab_dtd"
    assert source.split_sizes() == {"train": 1000, "test": 94}
    dest = str(tmp_path / "prepared" / "vtab_dtd")
    info = prepare_dataset(source, dest, samples_per_shard=128)
    assert info.num_classes == 47 and info.classes[5] == "texture5"
    _, labels = read_labels(dest, "train")
    expected = [_train_label(i) for i in range(800)] + [_val_label(i) for i in range(200)]
    assert labels.tolist() == expected  # dtd: train[:800] + validation[:200], in that order
    assert read_labels(dest, "train[:800]")[1].tolist() == expected[:800]
    assert read_labels(dest, "train[800:1000]")[1].tolist() == expected[800:]
    assert read_labels(dest, "test")[1].tolist() == [i % 47 for i in range(94)]
    get_benchmark("vtab/dtd")  # the prepared folder is what the benchmark reads
    assert prepare_command("vtab/dtd", str(tmp_path / "prepared")).startswith("vitray data prepare vtab:dtd:")


@pytest.mark.parametrize(
    "task, tfds_name, sizes, val200, test",
    [
        # cifar100: VTAB's train is the first 90% of TFDS train; val200 follows it.
        ("cifar100", "cifar100", {"train": 2000, "test": 30}, ("train", 1800), ("test", 0, 30)),
        # pets: 80%.
        ("pets", "oxford_iiit_pet", {"train": 1500, "test": 20}, ("train", 1200), ("test", 0, 20)),
        # eurosat: 60/20/20 of TFDS train; test = train[80%:].
        ("eurosat", "eurosat", {"train": 1500}, ("train", 900), ("train", 1200, 1500)),
        # dsprites: 80/10/10 of TFDS train.
        ("dsprites_loc", "dsprites", {"train": 2000}, ("train", 1600), ("train", 1800, 2000)),
        # smallnorb: val200 = test[:200], test = test[50%:].
        ("smallnorb_azimuth", "smallnorb", {"train": 900, "test": 450}, ("test", 0), ("test", 225, 450)),
        # clevr: 90% of train; VTAB tests on TFDS's validation split.
        ("clevr_count", "clevr", {"train": 1200, "validation": 40}, ("train", 1080), ("validation", 0, 40)),
    ],
)
def test_vtab_split_rules_follow_task_adaptation(task, tfds_name, sizes, val200, test):
    train800, got_val, got_test = VTAB_TASKS[task].splits(sizes)
    assert VTAB_TASKS[task].tfds_name == tfds_name
    assert train800 == ("train", 0, 800)
    assert got_val == (val200[0], val200[1], val200[1] + 200)
    assert got_test == test


def test_vtab_derived_labels():
    where = "example"
    clevr = {"objects/size": [0, 1, 1, 0, 1], "objects/pixel_coords": [1.0, 2.0, 9.2, 3.0, 4.0, 12.0, 0, 0, 8.7]}
    assert VTAB_TASKS["clevr_count"].label(clevr, where) == 2  # 5 objects - 3
    assert VTAB_TASKS["clevr_dist"].label(clevr, where) == 2  # closest depth 8.7 is in (8.5, 9.0]
    kitti = {"objects/type": [3, 0, 1], "objects/location": [0, 0, 4.0, 1, 1, 15.0, 2, 2, 25.0]}
    assert VTAB_TASKS["kitti_dist"].label(kitti, where) == 1  # a pedestrian at 4 m is no vehicle: 15 m
    assert VTAB_TASKS["kitti_dist"].label({"objects/type": [4], "objects/location": [0, 0, 3.0]}, where) == 3
    assert VTAB_TASKS["dsprites_loc"].label({"label_x_position": [31]}, where) == 15
    assert VTAB_TASKS["dsprites_ori"].label({"label_orientation": [39]}, where) == 15
    assert VTAB_TASKS["dsprites_ori"].label({"label_orientation": [5]}, where) == 2
    assert VTAB_TASKS["smallnorb_elevation"].label({"label_elevation": [8]}, where) == 8
    with pytest.raises(CorruptRecord, match="objects/size"):
        VTAB_TASKS["clevr_count"].label({"label": [1]}, where)


def test_vtab_dsprites_images_are_rescaled_to_0_255(tmp_path):
    binary = np.zeros((8, 8), dtype=np.uint8)
    binary[2:5, 3:6] = 1
    buffer = io.BytesIO()
    Image.fromarray(binary).save(buffer, format="PNG")
    examples = [
        {"image": buffer.getvalue(), "label_x_position": i % 32, "label_orientation": i % 40} for i in range(1100)
    ]
    build = write_tfds_build(
        tmp_path / "dsprites" / "2.0.0",
        "dsprites",
        {"train": examples},
        num_classes={"label_x_position": 32, "label_orientation": 40},
    )
    source = open_source(f"vtab:dsprites_loc:{build}")
    assert source.split_sizes() == {"train": 1000, "test": 110}  # 1100 - 80% - 10%
    sample = next(iter(source.chunk("train", [0])))
    pixels = np.asarray(Image.open(io.BytesIO(sample.image)))
    assert set(np.unique(pixels)) == {0, 255} and sample.label == 0
    last = list(source.chunk("train", list(range(998, 1000))))  # val200 = train[880:1080]
    assert [s.label for s in last] == [(1078 % 32) // 2, (1079 % 32) // 2]


def test_vtab_sources_refuse_wrong_builds_and_too_small_splits(tmp_path):
    pets = _pets_like(tmp_path / "tfds")
    with pytest.raises(ValueError, match="reads the TFDS dataset 'dtd'"):
        open_source(f"vtab:dtd:{pets}")
    with pytest.raises(ValueError, match="TASK one of"):
        open_source(f"vtab:imagenet:{pets}")
    small = _dtd_like(tmp_path / "small", train=500)
    with pytest.raises(ValueError, match=r"examples \[0:800\] of TFDS split 'train', which has 500"):
        open_source(f"vtab:dtd:{small}")


# -- end to end: prepare a VTAB-shaped task with the CLI, run the grid on it -------------------------
@pytest.mark.slow
def test_grid_runs_on_a_prepared_vtab_task(pretrained, tmp_path):
    build = _dtd_like(tmp_path / "tfds")
    data_root = tmp_path / "prepared"
    cli = [sys.executable, "-m", "vitray.cli"]
    prepared = subprocess.run(
        [*cli, "data", "prepare", f"vtab:dtd:{build}", str(data_root / "vtab_dtd"), "--serial"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    said = prepared.stdout + prepared.stderr  # the CLI's console writes to stderr
    assert "train: 1,000 samples" in said and "test: 94 samples" in said
    grid = {
        "data_root": str(data_root),
        "output": str(tmp_path / "eval"),
        "benchmarks": ["vtab/dtd"],
        "fewshot": {"shots": [1, 5], "seeds": 1},
        "finetune": {"steps": 4, "batch_size": 16, "warmup_steps": 1, "resolution": 16, "checkpoint_every": 4},
    }
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))
    run = subprocess.run(
        [*cli, "evaluate", pretrained, "-c", str(tmp_path / "grid.yaml")], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    from vitray.evaluation.results import ResultsTable

    rows = ResultsTable(str(tmp_path / "eval" / "results")).to_pandas()
    assert set(rows["benchmark"]) == {"vtab/dtd"}
    assert (rows["status"] == "ok").all(), rows[["method", "status", "error"]].to_string()
    assert set(rows["method"]) == {"fewshot", "finetune"}
    # VTAB's single lr: no selection, one final run trained on all 1000 examples.
    finetune = rows[(rows["method"] == "finetune") & (rows["metric"] == "accuracy")]
    assert len(finetune) == 1 and 0.0 <= float(finetune["value"].iloc[0]) <= 1.0
    assert json.loads(finetune["settings"].iloc[0])["train_split"] == "train[:1000]"
    fewshot = rows[(rows["method"] == "fewshot") & (rows["metric"] == "accuracy")]
    assert len(fewshot) == 2 and fewshot["value"].between(0.0, 1.0).all()


def test_chunks_pickle_for_the_ray_tasks_that_write_shards(tmp_path):
    import pickle

    build = _dtd_like(tmp_path / "tfds")
    for spec, split, indices in (
        (f"vtab:dtd:{build}", "train", range(795, 805)),
        (f"tfds:{build}", "validation", range(3)),
    ):
        chunk = open_source(spec).chunk(split, list(indices))
        assert [(s.image, s.label) for s in pickle.loads(pickle.dumps(chunk))] == [(s.image, s.label) for s in chunk]
    assert [s.label for s in open_source(f"vtab:dtd:{build}").chunk("train", list(range(798, 802)))] == [
        _train_label(798),
        _train_label(799),
        _val_label(0),
        _val_label(1),
    ]  # train800 ends, val200 begins


def test_tfds_multi_label_sequences_and_split_renames(tmp_path):
    # ImageNet-ReaL's shape: only a validation split, `real_label` a Sequence of ClassLabel (may be empty).
    real = [[1], [0, 2], [], [3]]
    examples = [{"image": png(i), "original_label": i % 4, "real_label": labels} for i, labels in enumerate(real)]
    build = write_tfds_build(
        tmp_path / "imagenet2012_real" / "1.0.0",
        "imagenet2012_real",
        {"validation": examples},
        shards=1,
        num_classes={"original_label": 4},
    )
    spec = json.loads((build / "features.json").read_text())
    spec["featuresDict"]["features"]["real_label"] = {
        "pythonClassName": "tensorflow_datasets.core.features.sequence_feature.Sequence",
        "sequence": {
            "feature": {
                "pythonClassName": "tensorflow_datasets.core.features.class_label_feature.ClassLabel",
                "classLabel": {"numClasses": "4"},
            },
            "length": "-1",
        },
    }
    (build / "features.json").write_text(json.dumps(spec))
    source = open_source(f"tfds:{build}?label=real_label&split=validation:val")
    assert source.label_kind == "multi" and source.classes == ["0", "1", "2", "3"]
    assert source.split_sizes() == {"val": 4}
    assert [s.label for s in source.chunk("val", range(4))] == [(1,), (0, 2), (), (3,)]
    info = prepare_dataset(source, str(tmp_path / "out"))
    assert info.label_kind == "multi" and info.splits["val"].num_samples == 4
    single = open_source(f"tfds:{build}?label=original_label")
    assert single.label_kind == "single" and single.split_sizes() == {"validation": 4}
    with pytest.raises(ValueError, match=r"TFDS_NAME one of \['validation'\]"):
        open_source(f"tfds:{build}?label=real_label&split=valid:val")


def test_vtab_checks_the_builder_config_where_vtab_names_one(tmp_path):
    examples = {
        split: [{"image": png(i), "label": i % 5} for i in range(n)]
        for split, n in (("train", 810), ("validation", 205), ("test", 7))
    }
    original = write_tfds_build(
        tmp_path / "diabetic_retinopathy_detection" / "original" / "3.0.0",
        "diabetic_retinopathy_detection",
        examples,
        num_classes={"label": 5},
        config="original",
    )
    with pytest.raises(ValueError, match="btgraham-300 config"):
        open_source(f"vtab:retinopathy:{original}")
    graham = write_tfds_build(
        tmp_path / "diabetic_retinopathy_detection" / "btgraham-300" / "3.0.0",
        "diabetic_retinopathy_detection",
        examples,
        num_classes={"label": 5},
        config="btgraham-300",
    )
    assert open_source(f"vtab:retinopathy:{graham}").split_sizes() == {"train": 1000, "test": 7}
