"""The benchmark registry: the ViT paper's transfer datasets, VTAB-1k, and the built-in demo set.

A :class:`Benchmark` says which prepared dataset (a folder `<data_root>/<dataset>` written by
`vitray data prepare`) to read, which splits play train / test, how many classes there are, and
the protocol settings of the paper (few-shot shots, fine-tuning steps / learning rates / batch /
resolution). Nothing here downloads data: a benchmark whose data is not prepared yields a
:class:`MissingDataset` whose message is the exact `vitray data prepare ...` command to run.

Sources of the settings: the ViT paper (Dosovitskiy et al. 2021, appendix B.1.1 and Table 4),
VTAB (Zhai et al. 2019) for the 19 tasks and their class counts, big_vision's few-shot config
(shots 1/5/10/25, 3 seeds, l2 2**10; images at the checkpoint's resolution, pre-processed as its
``resize(256)|central_crop(224)``: for 224 px, squashed to 256x256 and the central 224 crop).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from vitray import storage
from vitray.data.config import TrainCropKind
from vitray.data.layout import DatasetInfo, dataset_digest, read_dataset_info
from vitray.data.sources.vtab import VTAB_TASKS

VTAB_GROUPS = ("natural", "specialized", "structured")
# ImageNet from its TFDS builds (TFDS names the validation split `validation`; the benchmarks read `val`).
IMAGENET_SOURCE = "tfds:/path/to/tensorflow_datasets/imagenet2012/5.1.0?split=validation:val"
IMAGENET_REAL_SOURCE = "tfds:/path/to/tensorflow_datasets/imagenet2012_real/1.0.0?label=real_label&split=validation:val"
# The fine-tuning sweeps of the paper's Table 4: ImageNet's, and the one of CIFAR, Pets and Flowers.
PAPER_LRS = (0.003, 0.01, 0.03, 0.06)
SMALL_DATASET_LRS = (0.001, 0.003, 0.01, 0.03)


@dataclass(frozen=True)
class FewShotProtocol:
    """Linear few-shot probe settings (big_vision's defaults). The resolution is not a protocol
    setting: probes run at the checkpoint's own resolution (or the grid's `fewshot.img_size`)."""

    shots: tuple[int, ...] = (1, 5, 10, 25)
    seeds: int = 3
    l2_reg: float = 2.0**10


@dataclass(frozen=True)
class TrainPreprocess:
    """How a fine-tune run crops and flips its training images: big_vision's `pp_train` of the task
    (`configs/transfer.py`: `inception_crop`, `resmall_crop` or `resize_crop`, then `flip_lr` unless
    the task rules it out), as `data.crop` / `data.min_crop_area` / `data.flip` of the run
    (:class:`vitray.data.transforms.TrainCrop`). `resize` takes no crop at all: for labels that a
    crop would change (a position, a count, a distance read from apparent size)."""

    crop: TrainCropKind = "inception_crop"
    min_crop_area: float = 0.05  # the inception crop's smallest area (the authors': 5%)
    flip: bool = True

    def describe(self) -> str:
        """big_vision's spelling, e.g. "inception_crop(0.05)|flip_lr" or "resize"."""
        crop = f"inception_crop({self.min_crop_area:g})" if self.crop == "inception_crop" else self.crop
        return crop + ("|flip_lr" if self.flip else "")


# The crops of the authors' transfer config: ImageNet, Pets and Flowers-102 take the inception
# crop, CIFAR the resize-small + random crop it reports as the better choice there.
INCEPTION = TrainPreprocess("inception_crop")
RESMALL = TrainPreprocess("resmall_crop")


