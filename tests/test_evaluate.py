"""`vitray evaluate` over a local Ray: a grid on the digits benchmark (few-shot shots x seeds, and a
fine-tune sweep of two learning rates on train[:90%] scored on train[90%:] and the test split,
whose selected lr is then re-trained on train[:1000]) written cell by cell, killed midway and
re-run without redoing finished cells; failed cells retried, missing data reported with its
prepare command, the report matching the table; `--watch` following a run's new checkpoints;
the pre-training few-shot hook."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pretrain_helpers import kill_ray_head
from typer.testing import CliRunner

from vitray.cluster.checkpoint_inputs import resolve_checkpoints
from vitray.cluster.finetune import final_top1
from vitray.common.config import load_config
from vitray.evaluation.config import GridConfig
from vitray.evaluation.evaluators import TEST_TOP1, VAL_TOP1
from vitray.evaluation.evaluators.fewshot import fewshot_accuracies
from vitray.evaluation.grid import plan_grid
from vitray.evaluation.methods import CheckpointRef
from vitray.evaluation.report import summarize
from vitray.evaluation.results import ResultsTable
from vitray.evaluation.top1 import split_top1
from vitray.runfolder.checkpoint_folders import (
    IncompleteCheckpointError,
    find_checkpoints,
    latest_complete_checkpoint,
    load_checkpoint,
)
from vitray.runfolder.files import RunFiles

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "vitray.cli"]
FINETUNE_STEPS = 12
LEARNING_RATES = (0.01, 0.3)
FINAL_SPLIT = "train[:1000]"
CIFAR10_PREPARE = "vitray data prepare cifar10:/path/to/cifar-10-binary.tar.gz {root}/cifar10"


@pytest.fixture(scope="module")
def data_root(digits_dataset, tmp_path_factory) -> Path:
    """A benchmark data root holding only digits (so cifar10 is missing)."""
    root = tmp_path_factory.mktemp("prepared")
    (root / "digits").symlink_to(digits_dataset)
    return root


def _write_grid(path: Path, data_root: Path, output: Path) -> Path:
    grid = {
        "data_root": str(data_root),
        "output": str(output),
        "benchmarks": ["digits", "cifar10"],
        # 143 shots: as many as digits' train split holds in all (1,437 of 10 classes) but more than
        # some class has, so those cells fail as they draw their sets (and never block the others).
        "fewshot": {"shots": [1, 5, 143], "seeds": 2},
        # No retries within one invocation (test_faults_pretrain covers them): the failed rows must
        # be written before the kill below, and each invocation writes one row per failed cell.
        "retries": 0,
        # VTAB-1k style: select the lr on the held-out slice, then re-train it on another split.
        "finetune": {
            "learning_rates": list(LEARNING_RATES),
            "steps": FINETUNE_STEPS,
            "batch_size": 16,
            "warmup_steps": 2,
            "resolution": 24,
            "checkpoint_every": 4,
            "final_train_split": FINAL_SPLIT,
            # Steps held a little (weights unchanged), so that a run that the kill below finds half
            # done is still unfinished when its workers go: on a fast machine the few steps left
            # took less than the moments the workers outlive their raylet.
            # (1 s: with the 2-block model's quick steps, 0.5 s let a run complete its last checkpoint
            # in those moments, session 35)
            "overrides": {"debug.step_delay_s": 1.0},
        },
    }
    path.write_text(yaml.safe_dump(grid))
    return path


def _complete_finetune_steps(storage: Path) -> list[int]:
    if not storage.is_dir():
        return []
    return [c.step for run_dir in storage.iterdir() for c in find_checkpoints(str(run_dir)) if c.complete]


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 400, kill=None) -> None:
    """SIGKILL the grid's whole process group (driver, embedded Ray, workers) once `ready()`; with
    `kill`, call it then and wait for the driver to exit by itself before that."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if ready():
                if kill is not None:
                    kill()
                    proc.wait(timeout=120)  # Ray itself would end it after 60 s
                return
            if proc.poll() is not None:
                raise AssertionError(f"the grid ended before it could be stopped:\n{proc.stderr.read()[-4000:]}")
            time.sleep(0.2)
        raise AssertionError("the grid never reached the point to stop it")
    finally:
        for _ in range(2):  # Ray daemons re-parented to init stay in the group: kill again
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def killed_and_rerun(pretrained, data_root, tmp_path_factory) -> dict:
    """Run the grid, SIGKILL it once few-shot rows exist and the fine-tune is half done, re-run it."""
    work = tmp_path_factory.mktemp("grid")
    output = work / "eval"
    config = _write_grid(work / "grid.yaml", data_root, output)
    cmd = [*CLI, "evaluate", pretrained, "-c", str(config)]
    table = ResultsTable(str(output / "results"))

    def half_done() -> bool:
        rows = table.to_table()
        ok_fewshot = [
            m == "fewshot" and s == "ok" for m, s in zip(rows["method"].to_pylist(), rows["status"].to_pylist())
        ]
        steps = _complete_finetune_steps(output / "finetune_runs")
        return any(ok_fewshot) and any(s < FINETUNE_STEPS for s in steps)

    # Ray's head (the raylet of the grid's embedded Ray; tests/test_pretrain.py kills a GCS) killed by
    # its pid under the grid: the driver says so and exits, its fine-tune runs' attempts ended and
    # leases released.
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _kill_when(proc, half_done, kill=lambda: kill_ray_head(proc.pid, "raylet"))
    ray_gone = proc.stderr.read()
    runs_at_kill = {
        run.name: (RunFiles(str(run)).read_attempts(), (run / "vitray" / "lease.json").exists())
        for run in (output / "finetune_runs").iterdir()
    }
    after_kill = table.to_table(latest=False).to_pandas()
    finetune_steps_at_kill = _complete_finetune_steps(output / "finetune_runs")

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return {
        "output": output,
        "config": config,
        "cmd": cmd,
        "after_kill": after_kill,
        "data_root": data_root,
        "finetune_steps_at_kill": finetune_steps_at_kill,
        "ray_gone": (proc.returncode, ray_gone, runs_at_kill),
        "rerun": rerun,
        "final": table.to_table(latest=False).to_pandas(),
        "latest": table.to_pandas(),
    }


