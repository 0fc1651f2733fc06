"""``webdataset:PATH``: webdataset shards made elsewhere (timm's and Hugging Face's ``*-wds``,
img2dataset's, GNU tar's), written here in the real format (webdataset's own TarWriter, Python's
tarfile), prepared, and read back sample for sample by webdataset's own reader."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import webdataset as wds
from tfds_helpers import png

from vitray.data import prepare_dataset
from vitray.data.sources import open_source


def _shards(root: Path, layout: dict[str, list[list[int]]], *, labels: bool = True, name: str = "mine-{split}") -> Path:
    """One shard a list of sample numbers, named as timm's wds datasets are (`NAME-SPLIT-NNNN.tar`),
    each sample an image, its class (`i % 3`) and a JSON member, as webdataset's writer stores them."""
    root.mkdir(parents=True, exist_ok=True)
    for split, shards in layout.items():
        for n, numbers in enumerate(shards):
            (root / name.format(split=split)).parent.mkdir(parents=True, exist_ok=True)
            with wds.TarWriter(str(root / f"{name.format(split=split)}-{n:04d}.tar")) as writer:
                for i in numbers:
                    sample = {"__key__": f"images/s{i:06d}", "png": png(i), "json": {"i": i}}
                    writer.write({**sample, "cls": i % 3} if labels else sample)
    return root


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A tar of `members` in this order, as `tar cf` makes it (member order is the caller's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _prepared(dest: Path, split: str) -> list[tuple[str, int]]:
    """(the image's sha256, its label) of every sample of a prepared split, read by webdataset."""
    urls = sorted(str(p) for p in dest.glob(f"{split}-*.tar"))
    return sorted(
        (hashlib.sha256(s["png"]).hexdigest(), int(s["cls"])) for s in wds.WebDataset(urls, shardshuffle=False)
    )


def _expected(numbers) -> list[tuple[str, int]]:
    return sorted((hashlib.sha256(png(i)).hexdigest(), i % 3) for i in numbers)


def test_webdataset_shards_are_prepared_sample_for_sample(tmp_path):
    """timm's layout, a shard of GNU tar's order (`tar cf x.tar *.png *.cls`: a sample's members
    apart, its label after every image) and a sample with no image member (said, left out)."""
    root = _shards(tmp_path / "wds", {"train": [list(range(0, 7))], "validation": [[100, 101]]})
    by_extension = [(f"./s{i:06d}.png", png(i)) for i in range(7, 12)] + [
        (f"./s{i:06d}.cls", str(i % 3).encode()) for i in range(7, 12)
    ]
    _tar(root / "mine-train-0001.tar", [*by_extension, ("./s999999.json", b"{}")])
    source = open_source(f"webdataset:{root}?split=validation:val")
    assert (source.split_sizes(), source.classes, source.label_kind) == (
        {"train": 12, "val": 2},
        ["0", "1", "2"],
        "single",
    )
    assert source.notes == [
        f"leaving out 1 sample(s) with no jpg/jpeg/png member, e.g. {root}/mine-train-0001.tar:s999999 (json)"
    ]
    prepare_dataset(source, str(tmp_path / "out"), samples_per_shard=5)
    assert _prepared(tmp_path / "out", "train") == _expected(range(12))
    assert _prepared(tmp_path / "out", "val") == _expected([100, 101])


def test_webdataset_splits_come_from_file_names_folders_or_patterns(tmp_path):
    """Folders named as splits (`data/validation/0000.tar`), Hugging Face's other split words, a
    brace pattern and a glob; names with no split word are train, and said so."""
    folders = _shards(tmp_path / "folders", {"train": [[1, 2]], "validation": [[3]]}, name="data/{split}/shard")
    assert open_source(f"webdataset:{folders}").split_sizes() == {"train": 2, "validation": 1}
    words = _shards(tmp_path / "words", {"train": [[1, 2]], "valid": [[3]], "dev": [[4]]})
    assert open_source(f"webdataset:{words}").split_sizes() == {"train": 2, "valid": 1, "dev": 1}
    many = _shards(tmp_path / "many", {"train": [[1], [2], [3]], "test": [[4]]})
    assert open_source(f"webdataset:{many}/mine-train-{{0000..0001}}.tar").split_sizes() == {"train": 2}
    assert open_source(f"webdataset:{many}/*-test-*.tar").split_sizes() == {"test": 1}
    with pytest.raises(FileNotFoundError, match="mine-train-0003.tar does not exist"):
        open_source(f"webdataset:{many}/mine-train-{{0000..0007}}.tar")
    plain = _shards(tmp_path / "plain", {"x": [[1, 2]]}, name="{split}")  # img2dataset's 00000.tar
    (plain / "x-0000.tar").rename(plain / "00000.tar")
    unnamed = open_source(f"webdataset:{plain}")
    assert unnamed.split_sizes() == {"train": 2} and "all 1 are the train split" in unnamed.notes[-1]


def test_webdataset_labels_missing_in_a_split_or_everywhere(tmp_path):
    """No label anywhere: unlabelled (img2dataset); a split without any (a test split published
    without its labels, -1): left out and said; some samples of a split without: refused naming one
    that has none, and `unlabelled:` reads it all."""
    bare = open_source(f"webdataset:{_shards(tmp_path / 'bare', {'train': [[1, 2, 3]]}, labels=False)}")
    assert (bare.label_kind, bare.classes, bare.split_sizes()) == ("none", [], {"train": 3})
    with pytest.raises(ValueError, match="option label=clss: no sample has a .clss member"):
        open_source(f"webdataset:{tmp_path / 'bare'}?label=clss")

    test_unlabelled = _shards(tmp_path / "published", {"train": [[1, 2]]})
    _shards(test_unlabelled, {"test": [[3, 4]]}, labels=False)
    source = open_source(f"webdataset:{test_unlabelled}")
    assert source.split_sizes() == {"train": 2} and "leaving out split 'test' (2 samples)" in source.notes[0]
    assert open_source(f"unlabelled:webdataset:{test_unlabelled}").split_sizes() == {"train": 2, "test": 2}

    partial = _shards(tmp_path / "partial", {"train": [[1, 2]]})
    _tar(partial / "mine-train-0001.tar", [("s000007.png", png(7))])
    with pytest.raises(ValueError, match=r"mine-train-0001.tar:s000007.png has no label.*unlabelled:webdataset"):
        open_source(f"webdataset:{partial}")
    assert open_source(f"unlabelled:webdataset:{partial}").split_sizes() == {"train": 3}


@pytest.mark.parametrize(
    ("members", "refusal"),
    [
        ([("a.png", b"x"), ("a.cls", b"cat")], "a.cls holds 'cat', not a class index"),
        ([("a.png", b"x"), ("a.cls", b"1440764")], "holds the label 1,440,764: labels are class indices"),
        ([("a.jpg", b"x"), ("a.JPG", b"y")], "sample 'a' has two .jpg members"),
        ([("a.webp", b"x"), ("a.cls", b"1")], "no sample with a jpg/jpeg/png member \\(e.g. .*:a \\(cls, webp\\)\\)"),
    ],
)
def test_webdataset_members_no_shard_may_hold_are_refused_before_anything_is_written(tmp_path, members, refusal):
    _tar(tmp_path / "wds" / "train-0000.tar", members)
    with pytest.raises(ValueError, match=refusal):
        open_source(f"webdataset:{tmp_path / 'wds'}")


def test_webdataset_mistakes_are_refused_naming_the_file_or_option(tmp_path):
    root = _shards(tmp_path / "wds", {"train": [[1, 2]]})
    for query, refusal in (
        ("column=png", r"options \['column'\] are not known; allowed: image=EXT"),
        ("split=valid:val", "split='valid:val' is not SPLIT:NAME"),
        ("image=webp", "webp images are not read"),
        ("image=", "take member extensions"),
        ("image=png&image=jpg", "image= is given 2 times"),
    ):
        with pytest.raises(ValueError, match=refusal):
            open_source(f"webdataset:{root}?{query}")
    assert open_source(f"webdataset:{root}?image=.PNG").split_sizes() == {"train": 2}
    (root / "mine-train-val-0009.tar").write_bytes((root / "mine-train-0000.tar").read_bytes())
    with pytest.raises(ValueError, match="several split words \\(train, val\\)"):
        open_source(f"webdataset:{root}")
    (root / "mine-train-val-0009.tar").unlink()
    (root / "mine-train-0001.tar.gz").write_bytes(b"")
    with pytest.raises(ValueError, match="mine-train-0001.tar.gz is a compressed tar, which is not read"):
        open_source(f"webdataset:{root}")
    (root / "mine-train-0001.tar.gz").unlink()
    (root / "MINE-TRAIN-0002.TAR").write_bytes((root / "mine-train-0000.tar").read_bytes())
    assert open_source(f"unlabelled:webdataset:{root}").split_sizes() == {"train": 4}  # not skipped
    (root / "mine-train-0003.tar").write_bytes(b"not a tar file" * 100)
    with pytest.raises(ValueError, match="mine-train-0003.tar is not a readable tar file"):
        open_source(f"webdataset:{root}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .tar shards there"):
        open_source(f"webdataset:{tmp_path / 'empty'}")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_source(f"webdataset:{tmp_path / 'nowhere'}")
    _tar(tmp_path / "hollow" / "train-0000.tar", [])
    with pytest.raises(ValueError, match="split 'train' has no sample .*hold no sample"):
        open_source(f"webdataset:{tmp_path / 'hollow'}")


def test_many_shards_are_indexed_in_processes_of_their_own_with_the_same_result(tmp_path, monkeypatch):
    """From the pool as in one process, the pool really used; a bad label refused from a worker of
    it; and a script without a `__main__` guard opens it too (spawned workers ran it again, each
    starting a pool of its own: BrokenProcessPool)."""
    from concurrent.futures import ProcessPoolExecutor

    from vitray.data.sources import webdataset

    count = webdataset.SHARDS_PER_PROCESS_POOL
    root = _shards(tmp_path / "wds", {"train": [[i] for i in range(count)]})
    pools = []

    class Recorded(ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            pools.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(webdataset, "ProcessPoolExecutor", Recorded)
    pooled = open_source(f"webdataset:{root}")
    monkeypatch.setattr(webdataset, "SHARDS_PER_PROCESS_POOL", count + 1)
    inline = open_source(f"webdataset:{root}")
    assert len(pools) == 1 and pooled.split_sizes() == inline.split_sizes() == {"train": count}
    for a, b in zip(pooled.splits["train"], inline.splits["train"], strict=True):
        assert (a.path, a.names, a.offsets.tolist(), a.labels.tolist()) == (
            b.path,
            b.names,
            b.offsets.tolist(),
            b.labels.tolist(),
        )
    assert [int(i.labels[0]) for i in pooled.splits["train"]] == [i % 3 for i in range(count)]

    script = tmp_path / "open.py"  # no __main__ guard
    script.write_text(
        f"from vitray.data.sources import open_source\nprint(open_source({f'webdataset:{root}'!r}).split_sizes())\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip() == f"{{'train': {count}}}", done.stderr[-2000:]

    monkeypatch.setattr(webdataset, "SHARDS_PER_PROCESS_POOL", count)
    _tar(root / "mine-train-0003.tar", [("s.png", png(3)), ("s.cls", b"three")])  # refused from its process
    with pytest.raises(ValueError, match=r"mine-train-0003.tar:s.cls holds 'three'.*unlabelled:webdataset"):
        open_source(f"webdataset:{root}")


def test_webdataset_patterns_are_sources_of_their_own_folder(tmp_path, monkeypatch):
    """A folder or pattern under a split-named folder is that split; a pattern's spec is absolute
    (the same shards from elsewhere are the same source); a brace pattern that repeats a shard; a
    glob's `?` reads as the options (said); an output inside a pattern's folder is refused, as
    inside a folder source."""
    from typer.testing import CliRunner

    from vitray.cli.main import app

    _shards(tmp_path / "ds", {"x": [[1, 2]]}, name="validation/{split}")
    for location in ("ds/validation", "ds/validation/*.tar"):
        monkeypatch.chdir(tmp_path)
        source = open_source(f"webdataset:{location}")
        assert source.split_sizes() == {"validation": 2}, location
    assert open_source("webdataset:ds/validation/*.tar").spec == f"webdataset:{tmp_path}/ds/validation/*.tar"
    assert open_source("webdataset:ds/validation/x-{0000,0000}.tar").split_sizes() == {"validation": 2}
    with pytest.raises(
        ValueError, match=r"options \['.tar'\] are not known.*match one character of a glob with \[0-9\]"
    ):
        open_source("webdataset:ds/validation/x-000?.tar")
    refused = CliRunner().invoke(app, ["data", "prepare", "webdataset:ds/**/*.tar", "ds/out"])
    assert refused.exit_code == 2 and "inside" in refused.output, refused.output
