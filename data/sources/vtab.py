"""``vtab:TASK:PATH``: one VTAB-1k task from its TFDS build on disk, split as VTAB defines it.

PATH is the TFDS build's version folder (see :mod:`vitray.data.sources.tfds`), TASK one of
:data:`VTAB_TASKS` (the names of vitray's benchmarks ``vtab/TASK``). Two splits are written:

- ``train``: VTAB's ``train800val200``, exactly 1000 examples: ``train800`` first (positions
  0-799), then ``val200`` (800-999), so ``train[:800]`` / ``train[800:1000]`` are VTAB's own
  selection splits and ``train`` is what the final run trains on;
- ``test``: VTAB's full test split of the task.

Which TFDS examples those are, and each task's label, follow google-research/task_adaptation
(``task_adaptation/data/*.py``): e.g. DTD takes ``train[:800]`` + ``validation[:200]``; CIFAR-100
``train[:800]`` + ``train[45000:45200]`` (the first 90% of train is VTAB's train split);
EuroSAT ``train[:800]`` + ``train[16200:16400]`` and tests on ``train[21600:]``; CLEVR counts the
objects (label = count - 3) and tests on TFDS's ``validation``; dSprites bins positions and
orientations into 16 classes (and its 0/1 images are re-encoded as 0/255 PNGs, as VTAB scales them);
KITTI's label is the distance bin of the closest vehicle.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .base import Sample, Source, image_ext
from .tfds import (
    Example,
    Segment,
    TfdsBuild,
    TfdsChunk,
    contiguous_range,
    example_image,
    example_int,
    segment_nbytes,
)
from .tfrecord import CorruptRecord

TRAIN800, VAL200 = 800, 200

# How each task's train800 / val200 / test are cut from the TFDS splits (task_adaptation/data/*.py):
# TFDS split sizes -> ((split, start, stop) of train800, of val200, of test).
Range = tuple[str, int, int]
SplitRule = Callable[[dict[str, int]], tuple[Range, Range, Range]]


def _official_validation(sizes: dict[str, int]) -> tuple:
    """train[:800] + validation[:200]; test = test."""
    return ("train", 0, TRAIN800), ("validation", 0, VAL200), ("test", 0, sizes["test"])


def _held_out_of_train(percent: int, test: str = "test") -> Callable[[dict[str, int]], tuple]:
    """VTAB's train = the first `percent`% of TFDS train: val200 follows it; test = `test`."""

    def rule(sizes: dict[str, int]) -> tuple:
        train_count = percent * sizes["train"] // 100
        return ("train", 0, TRAIN800), ("train", train_count, train_count + VAL200), (test, 0, sizes[test])

    return rule


def _three_way_of_train(train_percent: int, val_percent: int) -> Callable[[dict[str, int]], tuple]:
    """train / val / test all cut from TFDS train (EuroSAT, Resisc45, dSprites)."""

    def rule(sizes: dict[str, int]) -> tuple:
        total = sizes["train"]
        train_count, val_count = train_percent * total // 100, val_percent * total // 100
        return (
            ("train", 0, TRAIN800),
            ("train", train_count, train_count + VAL200),
            ("train", train_count + val_count, total),
        )

    return rule


def _smallnorb(sizes: dict[str, int]) -> tuple:
    """val200 = test[:200]; test = test[50%:] (TFDS rounds a percentage to the closest index)."""
    half = round(50 * sizes["test"] / 100)
    return ("train", 0, TRAIN800), ("test", 0, VAL200), ("test", half, sizes["test"])


# -- labels -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Feature:
    """The integer feature `key`, optionally grouped into `num_classes` bins of `original` values."""

    key: str
    original: int | None = None
    num_classes: int | None = None

    def __call__(self, example: Example, where: str) -> int:
        value = example_int(example, self.key, where)
        if self.original is None:
            return value
        return int(np.floor(value / (self.original / self.num_classes)))


@dataclass(frozen=True)
class _ClevrCount:
    def __call__(self, example: Example, where: str) -> int:
        return len(_values(example, "objects/size", where)) - 3


