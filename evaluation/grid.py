"""Planning an evaluation grid: checkpoints x benchmarks x methods x settings x seeds -> cells.

Pure data, no Ray and no I/O: `cluster/evaluate.py` runs the plan. Each enabled method of
:data:`vitray.evaluation.methods.METHODS` plans its cells of every (checkpoint, benchmark) as units
of work -- few-shot cells grouped per (checkpoint, benchmark, resolution) because they share one
feature extraction, every fine-tune cell a training run of its own -- and as work that waits for
other cells' scores (VTAB-1k's final fine-tune runs, once the sweep that selects their learning
rate is scored).

A cell's settings are the *resolved* values (protocol defaults filled in), so its id -- a hash of
(checkpoint, benchmark, method, settings, seed, and the digest of the benchmark's prepared data) --
changes exactly when what it computes changes, and a re-run of the same grid finds its finished cells.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vitray.evaluation.config import GridConfig
from vitray.evaluation.methods import METHODS, CheckpointRef, GridWork, PendingWork
from vitray.evaluation.results import Cell


@dataclass(frozen=True)
class GridPlan:
    work: tuple[GridWork, ...] = ()  # in the order it is submitted: method by method
    pending: tuple[PendingWork, ...] = ()

    @property
    def cells(self) -> list[Cell]:
        """The cells known up front (pending work becomes cells once what it waits for is scored)."""
        return [cell for work in self.work for cell in work.cells]

    def __len__(self) -> int:
        """Every cell the grid runs, pending work included."""
        return len(self.cells) + len(self.pending)

    def without(self, finished: Iterable[str]) -> GridPlan:
        """The plan minus the cells whose ids are in `finished` (work left without a cell is
        dropped; pending work stays: whether its cell is finished is known once it is released)."""
        done = set(finished)
        kept = []
        for work in self.work:
            cells = tuple(c for c in work.cells if c.cell_id not in done)
            if cells:
                kept.append(work if len(cells) == len(work.cells) else work.with_cells(cells))
        return GridPlan(tuple(kept), self.pending)

    def for_benchmark(self, name: str) -> GridPlan:
        return GridPlan(
            tuple(w for w in self.work if w.benchmark.name == name),
            tuple(p for p in self.pending if p.benchmark.name == name),
        )

    def without_benchmark(self, name: str) -> GridPlan:
        return GridPlan(
            tuple(w for w in self.work if w.benchmark.name != name),
            tuple(p for p in self.pending if p.benchmark.name != name),
        )


def plan_grid(
    grid: GridConfig, checkpoints: Iterable[CheckpointRef], data: Mapping[str, str] | None = None
) -> GridPlan:
    """Every cell of `grid` for every checkpoint: each enabled method's work (the methods in the
    order of `METHODS`), and the pending work. `data` maps a benchmark's name to the digest of its
    prepared data (`vitray.evaluation.suite.data_digest`), part of its cells' ids."""
    data = data or {}
    checkpoints = list(checkpoints)
    work: list[GridWork] = []
    pending: list[PendingWork] = []
    for name, method in METHODS.items():
        section = grid.section(name)
        if not section.enabled:
            continue
        for checkpoint in checkpoints:
            for benchmark in grid.resolved_benchmarks():
                planned = method.plan(checkpoint, benchmark, section, data.get(benchmark.name, ""))
                work += planned.work
                pending += planned.pending
    return GridPlan(tuple(work), tuple(pending))
