"""The region decoder (`data/_jpeg_region.c`): the pixels of a full decode, only the crop's."""

from __future__ import annotations

import io
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from vitray.data import transforms
from vitray.data.transforms import CorruptSample, TrainCrop

needs_extension = pytest.mark.skipif(
    transforms._jpeg_region is None, reason="the _jpeg_region extension is not built (no libjpeg headers)"
)


def _photo(width: int, height: int) -> np.ndarray:
    """Texture with edges and colour in every 8x8 block, so that chroma upsampling matters."""
    rng = np.random.default_rng(width * 1000 + height)
    ys, xs = np.mgrid[0:height, 0:width]
    smooth = np.stack([xs * 255 // width, ys * 255 // height, ((xs // 13 + ys // 7) % 2) * 180], axis=-1)
    return np.clip(smooth + rng.integers(-40, 40, (height, width, 3)), 0, 255).astype(np.uint8)


def _jpeg(pixels: np.ndarray, **save) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90, **save)
    return out.getvalue()


def _full_crop(data: bytes, top: int, left: int, height: int, width: int) -> torch.Tensor:
    whole = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    return whole[:, top : top + height, left : left + width]


def test_the_extension_is_built_where_libjpeg_headers_are_installed():
    # setup.py marks it optional; on a machine with the headers (CI's) a silent build failure
    # would only show as a slower loader.
    if not Path("/usr/include/jpeglib.h").exists():
        pytest.skip("no libjpeg headers on this machine: the extension is optional")
    assert transforms._jpeg_region is not None and transforms.REGION_DECODE


@needs_extension
@pytest.mark.parametrize("subsampling", [0, 1, 2], ids=["4:4:4", "4:2:2", "4:2:0"])
@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
def test_a_region_has_the_pixels_of_the_full_decode(subsampling, progressive):
    decode_region = transforms._jpeg_region.decode_region
    width, height = 211, 157  # neither a multiple of the 16-px iMCU
    data = _jpeg(_photo(width, height), subsampling=subsampling, progressive=progressive)
    regions = [(0, 0, height, width), (0, 0, 1, 1), (height - 1, width - 1, 1, 1)]  # whole, corners
    # Edges on and off iMCU boundaries, at the image's borders and inside it.
    for top, left, h, w in itertools.product([0, 7, 16, 33], [0, 1, 15, 16, 17, 100], [1, 9, 64], [1, 31, 95]):
        if top + h <= height and left + w <= width:
            regions.append((top, left, h, w))
    for top, left, h, w in regions:
        got = torch.frombuffer(decode_region(data, top, left, h, w), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)
        assert torch.equal(got, _full_crop(data, top, left, h, w)), (top, left, h, w)


@needs_extension
def test_grayscale_jpegs_come_out_rgb_and_cmyk_ones_are_left_to_the_full_decoder():
    decode_region = transforms._jpeg_region.decode_region
    gray = _jpeg(_photo(90, 70)[..., 0])
    got = torch.frombuffer(decode_region(gray, 5, 9, 40, 50), dtype=torch.uint8).view(40, 50, 3).permute(2, 0, 1)
    assert torch.equal(got, _full_crop(gray, 5, 9, 40, 50))
    cmyk = io.BytesIO()
    Image.fromarray(_photo(90, 70)).convert("CMYK").save(cmyk, format="JPEG")
    with pytest.raises(transforms._jpeg_region.UnsupportedJPEG, match="CMYK"):
        decode_region(cmyk.getvalue(), 0, 0, 10, 10)
    # ... and TrainCrop decodes it the other way, to the same crop as PIL's.
    crop = TrainCrop(32, flip=False).from_bytes(cmyk.getvalue(), seed=3)
    assert crop.shape == (3, 32, 32) and crop.dtype == torch.uint8


@needs_extension
def test_bad_data_and_bad_regions_are_refused_by_name():
    decode_region = transforms._jpeg_region.decode_region
    data = _jpeg(_photo(64, 48))
    with pytest.raises(ValueError, match="corrupt JPEG: Not a JPEG file"):
        decode_region(b"not a jpeg at all", 0, 0, 1, 1)
    with pytest.raises(ValueError, match="corrupt JPEG: Premature end of JPEG file"):
        decode_region(data[: len(data) // 2], 40, 0, 8, 64)  # rows past the cut
    with pytest.raises(ValueError, match=r"region 10x49 at \(0, 0\) is not inside the image"):
        decode_region(data, 0, 0, 49, 10)
    with pytest.raises(ValueError, match="empty region"):
        decode_region(data, 0, 0, 0, 10)


@needs_extension
def test_train_crops_are_the_same_by_region_or_whole_and_cut_short_jpegs_fail_either_way(monkeypatch):
    data = _jpeg(_photo(500, 375), subsampling=2)
    train_crop = TrainCrop(64)  # most crops of a 500x375 photo are < 128 px: no DCT reduction
    by_region = [train_crop.from_bytes(data, seed) for seed in range(30)]
    monkeypatch.setattr(transforms, "REGION_DECODE", False)
    whole = [train_crop.from_bytes(data, seed) for seed in range(30)]
    assert all(torch.equal(a, b) for a, b in zip(by_region, whole))
    monkeypatch.setattr(transforms, "REGION_DECODE", True)
    # Cut after 90% of the image: most crops lie wholly above the cut, yet the sample is refused
    # whatever its crop (no end-of-image marker: the full decoder decides), as without regions.
    cut = data[: int(len(data) * 0.9)]
    for seed in range(10):
        with pytest.raises(CorruptSample, match="undecodable image"):
            train_crop.from_bytes(cut, seed)


def _as_tensor(region: bytearray, height: int, width: int) -> torch.Tensor:
    return torch.frombuffer(region, dtype=torch.uint8).view(height, width, 3).permute(2, 0, 1)


@needs_extension
def test_a_jpeg_gets_one_verdict_whatever_its_crop(monkeypatch):
    """What libjpeg only warns about: a header oddity (an unknown JFIF version, a sequential JPEG's
    odd scan parameters) leaves whole pixels, decoded by region; damaged entropy-coded data before
    the end marker is decoded whole for every crop, as Pillow and torchvision decode it (and so the
    reduced decode and the evaluation), not refused by the crops whose rows reach the damage only."""
    decode_region = transforms._jpeg_region.decode_region
    data = _jpeg(_photo(320, 240))
    scan = data.find(b"\xff\xda")
    odd_scan = bytearray(data)
    odd_scan[scan + 2 + int.from_bytes(data[scan + 2 : scan + 4], "big") - 3] = 1  # Ss = 1
    jfif_2 = bytearray(data)
    jfif_2[jfif_2.find(b"JFIF\0") + 5] = 2
    for quirk in (bytes(odd_scan), bytes(jfif_2)):
        assert torch.equal(_as_tensor(decode_region(quirk, 10, 20, 64, 64), 64, 64), _full_crop(data, 10, 20, 64, 64))
    damaged = data[: scan + (len(data) - scan) * 3 // 4] + b"\xff\xd9"
    decode_region(damaged, 0, 0, 30, 30)  # rows above the damage
    with pytest.raises(transforms._jpeg_region.DamagedJPEG, match="corrupt JPEG: Corrupt JPEG data"):
        decode_region(damaged, 200, 0, 30, 30)  # rows past it: the region decoder leaves it to the full decode

    train_crop = TrainCrop(64)  # most crops of a 320x240 photo are < 128 px: the region decoder
    for image in (bytes(odd_scan), bytes(jfif_2), damaged):
        by_region = [train_crop.from_bytes(image, seed) for seed in range(20)]  # none refused
        monkeypatch.setattr(transforms, "REGION_DECODE", False)
        whole = [train_crop.from_bytes(image, seed) for seed in range(20)]
        monkeypatch.setattr(transforms, "REGION_DECODE", True)
        assert all(torch.equal(a, b) for a, b in zip(by_region, whole))


@pytest.mark.parametrize("built", [True, False])
def test_a_run_says_when_its_loader_decodes_jpegs_whole(built, monkeypatch, capsys):
    """Without the extension (no libjpeg headers at install) the loader is slower: rank 0 says so,
    with the fix, once the loader's decode is resolved; the other ranks and a built install say nothing."""
    from types import SimpleNamespace

    from vitray.trainers.loop import TrainingLoop

    monkeypatch.setattr(transforms, "REGION_DECODE", built)
    for rank in (0, 1):
        worker = SimpleNamespace(
            cfg=SimpleNamespace(data=SimpleNamespace(decode="auto")),
            backend=SimpleNamespace(device=torch.device("cpu")),
        )
        worker.rank = rank
        assert TrainingLoop._decodes_on_device(worker) is False
    said = capsys.readouterr().out
    assert said == ("" if built else f"vitray: {transforms.WHOLE_DECODE_NOTE}\n")
    assert built or "apt install libjpeg-dev" in said
