"""The evaluation grid's config: which benchmarks, which transfer methods and settings, where.

A grid is benchmarks x method (few-shot shots / fine-tune learning rates) x seeds, evaluated for
one or more checkpoints. Unset settings fall back to each benchmark's protocol in
:mod:`vitray.evaluation.suite` (the paper's values), so a grid file only states what it changes::

    data_root: /data/prepared          # <data_root>/<dataset> folders from `vitray data prepare`
    output: eval-output                # results table, report, fine-tune runs
    benchmarks: [vtab]                 # names ("cifar10", "vtab/dtd") or groups ("paper", "vtab")
    fewshot: {shots: [1, 5, 10, 25], seeds: 3}
    finetune: {enabled: false}

The method sections (`fewshot`, `finetune`) are each method's `Config`, one field per method of
:data:`vitray.evaluation.methods.METHODS`. Plain data, validated by pydantic (unknown keys are errors naming the valid ones); loaded with
the one config loader, `vitray.common.config.load_config(GridConfig, path, overrides)`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from vitray.data.config import StoragePath
from vitray.evaluation.methods import METHODS, Inputs, MethodSection
from vitray.evaluation.suite import BENCHMARKS, Benchmark, benchmarks_in_group, group_names


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class EvalClusterConfig(_Section):
    address: str | None = Field(None, description="Ray address; none starts an embedded local Ray.")


class _GridBase(_Section):
    """The whole evaluation grid (see the module docstring for an example): where and what, and a
    section per transfer method (:data:`~vitray.evaluation.methods.METHODS`)."""

    EXAMPLE_CONFIG: ClassVar[str] = "configs/grid_digits.yaml"  # what a refusal for a missing -c points to

    data_root: StoragePath = Field(description="Folder (local or s3://) holding the prepared benchmark datasets.")
    output: StoragePath = Field(
        "eval-output",
        validate_default=True,
        description="Results table, report and fine-tune runs go here (local or s3://).",
    )
    benchmarks: list[str] = Field(default_factory=lambda: ["digits"], description="Benchmark names and/or groups.")
    cluster: EvalClusterConfig = Field(default_factory=EvalClusterConfig)
    retries: int = Field(
        2,
        ge=0,
        description="Times a failed cell is tried again in the same invocation before it is recorded as failed "
        "(a lost worker, a flaky read; not an error that would come again: a bad input, a refused config).",
    )
    storage_options: dict[str, Any] | None = Field(
        None,
        description="fsspec options for data_root and the results (output); endpoint and credentials default to "
        "the AWS environment, which checkpoints and fine-tune runs always use.",
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

    def section(self, method: str) -> MethodSection:
        """The grid's section of `method` (a name of `METHODS`)."""
        return getattr(self, method)

    @property
    def inputs(self) -> Inputs:
        return Inputs(str(self.data_root), self.storage_options)

    @property
    def results_path(self) -> str:
        return _join(self.output, "results")

    @property
    def report_path(self) -> str:
        return _join(self.output, "report")

    @property
    def finetune_storage(self) -> str:
        return _join(self.output, "finetune_runs")


GridConfig = create_model(
    "GridConfig",
    __base__=_GridBase,
    __module__=__name__,
    **{name: (method.Config, Field(default_factory=method.Config)) for name, method in METHODS.items()},
)
GridConfig.__doc__ = _GridBase.__doc__


def _join(root: str, name: str) -> str:
    from vitray import storage

    return storage.join(str(root).rstrip("/"), name)
