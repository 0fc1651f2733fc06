"""The ViT paper's fine-tuning recipe for one cell, typed: :class:`FinetuneRecipe`.

SGD momentum 0.9, cosine decay after a linear warm-up, no weight decay, grad-norm clip 1, a
zero-initialised head (the pre-logits layer dropped), position embeddings resampled to the
fine-tuning resolution, and held-out and test images resized as the training crop's family
evaluates (:attr:`FinetuneRecipe.eval_resize`). :meth:`FinetuneRecipe.for_cell` builds it once from a cell's settings (see
:func:`vitray.evaluation.methods.finetune.finetune_settings`); pydantic checks it there. `cluster/finetune.py`
makes it the run's `vitray.trainers.config.TrainingConfig` (:meth:`FinetuneRecipe.config` is that
config's shape: this package does not import the trainers) and runs it on Ray Train.

A selection cell's run trains on the train slice and, at its last step, reports two top-1s from
two evaluators of the same type (big_vision's pattern): the validation one on the held-out slice
(which selects the learning rate) and the test one on the benchmark's test split (the cell's
headline number), so the cell's path through the code ends with its run. A final run has one
evaluator: its validation split is the test split.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vitray.data.config import RESIZE_RATIO, TrainCropKind
from vitray.data.plan import default_num_slots
from vitray.evaluation.methods.finetune import TRAIN_SPLIT, VAL_SPLIT, FinetuneGrid, is_selection
from vitray.evaluation.results import Cell
from vitray.evaluation.suite import Benchmark, locate, locate_train

# Data streams per fine-tuning worker that the plan's slots are cut for (as many as divide the
# micro batch; see `vitray.data.plan.default_num_slots`). Fixed, not the loader's worker count:
# a fine-tune run's data order does not depend on how its data is decoded.
STREAMS_PER_WORKER = 8


class FinetuneRecipe(BaseModel):
    """One fine-tune run: what it starts from, what it trains on, how, and where it lives."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    checkpoint: str = Field(description="The pre-trained checkpoint the run starts from.")
    model: dict[str, Any] = Field(description="The checkpoint's model section (its architecture).")
    run_name: str
    run_storage: str
    seed: int = Field(0, ge=0)
    train: str = Field(description="Prepared dataset trained on.")
    train_split: str
    val: str = Field(description="Prepared dataset whose `val_split` top-1 the run reports at its last step.")
    val_split: str
    test: str | None = Field(
        None, description="Prepared dataset whose `test_split` top-1 a selection run reports too (None: a final run)."
    )
    test_split: str | None = Field(None, description="The benchmark's test split (with `test`).")
    lr: float = Field(gt=0)
    steps: int = Field(gt=0)
    batch_size: int = Field(gt=0)
    micro_batch_size: int = Field(gt=0)
    warmup_steps: int = Field(ge=0)
    resolution: int = Field(gt=0)
    crop: TrainCropKind = Field("inception_crop", description="The training crop (`data.crop`).")
    min_crop_area: float = Field(0.05, gt=0, le=1, description="The inception crop's smallest area.")
    flip: bool = Field(True, description="Random horizontal flips in training.")
    num_slots: int = Field(gt=0)
    checkpoint_every: int = Field(gt=0)
    eval_batch_size: int = Field(gt=0)
    num_workers: int = Field(gt=0)
    cpus_per_worker: float | None = Field(gt=0)  # None: resolved as `cluster.cpus_per_worker`
    gpus_per_worker: float = Field(ge=0)
    address: str | None = None
    storage_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _test_with_its_split(self) -> FinetuneRecipe:
        if (self.test is None) != (self.test_split is None):
            raise ValueError("test and test_split are set together (a selection cell's run) or not at all")
        return self

    @classmethod
    def for_cell(
        cls,
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
    ) -> FinetuneRecipe:
        """The recipe of a cell with resolved `settings` (lr, steps, batch_size, warmup_steps,
        resolution, crop, flip, min_crop_area, train_split and -- for a selection cell -- val_split;
        a crop or flip not in them is the benchmark's). The run trains on
        `train_split` of the benchmark's train data and reports top-1 on `val_split` of the same data
        and on the benchmark's test split (`test`, `test_split`), or, without `val_split` (a final
        run), on the test split alone. `options` is the grid's fine-tune section (workers, micro
        batch, checkpoint interval); its `overrides` are dotted keys for the config loader, applied by
        `cluster/finetune.py`."""
        options = options or FinetuneGrid()
        steps, batch = int(settings["steps"]), int(settings["batch_size"])
        workers = options.num_workers
        micro = max(1, min(options.micro_batch_size, batch // workers))
        test, test_split = locate(benchmark, data_root), benchmark.test_split
        if is_selection(settings):  # the held-out slice comes from the train data (ImageNet-ReaL: ImageNet's train)
            val, val_split = locate_train(benchmark, data_root), settings[VAL_SPLIT]
        else:
            val, val_split = test, test_split
        held_out = (val, val_split) != (test, test_split)  # scored on the test split by a second evaluator
        preprocess = benchmark.finetune.preprocess
        return cls(
            checkpoint=checkpoint,
            model=dict(model),
            run_name=run_name,
            run_storage=run_storage,
            seed=int(seed),
            train=locate_train(benchmark, data_root),
            train_split=settings.get(TRAIN_SPLIT, benchmark.train_split),
            val=val,
            val_split=val_split,
            test=test if held_out else None,
            test_split=test_split if held_out else None,
            lr=float(settings["lr"]),
            steps=steps,
            batch_size=batch,
            micro_batch_size=micro,
            warmup_steps=int(settings["warmup_steps"]),
            resolution=int(settings["resolution"]),
            crop=settings.get("crop", preprocess.crop),
            min_crop_area=float(settings.get("min_crop_area", preprocess.min_crop_area)),
            flip=bool(settings.get("flip", preprocess.flip)),
            num_slots=default_num_slots(workers, micro, STREAMS_PER_WORKER),
            checkpoint_every=options.checkpoint_every or max(1, steps // 4),
            eval_batch_size=options.eval_batch_size,
            num_workers=workers,
            cpus_per_worker=options.cpus_per_worker,
            gpus_per_worker=options.gpus_per_worker,
            address=address,
            storage_options=storage_options,
        )

    @property
    def eval_resize(self) -> dict[str, Any]:
        """How the held-out and test images are resized (the val evaluators' `resize`): as the
        training crop's family does. After the inception crop or resmall_crop, big_vision's transfer
        config: resize_small(448)|central_crop(384); after a crop of the squashed image (resize_crop,
        resize: BiT's VTAB rule), the whole image squashed, as BiT and vit_jax evaluate."""
        if self.crop in ("resize_crop", "resize"):
            return {"resize": "whole"}
        return {"resize": "aspect", "resize_ratio": RESIZE_RATIO}

    def config(self, val_evaluator: str, test_evaluator: str | None = None) -> dict[str, Any]:
        """The run in the shape of `vitray.trainers.config.TrainingConfig`; `val_evaluator` names the
        evaluator that reports the run's top-1 on `val_split` once, at its last step
        (`vitray.evaluation.evaluators.VAL`), and -- a selection cell's run -- `test_evaluator` the one that
        reports its top-1 on the test split then (`vitray.evaluation.evaluators.TEST`)."""
        scored = {"type": "val", "every": self.steps, "batch_size": self.eval_batch_size, **self.eval_resize}
        evals = {val_evaluator: scored}
        if self.test is not None:
            if test_evaluator is None or test_evaluator == val_evaluator:
                raise ValueError(
                    f"a selection cell's run scores the test split too: name its evaluator (got {test_evaluator!r})"
                )
            evals[test_evaluator] = {**scored, "path": self.test, "split": self.test_split}
        return {
            "seed": self.seed,
            "run": {"name": self.run_name, "storage": self.run_storage},
            # Fine-tuning drops the pre-logits layer (reset_head) and starts from a zero head (weights
            # and bias, whatever the pre-training head's bias was), as the paper does; without the
            # pre-training's dropout, as big_vision's transfer configs (vit_jax's configs keep 0.1
            # for L/16 and H/14: --set model.dropout=0.1).
            "model": {
                **self.model,
                "img_size": self.resolution,
                "representation_size": None,
                "head_bias_init": 0.0,
                "dropout": 0.0,
                "attn_dropout": 0.0,
            },
            "init": {"checkpoint": self.checkpoint, "reset_head": True},
            "data": {
                "train": self.train,
                "train_split": self.train_split,
                "val": self.val,
                "val_split": self.val_split,
                "num_slots": self.num_slots,
                "storage_options": self.storage_options,
                "crop": self.crop,
                "min_crop_area": self.min_crop_area,
                "flip": self.flip,
            },
            "train": {
                "steps": self.steps,
                "batch_size": self.batch_size,
                "micro_batch_size": self.micro_batch_size,
                "label_smoothing": 0.0,
                "mixup_alpha": 0.0,
            },
            "optim": {"name": "sgd", "lr": self.lr, "weight_decay": 0.0, "momentum": 0.9, "grad_clip": 1.0},
            "schedule": {"warmup_steps": self.warmup_steps, "decay": "cosine", "min_lr": 0.0},
            "checkpoint": {"every": self.checkpoint_every, "keep": 1},
            "log": {"every": max(1, min(50, self.steps // 4))},
            "evals": evals,
            "cluster": {
                "address": self.address,
                "num_workers": self.num_workers,
                "cpus_per_worker": self.cpus_per_worker,
                "gpus_per_worker": self.gpus_per_worker,
            },
        }


def finetune_run_name(cell: Cell) -> str:
    """A run name that is unique per cell and stable across re-runs (so a re-run resumes it)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", cell.benchmark).strip("-")
    return f"{slug}-lr{cell.settings['lr']:g}-seed{cell.seed}-{cell.cell_id}"


# finetune_run_name's form: the benchmark, learning rate and seed, then the cell id (16 hex digits).
_RUN_NAME = re.compile(r"(?P<cell>.+-lr[^-/]+-seed\d+)-[0-9a-f]{16}")


def run_name_cell(name: str) -> str | None:
    """``BENCHMARK-lrLR-seedSEED`` of a run that :func:`finetune_run_name` named, else None: the
    part that runs of the same benchmark, learning rate and seed share whatever their cell id."""
    named = _RUN_NAME.fullmatch(name)
    return named["cell"] if named else None
