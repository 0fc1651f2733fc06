"""The evaluators a training run schedules, one module per kind (big_vision's `evaluators/`).

A run's `evals:` section names each evaluator and its kind::

    evals:
      val:   {type: val, every: 100, batch_size: 256}
      probe: {type: fewshot, every: 1000, datasets: {digits: /data/digits}}

Each kind's module holds its config section (`Config`, a pydantic model whose `type` is the kind)
and its `Evaluator` (the shape is `base.Evaluator`): built once per training worker, its `run`
yields bare ``(metric, value)`` pairs. The training loop only schedules them
(`vitray.trainers.eval_schedule`: when, on which weights and ranks, under which names).

A new kind is one module here and its line in :data:`KINDS`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Annotated, Union

from pydantic import Field

from vitray.evaluation.evaluators import fewshot, val
from vitray.evaluation.evaluators.base import (
    EVAL_NAME,
    NAME_RULE,
    TEST,
    TEST_TOP1,
    VAL,
    VAL_TOP1,
    EvalSection,
    Evaluator,
    Forward,
    Worker,
    metric_name,
)

KINDS: dict[str, ModuleType] = {module.KIND: module for module in (val, fewshot)}

EvalConfig = Annotated[Union[tuple(module.Config for module in KINDS.values())], Field(discriminator="type")]  # noqa: UP007 -- a union built from the registry
"""One evaluator's section of `evals:`, told apart by its `type` (a kind of :data:`KINDS`)."""


def build_evaluator(config: EvalSection, worker: Worker) -> Evaluator:
    """The evaluator of kind ``config.type`` for this worker."""
    return KINDS[config.type].Evaluator(config, worker)


__all__ = [
    "EVAL_NAME",
    "KINDS",
    "NAME_RULE",
    "TEST",
    "TEST_TOP1",
    "VAL",
    "VAL_TOP1",
    "EvalConfig",
    "EvalSection",
    "Evaluator",
    "Forward",
    "Worker",
    "build_evaluator",
    "metric_name",
]