@dataclass(frozen=True)
class FinetuneProtocol:
    """Fine-tuning settings: SGD momentum 0.9, cosine decay, no weight decay, grad clip 1.

    `learning_rates` is the paper's sweep (one value for VTAB). Model selection holds out part of
    the train split (split slices, see :mod:`vitray.data.splits`): every learning rate trains on
    `train_split` and is scored on `val_split` and on the test split; the reported test top-1 is
    that of the learning rate with the best validation top-1 -- big_vision's `train[:98%]` /
    `train[98%:]`. When `final_train_split` is set (VTAB-1k: select on `train[:800]` /
    `train[800:1000]`, then train on `train[:1000]`), the selected learning rate is trained once
    more on it and that run's test top-1 is reported; with a single learning rate there is
    nothing to select, and only that final run is made.
    Warm-up steps are not given by the paper for every task: 500 (ImageNet, CIFAR) and 100 (Pets,
    Flowers) follow the authors' configs, 200 for VTAB's 2500 steps is vitray's choice.
    `preprocess` is the task's training crop and flip (:class:`TrainPreprocess`).
    """

    steps: int
    learning_rates: tuple[float, ...]
    batch_size: int = 512
    warmup_steps: int = 500
    resolution: int = 384
    train_split: str = "train[:98%]"
    val_split: str = "train[98%:]"
    final_train_split: str | None = None
    preprocess: TrainPreprocess = INCEPTION


@dataclass(frozen=True)
class Benchmark:
    """One downstream task: where its prepared data lives and how the paper evaluates it."""

    name: str
    title: str
    num_classes: int
    dataset: str
    train_split: str
    test_split: str
    prepare_source: str
    finetune: FinetuneProtocol
    fewshot: FewShotProtocol = field(default_factory=FewShotProtocol)
    groups: tuple[str, ...] = ()
    label_kind: Literal["single", "multi"] = "single"
    # Set when the train split lives in another prepared dataset (ImageNet-ReaL trains on ImageNet).
    train_dataset: str | None = None
    train_prepare_source: str | None = None
    notes: str = ""

    @property
    def vtab_group(self) -> str | None:
        """ "natural" / "specialized" / "structured" for VTAB-1k tasks, else None."""
        return next((g.split("/", 1)[1] for g in self.groups if g.startswith("vtab/")), None)


class MissingDataset(FileNotFoundError):
    """A benchmark's prepared data is not at the expected place; the message says how to prepare it."""

    def __init__(self, benchmark: str, path: str, command: str, reason: str):
        self.benchmark, self.path, self.command, self.reason = benchmark, path, command, reason
        super().__init__(f"benchmark {benchmark!r}: {reason}. Prepare it with:\n  {command}")


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------


def _held_out(val_percent: int) -> dict[str, str]:
    """The last `val_percent` of `train` for validation, the rest for training (big_vision style)."""
    return {"train_split": f"train[:{100 - val_percent}%]", "val_split": f"train[{100 - val_percent}%:]"}


def _paper(
    name: str,
    title: str,
    num_classes: int,
    source: str,
    steps: int,
    lrs: tuple[float, ...],
    warmup: int,
    val_percent: int,
    test_split: str = "test",
    preprocess: TrainPreprocess = INCEPTION,
    **kw: Any,
) -> Benchmark:
    finetune = FinetuneProtocol(
        steps=steps, learning_rates=lrs, warmup_steps=warmup, preprocess=preprocess, **_held_out(val_percent)
    )
    return Benchmark(
        name=name,
        title=title,
        num_classes=num_classes,
        dataset=name,
        train_split="train",
        test_split=test_split,
        prepare_source=source,
        groups=("paper",),
        finetune=finetune,
        **kw,
    )


# VTAB-1k: the 1000-example "train800val200" set is prepared as split `train` (first 800 = train800,
# last 200 = val200) and the full test set as `test`. Lr 0.01, 2500 steps, batch 512 for every task,
# 200 warm-up steps (the paper gives none; vit_jax's default is 500: vitray's choice);
# a sweep selects on train800 / val200, then the chosen lr trains on all 1000 (the VTAB protocol).
_VTAB_FINETUNE = FinetuneProtocol(
    steps=2500,
    learning_rates=(0.01,),
    warmup_steps=200,
    train_split="train[:800]",
    val_split="train[800:1000]",
    final_train_split="train[:1000]",
)
# The demo's 8x8 digits: at 8 pixels any crop cuts into a stroke (the authors' 5% leaves a fragment
# of one), and a mirror turns a 2 into something else. Fine-tuned from the demo's run (200 steps,
# lr 0.01, 24 px), whole images gave 0.84 test top-1, the pre-training's inception crop from 50 %
# of the area 0.76, resize_crop 0.62.
DIGITS_CROP = TrainPreprocess("resize", flip=False)