def test_ray_gone_under_the_grid_is_said_in_one_line_and_leaves_no_run_running(killed_and_rerun):
    code, stderr, runs = killed_and_rerun["ray_gone"]
    said = " ".join(stderr.split())
    assert code == 1, stderr[-4000:]
    assert "error: Ray went away under the " in said and "start the same command again" in said, said[-2000:]
    assert "Traceback" not in stderr and "Failed to connect to GCS" not in stderr, stderr[-4000:]
    # Every fine-tune run the grid had started ended its attempt (none left running) and released its
    # lease; the one that was training when Ray went recorded why.
    assert all(a["status"] != "running" for attempts, _ in runs.values() for a in attempts), runs
    assert not any(leased for _, leased in runs.values()), runs
    assert any(a["status"] == "failed" and "RayLost" in a["error"] for attempts, _ in runs.values() for a in attempts)


def test_rows_were_written_before_the_kill(killed_and_rerun):
    first = killed_and_rerun["after_kill"]
    assert set(first[first["method"] == "fewshot"]["status"]) >= {"ok", "failed"}
    assert (first[first["benchmark"] == "cifar10"]["status"] == "missing").all()
    assert "finetune" not in set(first[first["status"] == "ok"]["method"])  # killed before it finished
    assert (
        killed_and_rerun["finetune_steps_at_kill"] and max(killed_and_rerun["finetune_steps_at_kill"]) < FINETUNE_STEPS
    )


def test_rerun_skips_finished_cells_and_completes_the_grid(killed_and_rerun):
    rerun, first, final = killed_and_rerun["rerun"], killed_and_rerun["after_kill"], killed_and_rerun["final"]
    assert rerun.returncode == 1, rerun.stderr[-3000:]  # failed and missing cells remain
    assert "vitray evaluation results" in rerun.stdout

    # Cells that finished before the kill were not redone: one ok attempt, with the same timestamp.
    done_before = first[first["status"] == "ok"]
    assert len(done_before) >= 2
    for cell_id, finished_at in zip(done_before["cell_id"], done_before["finished_at"]):
        attempts = final[final["cell_id"] == cell_id]
        assert list(attempts["finished_at"]) == [finished_at]

    latest = killed_and_rerun["latest"]
    digits = latest[latest["benchmark"] == "digits"]
    shots = digits["settings"].map(lambda s: yaml.safe_load(s).get("shots"))
    assert (digits[shots.isin([1, 5]) | (digits["method"] == "finetune")]["status"] == "ok").all()
    # 2 lrs x (val, test top-1) and the final run's test top-1
    assert len(digits[shots.isin([1, 5])]) == 4 and len(digits[digits["method"] == "finetune"]) == 5
    assert digits[digits["status"] == "ok"]["value"].between(0, 1).all()


