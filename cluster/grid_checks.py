"""The work of an evaluation grid checked before any of its cells starts (`vitray evaluate`'s Ray
tasks, `vitray fewshot`'s cells in its own process): a mistake every cell would meet is refused
once, in one line. Without Ray."""

from __future__ import annotations

from typing import Any

from vitray import storage
from vitray.cluster.finetune import finetune_config
from vitray.data import DatasetInfo, read_dataset_info
from vitray.data.layout import DATASET_JSON
from vitray.data.splits import parse_split, slice_bounds
from vitray.evaluation.config import GridConfig
from vitray.evaluation.methods import METHODS, GridWork
from vitray.evaluation.methods.fewshot import FewShotGroup
from vitray.evaluation.methods.finetune import FinetuneJob
from vitray.evaluation.suite import locate_train


def check_work(work: list[GridWork], grid: GridConfig) -> None:
    """Every unit's model builds at its resolution (on the meta device), once per checkpoint and
    resolution, every fine-tune run's training config (its `finetune.overrides` included)
    validates, and the splits the cells read are in their datasets (`_SplitCheck`): a resolution the
    patch size does not divide, a wrong override, a split the data does not have or a few-shot count
    more than it holds is refused (PreflightError, ConfigError) before any cell starts, instead of
    failing every cell on its workers."""
    from vitray.trainers.driver_checks.preflight import PreflightError

    splits = _SplitCheck(grid.storage_options)
    for unit in work:
        if isinstance(unit, FinetuneJob):
            cfg = finetune_config(unit, grid)
            splits.check("finetune.train_split", cfg.data.train, cfg.data.train_split)
            for ev in cfg.evals.values():
                scored = ev.dataset(cfg.data) if ev.type == "val" else None
                if scored is not None:
                    splits.check("finetune.val_split", *scored)
                    splits.held_out(
                        "finetune.val_split", *scored, "finetune.train_split", cfg.data.train, cfg.data.train_split
                    )
        elif isinstance(unit, FewShotGroup):
            benchmark = unit.benchmark
            shots = max(int(c.settings["shots"]) for c in unit.cells)
            if any(c.settings["l2_reg"] == "select" and int(c.settings["shots"]) < 2 for c in unit.cells):
                raise PreflightError(
                    "fewshot.l2_reg=select (--l2 select) holds out part of each few-shot set, so every class needs "
                    "at least 2 shots; leave 1 out of fewshot.shots (--shots; the protocol's are 1, 5, 10, 25) or "
                    "give l2_reg a number"
                )
            train = locate_train(benchmark, grid.data_root)
            splits.check(f"{benchmark.name}'s train split", train, benchmark.train_split, shots=shots)
    check_models(work)


def check_models(work: list[GridWork]) -> None:
    """Every unit's model builds at its resolution (on the meta device), once per checkpoint and
    resolution: PreflightError naming the cells otherwise. Needs no data: `vitray demo` asks it of
    the grid before it pre-trains the checkpoint (with the model the run will have)."""
    from vitray.models import ModelConfig
    from vitray.trainers.driver_checks.preflight import PreflightError, check_model

    checked: set[tuple[str, int]] = set()
    for unit in work:
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
    to `watch` may not be there yet (the run has not written anything): its store is probed, not it.
    An output that is a prepared dataset or a run folder (a mistyped --output) is refused too."""
    options = grid.storage_options
    storage.check_remote_reachable(checkpoint, must_exist=not watch)  # read with the environment's credentials
    storage.check_remote_reachable(grid.data_root, storage_options=options)
    if writes:
        storage.check_remote_reachable(grid.output, writable=True, storage_options=options)
        for marker, what in ((DATASET_JSON, "a prepared dataset"), ("vitray", "a training run's folder")):
            if storage.exists(storage.join(grid.output, marker), options):
                raise ValueError(
                    f"output={grid.output} is {what} (it holds {marker}); give the evaluation a folder of its own"
                )


class _SplitCheck:
    """The splits (`NAME[start:stop]`) cells read, checked against their datasets' dataset.json (one
    read per dataset): the name is there, the slice is in range, and it holds `shots` examples of
    every class at least in number (the few-shot draw needs that many of each)."""

    def __init__(self, storage_options: dict[str, Any] | None):
        self.storage_options = storage_options
        self._infos: dict[str, DatasetInfo] = {}
        self._checked: set[tuple[str, str, int]] = set()

    def held_out(self, val_key: str, path: str, split: str, train_key: str, train_path: str, train_split: str) -> None:
        """No sample of the validation slice is trained on (`check_held_out`): the learning rate the
        grid selects on it, and the top-1 it reports, would be of training samples."""
        from vitray.trainers.driver_checks.preflight import check_held_out

        if path == train_path:  # (both checked, and their info read, by `check` first)
            check_held_out(val_key, split, train_key, train_split, self._infos[path], same_ok=False)

    def check(self, key: str, path: str, split: str, *, shots: int = 0) -> None:
        from vitray.trainers.driver_checks.preflight import PreflightError

        if (path, split, shots) in self._checked:
            return
        self._checked.add((path, split, shots))
        if path not in self._infos:
            self._infos[path] = read_dataset_info(path, self.storage_options)
        info = self._infos[path]
        spec = parse_split(split)
        try:
            start, stop = slice_bounds(spec, info.split(spec.name).num_samples)
        except KeyError as err:
            raise PreflightError(f"{key}={split}: {err.args[0]} (at {path})") from None
        except ValueError as err:
            raise PreflightError(f"{key}={split}: {err} (at {path})") from None
        if shots * info.num_classes > stop - start:
            raise PreflightError(
                f"few-shot: {shots} shots of each of the {info.num_classes} classes of {info.name} need "
                f"{shots * info.num_classes:,} examples, and {split} holds {stop - start:,}; lower fewshot.shots"
            )
