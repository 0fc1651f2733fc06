"""The evaluation grid's config: which benchmarks, which transfer methods and settings, where.

A grid is benchmarks x method (few-shot shots / fine-tune learning rates) x seeds, evaluated for
one or more checkpoints. Unset settings fall back to each benchmark's protocol in
:mod:`vitray.evaluation.suite` (the paper's values), so a grid file only states what it changes::

    data_root: /data/prepared          # <data_root>/<dataset> folders from `vitray data prepare`
    output: eval-output                # results table, report, fine-tune runs
    benchmarks: [vtab]                 # names ("cifar10", "vtab/dtd") or groups ("paper", "vtab")
    fewshot: {shots: [1, 5, 10, 25], seeds: 3}
    finetune: {enabled: false}

Plain data, validated by pydantic (unknown keys are errors naming the valid ones); loaded with
the one config loader, `vitray.common.config.load_config(GridConfig, path, overrides)`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vitray.data.config import StoragePath, TrainCropKind
from vitray.data.splits import parse_split
from vitray.evaluation.fewshot import DEFAULT_L2_REG
from vitray.evaluation.suite import BENCHMARKS, Benchmark, benchmarks_in_group, group_names


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FewShotGrid(_Section):
    """Linear few-shot probes: features extracted once per (checkpoint, benchmark) in a Ray task."""

    enabled: bool = Field(True, description="Run the few-shot cells of the grid.")
    shots: list[int] | None = Field(
        None, description="Shots per class; the benchmark's protocol (1, 5, 10, 25) when unset."
    )
    seeds: int | None = Field(None, gt=0, description="Seeds 0..n-1 per shots value; the protocol's (3) when unset.")
    l2_reg: float | Literal["select"] = Field(
        DEFAULT_L2_REG, description='Ridge strength, or "select" (cross-validated inside each few-shot set).'
    )
    img_size: int | None = Field(
        None, gt=0, description="Probe resolution; the checkpoint's model.img_size when unset."
    )
    batch_size: int = Field(256, gt=0, description="Images per forward pass during feature extraction.")
    data_workers: int = Field(1, ge=0, description="DataLoader processes decoding images inside the task.")
    num_cpus: float = Field(1.0, gt=0, description="CPUs the extraction task asks Ray for.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs the extraction task asks Ray for (uses CUDA when > 0).")

    @field_validator("shots")
    @classmethod
    def _positive_shots(cls, shots: list[int] | None) -> list[int] | None:
        if shots is not None and (not shots or any(s < 1 for s in shots)):
            raise ValueError(f"must be a non-empty list of positive integers, e.g. [1, 5, 10, 25]; got {shots}")
        return None if shots is None else sorted(set(shots))

    @field_validator("l2_reg")
    @classmethod
    def _positive_l2(cls, l2: float | str) -> float | str:
        if not isinstance(l2, str) and not l2 > 0:
            raise ValueError(f'must be a positive number or "select", got {l2}')
        return l2


class FinetuneGrid(_Section):
    """Fine-tuning cells: each one a Ray Train run of the fine-tune recipe (SGD momentum 0.9,
    cosine decay, warm-up, no weight decay, grad clip 1, zero head) from the checkpoint."""

    enabled: bool = Field(True, description="Run the fine-tune cells of the grid.")
    learning_rates: list[float] | None = Field(None, description="The sweep; the benchmark's protocol when unset.")
    seeds: int = Field(1, gt=0, description="Runs per learning rate (seeds 0..n-1).")
    steps: int | None = Field(None, gt=0, description="Optimizer steps; the protocol's when unset.")
    batch_size: int | None = Field(None, gt=0, description="Global batch; the protocol's (512) when unset.")
    warmup_steps: int | None = Field(None, ge=0, description="Linear warm-up steps; the protocol's when unset.")
    resolution: int | None = Field(None, gt=0, description="Fine-tuning resolution (position embeddings resampled).")
    crop: TrainCropKind | None = Field(
        None,
        description="Training crop (inception_crop, resmall_crop, resize_crop, resize; see data.crop); the "
        "benchmark's when unset (e.g. CIFAR: resmall_crop).",
    )
    min_crop_area: float | None = Field(
        None, gt=0, le=1, description="The inception crop's smallest area; the benchmark's (0.05) when unset."
    )
    flip: bool | None = Field(None, description="Random horizontal flips in training; the benchmark's when unset.")
    train_split: str | None = Field(
        None, description="Split (slice) each learning rate trains on; the protocol's (e.g. train[:98%]) when unset."
    )
    val_split: str | None = Field(
        None, description="Held-out split (slice) that selects the lr; the protocol's (e.g. train[98%:]) when unset."
    )
    final_train_split: str | None = Field(
        None,
        description="Re-train the selected learning rate on this split and report that run (VTAB-1k: train[:1000]); "
        "the protocol's when unset.",
    )
    micro_batch_size: int = Field(32, gt=0, description="Samples per worker per forward/backward (accumulation).")
    checkpoint_every: int | None = Field(
        None, gt=0, description="Checkpoint interval, so a stopped grid resumes a half-done run; steps/4 when unset."
    )
    eval_batch_size: int = Field(256, gt=0, description="Samples per batch when a fine-tuned model is scored.")
    num_workers: int = Field(1, gt=0, description="Ray Train workers per fine-tune run.")
    cpus_per_worker: float | None = Field(
        None, gt=0, description="CPUs per fine-tune worker; unset: as `cluster.cpus_per_worker` of a pre-training run."
    )
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs per fine-tune worker; 0 runs on CPUs.")
    max_concurrent: int | None = Field(
        None, gt=0, description="Fine-tune runs at once; what the cluster's CPUs/GPUs hold when unset."
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description='Dotted TrainingConfig keys set on every run\'s recipe, e.g. {"precision.dtype": "bf16"}.',
    )

    @field_validator("train_split", "val_split", "final_train_split")
    @classmethod
    def _split_syntax(cls, split: str | None) -> str | None:
        if split is not None:
            parse_split(split)
        return split

    @field_validator("learning_rates")
    @classmethod
    def _positive_lrs(cls, lrs: list[float] | None) -> list[float] | None:
        if lrs is not None and (not lrs or any(lr <= 0 for lr in lrs)):
            raise ValueError(f"must be a non-empty list of positive learning rates, e.g. [0.003, 0.01]; got {lrs}")
        return lrs


class EvalClusterConfig(_Section):
    address: str | None = Field(None, description="Ray address; none starts an embedded local Ray.")


class GridConfig(_Section):
    """The whole evaluation grid (see the module docstring for an example)."""

    data_root: StoragePath = Field(description="Folder (local or s3://) holding the prepared benchmark datasets.")
    output: StoragePath = Field(
        "eval-output",
        validate_default=True,
        description="Results table, report and fine-tune runs go here (local or s3://).",
    )
    benchmarks: list[str] = Field(default_factory=lambda: ["digits"], description="Benchmark names and/or groups.")
    fewshot: FewShotGrid = Field(default_factory=FewShotGrid)
    finetune: FinetuneGrid = Field(default_factory=FinetuneGrid)
    cluster: EvalClusterConfig = Field(default_factory=EvalClusterConfig)
    retries: int = Field(
        2,
        ge=0,
        description="Times a failed cell is tried again in the same invocation before it is recorded as failed.",
    )
    storage_options: dict[str, Any] | None = Field(
        None, description="fsspec options for remote paths (endpoint and credentials default to the AWS environment)."
    )

    @field_validator("benchmarks")
    @classmethod
    def _known_benchmarks(cls, names: list[str]) -> list[str]:
        if not names:
            raise ValueError("must name at least one benchmark or group")
        groups = set(group_names())
        unknown = [n for n in names if n not in BENCHMARKS and n not in groups]
        if unknown:
            raise ValueError(
                f"unknown benchmark(s) {', '.join(map(repr, unknown))}; valid names: {', '.join(BENCHMARKS)}; "
                f"valid groups: {', '.join(sorted(groups))}"
            )
        return names

    def resolved_benchmarks(self) -> list[Benchmark]:
        """The benchmarks named or grouped, each once, in the order given."""
        found: dict[str, Benchmark] = {}
        for name in self.benchmarks:
            for benchmark in [BENCHMARKS[name]] if name in BENCHMARKS else benchmarks_in_group(name):
                found.setdefault(benchmark.name, benchmark)
        return list(found.values())

    @property
    def results_path(self) -> str:
        return _join(self.output, "results")

    @property
    def report_path(self) -> str:
        return _join(self.output, "report")

    @property
    def finetune_storage(self) -> str:
        return _join(self.output, "finetune_runs")


def _join(root: str, name: str) -> str:
    from vitray import storage

    return storage.join(str(root).rstrip("/"), name)