def test_failed_cells_are_retried_and_keep_their_error(killed_and_rerun):
    final, latest = killed_and_rerun["final"], killed_and_rerun["latest"]
    failed = latest[latest["status"] == "failed"]
    assert len(failed) == 2 and all("143-shot sampling needs at least 143 examples" in e for e in failed["error"])
    for cell_id in failed["cell_id"]:
        assert len(final[final["cell_id"] == cell_id]) == 2  # attempted by both runs


def test_missing_benchmark_gives_the_prepare_command(killed_and_rerun, data_root):
    latest = killed_and_rerun["latest"]
    missing = latest[latest["benchmark"] == "cifar10"]
    assert len(missing) == 8 and (missing["status"] == "missing").all()  # 3 shots x 2 seeds + 2 fine-tune lrs
    command = CIFAR10_PREPARE.format(root=data_root)
    assert all(command in e for e in missing["error"])
    assert (
        command in killed_and_rerun["rerun"].stdout.replace("\n", "")
        or command in (killed_and_rerun["output"] / "report" / "report.md").read_text()
    )


def test_finetune_selects_the_lr_on_val_resumes_its_runs_and_retrains_the_choice(killed_and_rerun):
    runs = {run.name: run for run in (killed_and_rerun["output"] / "finetune_runs").iterdir()}
    assert len(runs) == 3  # two lrs and the final run; the re-run continued the killed runs, no new ones
    latest = killed_and_rerun["latest"]
    rows = latest[(latest["method"] == "finetune") & (latest["benchmark"] == "digits")]
    cells = {}
    for cell_id, part in rows.groupby("cell_id"):
        (run,) = [r for name, r in runs.items() if cell_id in name]  # named after its cell
        assert latest_complete_checkpoint(str(run)).step == FINETUNE_STEPS
        cells[cell_id] = (yaml.safe_load(part["settings"].iloc[0]), dict(zip(part["metric"], part["value"])), run)
    sweep = {s["lr"]: (m, run) for s, m, run in cells.values() if "val_split" in s}
    assert set(sweep) == set(LEARNING_RATES)
    for metrics, run in sweep.values():
        # The run validated on the held-out slice and scored the test split at its last step, in one trip.
        logged = RunFiles(str(run)).read_metrics()
        assert metrics["val_accuracy"] == pytest.approx(final_top1(logged, FINETUNE_STEPS, VAL_TOP1))
        assert metrics["accuracy"] == pytest.approx(final_top1(logged, FINETUNE_STEPS, TEST_TOP1))
        # ... which is its last checkpoint's top-1 on the test split.
        model, _ = load_checkpoint(str(run))
        test = split_top1(model, str(killed_and_rerun["data_root"] / "digits"), "test", batch_size=128)
        assert metrics["accuracy"] == pytest.approx(test, abs=1.5 / 360)  # at most one prediction flipped by rounding
    (final,) = [(s, m, run) for s, m, run in cells.values() if "val_split" not in s]
    settings, metrics, run = final
    best = max(sorted(sweep), key=lambda lr: sweep[lr][0]["val_accuracy"])
    assert settings["lr"] == best and settings["train_split"] == FINAL_SPLIT
    assert metrics == {
        "accuracy": pytest.approx(final_top1(RunFiles(str(run)).read_metrics(), FINETUNE_STEPS, VAL_TOP1))
    }
    summary = summarize(latest)
    (reported,) = summary[summary["method"] == "finetune"].itertuples()
    assert reported.mean == metrics["accuracy"] and reported.lr == f"{best:g}"


def test_report_files_match_the_table(killed_and_rerun, data_root):
    report = killed_and_rerun["output"] / "report"
    text = (report / "report.md").read_text()
    summary = summarize(killed_and_rerun["latest"])
    assert len(summary) == 3  # 1-shot, 5-shot, fine-tune
    for row in summary.itertuples():
        label = row.label.replace("|", "\\|")  # a pre-processing "a|b" is escaped in a Markdown cell
        assert f"| {label} | {row.metric} | {row.mean:.4f} | {row.std:.4f} | {row.seeds} |" in text
    assert "7 cells ok, 2 failed, 8 missing" in text
    assert "## Fine-tuning: every learning rate" in text and "train[90%:]" in text
    assert CIFAR10_PREPARE.format(root=data_root) in text
    for plot in ("accuracy_per_benchmark.png", "fewshot_vs_shots.png"):
        assert (report / plot).stat().st_size > 1000 and f"]({plot})" in text


