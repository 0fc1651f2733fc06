"""`vitray fewshot`: the grid's few-shot cells on one checkpoint, in this process, without Ray
(`vitray evaluate` runs the same cells in Ray tasks, `cluster/evaluate.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vitray.cluster.checkpoint_inputs import resolve_checkpoints
from vitray.cluster.grid_checks import check_grid_storage, check_work
from vitray.common.failures import describe_failure
from vitray.evaluation.config import GridConfig
from vitray.evaluation.methods import CheckpointRef, fewshot
from vitray.evaluation.suite import MissingDataset, require_prepared
from vitray.runfolder.pins import CheckpointPins


@dataclass
class FewshotSummary:
    """`vitray fewshot`'s answer: per benchmark and shots value its summary (mean, std, seeds, the
    ridge strengths), and what failed."""

    checkpoint: CheckpointRef
    rows: list[tuple[str, int, fewshot.ShotsSummary]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def fewshot_checkpoint(checkpoint: str, grid: GridConfig) -> FewshotSummary:
    """Every (shots, seed) few-shot cell of the grid's benchmarks on the checkpoint (or a run
    folder's latest), in this process on the CPU. A benchmark whose data is not prepared is a
    problem whose text is the prepare command; the others go on."""
    check_grid_storage(checkpoint, grid, writes=False)  # (its results go to the console only)
    (ref,) = resolve_checkpoints(checkpoint)
    summary = FewshotSummary(ref)
    section = grid.fewshot.model_copy(update={"num_gpus": 0.0})  # this process: the CPU
    groups = []
    for bench in grid.resolved_benchmarks():
        try:
            require_prepared(bench, grid.data_root, storage_options=grid.storage_options)
            groups.append((bench, fewshot.fewshot_group(ref, bench, section)))
        except (MissingDataset, ValueError) as err:
            summary.problems.append(str(err))
    # A resolution the patch size does not divide: refused once (PreflightError), not by every cell.
    check_work([group for _, group in groups], grid)
    with CheckpointPins([ref.path]):  # not pruned by a live run while the probes read it
        for bench, group in groups:
            outcomes = fewshot.run(group, section, grid.inputs)
            for k, shots in fewshot.summarize_scores(outcomes).items():
                summary.rows.append((bench.name, k, shots))
            summary.problems += [
                f"{bench.name} {o.cell.settings['shots']}-shot seed {o.cell.seed}: "
                f"{describe_failure(o.error).one_line()}"
                for o in outcomes
                if not o.ok
            ]
    return summary
