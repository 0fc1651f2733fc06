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
Implementations are found by dotted name (:data:`EVALUATORS`), so adding one is adding a
config model here and a class anywhere below `cluster/`. What evaluates lives in `evaluation/`
(the top-1 loop in `vitray.evaluation.top1`, the few-shot probe in `vitray.evaluation.fewshot_probe`),
imported by name when a run uses it, never when this module is imported (`trainers/` and
`evaluation/` do not import each other); this module adds the names, the EMA weights and the ranks.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from vitray.data.config import StoragePath
from vitray.data.splits import parse_split

if TYPE_CHECKING:  # the config imports this module for its `evals:` section
    from vitray.data.config import DataConfig
    from vitray.trainers.config import TrainingConfig

EVAL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def metric_name(evaluator: str, metric: str) -> str:
    """The one place metric names are made: ``<evaluator name>/<metric>``."""
    return f"{evaluator}/{metric}"


VAL = "val"  # the evaluator whose top-1 a fine-tune run reports
VAL_TOP1 = metric_name(VAL, "top1")
TEST = "test"  # a selection fine-tune run's second val evaluator: the benchmark's test split
TEST_TOP1 = metric_name(TEST, "top1")


# -- config ------------------------------------------------------------------------------------
class _EvalSection(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    every: int = Field(gt=0, description="Run every N steps (and at the last step).")
    weights: Literal["ema", "live"] = Field(
        "ema",
        description="ema: score the EMA weights when optim.ema_decay is set (else the live ones); live: always the live ones.",
    )


class ValEvalConfig(_EvalSection):
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


class FewshotEvalConfig(_EvalSection):
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

# type -> implementation, by dotted name (imported when a run builds its evaluators).
EVALUATORS: dict[str, str] = {
    "val": "vitray.trainers.evals:ValEvaluator",
    "fewshot": "vitray.trainers.evals:FewshotEvaluator",
}


# -- running -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvalEnv:
    """What an evaluator may use of the worker it runs in."""

    rank: int
    world_size: int
    device: Any
    dtype: torch.dtype
    sum_over_ranks: Callable[[list[float]], list[float]]
    ema: Any = None  # the run's vitray.trainers.ema.Ema, when optim.ema_decay is set
    # Every rank must make the same forward calls (ZeRO-3, XLA over hosts): rank-0 evaluators run
    # on every rank then, and evaluators pad their ranks' forward counts to the same number.
    collective_forward: bool = False


class Evaluator:
    """One named evaluator. Subclasses implement :meth:`evaluate` (bare metric names); calling the
    evaluator names its metrics ``<name>/<metric>`` and scores the EMA weights when the run keeps
    them (and the section does not ask for ``weights: live``)."""

    rank0_only = False  # evaluators that run on rank 0 alone leave the other ranks' weights alone

    def __init__(self, name: str, config: _EvalSection, training: TrainingConfig):
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


class ValEvaluator(Evaluator):
    """``top1`` on its section's `path` / `split` (the run's validation split by default); every rank
    scores its share, the counts are summed."""

    COUNT = "vitray.evaluation.top1:count_top1"

    def evaluate(self, module: torch.nn.Module, env: EvalEnv) -> dict[str, float]:
        from vitray.data import EvalLoader

        data = self.training.data
        path, split = self.config.dataset(data)
        module.eval()
        loader = EvalLoader(
            path,
            split,
            rank=env.rank,
            world_size=env.world_size,
            batch_size=self.config.batch_size,
            img_size=self.training.model.img_size,
            num_workers=data.num_workers,
            storage_options=data.storage_options,
        )
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
