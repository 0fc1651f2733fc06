"""JPEG decoding on the accelerator (``data.decode=gpu``), run with ``device="cpu"``.

The loader workers draw the crops the CPU path draws and hand over the JPEGs; the feed decodes,
crops, resizes and flips them where the model runs. On the CPU the very same code decodes with
libjpeg-turbo instead of nvjpeg: the boxes, keys, labels and loader positions must be the CPU
path's exactly, and the pixels its pixels to within resampling.

Where a CUDA device exists (the device machine; see docs/testing.md), the tests marked with ``DEVICES`` run
on it as well: nvjpeg's decode, the crops on the GPU and the feed's own thread.
"""

from __future__ import annotations

import io
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.io import ImageReadMode, decode_jpeg

from vitray.common.config import ConfigError, load_config
from vitray.data import ShardLoader, device_decode, prepare_dataset, read_manifest
from vitray.data.batch import SkipReporter, decode_chunk
from vitray.data.device_decode import EncodedCrops, decode_batch
from vitray.data.plan import ShardRange
from vitray.data.reader import SampleStream
from vitray.data.transforms import TrainCrop, jpeg_device_size, train_augment
from vitray.trainers.config import TrainingConfig
from vitray.trainers.step.feed import DeviceFeed, decodes_on_device

SIZE = 32
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
# (format, PIL mode, save options) per image, in turn: the JPEGs nvjpeg takes, and what stays on the CPU
KINDS = [
    ("JPEG", "RGB", {"quality": 90}),
    ("JPEG", "RGB", {"quality": 80, "progressive": True}),
    ("JPEG", "L", {"quality": 90}),
    ("JPEG", "CMYK", {"quality": 90}),  # CPU
    ("PNG", "RGB", {}),  # CPU
    ("JPEG", "RGB", {"quality": 85, "subsampling": 0}),
]


