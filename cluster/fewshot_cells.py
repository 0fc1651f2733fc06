"""Few-shot cells on a checkpoint: in a Ray task for the grid (`cluster/evaluate.py`), in this
process for `vitray fewshot`. Both load the checkpoint with :func:`~vitray.cluster.checkpoint_inputs.load_on_device`
and run the few-shot evaluator (`vitray.evaluation.fewshot_probe.run_fewshot_group`).
"""

from __future__ import annotations

import functools
from concurrent.futures import Future
from dataclasses import dataclass, field

from vitray.cluster.checkpoint_inputs import load_on_device, resolve_checkpoints
from vitray.common.failures import describe_failure
from vitray.evaluation.config import GridConfig
from vitray.evaluation.fewshot_probe import run_fewshot_group, summarize_scores
from vitray.evaluation.grid import CheckpointRef, FewShotGroup, fewshot_group
from vitray.evaluation.results import CellOutcome, error_text
from vitray.evaluation.suite import MissingDataset, require_prepared


def fewshot_cells(
    group: FewShotGroup,
    data_root: str,
    *,
    batch_size: int,
    data_workers: int,
    storage_options: dict | None,
    use_gpu: bool,
) -> list[CellOutcome]:
    """Loads the group's checkpoint, extracts features once and solves every cell (a checkpoint
    that does not load fails every cell)."""
    try:
        model, device = load_on_device(group.checkpoint.path, use_gpu=use_gpu)
    except Exception as error:
        return [CellOutcome(cell, error=error_text(error)) for cell in group.cells]
    return run_fewshot_group(
        model,
        group,
        data_root,
        batch_size=batch_size,
        num_workers=data_workers,
        storage_options=storage_options,
        device=device,
    )


def _fewshot_task(
    group: FewShotGroup, data_root: str, batch_size: int, data_workers: int, storage_options: dict | None, use_gpu: bool
) -> list[CellOutcome]:
    return fewshot_cells(
        group,
        data_root,
        batch_size=batch_size,
        data_workers=data_workers,
        storage_options=storage_options,
        use_gpu=use_gpu,
    )


def submit_fewshot(group: FewShotGroup, grid: GridConfig) -> Future:
    """The group's cells in a Ray task with the grid's few-shot resources (`fewshot.num_cpus` /
    `num_gpus`), as a future of their outcomes."""
    settings = grid.fewshot
    task = _remote_fewshot_task().options(num_cpus=settings.num_cpus, num_gpus=settings.num_gpus)
    ref = task.remote(
        group, grid.data_root, settings.batch_size, settings.data_workers, grid.storage_options, settings.num_gpus > 0
    )
    return ref.future()


@functools.cache
def _remote_fewshot_task():
    import ray  # here, not at import: `vitray fewshot` runs without Ray

    return ray.remote(_fewshot_task)


@dataclass
class FewshotSummary:
    """`vitray fewshot`'s answer: per benchmark and shots value (mean, std, seeds), and what failed."""

    checkpoint: CheckpointRef
    rows: list[tuple[str, int, float, float, int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def fewshot_checkpoint(checkpoint: str, grid: GridConfig) -> FewshotSummary:
    """Every (shots, seed) few-shot cell of the grid's benchmarks on the checkpoint (or a run
    folder's latest), in this process on the CPU, without Ray. A benchmark whose data is not
    prepared is a problem whose text is the prepare command; the others go on."""
    (ref,) = resolve_checkpoints(checkpoint)
    summary = FewshotSummary(ref)
    settings = grid.fewshot
    for bench in grid.resolved_benchmarks():
        try:
            require_prepared(bench, grid.data_root, storage_options=grid.storage_options)
            group = fewshot_group(ref, bench, settings)
        except (MissingDataset, ValueError) as err:
            summary.problems.append(str(err))
            continue
        outcomes = fewshot_cells(
            group,
            grid.data_root,
            batch_size=settings.batch_size,
            data_workers=settings.data_workers,
            storage_options=grid.storage_options,
            use_gpu=False,
        )
        for k, (mean, std, n) in summarize_scores(outcomes).items():
            summary.rows.append((bench.name, k, mean, std, n))
        summary.problems += [
            f"{bench.name} {o.cell.settings['shots']}-shot seed {o.cell.seed}: {describe_failure(o.error).one_line()}"
            for o in outcomes
            if not o.ok
        ]
    return summary
