"""Transfer evaluation: the evaluators a training run schedules (`vitray.evaluation.evaluators`),
few-shot linear probes, the benchmark suite, the evaluation grid and its transfer methods
(`vitray.evaluation.methods`), the results table and reports.

Nothing is imported with the package: its names below are imported on first use, so that a
training worker that only needs an evaluator does not import scipy, pyarrow, matplotlib or pandas.
"""

from __future__ import annotations

import importlib

# name -> the module of vitray.evaluation that defines it
_HOMES: dict[str, str] = {
    **dict.fromkeys(
        [
            "DEFAULT_L2_REG",
            "L2_GRID",
            "FewShotScore",
            "LsrSolution",
            "extract_features",
            "fewshot_accuracy",
            "predict",
            "sample_few_shot",
            "select_l2",
            "solve_lsr",
        ],
        "fewshot",
    ),
    **dict.fromkeys(["Cell", "ResultsTable", "make_cell_id"], "results"),
    **dict.fromkeys(
        [
            "BENCHMARKS",
            "Benchmark",
            "FewShotProtocol",
            "FinetuneProtocol",
            "MissingDataset",
            "benchmark_names",
            "benchmarks_in_group",
            "find_missing",
            "get_benchmark",
            "locate",
            "locate_train",
            "prepare_command",
            "require_prepared",
        ],
        "suite",
    ),
    **dict.fromkeys(
        ["print_table", "write_report", "summarize", "vtab_group_averages", "fine_tune_sweeps", "ReportFiles"], "report"
    ),
    **dict.fromkeys(["selected_finetune"], "selection"),
    **dict.fromkeys(["select_lr"], "methods.finetune"),
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"vitray.evaluation.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'vitray.evaluation' has no attribute {name!r}")


def __dir__() -> list[str]:  # the lazy names too: a notebook's completion lists them
    return sorted([*globals(), *_HOMES])


__all__ = sorted(_HOMES)
