"""`vitray runs` and the app's own options, through the CLI (issue 26): a path that does not
exist or storage that cannot be reached is one line and exit 2; attempts show their one-line
cause, not tracebacks; tables are not cut without a terminal; `--format json`; `--version`."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vitray.cli.main import app
from vitray.runfolder.files import RunFiles
from vitray.runfolder.run_report import run_report
from vitray.trainers.checkpoint.rank_files import files_under, mark_complete, write_state

# What Ray Train records for a worker failure: the whole traceback of each failed rank.
WORKER_TRACEBACK = """Training failed due to worker errors:
[Rank 0 Error Snippet]:
Traceback (most recent call last):
  File "/work/main/trainers/loop.py", line 120, in train
    model = build(config)
  File "/work/main/models/vit.py", line 40, in build
    raise ValueError(msg)
ValueError: img_size 30 is not a multiple of the patch size 16
"""


def invoke(*args: str, records: bool = False):
    """Run `vitray ARGS`; no traceback may be printed, except inside JSON records (``records``)."""
    result = CliRunner().invoke(app, list(args))
    assert "Traceback" not in (result.stderr if records else result.output), result.output
    return result


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def a_failed_run(storage: Path, name: str) -> None:
    files = RunFiles(str(storage / name))
    files.end_attempt(files.new_attempt("a1"), "failed", WORKER_TRACEBACK)


def test_a_path_that_does_not_exist_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    message = one_error_line(invoke("runs", str(tmp_path / "does" / "not" / "exist")))
    assert "does not exist" in message and "exist" in message


def test_an_empty_folder_has_no_runs(tmp_path):
    result = invoke("runs", str(tmp_path))
    assert result.exit_code == 0 and f"no runs under {tmp_path}" in result.output
    result = invoke("runs", str(tmp_path), "--format", "json")
    assert result.exit_code == 0 and json.loads(result.stdout) == []


def test_s3_without_credentials_is_one_line(seaweed_s3, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "1000")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    message = one_error_line(invoke("runs", seaweed_s3.url("runs")))
    assert "no credentials" in message and "AWS_ACCESS_KEY_ID" in message


def test_attempts_show_the_cause_on_one_line_and_tables_are_not_cut(tmp_path):
    long_name = "a-run-with-a-name-much-longer-than-eighty-columns-" + "x" * 60
    a_failed_run(tmp_path, long_name)
    result = invoke("runs", str(tmp_path))  # CliRunner's stdout is not a terminal
    assert result.exit_code == 0, result.output
    assert long_name in result.stdout  # whole, not cut to the 80 columns of a terminal
    row = next(line for line in result.stdout.splitlines() if long_name in line)
    assert "ValueError: img_size 30 is not a multiple of the patch size 16" in row
    assert "Rank 0 Error Snippet" not in result.stdout and "loop.py" not in result.stdout


def test_json_format(tmp_path):
    a_failed_run(tmp_path, "r1")
    result = invoke("runs", str(tmp_path), "--format", "json", records=True)
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)
    assert run["name"] == "r1" and run["num_checkpoints"] == 0
    assert run["status"] == "failed; no complete checkpoint"  # how its last attempt ended, first
    (attempt,) = run["attempts"]
    assert attempt["cause"] == "ValueError: img_size 30 is not a multiple of the patch size 16"
    assert attempt["error"] == WORKER_TRACEBACK  # the whole record stays available
    assert invoke("runs", str(tmp_path), "--format", "yaml").exit_code == 2


def a_run_with_incomplete_checkpoints(storage: Path) -> None:
    """A complete checkpoint at step 6, then one whose rank 1 never finished and one cut short."""
    for minute, world, cut in ((0, 1, False), (1, 2, False), (2, 1, True)):
        folder = storage / "r1" / f"checkpoint_2026-01-01_00-0{minute}-00.000001"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 100)
        write_state(folder, {"step": 6 * (minute + 1), "world_size": world, "config": {"train": {"steps": 100}}})
        mark_complete(folder, 0, files_under(folder))  # rank 0 only: with world 2, rank 1 is missing
        if cut:
            (folder / "model.safetensors").write_bytes(b"x" * 50)


def test_a_start_refused_before_its_first_attempt_is_no_run(tmp_path):
    """A start refused after taking its lease (too few CPUs for its workers: exit 2) leaves the lease's
    lock file alone in a new run folder: no run to list (it was listed as "no complete checkpoint yet")."""
    a_run_with_incomplete_checkpoints(tmp_path)
    (tmp_path / "refused" / "vitray").mkdir(parents=True)
    (tmp_path / "refused" / "vitray" / "lease.json.lock").write_text("")
    (run,) = json.loads(invoke("runs", str(tmp_path), "--format", "json").stdout)
    assert run["name"] == "r1"


def test_runs_show_why_a_checkpoint_does_not_count(tmp_path):
    a_run_with_incomplete_checkpoints(tmp_path)
    result = invoke("runs", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "resumable from step 6 of 100 (2 incomplete checkpoint(s) ignored)" in result.stdout
    assert "ignored checkpoint_2026-01-01_00-01-00.000001: rank 1 never finished writing it" in result.stdout
    assert "ignored checkpoint_2026-01-01_00-02-00.000001: model.safetensors is missing or truncated" in result.stdout
    (run,) = json.loads(invoke("runs", str(tmp_path), "--format", "json").stdout)
    assert run["num_checkpoints"] == 1 and run["latest_checkpoint"].endswith("00-00-00.000001")
    assert [(Path(c["path"]).name, c["problem"]) for c in run["incomplete"]] == [
        ("checkpoint_2026-01-01_00-01-00.000001", "rank 1 never finished writing it"),
        ("checkpoint_2026-01-01_00-02-00.000001", "model.safetensors is missing or truncated"),
    ]


def test_runs_name_the_shards_whose_samples_a_run_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    a_run_with_incomplete_checkpoints(tmp_path)
    shards = [f"s3://b/data/train-{i:06d}.tar" for i in range(8)]
    records = [
        {"step": 2, "loss": 1.0, "skipped_samples": 3, "skipped_shards": shards[:2]},
        {"step": 4, "loss": 0.9, "skipped_samples": 0},
        {"step": 6, "loss": 0.8, "skipped_samples": 9, "skipped_shards": shards[1:]},
    ]
    metrics = Path(RunFiles(str(tmp_path / "r1")).metrics_path)
    metrics.parent.mkdir(parents=True)
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = invoke("runs", str(tmp_path))
    assert result.exit_code == 0, result.output
    named = ", ".join(f"train-{i:06d}.tar" for i in range(5))
    assert f"12 corrupt samples skipped, from {named} and 3 more" in " ".join(result.stdout.split())
    (run,) = json.loads(invoke("runs", str(tmp_path), "--format", "json").stdout)
    assert run["skipped_samples"] == 12 and run["skipped_shards"] == shards
    # and the summary that ends `vitray pretrain`
    report = run_report(str(tmp_path / "r1"), total_steps=100, wall_s=5)
    assert f"data:        12 corrupt samples skipped, from {named} and 3 more" in " ".join(report)


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"vitray {version('vitray')}"


def test_export_refuses_an_unknown_format_naming_those_it_writes(tmp_path):
    # Checked once, by the exporter, before the checkpoint (here: none) is read.
    line = one_error_line(invoke("export", str(tmp_path / "nowhere"), "--format", "bmp"))
    assert "--format 'bmp' is not supported" in line
    assert all(fmt in line for fmt in ("npz", "safetensors", "timm", "onnx")), line


def test_a_run_folder_given_as_storage_is_shown_as_the_run_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    a_run_with_incomplete_checkpoints(tmp_path)
    result = invoke("runs", str(tmp_path / "r1"))
    assert result.exit_code == 0, result.output
    assert f"{tmp_path / 'r1'} is a run; the runs beside it: vitray runs {tmp_path}" in result.output
    assert "resumable from step 6" in result.stdout and "no runs under" not in result.output
    (run,) = json.loads(invoke("runs", str(tmp_path / "r1"), "--format", "json").stdout)
    assert run["name"] == "r1" and run["num_checkpoints"] == 1


def test_export_of_a_path_that_does_not_exist_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    missing = tmp_path / "runs" / "no-such-run"
    message = one_error_line(invoke("export", str(missing), "--out", str(tmp_path / "m.npz")))
    assert f"{missing} does not exist: give a checkpoint folder or a run folder" in message
    assert "neither" not in message
    # The default output (model.npz here) left by an earlier export: the missing checkpoint is named,
    # not the output in the way.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.npz").write_bytes(b"an earlier export")
    message = one_error_line(invoke("export", str(missing)))
    assert f"{missing} does not exist: give a checkpoint folder or a run folder" in message, message


def test_help_without_a_terminal_keeps_every_option_name_whole():
    from vitray.cli.main import app as whole_app

    for command in (["data", "prepare"], ["pretrain"], ["finetune"], ["evaluate"], ["export"], ["runs"]):
        result = CliRunner().invoke(whole_app, [*command, "--help"])  # its output is not a terminal
        assert result.exit_code == 0 and "…" not in result.output, result.output
    assert "--samples-per-shard" in CliRunner().invoke(whole_app, ["data", "prepare", "--help"]).output


def test_help_names_arguments_as_the_docs_do_and_shows_no_value_beside_a_flag():
    """`vitray data prepare SOURCE DEST` as the docs and the summary line write it (Typer wrote
    `{source} {dest}`), and a flag with nothing in the type column (Typer's `<bool>` beside
    `--overwrite` and `--help` read as if they took a value); options with values keep their type."""
    from vitray.cli.main import app as whole_app

    shown = CliRunner().invoke(whole_app, ["data", "prepare", "--help"], env={"COLUMNS": "200"}).output
    assert "{SOURCE} {DEST}" in shown and "{source}" not in shown, shown
    assert "<bool>" not in shown and "<int range>" in shown, shown
    flag = next(line for line in shown.splitlines() if "--skip-bad" in line)
    assert flag.split("--skip-bad", 1)[1].split()[0] == "Leave", flag  # its help comes next, no type between
    for command in ([], ["data"], ["pretrain"], ["finetune"], ["evaluate"], ["export"], ["runs"], ["inspect"]):
        assert "<bool>" not in CliRunner().invoke(whole_app, [*command, "--help"]).output, command
    missing = CliRunner().invoke(whole_app, ["data", "prepare"])
    assert missing.exit_code == 2 and "Missing argument 'SOURCE'" in missing.output, missing.output


def test_help_breaks_lines_where_the_terminal_ends_not_where_the_source_did():
    """A docstring's paragraphs are wrapped to the width of the help (100 columns without a
    terminal), in the command list and on each command's page, not broken where its source lines end."""
    from vitray.cli.main import app as whole_app

    def lines(*command: str) -> list[str]:
        result = CliRunner().invoke(whole_app, [*command, "--help"])
        assert result.exit_code == 0, result.output
        return result.output.splitlines()

    assert any("mean attention distance per head and layer" in line for line in lines())
    assert any("(exit 75); Ctrl-C does the same (exit 130)" in line for line in lines("pretrain"))
    assert any("rest. Prints the table" in line for line in lines("evaluate"))


