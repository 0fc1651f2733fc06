"""Hostile shards: member names that try to leave the shard and absurd member sizes are rejected
with an error naming the shard, the member and the rule -- never skipped as "corrupt"."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from vitray.data import EvalLoader, ShardLoader, read_manifest
from vitray.data.plan import ShardRange
from vitray.data.reader import MAX_MEMBER_BYTES, SampleStream, UnsafeShardError


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("L", (8, 8), 128).save(out, format="PNG")
    return out.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shard(path: Path, samples: list[tuple[str, int]]) -> Path:
    """A webdataset shard: for each (key, label), KEY.png and KEY.cls, keys used as given."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for key, label in samples:
            _add(tar, f"{key}.png", _png())
            _add(tar, f"{key}.cls", str(label).encode())
    return path


def write_shard_claiming(path: Path, key: str, size: int) -> Path:
    """One good sample, then a member whose header claims `size` bytes, followed by a few bytes --
    what a crafted shard looks like (nothing of that size is ever written)."""
    write_shard(path, [("good", 1)])
    info = tarfile.TarInfo(f"{key}.png")
    info.size = size
    data = path.read_bytes()
    end = len(data) - 2 * tarfile.BLOCKSIZE  # drop the end-of-archive blocks, append the crafted member
    while data[end - tarfile.BLOCKSIZE : end] == bytes(tarfile.BLOCKSIZE):
        end -= tarfile.BLOCKSIZE
    path.write_bytes(data[:end] + info.tobuf(format=tarfile.GNU_FORMAT) + b"\x89PNG" + bytes(508))
    return path


def read_all(path: Path, count: int, want: bool = True) -> list:
    stream = SampleStream([str(path)], [ShardRange(0, 0, count)])
    try:
        return [stream.read(want) for _ in range(count)]
    finally:
        stream.close()


@pytest.mark.parametrize("key", ["../evil", "../../etc/cron.d/x", "/etc/passwd", "a/../../x", "..\\windows\\x"])
@pytest.mark.parametrize("want", [True, False], ids=["read", "skipped-over"])
def test_member_names_escaping_the_shard_are_rejected(tmp_path, key, want):
    shard = write_shard(tmp_path / "train-000000.tar", [("ok", 0), (key, 1)])
    with pytest.raises(UnsafeShardError) as err:
        read_all(shard, 2, want=want)
    message = str(err.value)
    assert str(shard) in message and repr(f"{key}.png") in message
    assert "escapes the shard" in message and "relative KEY.EXT" in message


def test_a_hostile_first_member_is_rejected_when_the_shard_opens(tmp_path):
    shard = write_shard(tmp_path / "s.tar", [("/abs/first", 0)])
    with pytest.raises(UnsafeShardError, match="'/abs/first.png' escapes the shard"):
        read_all(shard, 1)


def test_absurd_member_sizes_are_rejected_before_reading(tmp_path):
    claimed = 64 * MAX_MEMBER_BYTES
    shard = write_shard_claiming(tmp_path / "s.tar", "huge", claimed)
    with pytest.raises(UnsafeShardError) as err:
        read_all(shard, 2)
    message = str(err.value)
    assert f"claims {claimed:,} bytes" in message and f"at most {MAX_MEMBER_BYTES:,}" in message
    assert str(shard) in message and "'huge.png'" in message


def test_ordinary_names_and_sizes_still_read(tmp_path):
    # Folders inside keys, dots in folder names and '..' as part of a longer word are all fine.
    keys = ["plain", "sub/dir/k1", "v1.2/k2", "a..b/k3"]
    shard = write_shard(tmp_path / "s.tar", [(k, i) for i, k in enumerate(keys)])
    samples = read_all(shard, len(keys))
    assert [s.key for s in samples] == keys
    assert [int(s.fields["cls"]) for s in samples] == [0, 1, 2, 3]
    # Just at the limit is not "absurd": the size check alone lets it through (the bytes are missing,
    # so the reader reports the sample as damaged, as for any truncated shard).
    at_limit = write_shard_claiming(tmp_path / "limit.tar", "big", MAX_MEMBER_BYTES)
    assert read_all(at_limit, 2)[0].key == "good"


def _with_hostile_shard(digits_dataset: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the prepared digits whose first train shard is replaced by a hostile one with the
    same number of samples (the manifest still lists it as it was)."""
    dest = tmp_path / "digits"
    shutil.copytree(digits_dataset, dest)
    first = read_manifest(str(dest), "train")[0]
    samples = [(f"s{i:04d}", i % 10) for i in range(first.num_samples - 1)] + [("../../outside", 3)]
    write_shard(dest / first.name, samples)
    return dest, first.name


@pytest.mark.parametrize("workers", [0, 1])
def test_training_and_evaluation_loaders_stop_on_a_hostile_shard(digits_dataset, tmp_path, workers):
    dest, shard_name = _with_hostile_shard(digits_dataset, tmp_path)
    expected = f"{shard_name}: member '../../outside.png' escapes the shard"
    with pytest.raises(UnsafeShardError, match=expected):
        list(EvalLoader(str(dest), "train", batch_size=64, img_size=8, num_workers=workers))
    train = ShardLoader(
        str(dest),
        "train",
        rank=0,
        world_size=1,
        batch_size=8,
        img_size=8,
        train=True,
        seed=0,
        num_slots=4,
        num_workers=workers,
        shuffle_buffer=8,
    )
    batches = iter(train)
    with pytest.raises(UnsafeShardError, match=expected):  # the error crosses the DataLoader's processes
        for _ in range(2 * train.steps_per_epoch):
            next(batches)
