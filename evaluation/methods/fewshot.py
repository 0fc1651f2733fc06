"""The grid's few-shot method: closed-form linear probes on frozen features (the paper's few-shot
numbers), one (shots, seed) draw per cell.

The cells of one (checkpoint, benchmark, resolution) are one :class:`FewShotGroup`: one Ray task
loads the checkpoint, extracts the features once and solves every cell (:func:`run`), through the
probe that a training run's few-shot evaluator uses too (:func:`vitray.evaluation.fewshot_probe.probe`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator

from vitray.evaluation.fewshot import DEFAULT_L2_REG
from vitray.evaluation.fewshot_probe import Draw, ProbeData, probe
from vitray.evaluation.methods.base import (
    METRIC,
    TASK,
    CheckpointRef,
    Inputs,
    Planned,
    TaskSection,
    load_on_device,
)
from vitray.evaluation.results import Cell, CellOutcome, error_text
from vitray.evaluation.suite import Benchmark, locate, locate_train

NAME = "fewshot"
TITLE = "few-shot"
RUNS_AS = TASK
# The ridge strength `l2_reg: select` chose for a cell: a metric of its own beside its accuracy.
L2_METRIC = "l2_reg"


class FewShotGrid(TaskSection):
    """Linear few-shot probes: features extracted once per checkpoint and benchmark, in a Ray task.
    Unset keys take the benchmark's protocol."""

    shots: list[int] | None = Field(
        None, description="Shots per class; the benchmark's protocol (1, 5, 10, 25) when unset."
    )
    seeds: int | None = Field(None, gt=0, description="Seeds 0..n-1 per shots value; the protocol's (3) when unset.")
    l2_reg: float | Literal["select"] | None = Field(
        None,
        description='Ridge strength, or "select" (cross-validated inside each few-shot set); the benchmark\'s '
        f"protocol ({DEFAULT_L2_REG:g}, big_vision's) when unset.",
    )
    img_size: int | None = Field(
        None, gt=0, description="Probe resolution; the checkpoint's model.img_size when unset."
    )
    batch_size: int = Field(256, gt=0, description="Images per forward pass during feature extraction.")
    data_workers: int = Field(1, ge=0, description="DataLoader processes decoding images inside the task.")

    @field_validator("shots")
    @classmethod
    def _positive_shots(cls, shots: list[int] | None) -> list[int] | None:
        if shots is not None and (not shots or any(s < 1 for s in shots)):
            raise ValueError(f"must be a non-empty list of positive integers, e.g. [1, 5, 10, 25]; got {shots}")
        return None if shots is None else sorted(set(shots))

    @field_validator("l2_reg", mode="before")
    @classmethod
    def _positive_l2(cls, l2: Any) -> Any:
        """One sentence for every wrong value (not one per branch of the union)."""
        if l2 is None or l2 == "select":
            return l2
        try:
            number = float(l2)  # a number, or its text (YAML 1.1 reads 1e3 as a string)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(l2, bool) or not (math.isfinite(number) and number > 0):
            raise ValueError(f'must be a positive number or "select", got {l2!r}')
        return number


Config = FewShotGrid


@dataclass(frozen=True)
class FewShotGroup:
    """Few-shot cells of one (checkpoint, benchmark, resolution): one feature extraction."""

    method: ClassVar[str] = NAME
    checkpoint: CheckpointRef
    benchmark: Benchmark
    img_size: int
    cells: tuple[Cell, ...]

    def with_cells(self, cells: tuple[Cell, ...]) -> FewShotGroup:
        return replace(self, cells=cells)


def fewshot_settings(benchmark: Benchmark, section: FewShotGrid, img_size: int) -> list[dict[str, Any]]:
    """Resolved settings of every few-shot cell of `benchmark` (one per shots value)."""
    shots = section.shots or list(benchmark.fewshot.shots)
    l2_reg = benchmark.fewshot.l2_reg if section.l2_reg is None else section.l2_reg
    return [{"shots": int(s), "l2_reg": l2_reg, "img_size": int(img_size)} for s in shots]


def fewshot_seeds(benchmark: Benchmark, section: FewShotGrid) -> list[int]:
    return list(range(section.seeds or benchmark.fewshot.seeds))


