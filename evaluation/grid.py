"""Planning an evaluation grid: checkpoints x benchmarks x methods x settings x seeds -> cells.

Pure data, no Ray and no I/O: `cluster/evaluate.py` runs the plan. Few-shot cells are grouped
per (checkpoint, benchmark, resolution) because they share one feature extraction; every
fine-tune cell is a training run of its own. A fine-tune cell per learning rate trains on the
benchmark's train-minus-validation slice and is scored on the held-out slice and on the test
split ("selection" cells). Where the protocol re-trains the selected learning rate (VTAB-1k), a
:class:`FinalRun` per seed becomes a cell once its selection cells are finished.

A cell's settings are the *resolved* values (protocol defaults filled in), so its id -- a hash of
(checkpoint, benchmark, method, settings, seed) -- changes exactly when what it computes changes,
and a re-run of the same grid finds its finished cells.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

from vitray.evaluation.config import FewShotGrid, FinetuneGrid, GridConfig
from vitray.evaluation.results import Cell
from vitray.evaluation.suite import Benchmark

METRIC = "accuracy"  # test top-1: the headline number of every cell
VAL_METRIC = "val_accuracy"  # top-1 on the held-out split, which selects the fine-tuning lr
TRAIN_SPLIT, VAL_SPLIT = "train_split", "val_split"


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint to evaluate.

    `path` is the checkpoint folder (absolute local path or URL; it is part of every cell id),
    `step` its training step, `model` the model section it was trained with (name, img_size, ...).
    """

    path: str
    step: int | None
    model: Mapping[str, Any] = field(default_factory=dict)
    target_steps: int | None = None  # the run's train.steps: the run is finished at this step

    @property
    def img_size(self) -> int:
        return int(self.model["img_size"])

    @property
    def model_name(self) -> str:
        return str(self.model["name"])


class GridWork(Protocol):
    """A unit of a grid's work, run as a whole by its method's runner (`cluster/evaluate.py` finds
    the runner by `method`): the cells it computes."""

    method: ClassVar[str]  # the cells' method, `Cell.method`

    @property
    def cells(self) -> tuple[Cell, ...]: ...

    def with_cells(self, cells: tuple[Cell, ...]) -> GridWork:
        """The same work for only `cells` (some of its own): a retry of the cells that failed."""
        ...


@dataclass(frozen=True)
class FewShotGroup:
    """Few-shot cells of one (checkpoint, benchmark, resolution): one feature extraction."""

    method: ClassVar[str] = "fewshot"
    checkpoint: CheckpointRef
    benchmark: Benchmark
    img_size: int
    cells: tuple[Cell, ...]

    def with_cells(self, cells: tuple[Cell, ...]) -> FewShotGroup:
        return replace(self, cells=cells)


@dataclass(frozen=True)
class FinetuneJob:
    """One fine-tune cell: `cell.settings` holds lr, steps, batch_size, warmup_steps, resolution,
    crop, flip (and, with the inception crop, min_crop_area)."""

    method: ClassVar[str] = "finetune"
    checkpoint: CheckpointRef
    benchmark: Benchmark
    cell: Cell

    @property
    def cells(self) -> tuple[Cell, ...]:
        return (self.cell,)

    def with_cells(self, cells: tuple[Cell, ...]) -> FinetuneJob:
        assert cells == (self.cell,), cells  # one cell: retried whole
        return self


@dataclass(frozen=True)
class FinalRun:
    """The re-run of the learning rate selected by `selection` (one seed's sweep) on `train_split`.

    Its cell is known once the sweep's validation scores are: :meth:`job` builds it for the lr that
    :func:`vitray.evaluation.selection.select_lr` picks.
    """

    checkpoint: CheckpointRef
    benchmark: Benchmark
    seed: int
    train_split: str
    selection: tuple[Cell, ...]

    def job(self, lr: float) -> FinetuneJob:
        settings = final_settings(self.selection[0].settings, lr, self.train_split)
        cell = Cell(self.checkpoint.path, self.benchmark.name, "finetune", settings, self.seed, self.checkpoint.step)
        return FinetuneJob(self.checkpoint, self.benchmark, cell)


@dataclass(frozen=True)
class GridPlan:
    fewshot: tuple[FewShotGroup, ...] = ()
    finetune: tuple[FinetuneJob, ...] = ()
    finals: tuple[FinalRun, ...] = ()

    @property
    def cells(self) -> list[Cell]:
        """The cells known up front (final runs become cells once their sweep is scored)."""
        return [c for g in self.fewshot for c in g.cells] + [j.cell for j in self.finetune]

    def __len__(self) -> int:
        """Every cell the grid runs, final runs included."""
        return len(self.cells) + len(self.finals)

    def without(self, finished: Iterable[str]) -> GridPlan:
        """The plan minus the cells whose ids are in `finished` (groups left empty are dropped;
        final runs stay: whether theirs is finished is known once their lr is)."""
        done = set(finished)
        groups = []
        for group in self.fewshot:
            pending = tuple(c for c in group.cells if c.cell_id not in done)
            if pending:
                groups.append(FewShotGroup(group.checkpoint, group.benchmark, group.img_size, pending))
        jobs = tuple(j for j in self.finetune if j.cell.cell_id not in done)
        return GridPlan(tuple(groups), jobs, self.finals)

    def for_benchmark(self, name: str) -> GridPlan:
        return GridPlan(
            tuple(g for g in self.fewshot if g.benchmark.name == name),
            tuple(j for j in self.finetune if j.benchmark.name == name),
            tuple(f for f in self.finals if f.benchmark.name == name),
        )

    def without_benchmark(self, name: str) -> GridPlan:
        return GridPlan(
            tuple(g for g in self.fewshot if g.benchmark.name != name),
            tuple(j for j in self.finetune if j.benchmark.name != name),
            tuple(f for f in self.finals if f.benchmark.name != name),
        )


