"""``fewshot``: the closed-form linear few-shot probe on the frozen features of the model being
trained (the probe of `vitray fewshot` and of the grid, `vitray.evaluation.fewshot_probe`).

    evals:
      probe: {type: fewshot, every: 1000, datasets: {digits: /data/digits}, shots: [10], seeds: 1}

Metrics ``<dataset>_<k>shot`` (mean over seeds), computed on rank 0; the other ranks go on
training, unless the forward pass is a collective (ZeRO-3, XLA over hosts): then every rank runs
the same passes and rank 0 reports.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field, field_validator

from vitray.data.config import StoragePath
from vitray.evaluation.evaluators.base import EVAL_NAME, NAME_RULE, EvalSection, Forward, Worker

KIND = "fewshot"


class FewshotEvalConfig(EvalSection):
    """A closed-form linear probe on frozen features (as `vitray fewshot`), on rank 0: metrics
    `NAME/DATASET_Kshot` (mean over seeds)."""

    type: Literal["fewshot"] = Field(description="fewshot: the closed-form linear probe on frozen features.")
    datasets: dict[str, StoragePath] = Field(
        min_length=1, description="name -> prepared dataset (local or s3://), e.g. {digits: /data/digits}."
    )
    shots: list[int] = Field(default_factory=lambda: [10], min_length=1, description="Examples per class.")
    seeds: int = Field(1, gt=0, description="Few-shot sets drawn per shots value (seeds 0..n-1).")
    batch_size: int = Field(256, gt=0, description="Samples per forward when extracting features.")

    @field_validator("shots")
    @classmethod
    def _positive_shots(cls, shots: list[int]) -> list[int]:
        if any(k <= 0 for k in shots):
            raise ValueError(f"must be positive numbers of examples per class, got {shots}")
        return shots

    @field_validator("datasets")
    @classmethod
    def _dataset_names(cls, datasets: dict[str, str]) -> dict[str, str]:
        for name in datasets:  # each names metrics (`NAME/DATASET_Kshot`): '' or 'a/b' made odd ones
            if not EVAL_NAME.match(name):
                raise ValueError(f"dataset name {name!r} {NAME_RULE} (it names the probe's metrics)")
        return datasets


Config = FewshotEvalConfig


class Evaluator:
    """``<dataset>_<k>shot`` for every dataset and shots value of the section."""

    rank0_only: ClassVar[bool] = True

    def __init__(self, config: FewshotEvalConfig, worker: Worker):
        self.config, self.worker = config, worker
        # The train splits' labels, read at the first evaluation (every sample of the split) and
        # kept for the later ones: the data does not change during a run.
        self._pools: dict[tuple[str, str], Any] = {}

    def uses_worker_processes(self) -> bool:
        return False  # the probe decodes in the evaluating process

    def run(self, model: Any, forward: Forward) -> Iterator[tuple[str, float]]:
        cfg = self.config
        yield from fewshot_accuracies(
            model,
            cfg.datasets,
            shots=tuple(cfg.shots),
            seeds=cfg.seeds,
            batch_size=cfg.batch_size,
            storage_options=self.worker.data.storage_options,
            outage_s=self.worker.outage_s,
            pools=self._pools,
        )


def fewshot_accuracies(
    model: Any,
    datasets: Mapping[str, str],
    *,
    shots: Sequence[int] = (10,),
    seeds: int = 1,
    l2_reg: float | None = None,
    train_split: str = "train",
    test_split: str = "test",
    batch_size: int = 256,
    num_workers: int = 0,
    storage_options: dict[str, Any] | None = None,
    outage_s: float | None = None,
    pools: dict[tuple[str, str], Any] | None = None,
) -> Iterator[tuple[str, float]]:
    """Few-shot accuracy of a model: ``("NAME_{k}shot", mean over seeds)`` per dataset and shots
    value.

    `datasets` maps a short name to a prepared dataset folder (local or s3://), e.g.
    ``{"digits": "/data/digits"}``. The model is probed at its own resolution on its own device
    and dtype, and is left in the train/eval mode it was in. Same probe as `vitray fewshot`;
    `l2_reg` is its default ridge strength when unset; `outage_s` (a training run's probe): reads
    wait this long for a store that stopped answering; `pools` (a training run's evaluator): the
    train splits' labels by (path, split), read once into it and taken from it after.
    """
    # The probe's solver imports scipy: on first use, not when a run's config names this evaluator.
    from vitray.evaluation.fewshot import DEFAULT_L2_REG
    from vitray.evaluation.fewshot_probe import Draw, FewShotPool, ProbeData, probe

    if not datasets:
        raise ValueError('datasets is empty: give {name: prepared dataset folder}, e.g. {"digits": "/data/digits"}')
    param = next(model.parameters())
    features_of = model if param.dtype == torch.float32 else _CastInputs(model, param.dtype)
    for name, path in datasets.items():
        num_classes = _dataset_info(path, storage_options, outage_s).num_classes
        data = ProbeData(path, train_split, path, test_split, num_classes, model.img_size)
        draws = {
            (k, seed): Draw(k, seed, DEFAULT_L2_REG if l2_reg is None else l2_reg)
            for k in shots
            for seed in range(seeds)
        }
        pool = None
        if pools is not None:
            if (path, train_split) not in pools:
                pools[path, train_split] = FewShotPool.read(path, train_split, storage_options, outage_s)
            pool = pools[path, train_split]
        results = probe(
            features_of,
            data,
            draws,
            batch_size=batch_size,
            num_workers=num_workers,
            storage_options=storage_options,
            device=param.device,
            outage_s=outage_s,
            pool=pool,
        )
        for result in results.values():
            if isinstance(result, Exception):
                raise result
        for k in shots:
            yield f"{name}_{k}shot", float(np.mean([results[k, seed].accuracy for seed in range(seeds)]))


def _dataset_info(path: str, storage_options: dict[str, Any] | None, outage_s: float | None) -> Any:
    from vitray import storage
    from vitray.data import read_dataset_info

    if outage_s is None:
        return read_dataset_info(path, storage_options)
    return storage.ride_out(
        lambda: read_dataset_info(path, storage_options), what=f"reading {path}'s dataset info", within_s=outage_s
    )


class _CastInputs(torch.nn.Module):
    """Feeds the loaders' float32 images to a bf16/fp16 model."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype
        self.training = inner.training  # extract_features restores this mode afterwards

    def forward_pre_logits(self, images: torch.Tensor) -> torch.Tensor:
        return self.inner.forward_pre_logits(images.to(self.dtype))
