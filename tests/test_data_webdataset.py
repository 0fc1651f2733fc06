"""``webdataset:PATH``: webdataset shards made elsewhere (timm's and Hugging Face's ``*-wds``,
img2dataset's), written here by webdataset's own TarWriter, prepared, and read back sample for
sample by webdataset's own reader."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest
import webdataset as wds
from tfds_helpers import png

from vitray.data import prepare_dataset
from vitray.data.sources import open_source


def _shards(root: Path, layout: dict[str, list[list[int]]], *, labels: bool = True) -> Path:
    """One shard a list of sample numbers, named as timm's wds datasets are (`NAME-SPLIT-NNNN.tar`),
    each sample an image, its class (`i % 3`) and a JSON member, as webdataset's writer stores them."""
    root.mkdir(parents=True, exist_ok=True)
    for split, shards in layout.items():
        for n, numbers in enumerate(shards):
            with wds.TarWriter(str(root / f"mine-{split}-{n:04d}.tar")) as writer:
                for i in numbers:
                    sample = {"__key__": f"images/s{i:06d}", "png": png(i), "json": {"i": i}}
                    writer.write({**sample, "cls": i % 3} if labels else sample)
    return root


def _prepared(dest: Path, split: str) -> list[tuple[str, int]]:
    """(the image's sha256, its label) of every sample of a prepared split, read by webdataset."""
    urls = sorted(str(p) for p in dest.glob(f"{split}-*.tar"))
    return sorted(
        (hashlib.sha256(s["png"]).hexdigest(), int(s["cls"])) for s in wds.WebDataset(urls, shardshuffle=False)
    )


def test_webdataset_shards_are_prepared_sample_for_sample(tmp_path):
    root = _shards(tmp_path / "wds", {"train": [list(range(0, 7)), list(range(7, 12))], "validation": [[100, 101]]})
    with tarfile.open(root / "mine-train-0001.tar", "a") as tar:  # a sample with no image member
        data = b'{"caption": "no image"}'
        info = tarfile.TarInfo("images/s999999.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    source = open_source(f"webdataset:{root}?split=validation:val")
    assert (source.split_sizes(), source.classes, source.label_kind) == (
        {"train": 12, "val": 2},
        ["0", "1", "2"],
        "single",
    )
    assert source.left_out == [f"{root / 'mine-train-0001.tar'}:images/s999999"]
    prepare_dataset(source, str(tmp_path / "out"), samples_per_shard=5)
    for split, numbers in (("train", range(12)), ("val", [100, 101])):
        expected = sorted((hashlib.sha256(png(i)).hexdigest(), i % 3) for i in numbers)
        assert _prepared(tmp_path / "out", split) == expected, split


def test_webdataset_without_labels_is_unlabelled_and_partial_labels_are_refused(tmp_path):
    bare = open_source(f"webdataset:{_shards(tmp_path / 'bare', {'train': [[1, 2, 3]]}, labels=False)}")
    assert (bare.label_kind, bare.classes, bare.split_sizes()) == ("none", [], {"train": 3})

    mixed = _shards(tmp_path / "mixed", {"train": [[1, 2]]})
    _shards(mixed, {"test": [[3]]}, labels=False)
    with pytest.raises(ValueError, match=r"mine-test-0000.tar:images/s000003.png has no .cls member.*unlabelled:"):
        open_source(f"webdataset:{mixed}")
    assert open_source(f"unlabelled:webdataset:{mixed}").split_sizes() == {"train": 2, "test": 1}


def test_webdataset_mistakes_are_refused_naming_the_file_or_option(tmp_path):
    root = _shards(tmp_path / "wds", {"train": [[1, 2]]})
    with pytest.raises(ValueError, match=r"options \['column'\] are not known; allowed: image=EXT"):
        open_source(f"webdataset:{root}?column=png")
    with pytest.raises(ValueError, match="split='valid:val' is not SPLIT:NAME"):
        open_source(f"webdataset:{root}?split=valid:val")
    (root / "mine-train-val-0009.tar").write_bytes((root / "mine-train-0000.tar").read_bytes())
    with pytest.raises(ValueError, match="several split words \\(train, val\\)"):
        open_source(f"webdataset:{root}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .tar shards there"):
        open_source(f"webdataset:{tmp_path / 'empty'}")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_source(f"webdataset:{tmp_path / 'nowhere'}")

    odd = tmp_path / "odd"
    odd.mkdir()
    with wds.TarWriter(str(odd / "train-0000.tar")) as writer:
        writer.write({"__key__": "a", "png": png(1), "cls": b"cat"})
    with pytest.raises(ValueError, match=r"train-0000.tar:a.cls holds 'cat', not a class index"):
        open_source(f"webdataset:{odd}")
    (odd / "train-0000.tar").write_bytes(b"not a tar file" * 100)
    with pytest.raises(ValueError, match="is not a readable tar file"):
        open_source(f"webdataset:{odd}")