# VTAB-1k's training crops follow BiT's rule, which the ViT paper's VTAB protocol comes from
# (Kolesnikov et al. 2020, sec. 3.3): the image resized to a square, a random crop of it and a
# random flip, except that no random crop or flip is made "for tasks where those actions destroy
# the label semantics, such as when predicting object orientations or coordinates in pixel space".
RESIZE_CROP = TrainPreprocess("resize_crop")
# The label is a mirror-sensitive shape (SVHN's digits): the crop stays, the flip goes.
RESIZE_CROP_NO_FLIP = TrainPreprocess("resize_crop", flip=False)
# The label is a count, a distance or depth read from apparent size, or a position (CLEVR, DMLab,
# KITTI, dSprites location, smallNORB elevation): a crop can cut objects out or change their size
# and place, so the whole image is taken. A mirror keeps counts, distances and elevation.
WHOLE = TrainPreprocess("resize")
# ... and where the label is a left-right position or an orientation (dSprites location and
# orientation, smallNORB azimuth), a mirror changes it too.
WHOLE_NO_FLIP = TrainPreprocess("resize", flip=False)

# name, title, classes, group, TFDS source VTAB uses (for the notes), training crop and flip
_VTAB_TASKS = (
    ("caltech101", "Caltech101", 102, "natural", "caltech101", RESIZE_CROP),
    ("cifar100", "CIFAR-100", 100, "natural", "cifar100", RESIZE_CROP),
    ("dtd", "DTD", 47, "natural", "dtd", RESIZE_CROP),
    ("flowers102", "Oxford Flowers-102", 102, "natural", "oxford_flowers102", RESIZE_CROP),
    ("pets", "Oxford-IIIT Pets", 37, "natural", "oxford_iiit_pet", RESIZE_CROP),
    ("sun397", "SUN397", 397, "natural", "sun397", RESIZE_CROP),
    ("svhn", "SVHN", 10, "natural", "svhn_cropped", RESIZE_CROP_NO_FLIP),
    ("patch_camelyon", "Patch Camelyon", 2, "specialized", "patch_camelyon", RESIZE_CROP),
    ("eurosat", "EuroSAT", 10, "specialized", "eurosat", RESIZE_CROP),
    ("resisc45", "Resisc45", 45, "specialized", "resisc45", RESIZE_CROP),
    (
        "retinopathy",
        "Diabetic Retinopathy",
        5,
        "specialized",
        "diabetic_retinopathy_detection/btgraham-300",
        RESIZE_CROP,
    ),
    ("clevr_count", "CLEVR count", 8, "structured", "clevr (count_all: 3..10 objects)", WHOLE),
    ("clevr_dist", "CLEVR distance", 6, "structured", "clevr (closest_object_distance)", WHOLE),
    ("dmlab", "DMLab", 6, "structured", "dmlab", WHOLE),
    ("dsprites_loc", "dSprites location", 16, "structured", "dsprites (label_x_position, 16 bins)", WHOLE_NO_FLIP),
    ("dsprites_ori", "dSprites orientation", 16, "structured", "dsprites (label_orientation, 16 bins)", WHOLE_NO_FLIP),
    ("kitti_dist", "KITTI distance", 4, "structured", "kitti (closest_vehicle_distance)", WHOLE),
    ("smallnorb_azimuth", "smallNORB azimuth", 18, "structured", "smallnorb (label_azimuth)", WHOLE_NO_FLIP),
    ("smallnorb_elevation", "smallNORB elevation", 9, "structured", "smallnorb (label_elevation)", WHOLE),
)


def _vtab(name: str, title: str, num_classes: int, group: str, tfds: str, preprocess: TrainPreprocess) -> Benchmark:
    dataset = f"vtab_{name}"
    task = VTAB_TASKS[name]
    build = f"/path/to/tensorflow_datasets/{task.tfds_name}/{task.tfds_config + '/' if task.tfds_config else ''}VERSION"
    return Benchmark(
        name=f"vtab/{name}",
        title=f"VTAB {title}",
        num_classes=num_classes,
        dataset=dataset,
        train_split="train",
        test_split="test",
        prepare_source=f"vtab:{name}:{build}",
        finetune=replace(_VTAB_FINETUNE, preprocess=preprocess),
        groups=("vtab", f"vtab/{group}"),
        notes=(
            f"VTAB-1k task from TFDS {tfds}: split `train` holds exactly the 1000 train800val200 "
            "examples (train800 first), split `test` the full test set; `vitray data prepare vtab:...` "
            "cuts them from the TFDS build as VTAB does"
        ),
    )


