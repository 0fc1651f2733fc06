"""The grid's fine-tune method: the paper's transfer numbers, each cell a training run.

A cell per learning rate of the benchmark's sweep trains on the train split minus a held-out
slice and is scored, at its last step, on that slice (`val_accuracy`, which selects the learning
rate) and on the test split (`accuracy`): a "selection" cell. Where the protocol re-trains the
selected learning rate on another split (VTAB-1k: train[:1000]), that run is a :class:`FinalRun`
per seed, pending until its sweep is scored. Each cell's run is a Ray Train run that the grid's
driver starts (`cluster/finetune.py`), of the recipe in :mod:`vitray.evaluation.finetune_recipe`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field, field_validator

from vitray.data.config import TrainCropKind
from vitray.data.splits import parse_split
from vitray.evaluation.methods.base import TRAINING_RUN, CheckpointRef, MethodSection, Planned
from vitray.evaluation.results import Cell
from vitray.evaluation.suite import Benchmark

NAME = "finetune"
TITLE = "fine-tune"
RUNS_AS = TRAINING_RUN

VAL_METRIC = "val_accuracy"  # top-1 on the held-out split, which selects the fine-tuning lr
TRAIN_SPLIT, VAL_SPLIT = "train_split", "val_split"
OVERRIDES = "overrides"  # the grid's finetune.overrides, in the settings of every cell they change


class FinetuneGrid(MethodSection):
    """Fine-tuning cells: one Ray Train run of the fine-tune recipe (SGD momentum 0.9, cosine decay,
    warm-up, no weight decay, grad clip 1, zero head) per benchmark, learning rate and seed. Unset
    keys take the benchmark's protocol."""

    learning_rates: list[float] | None = Field(None, description="The sweep; the benchmark's protocol when unset.")
    seeds: int = Field(1, gt=0, description="Runs per learning rate (seeds 0..n-1).")
    steps: int | None = Field(None, gt=0, description="Optimizer steps; the protocol's when unset.")
    batch_size: int | None = Field(
        None,
        gt=0,
        description="Global batch; the benchmark protocol's (512 for the paper's and VTAB tasks) when unset.",
    )
    warmup_steps: int | None = Field(None, ge=0, description="Linear warm-up steps; the protocol's when unset.")
    resolution: int | None = Field(None, gt=0, description="Fine-tuning resolution (position embeddings resampled).")
    crop: TrainCropKind | None = Field(
        None,
        description="Training crop (inception_crop, resmall_crop, resize_crop, resize; see data.crop); the "
        "benchmark's when unset (e.g. CIFAR: resmall_crop).",
    )
    min_crop_area: float | None = Field(
        None, gt=0, le=1, description="The inception crop's smallest area; the benchmark's (0.05) when unset."
    )
    flip: bool | None = Field(None, description="Random horizontal flips in training; the benchmark's when unset.")
    train_split: str | None = Field(
        None, description="Split (slice) each learning rate trains on; the protocol's (e.g. train[:98%]) when unset."
    )
    val_split: str | None = Field(
        None, description="Held-out split (slice) that selects the lr; the protocol's (e.g. train[98%:]) when unset."
    )
    final_train_split: str | None = Field(
        None,
        description="Re-train the selected learning rate on this split and report that run (VTAB-1k: train[:1000]); "
        "the protocol's when unset.",
    )
    micro_batch_size: int = Field(32, gt=0, description="Samples per worker per forward/backward (accumulation).")
    checkpoint_every: int | None = Field(
        None, gt=0, description="Checkpoint interval, so a stopped grid resumes a half-done run; steps/4 when unset."
    )
    eval_batch_size: int = Field(256, gt=0, description="Samples per batch when a fine-tuned model is scored.")
    num_workers: int = Field(1, gt=0, description="Ray Train workers per fine-tune run.")
    cpus_per_worker: float | None = Field(
        None, gt=0, description="CPUs per fine-tune worker; unset: as `cluster.cpus_per_worker` of a pre-training run."
    )
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs per fine-tune worker; 0 runs on CPUs.")
    max_concurrent: int | None = Field(
        None, gt=0, description="Fine-tune runs at once; what the cluster's CPUs/GPUs hold when unset."
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description='Dotted TrainingConfig keys set on every run\'s recipe, e.g. {"precision.dtype": "bf16"}.',
    )

    @field_validator("train_split", "val_split", "final_train_split")
    @classmethod
    def _split_syntax(cls, split: str | None) -> str | None:
        if split is not None:
            parse_split(split)
        return split

    @field_validator("learning_rates")
    @classmethod
    def _positive_lrs(cls, lrs: list[float] | None) -> list[float] | None:
        if lrs is not None and (not lrs or any(lr <= 0 for lr in lrs)):
            raise ValueError(f"must be a non-empty list of positive learning rates, e.g. [0.003, 0.01]; got {lrs}")
        return lrs


