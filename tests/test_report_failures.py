"""A failed grid cell shows its root cause on one line in the printed table, in report.md and in
`--format json`; the whole traceback stays in the results table (issue 26)."""

from __future__ import annotations

import json

from rich.console import Console

from vitray.evaluation.report import print_table, summary_json, write_report
from vitray.evaluation.results import MAX_ERROR_CHARS, Cell, ResultsTable, shorten_error

CAUSE = "ValueError: finetune.resolution 24 is not divisible by the patch size 16"
# What error_text records for a fine-tune cell whose Ray workers failed (grid.py's retry prefix,
# the outer error, then the traceback whose last line is the cause).
RECORDED = (
    "failed 2 times (grid retries=1); last error: WorkerGroupError: Training failed due to worker errors:\n"
    "[Rank 0 Error Snippet]:\nTraceback (most recent call last):\n"
    '  File "/work/main/evaluation/transfer.py", line 300, in finetune\n    model = build(cfg)\n'
    + "  ... a long frame ...\n" * 300
    + CAUSE
    + "\n"
)


def results(tmp_path) -> ResultsTable:
    table = ResultsTable(str(tmp_path / "results"))
    table.append(
        Cell("runs/r1/checkpoint_000010", "digits", "fewshot", {"shots": 5, "l2": 1024}, 0, 10).ok(
            {"accuracy": 0.5}, 1.0
        )
    )
    table.append(Cell("runs/r1/checkpoint_000010", "digits", "finetune", {"lr": 0.01}, 0, 10).failed(RECORDED, 2.0))
    return table


def test_the_table_and_the_report_show_the_cause_on_one_line(tmp_path):
    table = results(tmp_path)
    console = Console(record=True, width=300)
    print_table(table, console=console)
    printed = console.export_text()
    assert CAUSE in printed
    assert "Rank 0 Error Snippet" not in printed and "Traceback" not in printed and "a long frame" not in printed

    markdown = write_report(table, tmp_path / "report").markdown.read_text()
    (row,) = [line for line in markdown.splitlines() if "| failed |" in line]
    assert row.endswith(f"| {CAUSE} |") and "<br>" not in row

    # The record keeps the traceback (cut in the middle: its end, the cause, survives).
    (stored,) = [r["error"] for r in table.to_table().to_pylist() if r["status"] == "failed"]
    assert len(stored) <= MAX_ERROR_CHARS + 60 and stored.startswith("failed 2 times") and stored.endswith(CAUSE + "\n")
    assert "Rank 0 Error Snippet" in stored


def test_summary_json(tmp_path):
    summary = json.loads(summary_json(results(tmp_path)))
    (row,) = summary["results"]
    assert (row["benchmark"], row["settings"], row["mean"], row["seeds"]) == (
        "digits",
        {"shots": 5, "l2": 1024},
        0.5,
        1,
    )
    (failed,) = summary["not_finished"]
    assert failed["status"] == "failed" and failed["cause"] == CAUSE and failed["settings"] == {"lr": 0.01}


def test_shorten_error_keeps_both_ends():
    text = "start " + "x" * 10_000 + " end"
    short = shorten_error(text, limit=1000)
    assert short.startswith("start ") and short.endswith(" end") and len(short) < 1100 and "characters cut" in short
    assert shorten_error("short", limit=1000) == "short"


def test_the_cells_of_a_missing_benchmark_are_one_row_with_their_count(tmp_path):
    """One reason and one command fix them all: the paper's grid has 16 cells (x seeds) for each
    of its benchmarks, which filled the table with the same prepare command. Failed cells stay one
    row each (each has its own cause), and `--format json` lists every cell."""
    table = results(tmp_path)
    reason = "benchmark 'pets': no dataset.json at /data/pets (not prepared). Prepare it with:\n  vitray data prepare pets:DIR /data/pets"
    for seed in range(3):
        for shots in (1, 5, 10, 25):
            table.append(
                Cell("runs/r1/checkpoint_000010", "pets", "fewshot", {"shots": shots}, seed, 10).missing(reason)
            )
    for lr in (0.001, 0.01):
        table.append(Cell("runs/r1/checkpoint_000010", "pets", "finetune", {"lr": lr}, 0, 10).missing(reason))
    console = Console(record=True, width=400)
    print_table(table, console=console)
    printed = console.export_text()
    assert printed.count("vitray data prepare pets:DIR /data/pets") == 1
    (pets,) = [line for line in printed.splitlines() if line.startswith("│ pets")]
    cells = [cell.strip() for cell in pets.split("│")[1:-1]]
    assert cells[:5] == [
        "pets",
        "10",
        "14 cells: few-shot 1, 5, 10, 25 shots; finetune lr 0.001, 0.01",
        "0, 1, 2",
        "missing",
    ]
    assert CAUSE in printed  # the failed cell, on its own row

    markdown = write_report(table, tmp_path / "report").markdown.read_text()
    assert markdown.count("| missing |") == 1 and "| pets | 10 | 14 cells: few-shot 1, 5, 10, 25 shots;" in markdown
    assert len(json.loads(summary_json(table))["not_finished"]) == 15


