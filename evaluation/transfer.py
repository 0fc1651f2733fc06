"""Transfer runs without Ray: few-shot probes on a loaded model, and the fine-tune recipe as data.

- :func:`run_fewshot_group` reads a benchmark's train labels (no image decoded), draws every
  (shots, seed) cell's few-shot set of a :class:`FewShotGroup`, extracts features once for the
  drawn examples and for the test split (batched, through :class:`vitray.data.EvalLoader`) and
  solves every cell; a cell that cannot be solved (too few examples for its shots) fails alone.
- :func:`fewshot_probe` is the same probe on the model being trained, run by the training loop's
  evaluators of type ``fewshot`` (`vitray.trainers.evals`, which import it by name):
  ``{"fewshot/digits_10shot": 0.83}``.
- :func:`finetune_recipe` is the ViT paper's fine-tuning recipe for one cell as plain data in
  the shape of `vitray.trainers.config.TrainingConfig` (SGD momentum 0.9, cosine decay, linear
  warm-up, no weight decay, grad-norm clip 1, zero-initialised head, position embeddings
  resampled to the fine-tuning resolution). `cluster/transfer.py` makes it a TrainingConfig
  (`finetune_training_config`) and runs it; keeping it data keeps `evaluation/` free of the
  trainers. A selection cell's run trains
  on the train slice and reports top-1 on the held-out slice; :func:`split_top1` then scores its
  final weights on the test split. A final run reports its test top-1 itself.
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
from vitray.evaluation.fewshot import DEFAULT_L2_REG, extract_features, sample_few_shot, score_few_shot_set
from vitray.evaluation.grid import METRIC, TRAIN_SPLIT, VAL_SPLIT, FewShotGroup, is_selection
from vitray.evaluation.results import Cell
from vitray.evaluation.suite import Benchmark, locate, locate_train

# The few-shot images' pre-processing, as the authors' (big_vision configs/common_fewshot.py,
# resize(256)|central_crop(224) at 224 px): squashed square to img_size/0.875, then the central
# crop; for the train shots and the test split alike.
FEWSHOT_RESIZE = "square"

# Slots of the data plan per fine-tuning worker, at most: every slot advances in lock-step, so the
# micro batch must be a multiple of it (see TrainingConfig's checks).
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
    resize: str = "aspect",
    batch_size: int = 256,
    num_workers: int = 0,
    storage_options: dict[str, Any] | None = None,
    device: Any = "cpu",
) -> tuple[np.ndarray, np.ndarray]:
    """Pre-logits features (N, D) and labels of a whole prepared split, streamed in batches."""
    from vitray.data import EvalLoader

    loader = EvalLoader(
        path,
        split,
        batch_size=batch_size,
        img_size=img_size,
        resize=resize,
        num_workers=num_workers,
        storage_options=storage_options,
    )
    return extract_features(model, loader, device=device)


@dataclass(frozen=True)
class FewShotPool:
    """The examples few-shot sets are drawn from: a train split's labels, read without decoding
    any image (samples whose label cannot be read are left out). Features are then extracted for
    the drawn examples only (:func:`sampled_features`)."""

    keys: list[str]
    labels: np.ndarray  # class ids, pool order = stored order
    positions: np.ndarray  # each member's position in the split (or slice)

    @classmethod
    def read(cls, path: str, split: str, storage_options: dict[str, Any] | None = None) -> FewShotPool:
        from vitray.data import read_labels

        keys, labels = read_labels(path, split, storage_options=storage_options)
        readable = np.flatnonzero(labels >= 0)
        return cls([keys[i] for i in readable], labels[readable], readable)


def sampled_features(
    model: Any,
    path: str,
    split: str,
    pool: FewShotPool,
    picks: Mapping[Any, np.ndarray],
    *,
    img_size: int,
    resize: str = FEWSHOT_RESIZE,
    batch_size: int = 256,
    num_workers: int = 0,
    storage_options: dict[str, Any] | None = None,
    device: Any = "cpu",
) -> dict[Any, tuple[np.ndarray, np.ndarray]]:
    """Features and labels of every few-shot set in `picks` (name -> pool indices, e.g. from
    :func:`vitray.evaluation.fewshot.sample_few_shot`), each picked image extracted once.

    An image that turns out undecodable is left out of the sets that picked it (it is reported
    by the data layer as a skipped sample).
    """
    from vitray.data import EvalLoader

    union = np.unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in picks.values()]))
    loader = EvalLoader(
        path,
        split,
        batch_size=batch_size,
        img_size=img_size,
        resize=resize,
        num_workers=num_workers,
        storage_options=storage_options,
        indices=pool.positions[union].tolist(),
    )
    keys: list[str] = []

    def batches():
        for batch in loader:
            keys.extend(batch.keys)
            yield batch

    features, _ = extract_features(model, batches(), device=device)
    row_of = {key: row for row, key in enumerate(keys)}
    sets = {}
    for name, picked in picks.items():
        picked = np.asarray(picked, dtype=np.int64)
        found = [(i, row_of[pool.keys[i]]) for i in picked if pool.keys[i] in row_of]
        members = np.array([i for i, _ in found], dtype=np.int64)
        sets[name] = features[[row for _, row in found]], pool.labels[members]
    return sets


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

    The train split's labels are read first (no image decoded); each cell's few-shot set is drawn
    from them, and features are extracted for the drawn examples only, plus the whole test split.
    Reading or extraction errors fail every cell of the group; a sampling or solve error (e.g.
    fewer examples than shots) fails its own cell only. A cell's `seconds` is its solve time plus
    an equal share of the reading and extraction time.
    """
    benchmark = group.benchmark
    started = time.perf_counter()
    errors: dict[str, str] = {}
    try:
        if model.img_size != group.img_size:
            model.set_img_size(group.img_size)
        common = {
            "img_size": group.img_size,
            "resize": FEWSHOT_RESIZE,
            "batch_size": batch_size,
            "num_workers": num_workers,
            "storage_options": storage_options,
            "device": device,
        }
        train_path = locate_train(benchmark, data_root)
        pool = FewShotPool.read(train_path, benchmark.train_split, storage_options)
        picks = {}
        for cell in group.cells:
            try:
                picks[cell.cell_id] = sample_few_shot(
                    pool.labels, cell.settings["shots"], cell.seed, benchmark.num_classes
                )
            except ValueError as error:  # e.g. fewer examples than shots: this cell only
                errors[cell.cell_id] = f"{type(error).__name__}: {error}"
        sets = sampled_features(model, train_path, benchmark.train_split, pool, picks, **common) if picks else {}
        test_x, test_y = extract_split_features(model, locate(benchmark, data_root), benchmark.test_split, **common)
    except Exception as error:
        seconds = (time.perf_counter() - started) / len(group.cells)
        return [CellOutcome(cell, error=error_text(error), seconds=seconds) for cell in group.cells]
    share = (time.perf_counter() - started) / len(group.cells)
    outcomes = []
    for cell in group.cells:
        t0 = time.perf_counter()
        metrics, error_message = None, errors.get(cell.cell_id)
        if error_message is None:
            try:
                train_x, train_y = sets[cell.cell_id]
                score = score_few_shot_set(
                    train_x,
                    train_y,
                    test_x,
                    test_y,
                    num_classes=benchmark.num_classes,
                    shots=cell.settings["shots"],
                    seed=cell.seed,
                    l2_reg=cell.settings["l2_reg"],
                )
                metrics = {METRIC: score.accuracy}
            except Exception as error:
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
        common = {
            "img_size": model.img_size,
            "resize": FEWSHOT_RESIZE,
            "batch_size": batch_size,
            "num_workers": num_workers,
            "storage_options": storage_options,
            "device": param.device,
        }
        num_classes = _num_classes(path, storage_options)
        pool = FewShotPool.read(path, train_split, storage_options)
        picks = {(k, seed): sample_few_shot(pool.labels, k, seed, num_classes) for k in shots for seed in range(seeds)}
        sets = sampled_features(probe, path, train_split, pool, picks, **common)
        test_x, test_y = extract_split_features(probe, path, test_split, **common)
        for k in shots:
            scores = [
                score_few_shot_set(
                    *sets[k, seed], test_x, test_y, num_classes=num_classes, shots=k, seed=seed, l2_reg=l2_reg
                )
                for seed in range(seeds)
            ]
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
    val_evaluator: str,
) -> dict[str, Any]:
    """A fine-tune run as plain data in the shape of `vitray.trainers.config.TrainingConfig`
    (`cluster.transfer.finetune_training_config` validates it into one; this package does not
    import the trainers).

    `settings` are a cell's resolved settings (lr, steps, batch_size, warmup_steps, resolution,
    train_split and -- for a selection cell -- val_split; see
    :func:`vitray.evaluation.grid.finetune_settings`). The run trains on `train_split` of the
    benchmark's train data and reports top-1 at its last step on `val_split` of the same data, or,
    without `val_split` (a final run), on the test split. `model` the checkpoint's model section
    (its architecture; the resolution becomes `settings["resolution"]`), `options` the grid's
    fine-tune section (workers, micro batch, checkpoint interval). `options.overrides` are not
    applied here: they are dotted keys for the config loader. `val_evaluator` names the evaluator
    that reports the run's top-1 (`vitray.trainers.evals.VAL`).
    """
    options = options or FinetuneGrid()
    steps, batch = int(settings["steps"]), int(settings["batch_size"])
    workers = options.num_workers
    micro = max(1, min(options.micro_batch_size, batch // workers))
    slots_per_worker = math.gcd(micro, MAX_SLOTS_PER_WORKER)
    return {
        "seed": int(seed),
        "run": {"name": run_name, "storage": run_storage},
        # Fine-tuning drops the pre-logits layer (reset_head) and starts from a zero head (weights
        # and bias, whatever the pre-training head's bias was), as the paper does.
        "model": {
            **dict(model),
            "img_size": int(settings["resolution"]),
            "representation_size": None,
            "head_bias_init": 0.0,
        },
        "init": {"checkpoint": checkpoint, "reset_head": True},
        "data": {
            "train": locate_train(benchmark, data_root),
            "train_split": settings.get(TRAIN_SPLIT, benchmark.train_split),
            # The held-out slice comes from the train data (ImageNet-ReaL: ImageNet's train split).
            "val": locate_train(benchmark, data_root) if is_selection(settings) else locate(benchmark, data_root),
            "val_split": settings[VAL_SPLIT] if is_selection(settings) else benchmark.test_split,
            "num_slots": workers * slots_per_worker,
            "storage_options": storage_options,
        },
        "train": {
            "steps": steps,
            "batch_size": batch,
            "micro_batch_size": micro,
            "label_smoothing": 0.0,
            "mixup_alpha": 0.0,
        },
        "optim": {"name": "sgd", "lr": float(settings["lr"]), "weight_decay": 0.0, "momentum": 0.9, "grad_clip": 1.0},
        "schedule": {"warmup_steps": int(settings["warmup_steps"]), "decay": "cosine", "min_lr": 0.0},
        "checkpoint": {"every": options.checkpoint_every or max(1, steps // 4), "keep": 1},
        "log": {"every": max(1, min(50, steps // 4))},
        # Top-1 on the val split (or the test split) once, at the end: the evaluator `val_evaluator` names.
        "evals": {val_evaluator: {"type": "val", "every": steps, "batch_size": options.eval_batch_size}},
        "cluster": {
            "address": address,
            "num_workers": workers,
            "cpus_per_worker": options.cpus_per_worker,
            "gpus_per_worker": options.gpus_per_worker,
        },
    }


def final_top1(metrics: Iterable[Mapping[str, Any]], steps: int, metric: str) -> float | None:
    """The top-1 on its `data.val_split` a finished fine-tune run logged at its last step as
    `metric` (`vitray.trainers.evals.VAL_TOP1`; the held-out slice of a selection cell, the test
    split of a final run), or None if it has not."""
    found = None
    for record in metrics:
        if record.get("step") == steps and metric in record:
            found = float(record[metric])
    return found


def split_top1(
    model: Any,
    path: str,
    split: str,
    *,
    batch_size: int = 256,
    num_workers: int = 0,
    storage_options: dict[str, Any] | None = None,
    device: Any = "cpu",
) -> float:
    """Top-1 accuracy of a classifier on a prepared split (or slice), at the model's resolution.

    Multi-label data (ImageNet-ReaL): a prediction counts when it is one of the image's labels, and
    images without any label are left out, as ReaL is scored. The model is evaluated in eval mode
    and left in the mode it was in.
    """
    from vitray.data import EvalLoader, top1_hits

    loader = EvalLoader(
        path,
        split,
        batch_size=batch_size,
        img_size=model.img_size,
        num_workers=num_workers,
        storage_options=storage_options,
    )
    was_training = model.training
    model.to(device).eval()
    correct = seen = 0
    try:
        with torch.inference_mode():
            for batch in loader:
                hits, scored = top1_hits(model(batch.images.to(device)).float().argmax(1), batch.labels)
                correct, seen = correct + hits, seen + scored
    finally:
        model.train(was_training)
    if seen == 0:
        raise ValueError(f"split {split!r} of {path} has no labelled sample to score")
    return correct / seen