def test_export_says_which_newer_checkpoints_it_passed_over_and_refuses_an_incomplete_one(tmp_path, monkeypatch):
    """A run folder exports its latest complete checkpoint, saying why a newer one does not count (it
    said nothing); a checkpoint folder that is not complete is refused in one line, exit 2 (it was
    an unforeseen error, exit 1, with a traceback file)."""
    import shutil

    from pretrain_helpers import make_checkpoint

    monkeypatch.setenv("COLUMNS", "1000")
    good = tmp_path / "r1" / "checkpoint_2026-01-01_00-00-00.000001"
    make_checkpoint(good)
    cut = tmp_path / "r1" / "checkpoint_2026-01-01_00-01-00.000001"
    shutil.copytree(good, cut)
    (cut / "model.safetensors").write_bytes((cut / "model.safetensors").read_bytes()[:100])
    result = invoke("export", str(tmp_path / "r1"), "--format", "safetensors", "--out", str(tmp_path / "m.st"))
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert f"skipped newer checkpoint {cut}: model.safetensors is missing or truncated" in flat
    assert f"from {good} (step 4)" in flat and (tmp_path / "m.st").stat().st_size > 1000
    message = one_error_line(invoke("export", str(cut), "--out", str(tmp_path / "cut.npz")))
    assert message == f"error: checkpoint {cut}: model.safetensors is missing or truncated"
    assert not (tmp_path / "cut.npz").exists()