def test_unlimited_restarts_end_on_the_same_failure_a_third_time_but_not_on_lost_workers(tmp_path):
    """`cluster.max_failures=-1` (every paper recipe): a worker error that comes back word for word
    from the same checkpoint (a seed torch cannot take, a bug) restarted every few seconds for good;
    a lost worker or node, however often, is waited out, and so is an error that comes back after
    progress; a bounded max_failures is Ray Train's own count."""
    from pretrain_helpers import make_checkpoint
    from ray.exceptions import ActorDiedError
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    from vitray.cluster.torch_trainer import SAME_FAILURE_LIMIT, _NoRestartForWhatARestartCannotFix

    def group(*errors: Exception) -> WorkerGroupError:
        return WorkerGroupError("Training failed due to worker errors", dict(enumerate(errors)))

    def decisions(max_failures: int, failures: list, run_dir: str | None = None) -> list[FailureDecision]:
        default = DefaultFailurePolicy(FailureConfig(max_failures=max_failures))
        policy = _NoRestartForWhatARestartCannotFix(default, run_dir)
        # (a callable: what happened between two failures, e.g. a checkpoint written)
        return [policy.make_decision(f) for f in (f() if callable(f) else f for f in failures)]

    def overflow() -> ValueError:
        return ValueError("Overflow when unpacking long long")

    same = [group(overflow(), overflow()) for _ in range(SAME_FAILURE_LIMIT)]
    assert decisions(-1, same) == [FailureDecision.RETRY] * (SAME_FAILURE_LIMIT - 1) + [FailureDecision.RAISE]
    # Another error between two of them starts the count again; lost workers never end the run.
    other = group(ValueError("another"), ValueError("another"))
    assert FailureDecision.RAISE not in decisions(-1, [same[0], same[1], other, same[0], same[1]])
    lost = [group(ActorDiedError(), ActorDiedError()) for _ in range(2 * SAME_FAILURE_LIMIT)]
    assert FailureDecision.RAISE not in decisions(-1, lost)
    assert FailureDecision.RAISE not in decisions(10, same)  # the user's budget of 10
    # The same error again after the run made progress (a new complete checkpoint): restarted.
    run_dir = tmp_path / "run"

    def after_a_checkpoint(step: int):
        def failure() -> WorkerGroupError:
            make_checkpoint(run_dir / f"checkpoint_s{step:012d}_2026-01-01_00-00-00.000001")
            return same[0]

        return failure

    assert decisions(-1, [same[0], after_a_checkpoint(4), after_a_checkpoint(8)], str(run_dir)) == (
        [FailureDecision.RETRY] * 3
    )
    assert decisions(-1, [same[0], same[0], same[0]], str(run_dir))[-1] == FailureDecision.RAISE


def test_the_worker_group_notes_say_the_run_ends_when_the_policy_ends_it(tmp_path):
    from vitray.cluster.torch_trainer import SAME_FAILURE_LIMIT, _FailureNotes, _WorkerGroupFailures

    notes = _FailureNotes()
    try:
        callback = _WorkerGroupFailures(notes.path, max_failures=-1, run_dir=str(tmp_path / "run"))
        for _ in range(SAME_FAILURE_LIMIT):
            callback.after_exception(None, {0: ValueError("Overflow when unpacking long long")})
        said = notes.new()
    finally:
        notes.close()
    assert [note["final"] for note in said] == [False] * (SAME_FAILURE_LIMIT - 1) + [True]
    assert said[-1]["causes"] == ["rank 0: ValueError: Overflow when unpacking long long"]
