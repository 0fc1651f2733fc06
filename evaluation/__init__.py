"""Transfer evaluation: few-shot linear probes, the benchmark suite, the results table and reports.

`vitray.evaluation.report` (matplotlib, rich) is imported on first use of its names.
"""

from vitray.evaluation.fewshot import (
    DEFAULT_L2_REG,
    L2_GRID,
    FewShotScore,
    LsrSolution,
    extract_features,
    fewshot_accuracy,
    predict,
    sample_few_shot,
    select_l2,
    solve_lsr,
)
from vitray.evaluation.results import Cell, ResultsTable, make_cell_id
from vitray.evaluation.suite import (
    BENCHMARKS,
    Benchmark,
    FewShotProtocol,
    FinetuneProtocol,
    MissingDataset,
    benchmark_names,
    benchmarks_in_group,
    find_missing,
    get_benchmark,
    locate,
    locate_train,
    prepare_command,
    require_prepared,
)

_REPORT_NAMES = {"print_table", "write_report", "summarize", "vtab_group_averages", "fine_tune_sweeps", "ReportFiles"}
_SELECTION_NAMES = {"select_lr", "selected_finetune"}  # pandas: imported on first use, like the report


def __getattr__(name: str):
    if name in _REPORT_NAMES or name in _SELECTION_NAMES:
        import importlib

        module = "report" if name in _REPORT_NAMES else "selection"
        return getattr(importlib.import_module(f"vitray.evaluation.{module}"), name)
    raise AttributeError(f"module 'vitray.evaluation' has no attribute {name!r}")


__all__ = [
    "BENCHMARKS",
    "DEFAULT_L2_REG",
    "L2_GRID",
    "Benchmark",
    "Cell",
    "FewShotProtocol",
    "FewShotScore",
    "FinetuneProtocol",
    "LsrSolution",
    "MissingDataset",
    "ResultsTable",
    "benchmark_names",
    "benchmarks_in_group",
    "extract_features",
    "fewshot_accuracy",
    "find_missing",
    "get_benchmark",
    "locate",
    "locate_train",
    "make_cell_id",
    "predict",
    "prepare_command",
    "require_prepared",
    "sample_few_shot",
    "select_l2",
    "solve_lsr",
    *sorted(_REPORT_NAMES),
    *sorted(_SELECTION_NAMES),
]
