"""When and how the training loop runs its evaluators (`vitray.evaluation.evaluators`).

The evaluators compute; this module schedules: each one runs every `every` steps and at the last
step, on the EMA weights when the run keeps them (unless its section says ``weights: live``; the
live weights are put back, bit for bit, before training goes on), on the ranks its kind asks for,
and its metrics are named ``<evaluator name>/<metric>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vitray.evaluation.evaluators import EvalSection, Evaluator, Forward, Worker, build_evaluator, metric_name
from vitray.trainers.config import TrainingConfig


@dataclass
class ScheduledEvaluator:
    """One named evaluator of the run's `evals:` section, built for this worker."""

    name: str
    config: EvalSection
    evaluator: Evaluator

    def due(self, step: int, last_step: int) -> bool:
        return step % self.config.every == 0 or step == last_step

    def __call__(self, module: Any, forward: Forward, *, rank: int, ema: Any = None) -> dict[str, float]:
        """The evaluator's metrics, named; {} on a rank that does not report them. `ema` is the
        run's `vitray.trainers.step.ema.Ema` when it keeps one."""
        rank0_only = self.evaluator.rank0_only
        if rank0_only and rank != 0 and not forward.collective_forward:
            return {}
        if ema is not None and self.config.weights == "ema":
            with ema.swapped_in():
                metrics = dict(self.evaluator.run(module, forward))
        else:
            metrics = dict(self.evaluator.run(module, forward))
        if rank0_only and rank != 0:
            return {}  # it ran here only for the collectives in the forward passes
        return {metric_name(self.name, metric): value for metric, value in metrics.items()}


def build_evaluators(training: TrainingConfig, rank: int, world_size: int) -> list[ScheduledEvaluator]:
    """The evaluators of a `TrainingConfig`'s `evals:` section for this rank, in the order given."""
    worker = Worker(
        rank=rank,
        world_size=world_size,
        img_size=training.model.img_size,
        data=training.data,
        outage_s=training.run.storage_outage_s,
    )
    return [ScheduledEvaluator(name, ev, build_evaluator(ev, worker)) for name, ev in training.evals.items()]
