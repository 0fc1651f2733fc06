"""The evaluators a run's `evals:` section names (`vitray.trainers.evals`), built once by the loop,
which runs whichever is due and logs what they return.

Implementations are found by dotted name (:data:`EVALUATORS`), so adding one is adding a config
model to `trainers/evals.py` and a class anywhere below `cluster/`. What evaluates lives in
`evaluation/` (the top-1 loop in `vitray.evaluation.top1`, the few-shot probe in
`vitray.evaluation.fewshot_probe`), imported by name when a run uses it, never when this module is
imported (`trainers/` and `evaluation/` do not import each other); this module adds the names, the
EMA weights and the ranks.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vitray.trainers.config import TrainingConfig
from vitray.trainers.evals import EvalSection, metric_name

# type -> implementation, by dotted name (imported when a run builds its evaluators).
EVALUATORS: dict[str, str] = {
    "val": "vitray.trainers.evaluators:ValEvaluator",
    "fewshot": "vitray.trainers.evaluators:FewshotEvaluator",
}


@dataclass(frozen=True)
class EvalEnv:
    """What an evaluator may use of the worker it runs in."""

    rank: int
    world_size: int
    device: Any
    dtype: torch.dtype
    sum_over_ranks: Callable[[list[float]], list[float]]
    ema: Any = None  # the run's vitray.trainers.step.ema.Ema, when optim.ema_decay is set
    # Every rank must make the same forward calls (ZeRO-3, XLA over hosts): rank-0 evaluators run
    # on every rank then, and evaluators pad their ranks' forward counts to the same number.
    collective_forward: bool = False


class Evaluator:
    """One named evaluator. Subclasses implement :meth:`evaluate` (bare metric names); calling the
    evaluator names its metrics ``<name>/<metric>`` and scores the EMA weights when the run keeps
    them (and the section does not ask for ``weights: live``)."""

    rank0_only = False  # evaluators that run on rank 0 alone leave the other ranks' weights alone

    def __init__(self, name: str, config: EvalSection, training: TrainingConfig):
        self.name, self.config, self.training = name, config, training
        self.every = config.every

    def due(self, step: int, last_step: int) -> bool:
        return step % self.every == 0 or step == last_step

    def __call__(self, module: torch.nn.Module, env: EvalEnv) -> dict[str, float]:
        if self.rank0_only and env.rank != 0 and not env.collective_forward:
            return {}
        ema = getattr(env, "ema", None)
        if ema is not None and self.config.weights == "ema":
            with ema.swapped_in():
                metrics = self.evaluate(module, env)
        else:
            metrics = self.evaluate(module, env)
        if self.rank0_only and env.rank != 0:
            return {}  # it ran here only for the collectives in the forward passes
        return {metric_name(self.name, metric): value for metric, value in metrics.items()}

    def evaluate(self, module: torch.nn.Module, env: EvalEnv) -> dict[str, float]:
        raise NotImplementedError

    def uses_worker_processes(self, rank: int, world_size: int) -> bool:
        """Whether this evaluator reads its data with worker processes on this rank (the loop then
        starts their server early); those here read in the evaluating process."""
        return False


class ValEvaluator(Evaluator):
    """``top1`` on its section's `path` / `split` (the run's validation split by default); every rank
    scores its share, the counts are summed."""

    COUNT = "vitray.evaluation.top1:count_top1"

    def evaluate(self, module: torch.nn.Module, env: EvalEnv) -> dict[str, float]:
        module.eval()
        loader = self._loader(env.rank, env.world_size)
        correct, seen = import_by_name(self.COUNT)(module, loader, device=env.device, dtype=env.dtype)
        with torch.no_grad():
            if env.collective_forward:
                # Ranks' shares can differ by a batch; the forward is a collective, so a rank with
                # fewer batches makes as many forward calls (on a blank image, not scored).
                counts = env.sum_over_ranks(
                    [float(len(loader)) if r == env.rank else 0.0 for r in range(env.world_size)]
                )
                img = self.training.model.img_size
                blank = torch.zeros(1, 3, img, img, device=env.device, dtype=env.dtype)
                for _ in range(int(max(counts)) - len(loader)):
                    module(blank)
        module.train()
        correct, seen = env.sum_over_ranks([float(correct), float(seen)])
        return {"top1": correct / max(seen, 1.0)}

    def uses_worker_processes(self, rank: int, world_size: int) -> bool:
        # Without data.num_workers there is nothing to decide: no listing of the split for it.
        return self.training.data.num_workers > 0 and self._loader(rank, world_size).num_workers > 0

    def _loader(self, rank: int, world_size: int):
        """This rank's share of the split, with data.num_workers workers where the share is big
        enough to repay starting them (`vitray.data.eval_loader.worker_count`)."""
        from vitray.data import EvalLoader
        from vitray.data.eval_loader import worker_count

        data = self.training.data
        path, split = self.config.dataset(data)
        loader = EvalLoader(
            path,
            split,
            rank=rank,
            world_size=world_size,
            batch_size=self.config.batch_size,
            img_size=self.training.model.img_size,
            num_workers=0,
            storage_options=data.storage_options,
        )
        loader.num_workers = worker_count(loader.num_samples, data.num_workers)
        return loader


class FewshotEvaluator(Evaluator):
    """``<dataset>_<k>shot`` for every dataset and shots value, on rank 0 (the other ranks go on,
    unless the forward is a collective: then every rank runs it and rank 0 reports)."""

    PROBE = "vitray.evaluation.fewshot_probe:evaluate"
    rank0_only = True

    def evaluate(self, module: torch.nn.Module, env: EvalEnv) -> dict[str, float]:
        # Rank 0 alone, or (collective forward) every rank the same passes over the same data.
        probe = import_by_name(self.PROBE)
        cfg = self.config
        metrics = probe(
            module,
            cfg.datasets,
            shots=tuple(cfg.shots),
            seeds=cfg.seeds,
            batch_size=cfg.batch_size,
            storage_options=self.training.data.storage_options,
        )
        return dict(metrics)


def import_by_name(dotted: str) -> Any:
    """``"package.module:attribute"`` -> the attribute."""
    module, _, attribute = dotted.partition(":")
    return getattr(importlib.import_module(module), attribute)


def build_evaluators(training: TrainingConfig) -> list[Evaluator]:
    """The evaluators of a `TrainingConfig`'s `evals:` section, in the order given."""
    return [import_by_name(EVALUATORS[ev.type])(name, ev, training) for name, ev in training.evals.items()]
