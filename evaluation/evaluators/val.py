"""``val``: top-1 of the model being trained on a labelled split, every rank scoring its share.

    evals:
      val:  {type: val, every: 100, batch_size: 256}                     # data.val (else data.train) / data.val_split
      test: {type: val, every: 1000, path: /data/cifar10, split: test}   # the same kind on another split

Several evaluators of this kind score different splits: one reads `data.val` (else `data.train`) /
`data.val_split` unless its section names a `path` / `split`. Metric: ``top1`` (the ranks'
counts summed; multi-label data scored as `vitray.data.top1_hits` does).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from vitray.data.config import EVAL_RESIZE_RATIO, DataConfig, StoragePath
from vitray.data.splits import parse_split
from vitray.evaluation.evaluators.base import EvalSection, Forward, Worker
from vitray.runfolder.run_report import EVAL_SKIPPED

KIND = "val"


class ValEvalConfig(EvalSection):
    """Top-1 of the model being trained on `path` / `split` (by default `data.val` (else `data.train`) /
    `data.val_split`), every rank scoring its share: metric `NAME/top1`."""

    type: Literal["val"] = Field(description="val: top-1 of the model on a labelled split.")
    batch_size: int = Field(256, gt=0, description="Samples per worker per forward.")
    path: StoragePath | None = Field(
        None, description="Prepared dataset scored (local or s3://); data.val (else data.train) when unset."
    )
    split: str | None = Field(None, description="Split (or slice: train[98%:]) scored; data.val_split when unset.")
    resize: Literal["aspect", "whole"] = Field(
        "aspect",
        description="How images reach the resolution S, in big_vision's spelling: aspect, resize_small(R)|"
        "central_crop(S) with R = S x resize_ratio (the authors' ImageNet evaluation; big_vision's transfer "
        "config); whole, resize(S): the whole image squashed to S x S (vit_jax's, and BiT's for VTAB-1k).",
    )
    resize_ratio: float = Field(
        EVAL_RESIZE_RATIO,
        ge=1,
        description="resize=aspect: R / S (256 / 224 by default; the fine-tune recipes take 448 / 384, big_vision's "
        "configs/transfer.py).",
    )

    @field_validator("split")
    @classmethod
    def _split_syntax(cls, split: str | None) -> str | None:
        if split is not None:
            parse_split(split)  # a malformed slice fails with the config, before any worker starts
        return split

    def dataset(self, data: DataConfig) -> tuple[str, str]:
        """(path, split) this evaluator scores, given the run's data section."""
        return self.path or data.val_path, self.split or data.val_split


Config = ValEvalConfig


class Evaluator:
    """``top1`` on the section's split; every rank scores its share, the counts are summed. Images
    that cannot be decoded are left out of the score and counted: ``skipped``, where there are any."""

    rank0_only: ClassVar[bool] = False

    def __init__(self, config: ValEvalConfig, worker: Worker):
        self.config, self.worker = config, worker
        self._loader: Any = None

    def uses_worker_processes(self) -> bool:
        # Without data.num_workers there is nothing to decide: no listing of the split for it.
        return self.worker.data.num_workers > 0 and self.loader().num_workers > 0

    def loader(self):
        """This rank's share of the split (listed once), with data.num_workers workers where the
        share is big enough to repay starting them (`vitray.data.eval_loader.worker_count`)."""
        if self._loader is None:
            from vitray.data import EvalLoader
            from vitray.data.eval_loader import worker_count

            data = self.worker.data
            path, split = self.config.dataset(data)
            self._loader = EvalLoader(
                path,
                split,
                rank=self.worker.rank,
                world_size=self.worker.world_size,
                batch_size=self.config.batch_size,
                img_size=self.worker.img_size,
                resize=self.config.resize,
                resize_ratio=self.config.resize_ratio,
                num_workers=0,
                storage_options=data.storage_options,
                outage_s=self.worker.outage_s,
            )
            # The share's size is known once the split is listed: workers only where it repays them.
            self._loader.num_workers = worker_count(self._loader.num_samples, data.num_workers)
        return self._loader

    def run(self, model: Any, forward: Forward) -> Iterator[tuple[str, float]]:
        import torch

        from vitray.evaluation.top1 import count_top1

        loader = self.loader()
        skipped_before = loader.stats["skipped"]
        model.eval()
        try:
            correct, seen = count_top1(model, loader, device=forward.device, dtype=forward.dtype)
            if forward.collective_forward:
                # Ranks' shares can differ by a batch; the forward is a collective, so a rank with
                # fewer batches makes as many forward calls (on a blank image, not scored).
                rank, world = self.worker.rank, self.worker.world_size
                counts = forward.sum_over_ranks([float(len(loader)) if r == rank else 0.0 for r in range(world)])
                img = self.worker.img_size
                blank = torch.zeros(1, 3, img, img, device=forward.device, dtype=forward.dtype)
                with torch.no_grad():
                    for _ in range(int(max(counts)) - len(loader)):
                        model(blank)
        finally:
            model.train()
        skipped = loader.stats["skipped"] - skipped_before
        correct, seen, skipped = forward.sum_over_ranks([float(correct), float(seen), float(skipped)])
        yield "top1", correct / max(seen, 1.0)
        if skipped:  # the score is of fewer images than the split holds: the record says how many fewer
            yield EVAL_SKIPPED, skipped
