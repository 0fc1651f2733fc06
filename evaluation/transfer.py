"""Transfer runs without Ray: few-shot probes on a loaded model, and the fine-tune recipe as data.

- :func:`run_fewshot_group` extracts a benchmark's train and test features once (batched, through
  :class:`vitray.data.EvalLoader`) and solves every (shots, seed) cell of a :class:`FewShotGroup`;
  a cell that cannot be solved (too few examples for its shots) fails alone.
- :func:`fewshot_probe` is the same probe as a hook for the pre-training loop:
  ``{"fewshot/digits_10shot": 0.83}``.
- :func:`finetune_recipe` is the ViT paper's fine-tuning recipe for one cell as a plain dict in
  the shape of `vitray.trainers.config.PretrainConfig` (SGD momentum 0.9, cosine decay, linear
  warm-up, no weight decay, grad-norm clip 1, zero-initialised head, position embeddings
  resampled to the fine-tuning resolution). `cluster/` validates it with PretrainConfig and runs
  it; keeping it a dict keeps `evaluation/` free of the trainers.
"""

from __future__ import annotations

import math
import re
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vitray.evaluation.config import FinetuneGrid
from vitray.evaluation.fewshot import DEFAULT_L2_REG, extract_features, fewshot_accuracy
from vitray.evaluation.grid import METRIC, FewShotGroup
from vitray.evaluation.results import Cell
from vitray.evaluation.suite import Benchmark, locate, locate_train

# Slots of the data plan per fine-tuning worker, at most: every slot advances in lock-step, so the
# micro batch must be a multiple of it (see PretrainConfig's checks).
MAX_SLOTS_PER_WORKER = 8


@dataclass(frozen=True)
class CellOutcome:
    """What became of one cell: metrics when it succeeded, else the error text."""

    cell: Cell
    metrics: Mapping[str, float] | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    def rows(self) -> list[dict[str, Any]]:
        """The cell's rows for :class:`vitray.evaluation.results.ResultsTable`."""
        if self.error is not None:
            return self.cell.failed(self.error, self.seconds)
        return self.cell.ok(dict(self.metrics or {}), self.seconds)


def error_text(error: BaseException, limit: int = 12) -> str:
    """`Type: message` and the innermost frames of the traceback: enough to act on, small to store."""
    frames = traceback.format_exception(type(error), error, error.__traceback__)
    tail = "".join(frames[-limit:]).strip()
    return f"{type(error).__name__}: {error}\n{tail}"


# ---------------------------------------------------------------------------------------------
# Few-shot
# ---------------------------------------------------------------------------------------------


def extract_split_features(
    model: Any,
    path: str,
    split: str,
    *,
    img_size: int,
    batch_size: int = 256,
    num_workers: int = 0,
    storage_options: dict[str, Any] | None = None,
    device: Any = "cpu",
) -> tuple[np.ndarray, np.ndarray]:
    """Pre-logits features (N, D) and labels of a whole prepared split, streamed in batches."""
    from vitray.data import EvalLoader

    loader = EvalLoader(
        path, split, batch_size=batch_size, img_size=img_size, num_workers=num_workers,
        storage_options=storage_options,
    )  # fmt: skip
    return extract_features(model, loader, device=device)


def run_fewshot_group(
    model: Any,
    group: FewShotGroup,
    data_root: str,
    *,
    batch_size: int = 256,
    num_workers: int = 0,
    storage_options: dict[str, Any] | None = None,
    device: Any = "cpu",
) -> list[CellOutcome]:
    """Every cell of `group` on `model` (resampled to `group.img_size` in place when it differs).

    Extraction errors fail every cell of the group; a solve error fails its own cell only. A
    cell's `seconds` is its solve time plus an equal share of the extraction time.
    """
    benchmark = group.benchmark
    started = time.perf_counter()
    try:
        if model.img_size != group.img_size:
            model.set_img_size(group.img_size)
        features = {}
        for role, path, split in (
            ("train", locate_train(benchmark, data_root), benchmark.train_split),
            ("test", locate(benchmark, data_root), benchmark.test_split),
        ):
            features[role] = extract_split_features(
                model, path, split, img_size=group.img_size, batch_size=batch_size, num_workers=num_workers,
                storage_options=storage_options, device=device,
            )  # fmt: skip
    except Exception as error:  # noqa: BLE001 - recorded as the cells' failure, never lost
        seconds = (time.perf_counter() - started) / len(group.cells)
        return [CellOutcome(cell, error=error_text(error), seconds=seconds) for cell in group.cells]
    share = (time.perf_counter() - started) / len(group.cells)
    (train_x, train_y), (test_x, test_y) = features["train"], features["test"]
    outcomes = []
    for cell in group.cells:
        t0 = time.perf_counter()
        metrics, error_message = None, None
        try:
            (score,) = fewshot_accuracy(
                train_x, train_y, test_x, test_y, num_classes=benchmark.num_classes,
                shots=cell.settings["shots"], seeds=[cell.seed], l2_reg=cell.settings["l2_reg"],
            )  # fmt: skip
            metrics = {METRIC: score.accuracy}
        except Exception as error:  # noqa: BLE001 - e.g. fewer examples than shots: this cell only
            error_message = f"{type(error).__name__}: {error}"
        outcomes.append(CellOutcome(cell, metrics, error_message, share + time.perf_counter() - t0))
    return outcomes