def _build_registry() -> dict[str, Benchmark]:
    entries = [
        _paper(
            "imagenet",
            "ImageNet",
            1000,
            IMAGENET_SOURCE,
            20_000,
            PAPER_LRS,
            500,
            1,
            test_split="val",
            notes="ILSVRC-2012; split `val` is the 50k validation set (TFDS `validation`)",
        ),
        _paper(
            "imagenet_real",
            "ImageNet-ReaL",
            1000,
            IMAGENET_REAL_SOURCE,
            20_000,
            PAPER_LRS,
            500,
            1,
            test_split="val",
            label_kind="multi",
            train_dataset="imagenet",
            train_prepare_source=IMAGENET_SOURCE,
            notes="ImageNet validation images with the ReaL label sets (multi-label); trains on ImageNet",
        ),
        _paper(
            "cifar10",
            "CIFAR-10",
            10,
            "cifar10:/path/to/cifar-10-binary.tar.gz",
            10_000,
            SMALL_DATASET_LRS,
            500,
            2,
            preprocess=RESMALL,
        ),
        _paper(
            "cifar100",
            "CIFAR-100",
            100,
            "cifar100:/path/to/cifar-100-binary.tar.gz",
            10_000,
            SMALL_DATASET_LRS,
            500,
            2,
            preprocess=RESMALL,
        ),
        _paper(
            "pets",
            "Oxford-IIIT Pets",
            37,
            "pets:/path/to/oxford-iiit-pet",
            500,
            SMALL_DATASET_LRS,
            100,
            10,
            notes="images.tar.gz + annotations.tar.gz; split `train` is trainval (3,680 images)",
        ),
        _paper(
            "flowers102",
            "Oxford Flowers-102",
            102,
            "flowers102:/path/to/oxford-flowers102",
            500,
            SMALL_DATASET_LRS,
            100,
            10,
            notes="102flowers.tgz + imagelabels.mat + setid.mat; `train` is trnid",
        ),
        *(_vtab(*task) for task in _VTAB_TASKS),
        Benchmark(
            name="digits",
            title="scikit-learn digits (demo)",
            num_classes=10,
            dataset="digits",
            train_split="train",
            test_split="test",
            prepare_source="builtin:digits",
            groups=("demo",),
            fewshot=FewShotProtocol(shots=(1, 5, 10, 25), seeds=3),
            finetune=FinetuneProtocol(
                steps=200,
                learning_rates=(0.01, 0.03),
                batch_size=64,
                warmup_steps=20,
                resolution=32,
                preprocess=DIGITS_CROP,
                **_held_out(10),
            ),
            notes="8x8 handwritten digits shipped with scikit-learn; CPU-sized settings for the demo and tests",
        ),
    ]
    return {b.name: b for b in entries}


BENCHMARKS: dict[str, Benchmark] = _build_registry()


def benchmark_names() -> list[str]:
    """Every registered benchmark name, in registry order."""
    return list(BENCHMARKS)


def group_names() -> list[str]:
    """Valid arguments of :func:`benchmarks_in_group`."""
    return sorted({g for b in BENCHMARKS.values() for g in b.groups} | {"all"})


def get_benchmark(name: str) -> Benchmark:
    """The registered benchmark `name` (e.g. "cifar10", "vtab/dtd"); unknown names list valid ones."""
    try:
        return BENCHMARKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown benchmark {name!r}; valid: {', '.join(BENCHMARKS)}") from None


def benchmarks_in_group(group: str) -> list[Benchmark]:
    """Benchmarks tagged `group`: "paper", "vtab", "vtab/natural", "vtab/specialized",
    "vtab/structured", "demo", or "all"."""
    if group == "all":
        return list(BENCHMARKS.values())
    members = [b for b in BENCHMARKS.values() if group in b.groups]
    if not members:
        raise ValueError(f"unknown benchmark group {group!r}; valid: {', '.join(group_names())}")
    return members


def with_overrides(benchmark: Benchmark, **changes: Any) -> Benchmark:
    """A copy with changed fields, e.g. a custom `dataset` folder name or fewer fine-tune steps."""
    return replace(benchmark, **changes)


# ---------------------------------------------------------------------------------------------
# Locating prepared data
# ---------------------------------------------------------------------------------------------