Config = FinetuneGrid


@dataclass(frozen=True)
class FinetuneJob:
    """One fine-tune cell: `cell.settings` holds lr, steps, batch_size, warmup_steps, resolution,
    crop, flip (and, with the inception crop, min_crop_area)."""

    method: ClassVar[str] = NAME
    checkpoint: CheckpointRef
    benchmark: Benchmark
    cell: Cell

    @property
    def cells(self) -> tuple[Cell, ...]:
        return (self.cell,)

    @property
    def img_size(self) -> int:
        return int(self.cell.settings["resolution"])  # the position embeddings are resampled to it

    def with_cells(self, cells: tuple[Cell, ...]) -> FinetuneJob:
        assert cells == (self.cell,), cells  # one cell: retried whole
        return self


@dataclass(frozen=True)
class FinalRun:
    """The re-run of the learning rate selected by `selection` (one seed's sweep) on `train_split`:
    pending until every cell of the sweep is scored, then the job of the lr :func:`select_lr` picks."""

    checkpoint: CheckpointRef
    benchmark: Benchmark
    seed: int
    train_split: str
    selection: tuple[Cell, ...]

    @property
    def waits_for(self) -> tuple[Cell, ...]:
        return self.selection

    def release(self, metrics: Mapping[str, Mapping[str, float]]) -> FinetuneJob:
        return self.job(select_lr({float(c.settings["lr"]): metrics[c.cell_id][VAL_METRIC] for c in self.selection}))

    def job(self, lr: float) -> FinetuneJob:
        settings = final_settings(self.selection[0].settings, lr, self.train_split)
        data = self.selection[0].data  # the sweep's
        cell = Cell(self.checkpoint.path, self.benchmark.name, NAME, settings, self.seed, self.checkpoint.step, data)
        return FinetuneJob(self.checkpoint, self.benchmark, cell)


def select_lr(val_top1: Mapping[float, float]) -> float:
    """The learning rate with the best validation top-1; ties go to the smallest lr."""
    if not val_top1:
        raise ValueError("no learning rate to select from: the sweep has no scored cell")
    return max(sorted(val_top1), key=lambda lr: val_top1[lr])


def finetune_splits(benchmark: Benchmark, section: FinetuneGrid) -> tuple[str, str, str | None]:
    """(train, validation, final train) split strings: the grid's where set, else the protocol's."""
    protocol = benchmark.finetune
    return (
        section.train_split or protocol.train_split,
        section.val_split or protocol.val_split,
        section.final_train_split or protocol.final_train_split,
    )


def train_preprocess(benchmark: Benchmark, section: FinetuneGrid) -> dict[str, Any]:
    """The training crop and flip of a fine-tune cell: the grid's where set, else the benchmark's
    (:class:`~vitray.evaluation.suite.TrainPreprocess`); the smallest crop area only with the
    inception crop, the one crop that has it."""
    protocol = benchmark.finetune.preprocess
    crop = section.crop or protocol.crop
    settings: dict[str, Any] = {"crop": crop, "flip": protocol.flip if section.flip is None else bool(section.flip)}
    if crop == "inception_crop":
        settings["min_crop_area"] = float(section.min_crop_area or protocol.min_crop_area)
    return settings


def is_selection(settings: Mapping[str, Any]) -> bool:
    """A selection cell is scored on a held-out split (`val_split`); a final run only on the test split."""
    return VAL_SPLIT in settings


def final_settings(selection: Mapping[str, Any], lr: float, train_split: str) -> dict[str, Any]:
    """The settings of the final run at `lr` on `train_split` of a selection cell's sweep."""
    kept = {k: v for k, v in selection.items() if k not in ("lr", TRAIN_SPLIT, VAL_SPLIT)}
    return {"lr": float(lr), **kept, TRAIN_SPLIT: train_split}


