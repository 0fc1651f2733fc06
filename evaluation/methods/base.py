"""What every transfer method of the evaluation grid shares: the checkpoint a cell evaluates, the
shapes of a method's work, its config section, and where its work reads data.

A method plans its cells per (checkpoint, benchmark) as units of work (:class:`GridWork`), each run
as a whole: few-shot groups share one feature extraction, every fine-tune cell is a training run.
Work that can only be built once other cells are scored -- the fine-tune run of the learning rate a
sweep selects -- is :class:`PendingWork` until then. Pure data: no Ray, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from vitray.evaluation.results import Cell
from vitray.evaluation.suite import Benchmark

METRIC = "accuracy"  # test top-1: the headline number of every cell

# How a method's units of work run (`cluster/evaluate.py`): each in a Ray task that calls the
# method's `run` with its section's `num_cpus` / `num_gpus`, or (fine-tune) as a Ray Train run
# that the driver starts.
TASK: Literal["task"] = "task"
TRAINING_RUN: Literal["training_run"] = "training_run"


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

    method: ClassVar[str]  # the cells' method, `Cell.method`: its module's NAME
    checkpoint: CheckpointRef
    benchmark: Benchmark

    @property
    def cells(self) -> tuple[Cell, ...]: ...

    @property
    def img_size(self) -> int:
        """The resolution the checkpoint's model runs at (checked before the grid starts)."""
        ...

    def with_cells(self, cells: tuple[Cell, ...]) -> GridWork:
        """The same work for only `cells` (some of its own): a retry of the cells that failed."""
        ...


class PendingWork(Protocol):
    """Work whose cell is known only once other cells are scored (`waits_for`)."""

    benchmark: Benchmark

    @property
    def waits_for(self) -> tuple[Cell, ...]: ...

    def release(self, metrics: Mapping[str, Mapping[str, float]]) -> GridWork:
        """The work, given the metrics of every cell it waits for (cell_id -> metric -> value)."""
        ...


@dataclass(frozen=True)
class Planned:
    """A method's plan for one (checkpoint, benchmark)."""

    work: tuple[GridWork, ...] = ()
    pending: tuple[PendingWork, ...] = ()


class MethodSection(BaseModel):
    """A method's section of the grid config (`GridConfig.<method>`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    enabled: bool = Field(True, description="Run this method's cells of the grid.")


class TaskSection(MethodSection):
    """The section of a method whose units of work run as Ray tasks: what each task asks Ray for."""

    num_cpus: float = Field(1.0, gt=0, description="CPUs each of its Ray tasks asks for.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs each of its Ray tasks asks for (uses CUDA when > 0).")


@dataclass(frozen=True)
class Inputs:
    """Where a grid's work reads: the prepared benchmarks under `data_root` (local or s3://)."""

    data_root: str
    storage_options: dict[str, Any] | None = None


def load_on_device(path: str, *, use_gpu: bool = False) -> tuple[Any, str]:
    """The model of the checkpoint at `path` and the device it is to run on: "cuda" when `use_gpu`
    and a GPU is visible (a Ray task given one), else "cpu"."""
    import torch

    from vitray.runfolder.checkpoint_folders import load_checkpoint

    model, _ = load_checkpoint(path)
    device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
    return model.to(device), device