def test_a_damaged_completion_record_is_named_not_the_trainer_state(tmp_path):
    """`runs` blamed an unreadable record on trainer_state.json, which was whole."""
    a_run_with_incomplete_checkpoints(tmp_path)
    newest = tmp_path / "r1" / "checkpoint_2026-01-01_00-02-00.000001"
    (newest / "complete-rank-0000.json").write_text("{")
    result = invoke("runs", str(tmp_path))
    assert result.exit_code == 0, result.output
    flat = " ".join(result.stdout.split())
    assert f"ignored {newest.name}: rank 0's completion record complete-rank-0000.json is unreadable" in flat
    assert "trainer_state.json" not in flat


def test_an_engines_own_figures_are_not_shown_as_evaluation_results(tmp_path):
    from vitray.common.config import ConfigError, load_config
    from vitray.runfolder.progress import progress_line
    from vitray.trainers.config import TrainingConfig

    record = {"step": 4, "loss": 2.5, "val/top1": 0.25, "xla/compilations": 2, "xla/devices": 4}
    metrics = Path(RunFiles(str(tmp_path / "r")).metrics_path)
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps(record) + "\n")
    assert "evaluations at step 4: val/top1 0.2500" in run_report(str(tmp_path / "r"), total_steps=8, wall_s=1)
    line = progress_line(record, [record], 8)
    assert "val/top1 0.250" in line and "xla/" not in line
    with pytest.raises(ConfigError, match="evaluator name 'xla' is taken by the engine's own metrics"):
        load_config(TrainingConfig, None, ["data.train=/data", "evals={xla: {type: val, every: 10}}"])