def _photo(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Smooth gradients with edges and a little noise: photo-like, so resampling differences stay small."""
    ys, xs = np.mgrid[0:height, 0:width]
    pixels = np.stack([xs * 255 // width, ys * 255 // height, ((xs // 13 + ys // 9) % 2) * 180], axis=-1)
    return Image.fromarray(np.clip(pixels + rng.integers(-8, 8, size=pixels.shape), 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def mixed_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 images of 40-150 px, 2 classes: RGB, progressive, grayscale and 4:4:4 JPEGs, CMYK JPEGs, PNGs."""
    root = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(0)
    for i in range(48):
        fmt, mode, options = KINDS[i % len(KINDS)]
        width, height = (int(v) for v in rng.integers(40, 150, size=2))
        path = root / "images" / f"class{i % 2}" / f"{i:03d}.{'png' if fmt == 'PNG' else 'jpg'}"
        path.parent.mkdir(parents=True, exist_ok=True)
        _photo(rng, width, height).convert(mode).save(path, format=fmt, **options)
    prepare_dataset(f"imagefolder:{root / 'images'}", str(root / "shards"), samples_per_shard=20)
    return root / "shards"


def _loader(path: Path, *, workers: int = 0, world_size: int = 1, rank: int = 0, **kwargs) -> ShardLoader:
    return ShardLoader(
        str(path),
        "train",
        rank=rank,
        world_size=world_size,
        batch_size=8 // world_size,
        img_size=SIZE,
        train=True,
        seed=7,
        num_slots=4,
        num_workers=workers,
        shuffle_buffer=4,
        **{"float_images": False, **kwargs},
    )


def _decoded(batch, device: str = "cpu") -> torch.Tensor:
    images, failed = decode_batch(batch.images.contiguous().to(device), batch.encoded, len(batch))
    assert failed == [] and images.device.type == device
    return images.cpu()


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The CPU path's pixels to within resampling: its crops of 2x the output and more are decoded at
    a reduced DCT scale and resized in uint8 arithmetic, the device's from the full decode in float.
    On CUDA nvjpeg's decode (its IDCT and chroma upsampling) differs from libjpeg's besides: a mean
    of 1.79 levels on an H100 (session 21), where the CPU's own decode stays under 1.5."""
    assert got.shape == expected.shape and got.dtype == expected.dtype == torch.uint8
    diff = (got.float() - expected.float()).abs()
    assert diff.mean() < 2.5 and diff.flatten(1).mean(1).max() < 5, (diff.mean(), diff.flatten(1).mean(1).max())


def test_only_jpegs_that_nvjpeg_decodes_as_libjpeg_are_left_to_the_device(mixed_dataset):
    rng = np.random.default_rng(1)
    for fmt, mode, options in KINDS:
        out = io.BytesIO()
        _photo(rng, 60, 40).convert(mode).save(out, format=fmt, **options)
        data = out.getvalue()
        assert (jpeg_device_size(data) is not None) == (fmt == "JPEG" and mode != "CMYK"), (fmt, mode)
        if fmt == "JPEG" and mode != "CMYK":
            assert jpeg_device_size(data) == (60, 40)
            assert jpeg_device_size(data[:-40]) is None  # cut short: the CPU decides whether it is corrupt


def test_chunks_carry_the_cpu_paths_boxes_and_the_cpu_crops_of_pngs_and_cmyk(mixed_dataset):
    first_shard = read_manifest(str(mixed_dataset), "train")[0].name
    stream = SampleStream([str(mixed_dataset / first_shard)], [ShardRange(0, 0, 12)])
    raws = [stream.read(want=True) for _ in range(12)]
    seeds = list(range(300, 312))
    common = {"img_size": SIZE, "label_kind": "single", "num_classes": 2, "reporter": SkipReporter(), "where": "t"}
    cpu = decode_chunk(raws, seeds, transform=train_augment(SIZE), **common)
    dev = decode_chunk(raws, seeds, transform=train_augment(SIZE), device_decode=True, **common)
    assert dev.keys == cpu.keys and torch.equal(dev.labels, cpu.labels)

    encoded = dev.encoded
    on_cpu = [p for p in range(12) if p not in encoded.positions]
    kinds = [("png" if "png" in r.fields else "jpg") for r in raws]
    assert 0 < len(on_cpu) < 12 and len(encoded) + dev.num_images == 12
    assert {kinds[p] for p in encoded.positions} == {"jpg"}
    assert {kinds[p] for p in on_cpu} == {"png", "jpg"}  # PNGs and CMYK JPEGs
    # The CPU's crops of the samples it kept are the CPU path's, bit for bit, in sample order.
    assert torch.equal(dev.images, cpu.images[on_cpu])
    # The boxes: the same seeded draws from the full image size as the CPU path's.
    crop = TrainCrop(SIZE)
    for position, box, jpeg in zip(encoded.positions, encoded.boxes, encoded.jpegs()):
        width, height = Image.open(io.BytesIO(bytes(jpeg))).size
        assert bytes(jpeg) == raws[position].fields["jpg"]
        assert box == crop.params(width, height, torch.Generator().manual_seed(seeds[position]))
    images = decode_batch(dev.images, [encoded], 12)[0]
    _close(images, cpu.images)
    # Crops under twice the output size, which the CPU decodes at full scale: within a level or two.
    full_scale = [p for p, box in zip(encoded.positions, encoded.boxes) if crop.draft_scale(box[3], box[2]) == 1]
    assert full_scale and (images[full_scale].int() - cpu.images[full_scale].int()).abs().max() <= 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workers", [0, 2])
def test_device_decoded_batches_are_the_cpu_paths(mixed_dataset, workers, device):
    cpu_loader = _loader(mixed_dataset, workers=workers)
    cpu = list(itertools.islice(cpu_loader, 8))  # into the second epoch (6 batches each)
    dev_loader = _loader(mixed_dataset, workers=workers, device_decode=True)
    dev = list(itertools.islice(dev_loader, 8))
    assert sum(len(e) for b in dev for e in b.encoded) > len(cpu) * 8 // 2  # most go to the device
    for c, d in zip(cpu, dev):
        assert (d.keys, d.epoch, d.step, d.num_skipped) == (c.keys, c.epoch, c.step, c.num_skipped)
        assert torch.equal(d.labels, c.labels)
        _close(_decoded(d, device), c.images.contiguous())
    assert dev_loader.state_dict() == cpu_loader.state_dict()


def test_resume_and_another_world_size_give_the_cpu_paths_samples(mixed_dataset):
    """Exact resume and the sample-key audit: with device decoding the positions and keys are the
    CPU path's, also when a run resumes on another number of workers."""
    first = _loader(mixed_dataset, device_decode=True)
    before = list(itertools.islice(first, 3))
    state = first.state_dict()
    after = []
    for rank in range(2):
        resumed = _loader(mixed_dataset, world_size=2, rank=rank, device_decode=True)
        resumed.load_state_dict(state)
        after.append(list(itertools.islice(resumed, 4)))
    cpu_first = _loader(mixed_dataset)
    cpu_before = list(itertools.islice(cpu_first, 3))
    cpu_after = []
    for rank in range(2):
        resumed = _loader(mixed_dataset, world_size=2, rank=rank)
        resumed.load_state_dict(cpu_first.state_dict())
        cpu_after.append(list(itertools.islice(resumed, 4)))
    assert [b.keys for b in before] == [b.keys for b in cpu_before]
    assert [[b.keys for b in rank] for rank in after] == [[b.keys for b in rank] for rank in cpu_after]
    for d, c in zip([b for rank in after for b in rank], [b for rank in cpu_after for b in rank]):
        _close(_decoded(d), c.images.contiguous())


@pytest.mark.parametrize("device", DEVICES)
def test_the_feed_decodes_on_the_device_and_resumes_exactly(mixed_dataset, device):
    """(On CUDA the feed reads, copies and decodes on its own thread.)"""
    plain = iter(DeviceFeed(_loader(mixed_dataset), device))
    feed = DeviceFeed(_loader(mixed_dataset, workers=1, device_decode=True), device)
    fed, states = iter(feed), []
    for _ in range(3):
        expected, batch = next(plain), next(fed)
        assert batch.keys == expected.keys and torch.equal(batch.labels, expected.labels) and not batch.encoded
        assert batch.images.is_contiguous() and batch.images.dtype == torch.uint8
        assert batch.images.device.type == batch.labels.device.type == device
        _close(batch.images.cpu(), expected.images.cpu())
        states.append(feed.state_dict())
    assert [s["consumed_per_slot"] for s in states] == [2, 4, 6]
    resumed = DeviceFeed(_loader(mixed_dataset, device_decode=True), device)
    resumed.load_state_dict(states[1])
    again = next(iter(resumed))
    assert again.keys == batch.keys and torch.equal(again.images, batch.images)  # the third batch again
    fed.close()


def test_jpegs_no_decoder_reads_are_left_out_as_corrupt():
    out = io.BytesIO()
    _photo(np.random.default_rng(2), 48, 40).save(out, format="JPEG")
    good, bad = out.getvalue(), b"\xff\xd8\xff\xc0 this is not a JPEG \xff\xd9"
    box = (0, 0, 40, 48, False)
    encoded = EncodedCrops.of([good, bad, good], [box, box, (4, 8, 20, 20, True)], [0, 2, 3], SIZE)
    cpu_crops = torch.full((1, 3, SIZE, SIZE), 7, dtype=torch.uint8)  # position 1 was decoded by the CPU
    images, failed = decode_batch(cpu_crops, [encoded], 4)
    assert failed == [2] and images.shape == (3, 3, SIZE, SIZE)
    assert torch.equal(images[1], cpu_crops[0])
    whole = Image.open(io.BytesIO(good)).convert("RGB")
    expected = torch.from_numpy(np.array(whole.resize((SIZE, SIZE), Image.Resampling.BILINEAR))).permute(2, 0, 1)
    assert (images[0].float() - expected.float()).abs().mean() < 1.5
    flipped = whole.crop((8, 4, 28, 24)).resize((SIZE, SIZE), Image.Resampling.BILINEAR).transpose(0)
    assert (images[2].float() - torch.from_numpy(np.array(flipped)).permute(2, 0, 1).float()).abs().mean() < 1.5


def test_gpu_decode_is_refused_where_no_gpu_trains(mixed_dataset):
    base = [f"data.train={mixed_dataset}", "cluster.num_workers=1", "train.batch_size=8", "train.micro_batch_size=8"]
    with pytest.raises(ConfigError, match=r"data.decode=gpu .* trains on CPUs \(cluster.gpus_per_worker=0\): use data"):
        load_config(TrainingConfig, None, [*base, "data.decode=gpu"])
    with pytest.raises(ConfigError, match=r"trains on TPUs \(train.backend=xla\)"):
        load_config(TrainingConfig, None, [*base, "data.decode=gpu", "train.backend=xla"])
    assert (
        load_config(TrainingConfig, None, [*base, "data.decode=gpu", "cluster.gpus_per_worker=1"]).data.decode == "gpu"
    )
    assert load_config(TrainingConfig, None, base).data.decode == "auto"
    # On the worker: auto decodes on CUDA only; gpu on another device is refused by name.
    assert not decodes_on_device("auto", torch.device("cpu")) and not decodes_on_device("cpu", torch.device("cpu"))
    with pytest.raises(ValueError, match="data.decode=gpu needs a CUDA device, but this worker trains on cpu"):
        decodes_on_device("gpu", torch.device("cpu"))
    with pytest.raises(ValueError, match="device_decode .* needs train=True and float_images=False"):
        _loader(mixed_dataset, device_decode=True, float_images=True)


def test_training_with_device_decoding_trains_on_the_cpu_paths_samples(
    process_group, mixed_dataset, tmp_path, monkeypatch
):
    """The sample-key audit of a run whose JPEGs the feed decodes (forced on the CPU, where
    data.decode=gpu is refused) is the CPU path's, step by step, and it trains."""
    from pretrain_helpers import in_process_loop

    import vitray.trainers.loop as loop_module
    import vitray.trainers.step.feed as feed_module
    from vitray.trainers.keys import collect_keys

    decoded = []

    def counting_decode(images, encoded, count):
        decoded.append(sum(len(e) for e in encoded))
        return decode_batch(images, encoded, count)

    monkeypatch.setattr(feed_module, "decode_batch", counting_decode)
    keys, losses = {}, {}
    for setting in ("cpu", "device"):
        monkeypatch.setattr(loop_module, "decodes_on_device", lambda _setting, _device, on=setting == "device": on)
        folder = tmp_path / setting
        loop = in_process_loop(mixed_dataset, folder, f"debug.record_sample_keys={folder / 'keys'}", "data.flip=true")
        losses[setting] = loop.run()["loss"]
        keys[setting] = collect_keys(folder / "keys")
    assert keys["device"] == keys["cpu"] and sorted(keys["cpu"]) == [0, 1, 2, 3]
    assert len(decoded) >= 4 and sum(decoded) > 16  # the feed decoded most JPEGs of every batch
    assert losses["device"] == pytest.approx(losses["cpu"], abs=0.05)


def _reference_crop(image: torch.Tensor, box: tuple[int, int, int, int, bool], size: int) -> torch.Tensor:
    """The per-image crop, resize and flip decode_batch made before it batched them (and the
    reference of the batched resize): float32 ``(3, size, size)``."""
    top, left, h, w, flip = box
    crop = image[:, top : top + h, left : left + w].unsqueeze(0).float()
    if (h, w) != (size, size):
        crop = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return crop[0].flip(-1) if flip else crop[0]


def _jpegs(count: int, seed: int = 3) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        width, height = (int(v) for v in rng.integers(40, 150, size=2))
        data = io.BytesIO()
        _photo(rng, width, height).save(data, format="JPEG", quality=90)
        out.append(data.getvalue())
    return out


class _CountOps(TorchDispatchMode):
    """Counts the torch operators called under it: views (no kernel) and the others."""

    def __init__(self) -> None:
        super().__init__()
        self.views = self.others = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.others += 1
        return func(*args, **(kwargs or {}))


def test_the_host_work_of_decode_batch_does_not_grow_per_image():
    """The feed decodes on a thread that shares the GIL with the training step's: past the
    decoder's own work (torchvision's, one call for the list with nvjpeg), decode_batch resizes
    the crops with a constant number of operators per chunk of images; per image only two views,
    of its box in the decoded image and in the chunk's tensor (copied by one operator for all)."""
    jpegs, crop, cpu = _jpegs(8), TrainCrop(SIZE), torch.device("cpu")
    counts = {}
    for count in (8, 64):
        data = [jpegs[i % len(jpegs)] for i in range(count)]
        boxes = [crop.device_box(d, i) for i, d in enumerate(data)]
        encoded = EncodedCrops.of(data, boxes, range(count), SIZE)
        with _CountOps() as decoding:
            device_decode._decode_jpegs(encoded.jpegs(), cpu)
        with _CountOps() as ops:
            images, failed = decode_batch(torch.empty((0, 3, SIZE, SIZE), dtype=torch.uint8), [encoded], count)
        assert images.shape == (count, 3, SIZE, SIZE) and failed == []
        counts[count] = (ops.others - decoding.others, ops.views - decoding.views)
    (others_8, views_8), (others_64, views_64) = counts[8], counts[64]
    assert others_64 - others_8 <= 4, counts
    assert views_64 - views_8 <= 2 * 56, counts


def _boxes(images: list[torch.Tensor], count: int) -> list[tuple[int, int, int, int, bool]]:
    """Boxes of every kind, flipped and not: whole images, the output size, shrinking, enlarging,
    thin, against each edge, anywhere."""
    rng = np.random.default_rng(4)
    boxes = []
    for i in range(count):
        height, width = images[i % len(images)].shape[1:]
        kind = i % 6
        if kind == 0:
            h, w = height, width
        elif kind == 1:
            h, w = min(SIZE, height), min(SIZE, width)
        elif kind == 2:  # enlarged, one side at most
            h, w = int(rng.integers(1, SIZE)), int(rng.integers(1, width + 1))
        else:
            h, w = int(rng.integers(1, height + 1)), int(rng.integers(1, width + 1))
        top = [0, height - h, int(rng.integers(0, height - h + 1))][i % 3]
        left = [width - w, int(rng.integers(0, width - w + 1)), 0][i % 3]
        boxes.append((top, left, h, w, bool(i // 6 % 2)))
    return boxes


def _within_a_level(got: torch.Tensor, expected: torch.Tensor) -> None:
    diff = (got.int() - expected.int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 0.1, (diff.max(), diff.float().mean())


def test_the_batched_resize_is_the_per_image_one():
    """decode_batch resizes all crops with two batched matmuls (weights built as aten builds
    them): the per-image F.interpolate(antialias=True) and flip to within rounding, for boxes
    shrunk and enlarged, flipped, not square, against the edges, over more than one chunk."""
    count = device_decode.CHUNK + 26
    jpegs = _jpegs(8, seed=5)
    data = [jpegs[i % len(jpegs)] for i in range(count)]
    images = [decode_jpeg(torch.frombuffer(bytearray(d), dtype=torch.uint8), mode=ImageReadMode.RGB) for d in data]
    boxes = _boxes(images, count)
    expected = torch.stack([_reference_crop(image, box, SIZE) for image, box in zip(images, boxes)])
    expected = expected.round_().clamp_(0, 255).to(torch.uint8)
    # Every fourth sample decoded by the CPU (given as pixels), two positions left for corrupt ones.
    on_cpu = list(range(0, count, 4))
    on_device = [p for p in range(count) if p not in on_cpu]
    encoded = EncodedCrops.of(
        [data[p] for p in on_device] + [b"\xff\xd8 not a JPEG"] * 2,
        [boxes[p] for p in on_device] + [boxes[0]] * 2,
        [p + (p >= 10) + (p >= 30) for p in on_device] + [10, 31],
        SIZE,
    )
    cpu_crops = expected[on_cpu].clone()
    got, failed = decode_batch(cpu_crops, [encoded], count + 2)
    assert failed == [10, 31] and got.shape == expected.shape and got.is_contiguous()
    assert torch.equal(got[on_cpu], expected[on_cpu])
    _within_a_level(got[on_device], expected[on_device])
    # Every sample decoded here, in order; and the float16 the device computes in.
    encoded = EncodedCrops.of(data, boxes, range(count), SIZE)
    got, failed = decode_batch(torch.empty((0, 3, SIZE, SIZE), dtype=torch.uint8), [encoded], count)
    assert failed == []
    _within_a_level(got, expected)
    half = torch.empty_like(expected)
    device_decode._resize_into(half, list(range(count)), images, boxes, dtype=torch.float16)
    _within_a_level(half, expected)