def fewshot_group(
    checkpoint: CheckpointRef, benchmark: Benchmark, section: FewShotGrid, data: str = ""
) -> FewShotGroup:
    """The few-shot cells of one benchmark on one checkpoint (every shots value x seed), on the
    benchmark's data of digest `data`."""
    img_size = section.img_size or checkpoint.img_size
    cells = tuple(
        Cell(checkpoint.path, benchmark.name, NAME, settings, seed, checkpoint.step, data)
        for settings in fewshot_settings(benchmark, section, img_size)
        for seed in fewshot_seeds(benchmark, section)
    )
    return FewShotGroup(checkpoint, benchmark, img_size, cells)


def plan(checkpoint: CheckpointRef, benchmark: Benchmark, section: FewShotGrid, data: str = "") -> Planned:
    return Planned(work=(fewshot_group(checkpoint, benchmark, section, data),))


def run(group: FewShotGroup, section: FewShotGrid, inputs: Inputs) -> list[CellOutcome]:
    """Loads the group's checkpoint (on the GPU when the task was given one), extracts features once
    and solves every cell; a checkpoint that does not load fails every cell."""
    try:
        model, device = load_on_device(group.checkpoint.path, use_gpu=section.num_gpus > 0)
    except Exception as error:
        return [CellOutcome(cell, error=error_text(error)) for cell in group.cells]
    return run_on_model(
        model,
        group,
        inputs,
        batch_size=section.batch_size,
        num_workers=section.data_workers,
        device=device,
    )


def run_on_model(
    model: Any,
    group: FewShotGroup,
    inputs: Inputs,
    *,
    batch_size: int = 256,
    num_workers: int = 0,
    device: Any = "cpu",
) -> list[CellOutcome]:
    """Every cell of `group` on `model` (resampled to `group.img_size` in place when it differs).

    Reading or extraction errors fail every cell of the group; a sampling or solve error (e.g.
    fewer examples than shots) fails its own cell only. A cell's `seconds` is its share of the
    group's time.
    """
    benchmark = group.benchmark
    started = time.perf_counter()
    draws = {cell.cell_id: Draw(cell.settings["shots"], cell.seed, cell.settings["l2_reg"]) for cell in group.cells}
    try:
        if model.img_size != group.img_size:
            model.set_img_size(group.img_size)
        data = ProbeData(
            locate_train(benchmark, inputs.data_root),
            benchmark.train_split,
            locate(benchmark, inputs.data_root),
            benchmark.test_split,
            benchmark.num_classes,
            group.img_size,
        )
        results = probe(
            model,
            data,
            draws,
            batch_size=batch_size,
            num_workers=num_workers,
            storage_options=inputs.storage_options,
            device=device,
        )
    except Exception as error:
        seconds = (time.perf_counter() - started) / len(group.cells)
        return [CellOutcome(cell, error=error_text(error), seconds=seconds) for cell in group.cells]
    share = (time.perf_counter() - started) / len(group.cells)
    outcomes = []
    for cell in group.cells:
        result = results[cell.cell_id]
        if isinstance(result, Exception):
            outcomes.append(CellOutcome(cell, error=f"{type(result).__name__}: {result}", seconds=share))
        else:
            metrics = {METRIC: result.accuracy}
            if cell.settings["l2_reg"] == "select":  # the strength chosen: a result of its own
                metrics[L2_METRIC] = result.l2_reg
            outcomes.append(CellOutcome(cell, metrics, seconds=share))
    return outcomes


@dataclass(frozen=True)
class ShotsSummary:
    """The ok outcomes of one shots value: their accuracy's mean and population std, the number of
    seeds, and the ridge strength of each seed (`l2_reg: select`'s choices, or the one fixed value)."""

    mean: float
    std: float
    seeds: int
    l2: tuple[float, ...]


def summarize_scores(outcomes: Iterable[CellOutcome]) -> dict[int, ShotsSummary]:
    """Few-shot outcomes per shots value (:class:`ShotsSummary`), of the ok ones."""
    by_shots: dict[int, list[CellOutcome]] = {}
    for outcome in outcomes:
        if outcome.ok:
            by_shots.setdefault(int(outcome.cell.settings["shots"]), []).append(outcome)
    summaries = {}
    for k, done in sorted(by_shots.items()):
        accuracy = [o.metrics[METRIC] for o in done]
        l2 = [float(o.metrics.get(L2_METRIC, o.cell.settings["l2_reg"])) for o in done]
        summaries[k] = ShotsSummary(float(np.mean(accuracy)), float(np.std(accuracy)), len(done), tuple(l2))
    return summaries