def locate(benchmark: Benchmark | str, data_root: str) -> str:
    """`<data_root>/<benchmark.dataset>`: the prepared folder holding the test split (no I/O)."""
    return _join(data_root, _resolve(benchmark).dataset)


def locate_train(benchmark: Benchmark | str, data_root: str) -> str:
    """The prepared folder holding the train split (another benchmark's for ImageNet-ReaL)."""
    b = _resolve(benchmark)
    return _join(data_root, b.train_dataset or b.dataset)


def prepare_command(benchmark: Benchmark | str, data_root: str, *, train: bool = False) -> str:
    """The `vitray data prepare SOURCE DEST` command that writes the benchmark's (train) data."""
    b = _resolve(benchmark)
    source = b.train_prepare_source if train and b.train_dataset else b.prepare_source
    dest = locate_train(b, data_root) if train else locate(b, data_root)
    return f"vitray data prepare {shlex.quote(source)} {shlex.quote(dest)}"


def find_missing(
    benchmark: Benchmark | str, data_root: str, *, storage_options: dict[str, Any] | None = None
) -> MissingDataset | None:
    """None when the benchmark's data is prepared, else the :class:`MissingDataset` describing it.

    Checks `dataset.json` (written last by `vitray data prepare`, so its presence means finished)
    in every folder the benchmark reads, that the needed splits are listed there, and that its
    class count and label kind match. Works on local paths and s3:// (via `vitray.storage`).
    """
    b = _resolve(benchmark)
    needs = [(locate(b, data_root), [b.test_split] + ([] if b.train_dataset else [b.train_split]), False)]
    if b.train_dataset:
        needs.append((locate_train(b, data_root), [b.train_split], True))
    for path, splits, is_train in needs:
        command = prepare_command(b, data_root, train=is_train)
        try:
            info = read_dataset_info(path, storage_options)
        except FileNotFoundError:
            reason = f"no dataset.json at {path} (not prepared, or still being written)"
            return MissingDataset(b.name, path, command, reason)
        absent = [s for s in splits if s not in info.splits]
        if absent:
            reason = (
                f"{path} has no split {', '.join(map(repr, absent))} "
                f"(it has: {', '.join(sorted(info.splits)) or 'none'})"
            )
            return MissingDataset(b.name, path, command, reason)
        _check_matches(b, info, path, is_train)
    return None


def data_digest(
    benchmark: Benchmark | str, data_root: str, *, storage_options: dict[str, Any] | None = None
) -> str | None:
    """The digest of the prepared data the benchmark's cells read (:func:`vitray.data.dataset_digest`
    of its folder, and of the train split's where another dataset holds it): part of every cell's
    id, so results of data prepared again are not taken for the new data's. None when the data is
    not prepared."""
    b = _resolve(benchmark)
    folders = dict.fromkeys([locate(b, data_root), locate_train(b, data_root)])
    try:
        return "+".join(dataset_digest(folder, storage_options) for folder in folders)
    except FileNotFoundError:
        return None


def _check_matches(b: Benchmark, info: DatasetInfo, path: str, is_train: bool) -> None:
    if info.num_classes != b.num_classes:
        raise ValueError(
            f"benchmark {b.name!r} has {b.num_classes} classes but the dataset at {path} has "
            f"{info.num_classes}: wrong folder, or prepared from another source"
        )
    # The test data decides the metric (ImageNet-ReaL: multi-label); train data may be single-label.
    if not is_train and info.label_kind != b.label_kind:
        raise ValueError(
            f"benchmark {b.name!r} needs {b.label_kind}-label test data; {path} holds {info.label_kind}-label data"
        )


def require_prepared(
    benchmark: Benchmark | str, data_root: str, *, storage_options: dict[str, Any] | None = None
) -> str:
    """:func:`locate` after checking the data is prepared; raises :class:`MissingDataset` if not."""
    missing = find_missing(benchmark, data_root, storage_options=storage_options)
    if missing is not None:
        raise missing
    return locate(benchmark, data_root)


def _resolve(benchmark: Benchmark | str) -> Benchmark:
    return benchmark if isinstance(benchmark, Benchmark) else get_benchmark(benchmark)


def _join(root: str, name: str) -> str:
    return storage.join(str(root).rstrip("/"), name)