def fewshot_settings(benchmark: Benchmark, grid: FewShotGrid, img_size: int) -> list[dict[str, Any]]:
    """Resolved settings of every few-shot cell of `benchmark` (one per shots value)."""
    shots = grid.shots or list(benchmark.fewshot.shots)
    return [{"shots": int(s), "l2_reg": grid.l2_reg, "img_size": int(img_size)} for s in shots]


def fewshot_seeds(benchmark: Benchmark, grid: FewShotGrid) -> list[int]:
    return list(range(grid.seeds or benchmark.fewshot.seeds))


def finetune_splits(benchmark: Benchmark, grid: FinetuneGrid) -> tuple[str, str, str | None]:
    """(train, validation, final train) split strings: the grid's where set, else the protocol's."""
    protocol = benchmark.finetune
    return (
        grid.train_split or protocol.train_split,
        grid.val_split or protocol.val_split,
        grid.final_train_split or protocol.final_train_split,
    )


def train_preprocess(benchmark: Benchmark, grid: FinetuneGrid) -> dict[str, Any]:
    """The training crop and flip of a fine-tune cell: the grid's where set, else the benchmark's
    (:class:`~vitray.evaluation.suite.TrainPreprocess`); the smallest crop area only with the
    inception crop, the one crop that has it."""
    protocol = benchmark.finetune.preprocess
    crop = grid.crop or protocol.crop
    settings: dict[str, Any] = {"crop": crop, "flip": protocol.flip if grid.flip is None else bool(grid.flip)}
    if crop == "inception_crop":
        settings["min_crop_area"] = float(grid.min_crop_area or protocol.min_crop_area)
    return settings


def is_selection(settings: Mapping[str, Any]) -> bool:
    """A selection cell is scored on a held-out split (`val_split`); a final run only on the test split."""
    return VAL_SPLIT in settings


def final_settings(selection: Mapping[str, Any], lr: float, train_split: str) -> dict[str, Any]:
    """The settings of the final run at `lr` on `train_split` of a selection cell's sweep."""
    kept = {k: v for k, v in selection.items() if k not in ("lr", TRAIN_SPLIT, VAL_SPLIT)}
    return {"lr": float(lr), **kept, TRAIN_SPLIT: train_split}


def finetune_settings(benchmark: Benchmark, grid: FinetuneGrid) -> list[dict[str, Any]]:
    """Resolved settings of every fine-tune cell of `benchmark` (one per learning rate).

    Each trains on `train_split` and is scored on `val_split` (and the test split). With a final
    train split (VTAB-1k) and a single learning rate there is nothing to select: the one cell is
    the final run itself (`train_split` only, scored on the test split).
    """
    protocol = benchmark.finetune
    steps = grid.steps or protocol.steps
    warmup = protocol.warmup_steps if grid.warmup_steps is None else grid.warmup_steps
    base = {
        "steps": int(steps),
        "batch_size": int(grid.batch_size or protocol.batch_size),
        # The schedule clips warm-up to the run anyway; clipping here keeps the label truthful.
        "warmup_steps": int(min(warmup, steps)),
        "resolution": int(grid.resolution or protocol.resolution),
        **train_preprocess(benchmark, grid),
    }
    lrs = grid.learning_rates or protocol.learning_rates
    train, val, final = finetune_splits(benchmark, grid)
    if final is not None and len(lrs) == 1:
        return [final_settings(base, lrs[0], final)]
    return [{"lr": float(lr), **base, TRAIN_SPLIT: train, VAL_SPLIT: val} for lr in lrs]


def fewshot_group(checkpoint: CheckpointRef, benchmark: Benchmark, grid: FewShotGrid) -> FewShotGroup:
    """The few-shot cells of one benchmark on one checkpoint (every shots value x seed)."""
    img_size = grid.img_size or checkpoint.img_size
    cells = tuple(
        Cell(checkpoint.path, benchmark.name, "fewshot", settings, seed, checkpoint.step)
        for settings in fewshot_settings(benchmark, grid, img_size)
        for seed in fewshot_seeds(benchmark, grid)
    )
    return FewShotGroup(checkpoint, benchmark, img_size, cells)


def plan_grid(grid: GridConfig, checkpoints: Iterable[CheckpointRef]) -> GridPlan:
    """Every cell of `grid` for every checkpoint, few-shot groups first, and the final runs."""
    groups: list[FewShotGroup] = []
    jobs: list[FinetuneJob] = []
    finals: list[FinalRun] = []
    for checkpoint in checkpoints:
        for benchmark in grid.resolved_benchmarks():
            if grid.fewshot.enabled:
                groups.append(fewshot_group(checkpoint, benchmark, grid.fewshot))
            if grid.finetune.enabled:
                sweep = finetune_settings(benchmark, grid.finetune)
                seeds = range(grid.finetune.seeds)
                cells = {
                    (i, seed): Cell(checkpoint.path, benchmark.name, "finetune", settings, seed, checkpoint.step)
                    for i, settings in enumerate(sweep)
                    for seed in seeds
                }
                jobs += [FinetuneJob(checkpoint, benchmark, cell) for cell in cells.values()]
                final_split = finetune_splits(benchmark, grid.finetune)[2]
                if final_split is not None and is_selection(sweep[0]):
                    for seed in seeds:
                        selection = tuple(cells[i, seed] for i in range(len(sweep)))
                        finals.append(FinalRun(checkpoint, benchmark, seed, final_split, selection))
    return GridPlan(tuple(groups), tuple(jobs), tuple(finals))
