"""The work of an evaluation grid checked before any of its cells starts (`vitray evaluate`'s Ray
tasks, `vitray fewshot`'s cells in its own process): a mistake every cell would meet is refused
once, in one line. Without Ray."""

from __future__ import annotations

from vitray import storage
from vitray.cluster.finetune import finetune_config
from vitray.evaluation.config import GridConfig
from vitray.evaluation.methods import METHODS, GridWork
from vitray.evaluation.methods.finetune import FinetuneJob


def check_work(work: list[GridWork], grid: GridConfig) -> None:
    """Every unit's model builds at its resolution (on the meta device), once per checkpoint and
    resolution, and every fine-tune run's training config (its `finetune.overrides` included)
    validates: a resolution the patch size does not divide, or a wrong override, is refused
    (PreflightError, ConfigError) before any cell starts, instead of failing every cell on its workers."""
    from vitray.models import ModelConfig
    from vitray.trainers.driver_checks.preflight import PreflightError, check_model

    checked: set[tuple[str, int]] = set()
    for unit in work:
        if isinstance(unit, FinetuneJob):
            finetune_config(unit, grid)
        checkpoint, img_size = unit.checkpoint, unit.img_size
        if (checkpoint.path, img_size) in checked or not checkpoint.model:
            continue
        checked.add((checkpoint.path, img_size))
        try:
            check_model(ModelConfig.model_validate({**checkpoint.model, "img_size": img_size}))
        except PreflightError as err:
            title = METHODS[unit.method].TITLE
            raise PreflightError(f"{title} cells of {checkpoint.path} at {img_size} px: {err}") from None


def check_grid_storage(checkpoint: str, grid: GridConfig, *, writes: bool = True, watch: bool = False) -> None:
    """The checkpoint (or run folder), the data root and -- where the grid `writes` its results --
    the output can be reached with the credentials at hand (one quick probe each, `storage.check_reachable`):
    a wrong key, endpoint or bucket is refused in one line naming it (a StorageUnreachable), not met
    by the cells (as a missing dataset, or a traceback) after the grid's work has begun. A run folder
    to `watch` may not be there yet (the run has not written anything): its store is probed, not it."""
    options = grid.storage_options
    storage.check_remote_reachable(checkpoint, must_exist=not watch, storage_options=options)
    storage.check_remote_reachable(grid.data_root, storage_options=options)
    if writes:
        storage.check_remote_reachable(grid.output, storage_options=options)
