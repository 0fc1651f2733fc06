"""Preparing shards from every source format: content, determinism, standard readers, commits."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image
from test_cli_prepare_refusals import stopped_after

from vitray.data import ShardLoader, open_source, plan_shards, prepare_dataset, read_dataset_info, read_manifest


def png_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def random_image(rng: np.random.Generator, size: int = 12) -> np.ndarray:
    return rng.integers(0, 256, (size, size + 3, 3), dtype=np.uint8)


def shard_samples(dest: Path, split: str) -> dict[str, dict[str, bytes]]:
    """Every sample of a split, read with the standard library's tarfile: key -> {ext: bytes}."""
    samples: dict[str, dict[str, bytes]] = {}
    for row in read_manifest(str(dest), split):
        with tarfile.open(dest / row.name) as tar:
            for member in tar.getmembers():
                key, ext = member.name.split(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return samples


def all_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ---------------------------------------------------------------- source formats, in real layouts


def make_image_folder(root: Path, rng: np.random.Generator, splits=("train", "val"), per_class: int = 4):
    """PATH/SPLIT/CLASS/*.png|jpg with PNG and JPEG mixed, a nested folder and a non-image file.

    Returns {split: [(bytes, class name)]}."""
    made: dict[str, list[tuple[bytes, str]]] = {}
    for split in splits:
        made[split] = []
        for name in ("zebra", "ant", "cat"):
            folder = root / split / name
            (folder / "nested").mkdir(parents=True)
            (folder / "notes.txt").write_text("not an image")
            for i in range(per_class):
                data = jpeg_bytes(random_image(rng)) if i % 2 else png_bytes(random_image(rng))
                path = folder / ("nested" if i == 0 else "") / f"img{i}.{'jpeg' if i % 2 else 'png'}"
                path.write_bytes(data)
                made[split].append((data, name))
    return made


def write_cifar10(folder: Path, rng: np.random.Generator, rows_per_batch: int = 3):
    """The python-version CIFAR-10 layout; returns {split: (data rows, labels)}."""
    folder.mkdir(parents=True)
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": names, b"num_cases_per_batch": rows_per_batch, b"num_vis": 3072}, f, protocol=2)
    made = {"train": ([], []), "test": ([], [])}
    for split, files in {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}.items():
        for file in files:
            data = rng.integers(0, 256, (rows_per_batch, 3072), dtype=np.uint8)
            labels = rng.integers(0, 10, rows_per_batch).tolist()
            batch = {
                b"batch_label": file.encode(),
                b"labels": labels,
                b"data": data,
                b"filenames": [f"{file}_{i}.png".encode() for i in range(rows_per_batch)],
            }
            with open(folder / file, "wb") as f:
                pickle.dump(batch, f, protocol=2)
            made[split][0].extend(data)
            made[split][1].extend(labels)
    return made


def write_cifar100(folder: Path, rng: np.random.Generator, rows: int = 5):
    folder.mkdir(parents=True)
    fine = [f"class{i:02d}".encode() for i in range(100)]
    with open(folder / "meta", "wb") as f:
        pickle.dump({b"fine_label_names": fine, b"coarse_label_names": [b"c"] * 20}, f, protocol=2)
    made = {}
    for split in ("train", "test"):
        data = rng.integers(0, 256, (rows, 3072), dtype=np.uint8)
        labels = rng.integers(0, 100, rows).tolist()
        with open(folder / split, "wb") as f:
            pickle.dump(
                {
                    b"data": data,
                    b"fine_labels": labels,
                    b"coarse_labels": [0] * rows,
                    b"filenames": [b"x.png"] * rows,
                    b"batch_label": split.encode(),
                },
                f,
                protocol=2,
            )
        made[split] = (data, labels)
    return made


def hf_metadata(label_feature: dict) -> dict[bytes, bytes]:
    features = {"image": {"_type": "Image"}, "label": label_feature}
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


def write_parquet(folder: Path, rng: np.random.Generator, *, multi: bool = False, names: bool = True):
    """Hugging Face layout: train in two files (two row groups each), test in one."""
    folder.mkdir(parents=True)
    classes = ["cat", "dog", "fish", "bird"]
    if multi:
        feature = {"_type": "Sequence", "feature": {"_type": "ClassLabel", "names": classes}}
        label_type = pa.list_(pa.int64())
    else:
        feature = {"_type": "ClassLabel", "names": classes}
        label_type = pa.int64()
    schema = pa.schema(
        [("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("label", label_type)],
        metadata=hf_metadata(feature) if names else None,
    )
    made: dict[str, list] = {"train": [], "test": []}
    for file, split, rows in (
        ("train-00000-of-00002", "train", 5),
        ("train-00001-of-00002", "train", 4),
        ("test-00000-of-00001", "test", 3),
    ):
        records = []
        for i in range(rows):
            data = jpeg_bytes(random_image(rng)) if i % 2 else png_bytes(random_image(rng))
            label = sorted(rng.choice(3, size=1 + i % 2, replace=False).tolist()) if multi else int(rng.integers(0, 3))
            records.append({"image": {"bytes": data, "path": f"{file}_{i}.jpg"}, "label": label})
            made[split].append((data, label))
        pq.write_table(pa.Table.from_pylist(records, schema=schema), folder / f"{file}.parquet", row_group_size=3)
    return made, classes


# ---------------------------------------------------------------- tests


def test_image_folder_keeps_original_bytes_labels_and_sorted_classes(tmp_path):
    made = make_image_folder(tmp_path / "src", np.random.default_rng(0))
    info = prepare_dataset(f"imagefolder:{tmp_path / 'src'}", str(tmp_path / "out"), samples_per_shard=5)
    assert info.classes == ["ant", "cat", "zebra"]
    assert info.label_kind == "single"
    assert {s: (v.num_samples, v.num_shards) for s, v in info.splits.items()} == {"train": (12, 3), "val": (12, 3)}
    for split, expected in made.items():
        samples = shard_samples(tmp_path / "out", split)
        assert all("." not in key and key.startswith(f"{split}_") for key in samples)
        stored = sorted(
            (next(v[e] for e in ("png", "jpg") if e in v), info.classes[int(v["cls"])]) for v in samples.values()
        )
        assert stored == sorted(expected)  # every image once, bytes untouched, with its class
        for fields in samples.values():
            image_ext = "png" if "png" in fields else "jpg"
            assert fields[image_ext].startswith(b"\x89PNG" if image_ext == "png" else b"\xff\xd8")


def test_image_folder_without_split_folders_is_one_train_split(tmp_path):
    rng = np.random.default_rng(1)
    for name in ("b", "a"):
        (tmp_path / "src" / name).mkdir(parents=True)
        for i in range(3):
            (tmp_path / "src" / name / f"{i}.png").write_bytes(png_bytes(random_image(rng)))
    info = prepare_dataset(f"imagefolder:{tmp_path / 'src'}", str(tmp_path / "out"))
    assert list(info.splits) == ["train"] and info.splits["train"].num_samples == 6
    assert info.classes == ["a", "b"]


def test_image_folder_layouts_that_were_misread(tmp_path):
    """A class called "train" (CIFAR-100, VOC) took the folder for the split layout and dropped every
    other class; a symlink back up the tree counted its images many times over; a class folder with no
    image (an archive's __MACOSX) made a class no example has; images beside the class folders, and a
    `validation/` split folder, went unmentioned."""
    rng = np.random.default_rng(2)

    def folder(name: str, classes: tuple[str, ...]) -> Path:
        for cls in classes:
            (tmp_path / name / cls).mkdir(parents=True)
            for i in range(2):
                (tmp_path / name / cls / f"{i}.png").write_bytes(png_bytes(random_image(rng)))
        return tmp_path / name

    vehicles = folder("vehicles", ("bicycle", "bus", "car", "train"))
    (vehicles / "stray.png").write_bytes(png_bytes(random_image(rng)))
    (vehicles / "bus" / "again").symlink_to(vehicles / "bus" / "..", target_is_directory=True)
    with pytest.raises(ValueError, match=r"bus/again links to .*vehicles, which holds it: a loop"):
        open_source(f"imagefolder:{vehicles}")
    (vehicles / "bus" / "again").unlink()
    (vehicles / "bus" / "same").symlink_to(vehicles / "car", target_is_directory=True)  # no loop: read as its own
    source = open_source(f"imagefolder:{vehicles}")
    assert source.classes == ["bicycle", "bus", "car", "train"] and source.split_sizes() == {"train": 10}
    assert source.left_out == [str(vehicles / "stray.png")]
    splits = folder("splits", ("train/a", "train/b", "validation/a", "validation/b"))
    assert open_source(f"imagefolder:{splits}").split_sizes() == {"train": 4, "validation": 4}
    (vehicles / "__MACOSX").mkdir()
    (vehicles / "__MACOSX" / "._0.png").write_bytes(b"resource fork")
    with pytest.raises(ValueError, match=r"class folder\(s\) \['__MACOSX'\] hold no PNG/JPEG images"):
        open_source(f"imagefolder:{vehicles}")


def test_cifar10_pickles_become_lossless_pngs(tmp_path):
    made = write_cifar10(tmp_path / "cifar-10-batches-py", np.random.default_rng(2))
    info = prepare_dataset(f"cifar10:{tmp_path}", str(tmp_path / "out"), samples_per_shard=4)  # the parent folder
    assert info.classes[:3] == ["airplane", "automobile", "bird"] and info.num_classes == 10
    assert info.splits["train"].num_samples == 15 and info.splits["test"].num_samples == 3
    for split, (rows, labels) in made.items():
        expected = sorted((bytes(r), label) for r, label in zip(rows, labels))
        stored = []
        for fields in shard_samples(tmp_path / "out", split).values():
            pixels = np.asarray(Image.open(io.BytesIO(fields["png"])))  # (32, 32, 3)
            stored.append((pixels.transpose(2, 0, 1).tobytes(), int(fields["cls"])))
        assert sorted(stored) == expected


def test_cifar100_uses_fine_labels(tmp_path):
    made = write_cifar100(tmp_path / "c100", np.random.default_rng(3))
    info = prepare_dataset(f"cifar100:{tmp_path / 'c100'}", str(tmp_path / "out"))
    assert info.num_classes == 100 and info.classes[7] == "class07"
    labels = sorted(int(f["cls"]) for f in shard_samples(tmp_path / "out", "test").values())
    assert labels == sorted(made["test"][1])


def test_parquet_single_label_with_class_names(tmp_path):
    made, classes = write_parquet(tmp_path / "pq", np.random.default_rng(4))
    info = prepare_dataset(f"parquet:{tmp_path / 'pq'}", str(tmp_path / "out"), samples_per_shard=4)
    assert info.classes == classes and info.label_kind == "single"
    assert info.splits["train"].num_samples == 9 and info.splits["train"].num_shards == 3
    # Sequential source: the table order is kept, so keys follow the rows.
    samples = shard_samples(tmp_path / "out", "train")
    stored = [(next(v[e] for e in ("png", "jpg") if e in v), int(v["cls"])) for _, v in sorted(samples.items())]
    assert stored == made["train"]


def test_parquet_in_hugging_faces_converted_layout_keeps_its_splits(tmp_path):
    """`CONFIG/SPLIT/0000.parquet` (the Hub's parquet conversion): the split is the folder's name. The
    file name alone made one split "0000" of train and test together. Several configs are refused."""
    write_parquet(tmp_path / "flat", np.random.default_rng(6))
    for file, split in (("train-00000-of-00002", "train"), ("test-00000-of-00001", "test")):
        (tmp_path / "hub" / "default" / split).mkdir(parents=True)
        shutil.copy(tmp_path / "flat" / f"{file}.parquet", tmp_path / "hub" / "default" / split / "0000.parquet")
    assert open_source(f"parquet:{tmp_path / 'hub' / 'default'}").split_sizes() == {"train": 5, "test": 3}
    shutil.copytree(tmp_path / "hub" / "default", tmp_path / "hub" / "other")
    with pytest.raises(ValueError, match=r"split 'test' lie in several folders \(default/test, other/test\)"):
        open_source(f"parquet:{tmp_path / 'hub'}")


def test_an_image_only_table_is_unlabelled_data(tmp_path):
    """A table of images and no label column: `parquet:` names the way (`unlabelled:`), which reads it
    (it opened the wrapped source whole, label column required, and refused it)."""
    folder = tmp_path / "photos"
    folder.mkdir()
    rng = np.random.default_rng(7)
    images = [png_bytes(random_image(rng)) for _ in range(5)]
    pq.write_table(
        pa.table({"image": [{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(images)]}), folder / "train.parquet"
    )
    with pytest.raises(ValueError, match=rf"found \['image'\] \(a table without labels: unlabelled:parquet:{folder}\)"):
        open_source(f"parquet:{folder}")
    info = prepare_dataset(f"unlabelled:parquet:{folder}", str(tmp_path / "out"))
    assert info.label_kind == "none" and info.num_classes == 0 and info.splits["train"].num_samples == 5
    samples = shard_samples(tmp_path / "out", "train")
    assert [v["png"] for _, v in sorted(samples.items())] == images and all(set(v) == {"png"} for v in samples.values())


def test_parquet_multi_label_writes_json_labels(tmp_path):
    made, classes = write_parquet(tmp_path / "pq", np.random.default_rng(5), multi=True)
    info = prepare_dataset(f"parquet:{tmp_path / 'pq'}", str(tmp_path / "out"))
    assert info.label_kind == "multi" and info.classes == classes
    samples = shard_samples(tmp_path / "out", "test")
    stored = [json.loads(v["json"])["labels"] for _, v in sorted(samples.items())]
    assert stored == [label for _, label in made["test"]]
    assert read_dataset_info(str(tmp_path / "out")).label_kind == "multi"


def test_parquet_without_class_names_numbers_the_classes(tmp_path):
    write_parquet(tmp_path / "pq", np.random.default_rng(6), names=False)
    info = prepare_dataset(f"parquet:{tmp_path / 'pq' / 'test-00000-of-00001.parquet'}", str(tmp_path / "out"))
    assert list(info.splits) == ["test"]
    largest = max(int(v["cls"]) for v in shard_samples(tmp_path / "out", "test").values())
    assert info.classes == [str(i) for i in range(largest + 1)]


def test_builtin_digits(digits_dataset):
    from sklearn.datasets import load_digits

    info = read_dataset_info(str(digits_dataset))
    assert (info.splits["train"].num_samples, info.splits["test"].num_samples) == (1437, 360)
    digits = load_digits()
    stored = []
    for split in ("train", "test"):
        for fields in shard_samples(digits_dataset, split).values():
            image = np.asarray(Image.open(io.BytesIO(fields["png"])))
            assert image.shape == (8, 8)
            stored.append((image.tobytes(), int(fields["cls"])))
    scaled = np.round(digits.images * (255 / 16)).astype(np.uint8)
    assert sorted(stored) == sorted((im.tobytes(), int(t)) for im, t in zip(scaled, digits.target))


def test_same_source_gives_byte_identical_output(tmp_path):
    make_image_folder(tmp_path / "src", np.random.default_rng(7))
    for dest in ("a", "b"):
        prepare_dataset(f"imagefolder:{tmp_path / 'src'}", str(tmp_path / dest), samples_per_shard=5)
    assert all_files(tmp_path / "a") == all_files(tmp_path / "b")


def test_standard_readers_read_the_shards(digits_dataset):
    manifest = read_manifest(str(digits_dataset), "test")
    urls = [str(digits_dataset / row.name) for row in manifest]
    seen = {}
    for sample in wds.WebDataset(urls, shardshuffle=False).decode("pil"):
        assert sample["png"].size == (8, 8)
        seen[sample["__key__"]] = sample["cls"]
    assert len(seen) == 360 and set(seen.values()) == set(range(10))
    if shutil.which("tar"):
        listing = subprocess.run(["tar", "tf", urls[0]], check=True, capture_output=True, text=True).stdout.split()
        assert listing[:2] == ["test_00000000.png", "test_00000000.cls"]
        assert len(listing) == 2 * manifest[0].num_samples


def test_manifest_rows_describe_the_shards(digits_dataset):
    for split in ("train", "test"):
        rows = read_manifest(str(digits_dataset), split)
        assert [r.name for r in rows] == [f"{split}-{i:06d}.tar" for i in range(len(rows))]
        for row in rows:
            data = (digits_dataset / row.name).read_bytes()
            assert (row.bytes, row.sha256) == (len(data), hashlib.sha256(data).hexdigest())
            with tarfile.open(digits_dataset / row.name) as tar:
                assert len(tar.getnames()) == 2 * row.num_samples
            with tarfile.open(digits_dataset / row.name) as tar:
                member = tar.getmembers()[0]
                assert (member.mtime, member.uid, member.gid, member.uname, member.mode) == (0, 0, 0, "", 0o444)


def test_shards_are_capped_by_bytes(tmp_path):
    make_image_folder(tmp_path / "src", np.random.default_rng(8), splits=("train",), per_class=6)
    cap = 4000
    info = prepare_dataset(f"imagefolder:{tmp_path / 'src'}", str(tmp_path / "out"), max_shard_bytes=cap)
    rows = read_manifest(str(tmp_path / "out"), "train")
    assert info.splits["train"].num_shards == len(rows) > 3
    # Every shard stays under the cap plus tar's end-of-archive padding, or holds a single sample.
    assert all(r.bytes <= cap + 10240 or r.num_samples == 1 for r in rows)
    assert sum(r.num_samples for r in rows) == 18


def test_interrupted_prepare_is_not_taken_as_finished_and_a_rerun_completes(tmp_path):
    src = f"imagefolder:{tmp_path / 'src'}"
    make_image_folder(tmp_path / "src", np.random.default_rng(9))
    dest = tmp_path / "out"

    with pytest.raises(KeyboardInterrupt, match="simulated crash"):
        prepare_dataset(src, str(dest), samples_per_shard=5, map_fn=stopped_after(2))
    # No temp files; the marker says that these shards are vitray's (their records, that they are whole).
    assert sorted(p.name for p in dest.iterdir()) == [
        ".train-000000.tar.done",
        ".train-000001.tar.done",
        ".vitray-preparing",
        "train-000000.tar",
        "train-000001.tar",
    ]
    (dest / ".train-000002.tar.abc.tmp").write_bytes(b"half a shard")  # as a killed process leaves it
    with pytest.raises(FileNotFoundError, match="a preparation began there and has not finished"):
        read_dataset_info(str(dest))
    with pytest.raises(FileNotFoundError, match="a preparation began there and has not finished"):
        ShardLoader(str(dest), "train", rank=0, world_size=1, batch_size=8, img_size=8, train=True, seed=0)

    prepare_dataset(src, str(dest), samples_per_shard=5)
    prepare_dataset(src, str(tmp_path / "clean"), samples_per_shard=5)
    assert all_files(dest) == all_files(tmp_path / "clean")


def test_prepared_dest_is_kept_unless_overwrite(tmp_path, capsys):
    src = f"imagefolder:{tmp_path / 'src'}"
    make_image_folder(tmp_path / "src", np.random.default_rng(10))
    dest = tmp_path / "out"
    prepare_dataset(src, str(dest), samples_per_shard=5)
    before = all_files(dest)
    info = prepare_dataset(src, str(dest), samples_per_shard=2)
    assert "already prepared" in capsys.readouterr().out
    assert info.splits["train"].num_shards == 3 and all_files(dest) == before
    (dest / "train-1000000.tar").write_bytes(b"a shard of a larger preparation: names grow past six digits")
    info = prepare_dataset(src, str(dest), samples_per_shard=12, overwrite=True)
    assert info.splits["train"].num_shards == 1
    assert sorted(p.name for p in dest.iterdir()) == [
        "dataset.json",
        "train-000000.tar",
        "train.manifest.parquet",
        "val-000000.tar",
        "val.manifest.parquet",
    ]


def test_shard_tasks_pickle(tmp_path):
    make_image_folder(tmp_path / "src", np.random.default_rng(11))
    tasks = plan_shards(open_source(f"imagefolder:{tmp_path / 'src'}"), samples_per_shard=5)
    clone = pickle.loads(pickle.dumps(tasks))
    assert [t.name for t in clone] == [t.name for t in tasks]
    assert [s.image for s in clone[0].chunk] == [s.image for s in tasks[0].chunk]


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("nonsense", ValueError, "source 'nonsense' is not KIND:PATH; KIND is one of \\['builtin', "),
        ("webp:/x", ValueError, "source 'webp:/x' is not KIND:PATH"),
        ("builtin:mnist", ValueError, "no built-in dataset 'mnist'; built-in datasets: \\['digits'\\]"),
        ("imagefolder:/does/not/exist", FileNotFoundError, "imagefolder source /does/not/exist is not a folder"),
        (
            "cifar10:/does/not/exist",
            FileNotFoundError,
            "cifar10 source /does/not/exist does not exist: give the cifar10 archive as downloaded "
            "\\(its binary version, e.g. cifar10:/path/to/cifar-10-binary.tar.gz\\)",
        ),
        ("parquet:/does/not/exist", FileNotFoundError, "parquet source /does/not/exist: no .parquet files"),
    ],
)
def test_bad_sources_are_named(spec, error, message):
    with pytest.raises(error, match=message) as raised:
        open_source(spec)
    assert type(raised.value) is error


def test_images_of_other_formats_are_bad_images_named_where_they_are(tmp_path):
    """Shards hold PNG/JPEG only (the original bytes): a GIF file, or WEBP/GIF/BMP bytes under a .jpg
    name (as web scrapes hold) in a folder, a webdataset shard or a table, is one more bad image,
    named by its file, member or row: refused with the others (an image folder's before anything is
    written), or left out with --skip-bad; it once refused the whole source, one file at a time."""
    from vitray.data import BadImagesError

    rng = np.random.default_rng(0)
    others = {}
    for fmt in ("WEBP", "GIF", "BMP"):
        buffer = io.BytesIO()
        Image.fromarray(random_image(rng)).save(buffer, format=fmt)
        others[fmt] = buffer.getvalue()
    folder = tmp_path / "folder"
    make_image_folder(folder, rng, splits=("train",))
    (folder / "train" / "ant" / "web.jpg").write_bytes(others["WEBP"])  # known once read
    Image.fromarray(random_image(rng)).save(folder / "train" / "cat" / "anim.gif")  # known from its name ...
    (folder / "train" / "zebra" / "photo.webp").write_bytes(jpeg_bytes(random_image(rng)))  # ... and bytes: kept
    gif = f"{folder}/train/cat/anim.gif: not a PNG/JPEG image (.gif)"
    assert open_source(f"imagefolder:{folder}").known_bad == [gif]

    shards = tmp_path / "wds"
    shards.mkdir()
    with wds.TarWriter(str(shards / "train-0.tar")) as sink:
        for i, fmt in enumerate(["JPEG", *others]):
            image = others.get(fmt) or jpeg_bytes(random_image(rng))
            sink.write({"__key__": f"s{i}", "jpg": image, "cls": str(i % 2).encode()})
    table = tmp_path / "table"
    table.mkdir()
    images = [{"bytes": png_bytes(random_image(rng)), "path": "a.png"}, {"bytes": others["WEBP"], "path": "b.jpg"}]
    pq.write_table(pa.table({"image": pa.array(images), "label": [0, 1]}), table / "train.parquet")

    for source, expected in (
        (f"imagefolder:{folder}", [gif]),
        (
            f"webdataset:{shards}",
            [f"{shards}/train-0.tar:s{i}.jpg: not a PNG/JPEG image ({fmt})" for i, fmt in enumerate(others, 1)],
        ),
        (f"parquet:{table}", [f"{table}/train.parquet row 1: not a PNG/JPEG image (WEBP)"]),
    ):
        with pytest.raises(BadImagesError) as refused:
            prepare_dataset(source, str(tmp_path / "refused"))
        assert all(entry in refused.value.bad for entry in expected), refused.value.bad
        assert str(refused.value).endswith(
            "or pass --skip-bad to leave them out"
            if len(refused.value.bad) > 1
            else "or pass --skip-bad to leave it out"
        )
        dest = tmp_path / source.split(":")[0]
        prepare_dataset(source, str(dest), bad_images="skip")
        kept = shard_samples(dest, "train")
        assert all(fields.get("jpg", b"\xff\xd8")[:2] == b"\xff\xd8" for fields in kept.values())
        assert len(kept) == sum(row.num_samples for row in read_manifest(str(dest), "train"))


def test_unsupported_tables_are_rejected(tmp_path):
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(ValueError, match="has no PNG/JPEG images"):
        open_source(f"imagefolder:{tmp_path / 'empty'}")
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"img": [b"x"], "label": [1]}), tmp_path / "pq" / "train.parquet")
    with pytest.raises(ValueError, match="expected columns 'image'"):
        open_source(f"parquet:{tmp_path / 'pq'}")
    bad_label = tmp_path / "pq2"
    bad_label.mkdir()
    image = pa.array([{"bytes": png_bytes(np.zeros((2, 2, 3), np.uint8)), "path": "a.png"}])
    pq.write_table(pa.table({"image": image, "label": [7]}), bad_label / "train.parquet")
    # 8 numbered classes, but a table with class names that disagree is caught when it is opened:
    prepare_dataset(f"parquet:{bad_label}", str(tmp_path / "ok"))
    assert read_dataset_info(str(tmp_path / "ok")).num_classes == 8
    pq.write_table(
        pa.table({"image": image, "label": [7]}).replace_schema_metadata(
            hf_metadata({"_type": "ClassLabel", "names": ["a", "b"]})
        ),
        bad_label / "train.parquet",
    )
    with pytest.raises(ValueError, match=r"split 'train' has 1 of 1 rows with labels outside the classes 0..1"):
        prepare_dataset(f"parquet:{bad_label}", str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()  # before any shard
