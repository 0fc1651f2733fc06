"""Planning an evaluation grid: checkpoints x benchmarks x methods x settings x seeds -> cells.

Pure data, no Ray and no I/O: `cluster/evaluate.py` runs the plan. Few-shot cells are grouped
per (checkpoint, benchmark, resolution) because they share one feature extraction; every
fine-tune cell is a training run of its own.

A cell's settings are the *resolved* values (protocol defaults filled in), so its id -- a hash of
(checkpoint, benchmark, method, settings, seed) -- changes exactly when what it computes changes,
and a re-run of the same grid finds its finished cells.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vitray.evaluation.config import FewShotGrid, FinetuneGrid, GridConfig
from vitray.evaluation.results import Cell
from vitray.evaluation.suite import Benchmark

METRIC = "accuracy"


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


@dataclass(frozen=True)
class FewShotGroup:
    """Few-shot cells of one (checkpoint, benchmark, resolution): one feature extraction."""

    checkpoint: CheckpointRef
    benchmark: Benchmark
    img_size: int
    cells: tuple[Cell, ...]


@dataclass(frozen=True)
class FinetuneJob:
    """One fine-tune cell: `cell.settings` holds lr, steps, batch_size, warmup_steps, resolution."""

    checkpoint: CheckpointRef
    benchmark: Benchmark
    cell: Cell


@dataclass(frozen=True)
class GridPlan:
    fewshot: tuple[FewShotGroup, ...] = ()
    finetune: tuple[FinetuneJob, ...] = ()

    @property
    def cells(self) -> list[Cell]:
        return [c for g in self.fewshot for c in g.cells] + [j.cell for j in self.finetune]

    def __len__(self) -> int:
        return len(self.cells)

    def without(self, finished: Iterable[str]) -> GridPlan:
        """The plan minus the cells whose ids are in `finished` (groups left empty are dropped)."""
        done = set(finished)
        groups = []
        for group in self.fewshot:
            pending = tuple(c for c in group.cells if c.cell_id not in done)
            if pending:
                groups.append(FewShotGroup(group.checkpoint, group.benchmark, group.img_size, pending))
        jobs = tuple(j for j in self.finetune if j.cell.cell_id not in done)
        return GridPlan(tuple(groups), jobs)

    def for_benchmark(self, name: str) -> GridPlan:
        return GridPlan(
            tuple(g for g in self.fewshot if g.benchmark.name == name),
            tuple(j for j in self.finetune if j.benchmark.name == name),
        )

    def without_benchmark(self, name: str) -> GridPlan:
        return GridPlan(
            tuple(g for g in self.fewshot if g.benchmark.name != name),
            tuple(j for j in self.finetune if j.benchmark.name != name),
        )


def fewshot_settings(benchmark: Benchmark, grid: FewShotGrid, img_size: int) -> list[dict[str, Any]]:
    """Resolved settings of every few-shot cell of `benchmark` (one per shots value)."""
    shots = grid.shots or list(benchmark.fewshot.shots)
    return [{"shots": int(s), "l2_reg": grid.l2_reg, "img_size": int(img_size)} for s in shots]


def fewshot_seeds(benchmark: Benchmark, grid: FewShotGrid) -> list[int]:
    return list(range(grid.seeds or benchmark.fewshot.seeds))


def finetune_settings(benchmark: Benchmark, grid: FinetuneGrid) -> list[dict[str, Any]]:
    """Resolved settings of every fine-tune cell of `benchmark` (one per learning rate)."""
    protocol = benchmark.finetune
    steps = grid.steps or protocol.steps
    warmup = protocol.warmup_steps if grid.warmup_steps is None else grid.warmup_steps
    base = {
        "steps": int(steps),
        "batch_size": int(grid.batch_size or protocol.batch_size),
        # The schedule clips warm-up to the run anyway; clipping here keeps the label truthful.
        "warmup_steps": int(min(warmup, steps)),
        "resolution": int(grid.resolution or protocol.resolution),
    }
    return [{"lr": float(lr), **base} for lr in (grid.learning_rates or protocol.learning_rates)]


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
    """Every cell of `grid` for every checkpoint, few-shot groups first."""
    groups: list[FewShotGroup] = []
    jobs: list[FinetuneJob] = []
    for checkpoint in checkpoints:
        for benchmark in grid.resolved_benchmarks():
            if grid.fewshot.enabled:
                groups.append(fewshot_group(checkpoint, benchmark, grid.fewshot))
            if grid.finetune.enabled:
                for settings in finetune_settings(benchmark, grid.finetune):
                    for seed in range(grid.finetune.seeds):
                        cell = Cell(checkpoint.path, benchmark.name, "finetune", settings, seed, checkpoint.step)
                        jobs.append(FinetuneJob(checkpoint, benchmark, cell))
    return GridPlan(tuple(groups), tuple(jobs))
