"""The data section of a run's config (owned here so `data/` stays self-contained)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from vitray.storage import absolute

from .layout import DatasetInfo, read_dataset_info
from .splits import parse_split

__all__ = [
    "EVAL_RESIZE_RATIO",
    "RESIZE_RATIO",
    "TRAIN_CROPS",
    "DataConfig",
    "DatasetInfo",
    "StoragePath",
    "TrainCropKind",
    "read_dataset_info",
]

# The training crops (:class:`vitray.data.transforms.TrainCrop`), named as big_vision's transfer
# config names them.
TrainCropKind = Literal["inception_crop", "resmall_crop", "resize_crop", "resize"]
TRAIN_CROPS: tuple[TrainCropKind, ...] = ("inception_crop", "resmall_crop", "resize_crop", "resize")
# resmall_crop / resize_crop: the image is resized to this multiple of img_size before the random
# img_size crop (big_vision's transfer config: 448 for 384).
RESIZE_RATIO = 448 / 384
# Evaluation's resize_small(R)|central_crop(S) (vitray.data.transforms.eval_resize): R / S of the
# authors' ImageNet evaluation, 256 / 224.
EVAL_RESIZE_RATIO = 256 / 224


# A config field naming a local folder or file, or a URL: a relative local path is made absolute
# when the config is read (on the driver), so that Ray's workers, in other working directories,
# read and write the same folder.
def storage_path(path: str) -> str:
    """`absolute(path)`; an empty path, which would name the working folder itself (a run's or a
    grid's files among whatever is there), refused."""
    if not path.strip():
        raise ValueError("is empty: give a local folder or an s3:// URL")
    return absolute(path)


StoragePath = Annotated[str, AfterValidator(storage_path)]


class DataConfig(BaseModel):
    """Which prepared dataset to read and how (see :class:`vitray.data.ShardLoader`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    train: StoragePath = Field(description="Prepared dataset for training: a local folder or s3://bucket/prefix.")
    train_split: str = Field(
        "train", description="Split to train on, or a slice of one: train[:98%], train[:800] (see vitray.data.splits)."
    )
    val: StoragePath | None = Field(None, description="Prepared dataset for validation; the training one when unset.")
    val_split: str = Field("test", description="Split (or slice: train[98%:]) whose top-1 the run reports.")
    num_slots: int | None = Field(
        None,
        gt=0,
        description="Canonical slots of the epoch plan; fixed for a run, divisible by every world size used. "
        "Unset: a new run takes cluster.num_workers x data.num_workers (each loader worker streams a slot of its "
        "own; fewer per rank where they would not divide train.micro_batch_size) and a resumed run the number its "
        "checkpoint records. Set a number with many divisors (the paper configs: 1024) to resume on other world sizes.",
    )
    num_workers: int | None = Field(
        None,
        ge=0,
        description="DataLoader worker processes per rank (0: decode in the trainer). Unset: from the CPUs Ray gives "
        "each training worker (cluster.cpus_per_worker): when the run trains on GPUs or TPUs, as many of them but one "
        "(the one left runs the training process) as divide train.micro_batch_size (a slot each), at least 1; "
        "1 on a CPU run, whose step needs the cores far more than its "
        "loader. A run's config records the number it resolved to.",
    )
    shuffle_buffer: int = Field(512, gt=0, description="Samples per shuffle window within a slot.")
    crop: TrainCropKind = Field(
        "inception_crop",
        description="Training crop (big_vision's names): inception_crop (the paper's pre-training), resmall_crop "
        "(shorter side resized to resize_ratio x the resolution, then a random crop: the authors' choice for CIFAR), "
        "resize_crop (both sides resized so, then a random crop), resize (the whole image, no crop: for labels a "
        "crop would change).",
    )
    min_crop_area: float = Field(
        0.05, gt=0, le=1, description="Smallest inception crop, as a fraction of the image (the paper: 0.05)."
    )
    resize_ratio: float = Field(
        RESIZE_RATIO,
        ge=1,
        description="resmall_crop / resize_crop: how much larger than the resolution the image is resized before "
        "the random crop (big_vision: 448 for 384).",
    )
    flip: bool = Field(True, description="Random horizontal flips in training.")
    decode: Literal["auto", "cpu", "gpu"] = Field(
        "auto",
        description="Where training JPEGs are decoded, cropped and resized: cpu (the loader workers), gpu (nvjpeg "
        "on each worker's GPU, overlapped with the step; the loader workers only read the shards and draw the same "
        "crops; PNGs, CMYK and JPEGs nvjpeg does not decode stay on the CPU), auto: gpu when the run trains on "
        "CUDA (cluster.gpus_per_worker > 0, train.backend=deepspeed), cpu otherwise.",
    )
    storage_options: dict[str, Any] | None = Field(
        None,
        description="fsspec options for the data's remote paths (data.train, data.val, the evaluators' datasets); "
        "endpoint and credentials default to the AWS environment, which the run folder and checkpoints always use.",
    )

    @field_validator("train_split", "val_split")
    @classmethod
    def _split_syntax(cls, split: str) -> str:
        parse_split(split)  # a malformed slice fails with the config, before any worker starts
        return split

    @property
    def val_path(self) -> str:
        return self.val or self.train
