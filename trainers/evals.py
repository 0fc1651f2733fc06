"""Evaluators by name (big_vision's pattern): the config's `evals:` section names each one and its
type; the loop builds them once and runs whichever is due.

    evals:
      val:   {type: val, every: 100, batch_size: 256}             # top-1 on data.val_path / data.val_split
      test:  {type: val, every: 1000, path: /data/cifar10, split: test}   # the same type on another split
      probe: {type: fewshot, every: 1000, datasets: {digits: /data/digits}, shots: [10], seeds: 1}

Several evaluators of one type score different splits: a `val` evaluator reads `data.val_path` /
`data.val_split` unless its section names a `path` / `split`. An evaluator's metrics are named
``<name>/<metric>`` (:func:`metric_name`): the evaluator named ``val`` reports ``val/top1``
(:data:`VAL_TOP1`, what the fine-tune recipe and the progress bar read), the one named ``test``
``test/top1`` (:data:`TEST_TOP1`: a fine-tune run that selects its learning rate on a held-out
slice scores the benchmark's test split with it, in the same run). When the run keeps an EMA of
the weights (``optim.ema_decay``), evaluators score the EMA weights, as the authors report them
(``weights: live`` in an evaluator's section scores the raw weights instead); the raw weights are
put back before training goes on.
This module holds the config sections and the metric names (the training config reads them);
the evaluators that run them are `vitray.trainers.evaluators`'s.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vitray.data.config import DataConfig, StoragePath
from vitray.data.splits import parse_split

EVAL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def metric_name(evaluator: str, metric: str) -> str:
    """The one place metric names are made: ``<evaluator name>/<metric>``."""
    return f"{evaluator}/{metric}"


VAL = "val"  # the evaluator whose top-1 a fine-tune run reports
VAL_TOP1 = metric_name(VAL, "top1")
TEST = "test"  # a selection fine-tune run's second val evaluator: the benchmark's test split
TEST_TOP1 = metric_name(TEST, "top1")


# -- config ------------------------------------------------------------------------------------
class EvalSection(BaseModel):
    """What every evaluator's section has."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    every: int = Field(gt=0, description="Run every N steps (and at the last step).")
    weights: Literal["ema", "live"] = Field(
        "ema",
        description="ema: score the EMA weights when optim.ema_decay is set (else the live ones); live: always the live ones.",
    )


class ValEvalConfig(EvalSection):
    """Top-1 of the model being trained on `path` / `split` (by default `data.val_path` /
    `data.val_split`), on every rank (all-reduced)."""

    type: Literal["val"] = Field(description="val: top-1 (and loss) of the model on a labelled split.")
    batch_size: int = Field(256, gt=0, description="Samples per worker per forward.")
    path: StoragePath | None = Field(
        None, description="Prepared dataset scored (local or s3://); data.val_path when unset."
    )
    split: str | None = Field(None, description="Split (or slice: train[98%:]) scored; data.val_split when unset.")

    @field_validator("split")
    @classmethod
    def _split_syntax(cls, split: str | None) -> str | None:
        if split is not None:
            parse_split(split)  # a malformed slice fails with the config, before any worker starts
        return split

    def dataset(self, data: DataConfig) -> tuple[str, str]:
        """(path, split) this evaluator scores, given the run's data section."""
        return self.path or data.val_path, self.split or data.val_split


class FewshotEvalConfig(EvalSection):
    """A closed-form linear probe on frozen features (as `vitray fewshot`), on rank 0:
    metrics ``<name>/<dataset>_<k>shot`` (mean over seeds)."""

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


EvalConfig = Annotated[ValEvalConfig | FewshotEvalConfig, Field(discriminator="type")]
