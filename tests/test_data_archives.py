"""The original archives, read as distributed: Oxford-IIIT Pets (``images.tar.gz`` +
``annotations.tar.gz``), Oxford Flowers-102 (``102flowers.tgz`` + ``imagelabels.mat`` + ``setid.mat``)
and CIFAR's binary version (fixed-size records, the ``.tar.gz`` itself or extracted). Each test
writes small archives in those formats and checks labels, class names and splits."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import scipy.io
from PIL import Image

from vitray.data import prepare_dataset, read_labels
from vitray.data.shards import plan_shards
from vitray.data.sources import open_source


def _add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def _jpeg(value: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((6, 6, 3), value % 256, dtype=np.uint8)).save(buffer, format="JPEG")
    return buffer.getvalue()


# -- Oxford-IIIT Pets --------------------------------------------------------------------------------
BREEDS = ["Abyssinian", "american_bulldog", "Bengal"]


def _pets(folder: Path, drop: str | None = None) -> Path:
    folder.mkdir(parents=True)
    trainval = [(f"{BREEDS[i % 3]}_{i}", i % 3 + 1) for i in range(10)]
    test = [(f"{BREEDS[(i + 1) % 3]}_{100 + i}", (i + 1) % 3 + 1) for i in range(5)]
    header = "#Image CLASS-ID SPECIES BREED ID\n#ID: 1:37 Class ids\n"
    lines = {
        n: header + "".join(f"{name} {cid} {1 + cid % 2} {cid}\n" for name, cid in items)
        for n, items in (("trainval", trainval), ("test", test))
    }
    with tarfile.open(folder / "annotations.tar.gz", "w:gz") as archive:
        for name, text in lines.items():
            _add(archive, f"annotations/{name}.txt", text.encode())
        _add(archive, "annotations/list.txt", b"# not read\n")
    with tarfile.open(folder / "images.tar.gz", "w:gz") as archive:
        for i, (name, _) in enumerate(sorted(trainval + test)):  # archive order differs from the lists
            if name != drop:
                _add(archive, f"images/{name}.jpg", _jpeg(i))
    return folder


def test_pets_archives_give_trainval_and_test_with_breed_names(tmp_path):
    source = open_source(f"pets:{_pets(tmp_path / 'pets')}")
    assert source.name == "oxford_iiit_pet" and source.classes == BREEDS
    assert source.split_sizes() == {"train": 10, "test": 5}
    prepare_dataset(source, str(tmp_path / "out"), samples_per_shard=4)
    _keys, labels = read_labels(str(tmp_path / "out"), "train")
    assert sorted(labels.tolist()) == sorted(i % 3 for i in range(10))
    assert sorted(read_labels(str(tmp_path / "out"), "test")[1].tolist()) == sorted((i + 1) % 3 for i in range(5))
    # Each sample keeps the label of its own image (the shards are in a shuffled order).
    sample_labels = {s.image: s.label for s in source.chunk("train", range(10))}
    assert len(sample_labels) == 10 and set(sample_labels.values()) == {0, 1, 2}
    # And the shards hold the samples in that planned order, not the archive's (sorted by name here,
    # as the real one is by breed): a split's held-out tail would be a run of a few classes.
    chunk = source.chunk("train", [7, 2, 5, 0])
    assert [s.origin.rsplit(":", 1)[1] for s in chunk] == list(chunk.members)
    planned = [
        label
        for task in plan_shards(source, samples_per_shard=4)
        if task.split == "train"
        for label in task.chunk.members.values()
    ]
    assert read_labels(str(tmp_path / "out"), "train")[1].tolist() == planned


def test_pets_with_an_image_missing_from_the_archive_fails_clearly(tmp_path):
    source = open_source(f"pets:{_pets(tmp_path / 'pets', drop='Bengal_2')}")
    with pytest.raises(FileNotFoundError, match=r"lacks 1 of the images listed, e.g. \['images/Bengal_2.jpg'\]"):
        list(source.chunk("train", range(10)))
    with pytest.raises(FileNotFoundError, match=r"lacks \['images.tar.gz'"):
        open_source(f"pets:{tmp_path}")


# -- Oxford Flowers-102 -----------------------------------------------------------------------------
def _flowers(folder: Path) -> tuple[Path, np.ndarray]:
    folder.mkdir(parents=True)
    labels = np.array([(i * 5) % 4 + 1 for i in range(12)])  # 4 classes, 1-based
    scipy.io.savemat(folder / "imagelabels.mat", {"labels": labels[None, :]})
    scipy.io.savemat(
        folder / "setid.mat",
        {"trnid": np.array([[1, 5, 9, 2]]), "valid": np.array([[3, 7, 11]]), "tstid": np.array([[4, 6, 8, 10, 12]])},
    )
    with tarfile.open(folder / "102flowers.tgz", "w:gz") as archive:
        for i in range(1, 13):
            _add(archive, f"jpg/image_{i:05d}.jpg", _jpeg(i))
    return folder, labels


def test_flowers_archive_and_mat_files_give_the_three_splits(tmp_path):
    folder, labels = _flowers(tmp_path / "flowers")
    source = open_source(f"flowers102:{folder}")
    assert source.name == "oxford_flowers102" and source.classes == ["0", "1", "2", "3"]
    assert source.split_sizes() == {"train": 4, "validation": 3, "test": 5}
    by_image = {_jpeg(i): int(labels[i - 1]) - 1 for i in range(1, 13)}
    for split, ids in (("train", [1, 5, 9, 2]), ("validation", [3, 7, 11]), ("test", [4, 6, 8, 10, 12])):
        samples = list(source.chunk(split, range(len(ids))))
        assert sorted(s.label for s in samples) == sorted(int(labels[i - 1]) - 1 for i in ids)
        assert all(by_image[s.image] == s.label for s in samples) and all(s.ext == "jpg" for s in samples)
    info = prepare_dataset(source, str(tmp_path / "out"))
    assert {k: v.num_samples for k, v in info.splits.items()} == {"train": 4, "validation": 3, "test": 5}
    scipy.io.savemat(
        folder / "setid.mat", {"trnid": np.array([[1, 99]]), "valid": np.array([[2]]), "tstid": np.array([[3]])}
    )
    with pytest.raises(ValueError, match=r"trnid holds image numbers outside 1..12"):
        open_source(f"flowers102:{folder}")


# -- CIFAR binary version ---------------------------------------------------------------------------
def _records(labels: list[tuple[int, ...]]) -> bytes:
    out = bytearray()
    for i, label in enumerate(labels):
        pixels = np.random.default_rng(i).integers(0, 256, 3072, dtype=np.uint8)
        out += bytes(label) + pixels.tobytes()
    return bytes(out)


def _cifar10_bin(folder: Path) -> dict[str, bytes]:
    files = {f"data_batch_{b}.bin": _records([((b * 3 + i) % 10,) for i in range(4)]) for b in range(1, 6)}
    files["test_batch.bin"] = _records([(i % 10,) for i in range(3)])
    files["batches.meta.txt"] = (
        "\n".join(["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]) + "\n\n"
    ).encode()
    return files


def test_cifar10_binary_archive_and_folder_read_without_unpickling(tmp_path):
    files = _cifar10_bin(tmp_path)
    archive_path = tmp_path / "cifar-10-binary.tar.gz"
    with tarfile.open(archive_path, "w:gz") as archive:
        for name, data in files.items():
            _add(archive, f"cifar-10-batches-bin/{name}", data)
    extracted = tmp_path / "extracted" / "cifar-10-batches-bin"
    extracted.mkdir(parents=True)
    for name, data in files.items():
        (extracted / name).write_bytes(data)
    for spec in (f"cifar10:{archive_path}", f"cifar10:{extracted.parent}"):
        source = open_source(spec)
        assert source.split_sizes() == {"train": 20, "test": 3} and source.classes[9] == "truck"
        samples = list(source.chunk("train", [0, 5, 19]))
        assert [s.label for s in samples] == [3, 7, (15 + 3) % 10]  # batch 1 row 0, batch 2 row 1, batch 5 row 3
        pixels = np.asarray(Image.open(io.BytesIO(samples[0].image)))
        expected = np.random.default_rng(0).integers(0, 256, 3072, dtype=np.uint8).reshape(3, 32, 32).transpose(1, 2, 0)
        assert np.array_equal(pixels, expected)  # planes R, G, B -> HWC, lossless
    (extracted / "test_batch.bin").write_bytes(files["test_batch.bin"][:-10])
    with pytest.raises(ValueError, match="not a whole number of 3073-byte records"):
        open_source(f"cifar10:{extracted}")
    (extracted / "data_batch_3.bin").unlink()
    with pytest.raises(FileNotFoundError, match="binary version"):
        open_source(f"cifar10:{extracted}")


def test_cifar100_binary_uses_the_fine_label(tmp_path):
    folder = tmp_path / "cifar-100-binary"
    folder.mkdir()
    (folder / "train.bin").write_bytes(_records([(i % 20, (i * 7) % 100) for i in range(6)]))
    (folder / "test.bin").write_bytes(_records([(1, 42), (2, 99)]))
    (folder / "fine_label_names.txt").write_text("\n".join(f"fine{i}" for i in range(100)) + "\n")
    (folder / "coarse_label_names.txt").write_text("\n".join(f"coarse{i}" for i in range(20)) + "\n")
    source = open_source(f"cifar100:{tmp_path}")
    assert len(source.classes) == 100 and source.classes[42] == "fine42"
    prepare_dataset(source, str(tmp_path / "out"))
    assert sorted(read_labels(str(tmp_path / "out"), "train")[1].tolist()) == sorted((i * 7) % 100 for i in range(6))
    assert sorted(read_labels(str(tmp_path / "out"), "test")[1].tolist()) == [42, 99]


def test_archive_chunks_pickle_for_the_ray_tasks_that_write_shards(tmp_path):
    import pickle

    folder, _ = _flowers(tmp_path / "flowers")
    chunk = open_source(f"flowers102:{folder}").chunk("test", [0, 2, 4])
    assert [(s.image, s.label) for s in pickle.loads(pickle.dumps(chunk))] == [(s.image, s.label) for s in chunk]