def test_runs_of_a_dataset_or_a_checkpoint_folder_says_what_it_is(digits_dataset, tmp_path):
    """`vitray runs` of a prepared dataset or of a checkpoint folder said "no runs under X" alone."""
    result = CliRunner().invoke(app, ["runs", str(digits_dataset)])
    assert f"no runs under {digits_dataset}: it is a prepared dataset (dataset.json)" in result.output, result.output
    checkpoint = tmp_path / "store" / "r1" / "checkpoint_s000000000004_2026-01-01_00-00-00.000001"
    checkpoint.mkdir(parents=True)
    write_state(checkpoint, {"step": 4, "world_size": 1})
    result = CliRunner().invoke(app, ["runs", str(checkpoint)])
    said = " ".join(result.output.split())
    assert f"it is a checkpoint folder; its run's storage is {tmp_path / 'store'}" in said, result.output


def test_the_eta_of_a_run_longer_than_a_year_is_said_so(tmp_path):
    """train.steps=1e20: a timedelta of its seconds overflows, which stopped the progress lines and
    turned the run's Ctrl-C into 'failed: OverflowError'."""
    from vitray.runfolder.progress import TrainingProgress, progress_line

    first, record = {"step": 1, "time": 0.0, "loss": 2.0}, {"step": 3, "time": 2.0, "loss": 1.9}
    assert "eta over a year" in progress_line(record, [first, record], 10**20)
    assert "eta 0:00:07" in progress_line(record, [first, record], 10)
    # Whatever the display meets, it is not the run's failure: the follower logs it and goes on.
    progress = TrainingProgress(str(tmp_path / "r"), total_steps=10)
    progress._show = lambda: 1 / 0
    progress._refresh()


def test_vitray_runs_does_not_import_torch(tmp_path):
    """`vitray runs` reads files alone: it imported torch (1.4 s of its 1.9) through the module that
    derives weights from a checkpoint's shards."""
    from pretrain_helpers import make_checkpoint

    make_checkpoint(tmp_path / "mine" / "checkpoint_2026-01-01_00-00-00.000001")
    (tmp_path / "mine" / "vitray").mkdir()
    code = (
        "import sys\n"
        f"sys.argv = ['vitray', 'runs', {str(tmp_path)!r}]\n"
        "from vitray.cli.entry import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "mine" in done.stdout and "step 4" in done.stdout, done.stdout + done.stderr
    assert done.stdout.strip().endswith("torch imported: False"), done.stdout
