"""What every evaluator of a training run shares: its config section's common keys, how its
metrics are named, what it knows of the worker it runs in, and the shape of an evaluator.

An evaluator is built once per training worker, before the model exists (:class:`Worker`: its
rank, the run's resolution and data section), and then called whenever it is due with the model
and how to run it (:class:`Forward`: device, dtype, the all-reduce, whether a forward pass is a
collective). Its `run` yields bare ``(metric, value)`` pairs (big_vision's evaluators); the
training loop names them ``<evaluator name>/<metric>`` (:func:`metric_name`), picks the weights
(EMA or live) and the ranks it runs on (`vitray.trainers.eval_schedule`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from vitray.data.config import DataConfig

EVAL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# What EVAL_NAME allows, as a refusal says it (of evaluator, dataset and run names).
NAME_RULE = "must start with a letter or digit and contain only letters, digits, '_', '.', '-'"


def metric_name(evaluator: str, metric: str) -> str:
    """The one place metric names are made: ``<evaluator name>/<metric>``."""
    return f"{evaluator}/{metric}"


VAL = "val"  # the evaluator whose top-1 a fine-tune run reports
VAL_TOP1 = metric_name(VAL, "top1")
TEST = "test"  # a selection fine-tune run's second val evaluator: the benchmark's test split
TEST_TOP1 = metric_name(TEST, "top1")


class EvalSection(BaseModel):
    """What every evaluator's section of `evals:` has (each kind adds its `type` and its own keys)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    every: int = Field(gt=0, description="Run every N steps (and at the last step).")
    weights: Literal["ema", "live"] = Field(
        "ema",
        description="ema: score the EMA weights when optim.ema_decay is set (else the live ones); live: always the live ones.",
    )


@dataclass(frozen=True)
class Worker:
    """What an evaluator knows of the training worker it is built in, before the model exists."""

    rank: int
    world_size: int
    img_size: int  # the resolution the model is trained at
    data: DataConfig  # the run's data section: default validation split, data workers, storage options
    # run.storage_outage_s: an evaluator's reads wait this long for a store that stopped answering
    # (`vitray.storage.ride_out`), as the run's other storage calls do; None: bounded retries only.
    outage_s: float | None = None


@dataclass(frozen=True)
class Forward:
    """How to run the model being trained, given when an evaluator runs."""

    device: Any
    dtype: Any  # torch.dtype of the model's inputs
    sum_over_ranks: Callable[[list[float]], list[float]]
    # Every rank must make the same forward calls (ZeRO-3, XLA over hosts): evaluators of rank 0
    # alone run on every rank then, and evaluators pad their ranks' forward counts to one number.
    collective_forward: bool = False


class Evaluator(Protocol):
    """One kind of evaluator: ``Evaluator(config, worker)`` once per worker, then ``run`` when due."""

    # True: the metrics are rank 0's alone; the other ranks skip it (or, when the forward is a
    # collective, run it without reporting).
    rank0_only: ClassVar[bool]

    def __init__(self, config: Any, worker: Worker) -> None: ...

    def uses_worker_processes(self) -> bool:
        """Whether it reads its data with worker processes on this rank (the loop then starts their
        server early, while the model is built)."""
        ...

    def run(self, model: Any, forward: Forward) -> Iterator[tuple[str, float]]:
        """``(metric, value)`` of the model as it is now; leaves the model in train mode."""
        ...