def finetune_settings(benchmark: Benchmark, section: FinetuneGrid) -> list[dict[str, Any]]:
    """Resolved settings of every fine-tune cell of `benchmark` (one per learning rate).

    Each trains on `train_split` and is scored on `val_split` (and the test split). With a final
    train split (VTAB-1k) and a single learning rate there is nothing to select: the one cell is
    the final run itself (`train_split` only, scored on the test split).
    """
    protocol = benchmark.finetune
    steps = section.steps or protocol.steps
    if section.warmup_steps is not None:
        if section.warmup_steps > steps:  # as pre-training refuses it (the protocol's own is scaled below)
            of = "finetune.steps" if section.steps else f"{benchmark.name}'s protocol steps"
            raise ValueError(
                f"finetune.warmup_steps={section.warmup_steps} is longer than the fine-tune ({of}: {steps}): its "
                f"learning rate would never decay; set finetune.warmup_steps to at most {steps}"
            )
        warmup = section.warmup_steps
    elif steps < protocol.steps:  # a shorter run keeps the protocol's share of warm-up (20 of 20: no decay)
        warmup = round(protocol.warmup_steps * steps / protocol.steps)
    else:
        warmup = protocol.warmup_steps
    base = {
        "steps": int(steps),
        "batch_size": int(section.batch_size or protocol.batch_size),
        # The schedule clips warm-up to the run anyway; clipping here keeps the label truthful.
        "warmup_steps": int(min(warmup, steps)),
        "resolution": int(section.resolution or protocol.resolution),
        **train_preprocess(benchmark, section),
        **_result_overrides(section.overrides),
    }
    lrs = section.learning_rates or protocol.learning_rates
    train, val, final = finetune_splits(benchmark, section)
    if final is not None and len(lrs) == 1:
        return [final_settings(base, lrs[0], final)]
    return [{"lr": float(lr), **base, TRAIN_SPLIT: train, VAL_SPLIT: val} for lr in lrs]


# Config sections whose overrides change how a run goes, not what it computes: not part of a cell.
OPERATIONAL_SECTIONS = ("run", "checkpoint", "log", "cluster")


def is_operational(key: str) -> bool:
    """Whether a dotted config key -- or a change the pre-flight lists, "key: old -> new" -- is of
    :data:`OPERATIONAL_SECTIONS`, or a store's options (`data.storage_options`: where the data is
    read from, and with which credentials): how a run goes, not what it computes. (A fine-tune cell's
    settings, which the results table, the report and the cell's id hold, leave these out.)"""
    parts = key.split(":", 1)[0].strip().split(".")
    return parts[0] in OPERATIONAL_SECTIONS or "storage_options" in parts


def _result_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """The grid's overrides that change what its fine-tune runs compute, as a cell's setting (so part of
    its id: other values are other cells, run again); none: no setting (the ids stay as they were)."""
    changes = {k: v for k, v in sorted(overrides.items()) if not is_operational(k)}
    return {OVERRIDES: changes} if changes else {}


def plan(checkpoint: CheckpointRef, benchmark: Benchmark, section: FinetuneGrid, data: str = "") -> Planned:
    """A run per learning rate and seed and, where the protocol re-trains the selected learning
    rate (with more than one to select from), a final run per seed pending on its sweep; on the
    benchmark's data of digest `data`."""
    sweep = finetune_settings(benchmark, section)
    seeds = range(section.seeds)
    cells = {
        (i, seed): Cell(checkpoint.path, benchmark.name, NAME, settings, seed, checkpoint.step, data)
        for i, settings in enumerate(sweep)
        for seed in seeds
    }
    jobs = tuple(FinetuneJob(checkpoint, benchmark, cell) for cell in cells.values())
    final_split = finetune_splits(benchmark, section)[2]
    finals: tuple[FinalRun, ...] = ()
    if final_split is not None and is_selection(sweep[0]):
        finals = tuple(
            FinalRun(checkpoint, benchmark, seed, final_split, tuple(cells[i, seed] for i in range(len(sweep))))
            for seed in seeds
        )
    return Planned(work=jobs, pending=finals)