def fewshot_probe(
    model: Any,
    datasets: Mapping[str, str],
    *,
    shots: Sequence[int] = (10,),
    seeds: int = 1,
    l2_reg: float = DEFAULT_L2_REG,
    train_split: str = "train",
    test_split: str = "test",
    batch_size: int = 256,
    num_workers: int = 0,
    storage_options: dict[str, Any] | None = None,
    prefix: str = "fewshot/",
) -> dict[str, float]:
    """Few-shot accuracy of a model being trained: ``{"fewshot/NAME_{k}shot": mean over seeds}``.

    `datasets` maps a short name to a prepared dataset folder (local or s3://), e.g.
    ``{"digits": "/data/digits"}``. The model is probed at its own resolution on its own device
    and dtype, and is left in the train/eval mode it was in. Same code as `vitray fewshot`.
    """
    if not datasets:
        raise ValueError('datasets is empty: give {name: prepared dataset folder}, e.g. {"digits": "/data/digits"}')
    param = next(model.parameters())
    probe = model if param.dtype == torch.float32 else _CastInputs(model, param.dtype)
    results: dict[str, float] = {}
    for name, path in datasets.items():
        common = dict(img_size=model.img_size, batch_size=batch_size, num_workers=num_workers,
                      storage_options=storage_options, device=param.device)  # fmt: skip
        train_x, train_y = extract_split_features(probe, path, train_split, **common)
        test_x, test_y = extract_split_features(probe, path, test_split, **common)
        num_classes = _num_classes(path, storage_options)
        for k in shots:
            scores = fewshot_accuracy(
                train_x, train_y, test_x, test_y, num_classes=num_classes, shots=k, seeds=seeds, l2_reg=l2_reg
            )
            results[f"{prefix}{name}_{k}shot"] = float(np.mean([s.accuracy for s in scores]))
    return results


def _num_classes(path: str, storage_options: dict[str, Any] | None) -> int:
    from vitray.data import read_dataset_info

    return read_dataset_info(path, storage_options).num_classes


class _CastInputs(torch.nn.Module):
    """Feeds the loaders' float32 images to a bf16/fp16 model."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype
        self.training = inner.training  # extract_features restores this mode afterwards

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        return self.inner.forward_features(images.to(self.dtype))


def summarize_scores(outcomes: Iterable[CellOutcome]) -> dict[int, tuple[float, float, int]]:
    """Few-shot outcomes per shots value: (mean, population std, number of seeds) of the ok ones."""
    by_shots: dict[int, list[float]] = {}
    for outcome in outcomes:
        if outcome.ok:
            by_shots.setdefault(int(outcome.cell.settings["shots"]), []).append(outcome.metrics[METRIC])
    return {k: (float(np.mean(v)), float(np.std(v)), len(v)) for k, v in sorted(by_shots.items())}


# ---------------------------------------------------------------------------------------------
# Fine-tuning
# ---------------------------------------------------------------------------------------------


def finetune_run_name(cell: Cell) -> str:
    """A run name that is unique per cell and stable across re-runs (so a re-run resumes it)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", cell.benchmark).strip("-")
    return f"{slug}-lr{cell.settings['lr']:g}-seed{cell.seed}-{cell.cell_id}"


def finetune_recipe(
    benchmark: Benchmark,
    settings: Mapping[str, Any],
    *,
    checkpoint: str,
    model: Mapping[str, Any],
    data_root: str,
    run_name: str,
    run_storage: str,
    seed: int = 0,
    options: FinetuneGrid | None = None,
    address: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A fine-tune run as a PretrainConfig-shaped dict.

    `settings` are a cell's resolved settings (lr, steps, batch_size, warmup_steps, resolution;
    see :func:`vitray.evaluation.grid.finetune_settings`), `model` the checkpoint's model section
    (its architecture; the resolution becomes `settings["resolution"]`), `options` the grid's
    fine-tune section (workers, micro batch, checkpoint interval). `options.overrides` are not
    applied here: they are dotted keys for the config loader.
    """
    options = options or FinetuneGrid()
    steps, batch = int(settings["steps"]), int(settings["batch_size"])
    workers = options.num_workers
    micro = max(1, min(options.micro_batch_size, batch // workers))
    slots_per_worker = math.gcd(micro, MAX_SLOTS_PER_WORKER)
    return {
        "seed": int(seed),
        "run": {"name": run_name, "storage": run_storage},
        # Fine-tuning drops the pre-logits layer (reset_head), as the paper does.
        "model": {**dict(model), "img_size": int(settings["resolution"]), "representation_size": None},
        "init": {"checkpoint": checkpoint, "reset_head": True},
        "data": {
            "train": locate_train(benchmark, data_root),
            "train_split": benchmark.train_split,
            "val": locate(benchmark, data_root),
            "val_split": benchmark.test_split,
            "num_slots": workers * slots_per_worker,
            "storage_options": storage_options,
        },
        "train": {
            "optimizer": "sgd",
            "momentum": 0.9,
            "decay": "cosine",
            "weight_decay": 0.0,
            "grad_clip": 1.0,
            "lr": float(settings["lr"]),
            "min_lr": 0.0,
            "steps": steps,
            "warmup_steps": int(settings["warmup_steps"]),
            "batch_size": batch,
            "micro_batch_size": micro,
            "label_smoothing": 0.0,
            "mixup_alpha": 0.0,
            "eval_every": steps,  # top-1 on the test split once, at the end
            "eval_batch_size": options.eval_batch_size,
            "checkpoint_every": options.checkpoint_every or max(1, steps // 4),
            "keep_checkpoints": 1,
            "log_every": max(1, min(50, steps // 4)),
        },
        "cluster": {
            "address": address,
            "num_workers": workers,
            "cpus_per_worker": options.cpus_per_worker,
            "gpus_per_worker": options.gpus_per_worker,
        },
    }


def final_top1(metrics: Iterable[Mapping[str, Any]], steps: int) -> float | None:
    """The test top-1 a finished fine-tune run logged at its last step, or None if it has not."""
    found = None
    for record in metrics:
        if record.get("step") == steps and "val/top1" in record:
            found = float(record["val/top1"])
    return found
