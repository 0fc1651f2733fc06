"""The few-shot evaluator: closed-form linear probes (`vitray.evaluation.fewshot`) on a model's
features of prepared datasets.

:func:`probe` is the one function that runs the probe. It reads a train split's labels (no image
decoded), draws every requested (shots, seed) few-shot set, extracts features once for the drawn
examples and for the test split (batched, through :class:`vitray.data.EvalLoader`) and solves
every set. Its two callers:

- `vitray.evaluation.evaluators.fewshot`, on the model being trained (a run's evaluators of kind
  ``fewshot``): ``("digits_10shot", accuracy)`` per dataset and shots value (mean over seeds);
- the grid's few-shot method (`vitray.evaluation.methods.fewshot`, for `vitray fewshot` and
  `vitray evaluate`), a group of cells of one (checkpoint, benchmark) on a loaded model: one
  :class:`~vitray.evaluation.results.CellOutcome` per cell, a cell that cannot be solved (too few
  examples for its shots) failing alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vitray.evaluation.fewshot import (
    DEFAULT_L2_REG,
    FewShotScore,
    extract_features,
    sample_few_shot,
    score_few_shot_set,
)

# The few-shot images' pre-processing, as the authors' (big_vision configs/common_fewshot.py,
# resize(256)|central_crop(224) at 224 px): squashed square to img_size/0.875, then the central
# crop; for the train shots and the test split alike.
FEWSHOT_RESIZE = "square"


@dataclass(frozen=True)
class ProbeData:
    """Where a probe's few-shot sets are drawn from and where it is scored, at which resolution."""

    train_path: str
    train_split: str
    test_path: str
    test_split: str
    num_classes: int
    img_size: int


@dataclass(frozen=True)
class Draw:
    """One few-shot set: `shots` examples per class drawn with `seed`, solved with `l2_reg`."""

    shots: int
    seed: int
    l2_reg: Any = DEFAULT_L2_REG  # a number, or "select"


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
    outage_s: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Pre-logits features (N, D) and labels of a whole prepared split, streamed in batches
    (`outage_s` as :class:`vitray.data.EvalLoader` takes it)."""
    from vitray.data import EvalLoader

    loader = EvalLoader(
        path,
        split,
        batch_size=batch_size,
        img_size=img_size,
        resize=resize,
        num_workers=num_workers,
        storage_options=storage_options,
        outage_s=outage_s,
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
    def read(
        cls, path: str, split: str, storage_options: dict[str, Any] | None = None, outage_s: float | None = None
    ) -> FewShotPool:
        from vitray.data import read_labels

        keys, labels = read_labels(path, split, storage_options=storage_options, outage_s=outage_s)
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
    outage_s: float | None = None,
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
        outage_s=outage_s,
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


def probe(
    model: Any,
    data: ProbeData,
    draws: Mapping[Hashable, Draw],
    *,
    batch_size: int = 256,
    num_workers: int = 0,
    storage_options: dict[str, Any] | None = None,
    device: Any = "cpu",
    outage_s: float | None = None,
    pool: FewShotPool | None = None,
) -> dict[Hashable, FewShotScore | Exception]:
    """Every few-shot set of `draws` probed on `model`'s features at `data.img_size`: its score, or
    the error that drawing or solving it raised (e.g. fewer examples than shots: that set alone).
    Reading or extraction errors raise; `outage_s` (a training run's probe): reads wait this long
    for a store that stopped answering (`vitray.storage.ride_out`)."""
    common = {
        "img_size": data.img_size,
        "resize": FEWSHOT_RESIZE,
        "batch_size": batch_size,
        "num_workers": num_workers,
        "storage_options": storage_options,
        "device": device,
        "outage_s": outage_s,
    }
    if pool is None:  # `pool`: the train split's labels read before (a training run's probe keeps them)
        pool = FewShotPool.read(data.train_path, data.train_split, storage_options, outage_s)
    results: dict[Hashable, FewShotScore | Exception] = {}
    picks = {}
    for key, draw in draws.items():
        try:
            picks[key] = sample_few_shot(pool.labels, draw.shots, draw.seed, data.num_classes)
        except ValueError as error:
            results[key] = error
    if not picks:
        return results  # every draw failed: no test features to extract for nothing
    sets = sampled_features(model, data.train_path, data.train_split, pool, picks, **common)
    test_x, test_y = extract_split_features(model, data.test_path, data.test_split, **common)
    for key, draw in draws.items():
        if key in results:
            continue
        try:
            train_x, train_y = sets[key]
            results[key] = score_few_shot_set(
                train_x,
                train_y,
                test_x,
                test_y,
                num_classes=data.num_classes,
                shots=draw.shots,
                seed=draw.seed,
                l2_reg=draw.l2_reg,
            )
        except Exception as error:
            results[key] = error
    return {key: results[key] for key in draws}