@dataclass(frozen=True)
class _Threshold:
    """The largest i with thresholds[i] < value (VTAB's ``reduce_max(where(thrs - dist < 0))``)."""

    thresholds: tuple[float, ...]

    def bin(self, value: float) -> int:
        return int(np.flatnonzero(np.asarray(self.thresholds) < value).max())


@dataclass(frozen=True)
class _ClevrClosest(_Threshold):
    def __call__(self, example: Example, where: str) -> int:
        depths = _values(example, "objects/pixel_coords", where)[2::3]  # (x, y, depth) per object
        return self.bin(min(depths))


@dataclass(frozen=True)
class _KittiClosestVehicle(_Threshold):
    def __call__(self, example: Example, where: str) -> int:
        types = _values(example, "objects/type", where)
        z = _values(example, "objects/location", where)[2::3]  # (x, y, z) per object
        vehicles = [depth for kind, depth in zip(types, z) if kind < 3]  # Car, Van, Truck
        return self.bin(min([*vehicles, 1000.0]))


def _values(example: Example, key: str, where: str) -> list:
    if key not in example:
        raise CorruptRecord(f"{where} has no feature {key!r} (features: {sorted(example)})")
    return example[key]


# -- images -------------------------------------------------------------------------------------


def _scaled_png(data: bytes) -> bytes:
    """dSprites stores 0/1 pixel values; VTAB multiplies them by 255."""
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("L"), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels * np.uint8(255)).save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass(frozen=True)
class VtabTask:
    tfds_name: str
    num_classes: int
    splits: SplitRule
    label: Callable[[Example, str], int]
    label_feature: str | None = None  # class names come from this ClassLabel feature's labels.txt
    scale_binary_images: bool = False
    tfds_config: str | None = None  # the builder config VTAB reads, when the dataset has several


VTAB_TASKS: dict[str, VtabTask] = {
    "caltech101": VtabTask("caltech101", 102, _held_out_of_train(90), _Feature("label"), "label"),
    "cifar100": VtabTask("cifar100", 100, _held_out_of_train(90), _Feature("label"), "label"),
    "dtd": VtabTask("dtd", 47, _official_validation, _Feature("label"), "label"),
    "flowers102": VtabTask("oxford_flowers102", 102, _official_validation, _Feature("label"), "label"),
    "pets": VtabTask("oxford_iiit_pet", 37, _held_out_of_train(80), _Feature("label"), "label"),
    "sun397": VtabTask("sun397", 397, _official_validation, _Feature("label"), "label", tfds_config="tfds"),
    "svhn": VtabTask("svhn_cropped", 10, _held_out_of_train(90), _Feature("label"), "label"),
    "patch_camelyon": VtabTask("patch_camelyon", 2, _official_validation, _Feature("label"), "label"),
    "eurosat": VtabTask("eurosat", 10, _three_way_of_train(60, 20), _Feature("label"), "label"),
    "resisc45": VtabTask("resisc45", 45, _three_way_of_train(60, 20), _Feature("label"), "label"),
    "retinopathy": VtabTask(
        "diabetic_retinopathy_detection",
        5,
        _official_validation,
        _Feature("label"),
        "label",
        tfds_config="btgraham-300",
    ),
    "clevr_count": VtabTask("clevr", 8, _held_out_of_train(90, test="validation"), _ClevrCount()),
    "clevr_dist": VtabTask(
        "clevr", 6, _held_out_of_train(90, test="validation"), _ClevrClosest((0.0, 8.0, 8.5, 9.0, 9.5, 10.0, 100.0))
    ),
    "dmlab": VtabTask("dmlab", 6, _official_validation, _Feature("label"), "label"),
    "dsprites_loc": VtabTask(
        "dsprites", 16, _three_way_of_train(80, 10), _Feature("label_x_position", 32, 16), scale_binary_images=True
    ),
    "dsprites_ori": VtabTask(
        "dsprites", 16, _three_way_of_train(80, 10), _Feature("label_orientation", 40, 16), scale_binary_images=True
    ),
    "kitti_dist": VtabTask("kitti", 4, _official_validation, _KittiClosestVehicle((-100.0, 8.0, 20.0, 999.0))),
    "smallnorb_azimuth": VtabTask("smallnorb", 18, _smallnorb, _Feature("label_azimuth"), "label_azimuth"),
    "smallnorb_elevation": VtabTask("smallnorb", 9, _smallnorb, _Feature("label_elevation"), "label_elevation"),
}


