"""`trainers/checkpoint/torch_file.py`: a `torch.save` file read straight into fresh tensors (O_DIRECT
where its tensors start on a page), each byte once, checked against a listed size and CRC-32C."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import google_crc32c
import pytest
import torch
from disk_helpers import bytes_read
from torch.utils.serialization import config

from vitray.trainers.checkpoint import torch_file


class Mismatch(Exception):
    pass


def _fail(problem: str) -> None:
    raise Mismatch(problem)


def _state() -> dict:
    torch.manual_seed(0)
    base = torch.randn(300, 7)
    return {
        "base": base,
        "column": base[:, 2],  # a view: shares the storage of `base`
        "transposed": base.t(),
        "list": [torch.tensor(3.5), torch.zeros(0), torch.arange(10, dtype=torch.int64)],
        "ordered": collections.OrderedDict(half=torch.ones(5, dtype=torch.bfloat16)),
        "tuple": (torch.tensor([True, False]), 5, "text"),
        "large": torch.randn(3 * 2**20 + 3),  # 12 MiB + 12 bytes: a tail that is not a whole page
        "step": 7,
    }


def _save(state, path: Path, alignment: int) -> Path:
    with config.patch({"save.compute_crc32": False, "save.storage_alignment": alignment}):
        torch.save(state, path)
    return path


def _assert_same(expected, got) -> None:
    assert type(got) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert (got.dtype, got.shape, got.stride()) == (expected.dtype, expected.shape, expected.stride())
        assert torch.equal(got, expected)
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for key in expected:
            _assert_same(expected[key], got[key])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        for a, b in zip(expected, got):
            _assert_same(a, b)
    else:
        assert got == expected


@pytest.mark.parametrize("alignment", [4096, 64])
@pytest.mark.parametrize("o_direct", ["taken", "refused"])
def test_a_file_is_read_once_into_fresh_tensors_equal_to_torch_loads(tmp_path, alignment, o_direct, monkeypatch):
    """Page-aligned storages (vitray's checkpoints) and 64-byte ones (torch's default: files written
    before), where the file system takes O_DIRECT and where it refuses it (as some network and FUSE
    mounts do): the same values, dtypes, shapes and strides as `torch.load`, views still sharing
    their storage, nothing left mapping the file, the file read once (its bytes, not twice them)
    with its CRC-32C computed as it was read -- and the aligned storages read with O_DIRECT, past
    the page cache, where it is taken."""
    import errno
    import fcntl

    if o_direct == "refused":
        real_open = os.open

        def open_refusing_o_direct(path, flags, *args, **kwargs):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument", path)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", open_refusing_o_direct)
    monkeypatch.setattr(torch_file, "READ_BYTES", 2**20)  # 16 MiB in use: several ranges a tensor here
    direct_bytes = []
    real_readinto = torch_file._readinto

    def readinto(fd, view, start):
        got = real_readinto(fd, view, start)
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            direct_bytes.append(got)
        return got

    monkeypatch.setattr(torch_file, "_readinto", readinto)
    path = _save(_state(), tmp_path / "state.pt", alignment)
    data = path.read_bytes()
    expected = torch.load(path, weights_only=True)
    torch_file.load(str(path))  # (the first fake load in a process imports modules: their files count as read)
    direct_bytes.clear()
    before = bytes_read()
    got = torch_file.load(str(path), check=torch_file.FileCheck(len(data), google_crc32c.value(data), _fail))
    read = bytes_read() - before
    _assert_same(expected, got)
    assert got["column"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    got["base"][0, 2] = 99.0
    assert got["column"][0] == 99.0 and got["transposed"][2, 0] == 99.0
    assert len(data) <= read < 1.25 * len(data), f"read {read} bytes of a {len(data)}-byte file"
    assert str(path) not in Path("/proc/self/maps").read_text()
    if o_direct == "taken" and alignment == 4096:
        assert sum(direct_bytes) >= 0.95 * len(data), (sum(direct_bytes), len(data))
    else:
        assert not direct_bytes


def test_a_corrupt_or_cut_file_fails_its_check_and_a_good_one_passes(tmp_path):
    """A byte changed inside a tensor (same size: only the CRC-32C tells), a byte changed in the
    pickled structure (the load itself fails: the check still names the file as corrupt) and a
    file of another size are refused by the check before anything is returned."""
    path = _save(_state(), tmp_path / "state.pt", 4096)
    data = path.read_bytes()
    check = torch_file.FileCheck(len(data), google_crc32c.value(data), _fail)
    torch_file.load(str(path), check=check)

    tensor_byte = data.index(_state()["large"][1000:1004].numpy().tobytes())
    path.write_bytes(data[:tensor_byte] + bytes([data[tensor_byte] ^ 1]) + data[tensor_byte + 1 :])
    with pytest.raises(Mismatch, match="CRC-32C"):
        torch_file.load(str(path), check=check)

    pickle_byte = data.index(b"\x80", data.index(b"data.pkl"))  # the pickle's first opcode (its protocol)
    path.write_bytes(data[:pickle_byte] + b"\xff" + data[pickle_byte + 1 :])
    with pytest.raises(Mismatch, match="CRC-32C") as raised:
        torch_file.load(str(path), check=check)
    assert raised.value.__context__ is not None  # the load's own error, kept beside the check's

    path.write_bytes(data[:-10])
    with pytest.raises(Mismatch, match=f"has {len(data) - 10} bytes, its record lists {len(data)}"):
        torch_file.load(str(path), check=check)


def test_tensors_outside_the_containers_it_walks_are_read_by_torch_load(tmp_path, monkeypatch):
    """A file whose storages the fake load does not all reach (here: the walk made to miss one)
    is read by `torch.load` instead: the same result, never a fake tensor handed out."""
    path = _save(_state(), tmp_path / "state.pt", 4096)
    real_walk = torch_file._walk

    def walk_missing_the_list(value, visit, seen=None):
        if isinstance(value, dict) and "list" in value:
            return {k: (v if k == "list" else real_walk(v, visit, seen)) for k, v in value.items()}
        return real_walk(value, visit, seen)

    monkeypatch.setattr(torch_file, "_walk", walk_missing_the_list)
    got = torch_file.load(str(path))
    _assert_same(torch.load(path, weights_only=True), got)


def test_tensors_are_read_into_the_callers_own_where_they_fit(tmp_path):
    """`into`: a tensor of the file read straight into a tensor the caller already has (as a
    restore reads the master weights into DeepSpeed's partitions): the caller's memory holds the
    values and the loaded tensor is that memory, so copying it there is no copy at all. A target of
    another shape, or a tensor of the file that shares its storage, is read into fresh memory."""
    path = _save(_state(), tmp_path / "state.pt", 4096)
    expected = torch.load(path, weights_only=True)
    large, wrong_shape, shared = torch.empty(3 * 2**20 + 3), torch.empty(3), torch.empty(300, 7)

    got = torch_file.load(
        str(path), into=lambda s: [(s["large"], large), (s["list"][2], wrong_shape), (s["base"], shared)]
    )
    _assert_same(expected, got)
    assert torch.equal(large, expected["large"])
    assert got["large"].data_ptr() == large.data_ptr()
    assert got["list"][2].data_ptr() != wrong_shape.data_ptr()
    assert got["base"].data_ptr() != shared.data_ptr()  # `column` and `transposed` share its storage