def test_a_grid_with_nothing_left_to_do_does_not_start_ray(killed_and_rerun):
    cmd = [*killed_and_rerun["cmd"], "--set", "benchmarks=[digits]", "--set", "fewshot.shots=[1,5]"]
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "0 ok, 7 already finished, 0 failed, 0 missing" in out.stderr  # the final run's lr found from the table
    assert time.monotonic() - started < 60


def test_ctrl_c_leaves_the_report_of_the_cells_finished_before_it(pretrained, data_root, tmp_path):
    output = tmp_path / "eval"
    config = _write_grid(tmp_path / "grid.yaml", data_root, output)
    table = ResultsTable(str(output / "results"))

    seen: list[float] = []

    def a_fewshot_cell_finished() -> bool:
        # Its row is recorded before its line is printed: a moment after the row (the fine-tune sweep
        # trains for 12 s more), its line is out too.
        if not seen and "ok" in table.to_table()["status"].to_pylist():
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] > 2.0

    proc = subprocess.Popen(
        [*CLI, "evaluate", pretrained, "-c", str(config), "--set", "fewshot.shots=[1]", "--set", "fewshot.seeds=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    # The terminal's Ctrl-C reaches the driver (Ray's processes block SIGINT); the fine-tune sweep
    # is still training then (12 steps held a second each).
    _kill_when(proc, a_fewshot_cell_finished, kill=lambda: proc.send_signal(signal.SIGINT))
    said = " ".join(proc.stderr.read().split())
    assert proc.returncode == 130, said[-3000:]
    assert f"report: {output / 'report' / 'report.md'}" in said, said[-3000:]
    assert (
        "stopped by user (Ctrl-C): evaluation did not finish; the same command goes on: finished cells are kept, "
        "fine-tunes resume from their checkpoints" in said
    ), said[-3000:]
    # Its stderr is a pipe, not a terminal: each finished cell is a line (a bar is never redrawn there)
    assert re.search(r"cell 1/\d+ ok: digits 1-shot img_size=\d+ .* seed 0: accuracy 0\.\d{4}", said), said[-3000:]
    assert "finetune" not in set(table.to_pandas()["method"][table.to_pandas()["status"] == "ok"])
    text = (output / "report" / "report.md").read_text()
    (row,) = summarize(table.to_pandas()).itertuples()
    label = row.label.replace("|", "\\|")  # a pre-processing "a|b" is escaped in a Markdown cell
    assert f"| {label} | {row.metric} | {row.mean:.4f} |" in text


def test_pretraining_fewshot_hook_matches_the_grid(killed_and_rerun, pretrained, digits_dataset):
    model, _ = load_checkpoint(pretrained)
    model.train()
    metrics = dict(fewshot_accuracies(model, {"digits": str(digits_dataset)}, shots=(1, 5), seeds=2))
    assert model.training
    latest = killed_and_rerun["latest"]
    grid = summarize(latest[latest["method"] == "fewshot"])
    expected = {f"digits_{yaml.safe_load(s)['shots']}shot": m for s, m in zip(grid["settings"], grid["mean"])}
    # Same code, same features; only float rounding (other thread counts in the Ray task) could
    # flip one of the 360 test predictions.
    assert metrics == pytest.approx(expected, abs=1 / 360 + 1e-9)


# ---------------------------------------------------------------------------------------------
# Checkpoints of a run: --all-checkpoints, --watch
# ---------------------------------------------------------------------------------------------


def test_checkpoints_of_a_run(pretrained, tmp_path):
    assert [r.step for r in resolve_checkpoints(pretrained)] == [8]
    every = resolve_checkpoints(pretrained, all_checkpoints=True)
    assert [r.step for r in every] == [4, 8] and all(r.target_steps == 8 for r in every)
    assert resolve_checkpoints(every[0].path) == [every[0]]
    copy = tmp_path / "run"
    shutil.copytree(pretrained, copy)
    newest = Path(find_checkpoints(str(copy))[-1].path)
    (newest / "complete-rank-0001.json").unlink()  # a checkpoint whose upload never finished
    assert [r.step for r in resolve_checkpoints(str(copy), all_checkpoints=True)] == [4]
    with pytest.raises(
        IncompleteCheckpointError, match=rf"checkpoint \S*{newest.name}: rank 1 never finished writing it"
    ):
        resolve_checkpoints(str(newest))
    with pytest.raises(FileNotFoundError, match="neither a checkpoint folder"):
        resolve_checkpoints(str(tmp_path))


def test_watch_evaluates_new_checkpoints_until_the_run_finishes(pretrained, data_root, tmp_path):
    run_copy = tmp_path / "run"
    shutil.copytree(pretrained, run_copy)
    final = Path(find_checkpoints(str(run_copy))[-1].path)
    held_back = tmp_path / "held-back"
    final.rename(held_back)  # training "has not reached" step 8 yet
    output = tmp_path / "eval"
    cmd = [
        *CLI,
        "evaluate",
        str(run_copy),
        "--watch",
        "--poll",
        "1",
        "--watch-timeout",
        "400",
        "--data-root",
        str(data_root),
        "--output",
        str(output),
        "--no-progress",
        "--set",
        "finetune.enabled=false",
        "--set",
        "fewshot.shots=[5]",
        "--set",
        "fewshot.seeds=1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    table = ResultsTable(str(output / "results"))
    try:
        deadline = time.monotonic() + 300
        while table.to_table().num_rows == 0:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.5)
        shutil.copytree(held_back, run_copy / ".incoming")
        (run_copy / ".incoming").rename(final)  # the run writes its last checkpoint
        _stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    rows = table.to_pandas()
    assert sorted(rows["step"]) == [4, 8] and (rows["status"] == "ok").all()
    assert "steps 4" in stderr and "steps 8" in stderr and "stopped watching" not in stderr
    assert (output / "report" / "accuracy_vs_step.png").is_file()


def test_watch_waits_for_a_run_on_s3_that_has_not_written_anything_yet(seaweed_s3):
    """`evaluate --watch` may start before the run: a run folder on S3 that is not there yet is waited
    for (its bucket probed, not it), as a local one is; a checkpoint that is not there is refused."""
    import io

    from rich.console import Console

    from vitray import storage
    from vitray.cluster.evaluate import evaluate_checkpoint

    grid = GridConfig(data_root=seaweed_s3.url("prepared"), output=seaweed_s3.url("eval"), benchmarks=["digits"])
    said = io.StringIO()
    run = seaweed_s3.url("runs", "not-started-yet")
    watched = evaluate_checkpoint(
        run, grid, watch=True, poll_seconds=0.1, timeout_seconds=0.5, console=Console(file=said)
    )
    assert not watched.finished and not watched.grids
    assert f"waiting for {run} to appear" in said.getvalue()
    with pytest.raises(storage.StorageUnreachable, match="not-started-yet"):
        evaluate_checkpoint(run, grid)


def test_the_report_holds_every_success_and_only_this_grids_failures(tmp_path):
    """An output folder's results accumulate (other checkpoints, earlier grids): their successes are
    reported, but a failure of a cell this grid no longer plans (500 shots, dropped since) is no
    problem of this grid and would never clear."""
    from vitray.cluster.evaluate import reported_results
    from vitray.evaluation.results import Cell

    grid = GridConfig(data_root=str(tmp_path / "data"), output=str(tmp_path / "eval"), benchmarks=["digits"])
    table = ResultsTable(grid.results_path)
    earlier_ok, dropped, planned = (Cell("ckpt", "digits", "fewshot", {"shots": s}, 0, 1) for s in (5, 500, 10))
    table.append(earlier_ok.ok({"accuracy": 0.5}, 1.0))
    table.append(dropped.failed("ValueError: 500-shot sampling needs at least 500 examples", 1.0))
    table.append(planned.failed("WorkerCrashedError: lost", 1.0))
    reported = reported_results(grid, {planned.cell_id})
    assert sorted(zip(reported["cell_id"].to_pylist(), reported["status"].to_pylist())) == sorted(
        [(earlier_ok.cell_id, "ok"), (planned.cell_id, "failed")]
    )
    assert reported_results(grid).num_rows == 3  # all of it, where no grid is named


def test_missing_data_and_report_on_s3(seaweed_s3, monkeypatch):
    from rich.console import Console

    from vitray import storage
    from vitray.cluster import evaluate
    from vitray.cluster.evaluate import report_grid, run_grid
    from vitray.evaluation.results import Cell

    grid = GridConfig(
        data_root=seaweed_s3.url("prepared"),
        output=seaweed_s3.url("eval"),
        benchmarks=["pets"],
        fewshot={"shots": [5], "seeds": 2},
        finetune={"learning_rates": [0.01]},
    )
    ref = CheckpointRef(seaweed_s3.url("runs", "r", "checkpoint_1"), 100, {"name": "B/16", "img_size": 224})
    summary = run_grid(grid, [ref], show_progress=False)  # nothing is prepared: no Ray needed
    assert (summary.total, summary.missing, summary.ok) == (3, 3, 0)
    table = ResultsTable(grid.results_path)
    other = Cell(ref.path, "cifar10", "fewshot", {"shots": 5}, 0, 100)
    table.append(other.ok({"accuracy": 0.875}, 1.0))

    path = report_grid(grid, Console(file=open(os.devnull, "w")))
    assert path == seaweed_s3.url("eval", "report", "report.md")
    text = storage.read_bytes(path).decode()
    command = f"vitray data prepare pets:/path/to/oxford-iiit-pet {seaweed_s3.url('prepared', 'pets')}"
    assert "| 0.8750 |" in text and text.count(command) == 1  # the 3 cells of pets in one row
    assert "| pets | 100 | 3 cells: few-shot 5 shots; finetune lr 0.01 | 0, 1 | missing |" in text
    assert storage.exists(seaweed_s3.url("eval", "report", "accuracy_per_benchmark.png"))
    assert run_grid(grid, [ref], show_progress=False).missing == 3  # missing cells are retried, never skipped
    # A grid's end merges the parts (a part a finished cell) once there are many: 2 here.
    before = table.to_table(latest=False).to_pylist()
    assert len(table.part_files()) > 2
    monkeypatch.setattr(evaluate, "COMPACT_AT_PARTS", 2)
    assert run_grid(grid, [ref], show_progress=False).missing == 3
    after = table.to_table(latest=False).to_pylist()
    assert len(table.part_files()) == 1
    assert all(row in after for row in before) and len(after) == len(before) + 3


# ---------------------------------------------------------------------------------------------
# Configs and the command line (no Ray)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, benchmarks, cells",
    [
        ("grid_digits", 1, 4 * 3 + 2),
        ("grid_vtab1k", 19, 19),
        ("grid_paper", 6, 6 * 4 * 3 + 24),
    ],
)
def test_shipped_grid_configs_validate(name, benchmarks, cells):
    grid = load_config(GridConfig, REPO / "configs" / f"{name}.yaml")
    ref = CheckpointRef("/runs/r/checkpoint_1", 1, {"name": "B/16", "img_size": 224})
    assert len(grid.resolved_benchmarks()) == benchmarks and len(plan_grid(grid, [ref])) == cells


def test_bad_grid_values_fail_before_ray_with_the_valid_choices(pretrained, tmp_path):
    def evaluate(*sets):
        args = [a for s in sets for a in ("--set", s)]
        return subprocess.run(
            [*CLI, "evaluate", pretrained, "--data-root", str(tmp_path), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    out = evaluate("benchmarks=[digits,imagenet21k]")
    assert out.returncode == 2 and "unknown benchmark(s) 'imagenet21k'" in out.stderr and "vtab/dtd" in out.stderr
    out = evaluate("fewshot.shotz=[1]")
    assert out.returncode == 2 and "did you mean 'fewshot.shots'" in out.stderr
    out = evaluate("fewshot.shots=[0,5]")
    assert out.returncode == 2 and "positive integers" in out.stderr
    out = subprocess.run(
        [*CLI, "evaluate", str(tmp_path), "--data-root", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "neither a checkpoint folder" in out.stderr


def test_the_transfer_commands_are_registered_once_on_the_app():
    from vitray.cli.main import app

    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert sorted(n for n in names if n in ("evaluate", "fewshot", "finetune")) == ["evaluate", "fewshot", "finetune"]
    assert len(names) == len(set(names))
    help_text = CliRunner().invoke(app, ["evaluate", "--help"], env={"COLUMNS": "200"}).output
    assert "--all-checkpoints" in help_text and "--watch" in help_text