@dataclass(frozen=True)
class _VtabSample:
    """Picklable example -> sample for one task (label checked against the task's class count)."""

    label: Callable[[Example, str], int]
    num_classes: int
    scale_binary_images: bool

    def __call__(self, example: Example, where: str) -> Sample:
        data = example_image(example, "image", where)
        if self.scale_binary_images:
            data = _scaled_png(data)
        label = self.label(example, where)
        if not 0 <= label < self.num_classes:
            raise CorruptRecord(f"{where}: VTAB label {label} is outside 0..{self.num_classes - 1}")
        return Sample(data, image_ext(data), label)


class VtabSource(Source):
    kind = "vtab"
    random_access = False  # train[:800] must stay VTAB's train800: the order is the split

    def __init__(self, task_name: str, build: TfdsBuild, segments: dict[str, list[Segment]], classes: list[str]):
        task = VTAB_TASKS[task_name]
        super().__init__(f"{self.kind}:{task_name}:{build.folder}", f"vtab_{task_name}", classes, "single")
        self.task_name, self.build, self.segments = task_name, build, segments
        self.to_sample = _VtabSample(task.label, task.num_classes, task.scale_binary_images)

    @classmethod
    def open(cls, location: str) -> VtabSource:
        task_name, sep, path = location.partition(":")
        if not sep or task_name not in VTAB_TASKS or not path:
            raise ValueError(
                f"vtab source {location!r} is not TASK:PATH with TASK one of {sorted(VTAB_TASKS)} and PATH a TFDS "
                "build's version folder (e.g. vtab:dtd:~/tensorflow_datasets/dtd/3.0.1)"
            )
        task = VTAB_TASKS[task_name]
        build = TfdsBuild.open(Path(path).expanduser().resolve())
        if build.name != task.tfds_name:
            raise ValueError(
                f"vtab task {task_name!r} reads the TFDS dataset {task.tfds_name!r}; {build.folder} holds {build.name!r}"
            )
        if task.tfds_config and build.config != task.tfds_config:
            raise ValueError(
                f"vtab task {task_name!r} reads the {task.tfds_name}/{task.tfds_config} config; {build.folder} is "
                f"config {build.config!r}"
            )
        sizes = {name: split.size for name, split in build.splits.items()}
        try:
            train800, val200, test = task.splits(sizes)
        except KeyError as missing:
            raise ValueError(
                f"vtab task {task_name!r} needs the TFDS split {missing}; {build.folder} has {sorted(sizes)}"
            ) from None
        segments = {
            "train": [cls._segment(build, *train800), cls._segment(build, *val200)],
            "test": [cls._segment(build, *test)],
        }
        names = build.class_names(task.label_feature) if task.label_feature else None
        classes = names if names and len(names) == task.num_classes else [str(i) for i in range(task.num_classes)]
        return cls(task_name, build, segments, classes)

    @staticmethod
    def _segment(build: TfdsBuild, split: str, start: int, stop: int) -> Segment:
        if split not in build.splits:
            raise ValueError(
                f"{build.folder}: VTAB needs the TFDS split {split!r}; the build has {sorted(build.splits)}"
            )
        whole = build.splits[split]
        if not 0 <= start < stop <= whole.size:
            raise ValueError(
                f"{build.folder}: VTAB needs examples [{start}:{stop}] of TFDS split {split!r}, which has {whole.size}"
            )
        return Segment(whole, start, stop)

    def split_sizes(self) -> dict[str, int]:
        return {name: sum(s.stop - s.start for s in segs) for name, segs in self.segments.items()}

    def sample_nbytes(self, split: str) -> np.ndarray:
        return segment_nbytes(self.segments[split])

    def chunk(self, split: str, indices: Sequence[int]) -> TfdsChunk:
        start, stop = contiguous_range(indices, self.kind)
        return TfdsChunk(self.segments[split], start, stop, self.to_sample)
