"""Command-line mistakes that once ended in a traceback: each is now one line that names the cause and
the fix, exit 2, before any work and with nothing written; and what no command foresees is one line
too, exit 1, with its traceback in a file named on that line. Through the real app, in-process
(typer's CliRunner), so that `ray.is_initialized()` tells whether Ray was started."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import ray
from pretrain_helpers import make_checkpoint
from typer.testing import CliRunner

from vitray.cli import app as cli_app
from vitray.cli import main as cli_main
from vitray.cli.main import app
from vitray.common import exit_codes

FILE_TEXT = "a: 1\n"
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "victim.yaml"
    path.write_text(FILE_TEXT)
    return path


def refused(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == exit_codes.INPUT_ERROR, result.output
    assert "Traceback" not in result.output and not ray.is_initialized()
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


def test_a_config_that_is_no_text_or_no_file_is_refused(tmp_path):
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    assert refused("pretrain", "-c", str(tmp_path / "image.png")) == (
        f"error: config file {tmp_path / 'image.png'} is not text (not UTF-8): pass -c FILE.yaml"
    )
    assert refused("pretrain", "-c", str(tmp_path)) == f"error: config file {tmp_path} is not a file: pass -c FILE.yaml"


@pytest.mark.parametrize(
    "command, expected",
    [
        (
            ["data", "prepare", "builtin:digits", "{file}", "--overwrite"],
            "is a file, not a folder: give a new or empty",
        ),
        (["demo", "--out", "{file}"], "--out {file} is a file: give a folder for the demo's data, runs and report"),
        (["inspect", "{tmp}", "--out", "{file}"], "--out {file} is a file: give a folder for the figures"),
        (["runs", "{file}"], "{file} is a file: give the folder that holds the runs (a run.storage)"),
    ],
    ids=["data-prepare-into-a-file", "demo-out-a-file", "inspect-out-a-file", "runs-of-a-file"],
)
def test_a_file_where_a_folder_belongs_is_refused_and_left_as_it_was(command, expected, a_file, tmp_path):
    line = refused(*(arg.format(file=a_file, tmp=tmp_path) for arg in command))
    assert expected.format(file=a_file) in line, line
    assert a_file.read_text() == FILE_TEXT


@pytest.mark.parametrize("model", ["Ti/16", "R26+Ti/16"])
def test_the_demo_refuses_a_model_its_grid_cannot_fine_tune_before_it_pretrains(model, tmp_path, monkeypatch):
    """The grid's fine-tune size (24 px) was checked after the data was prepared and the model
    pre-trained (minutes), and then failed the demo with exit 1."""
    monkeypatch.setenv("COLUMNS", "1000")
    line = refused("demo", "--out", str(tmp_path / "demo"), "--set", f"model.name={model}")
    assert line.startswith(
        f"error: fine-tune cells of {tmp_path / 'demo' / 'runs' / 'demo'} at 24 px: model: img_size 24"
    ), line
    assert line.endswith("(the grid's fine-tune size: --grid-set finetune.resolution=N)"), line
    assert not (tmp_path / "demo").exists()


def test_submit_refuses_a_working_dir_that_does_not_exist(tmp_path):
    line = refused(
        "submit", "--address", "http://127.0.0.1:1", "--working-dir", str(tmp_path / "nowhere"), "--", "runs"
    )
    assert (
        line
        == f"error: --working-dir {tmp_path / 'nowhere'}: no such folder (the folder uploaded as the job's working dir)"
    )


def test_finetune_from_a_config_refuses_the_options_of_a_benchmarks_recipe(tmp_path):
    """They would be ignored: the config file holds the run's settings."""
    config = ["finetune", str(tmp_path), "-c", str(CONFIGS / "finetune_digits.yaml"), "--dry-run"]
    line = refused(*config, "--lr", "0.5", "--steps", "7", "--storage", str(tmp_path))
    assert line.startswith("error: --lr, --steps, --storage only go with --benchmark; with a fine-tune config, set")


@pytest.fixture
def checkpoint_and_data_root(digits_dataset, tmp_path):
    """A Ti/4 checkpoint (no training) and a data root holding the prepared digits."""
    checkpoint = tmp_path / "run" / "checkpoint_2026-01-01_00-00-00.000001"
    make_checkpoint(checkpoint)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "digits").symlink_to(digits_dataset)
    return checkpoint, tmp_path / "data"


def test_fewshot_refuses_a_probe_resolution_the_patch_does_not_divide_once(checkpoint_and_data_root):
    """Not once per cell: every cell would meet it."""
    checkpoint, data_root = checkpoint_and_data_root
    line = refused("fewshot", str(checkpoint), "-b", "digits", "--data-root", str(data_root), "--img-size", "18")
    assert line == (
        f"error: few-shot cells of {checkpoint} at 18 px: model: img_size 18 is not divisible by the patch size 4 of "
        "Ti/4; use a multiple of 4, e.g. 16"
    )


def test_a_grid_reading_splits_or_shots_its_data_does_not_have_is_refused_before_ray(
    checkpoint_and_data_root, tmp_path
):
    """Found by the cells on Ray (and retried, each re-extracting the test set's features) before:
    more shots than the train split holds, a split the dataset does not have, l2 selection at 1 shot."""
    checkpoint, data_root = checkpoint_and_data_root
    grid = ["evaluate", str(checkpoint), "--data-root", str(data_root), "--output", str(tmp_path / "eval")]
    grid += ["--set", "benchmarks=[digits]"]
    fewshot_only = ["--set", "finetune.enabled=false"]
    line = refused(*grid, *fewshot_only, "--set", "fewshot.shots=[5,500]")
    assert line == (
        "error: few-shot: 500 shots of each of the 10 classes of digits need 5,000 examples, and train holds 1,437; "
        "lower fewshot.shots"
    ), line
    line = refused(*grid, "--set", "fewshot.enabled=false", "--set", "finetune.train_split=bogus[:90%]")
    assert line.startswith("error: finetune.train_split=bogus[:90%]: dataset 'digits' has no split 'bogus'; it has ")
    line = refused("fewshot", str(checkpoint), "-b", "digits", "--data-root", str(data_root), "--l2", "select")
    assert line.startswith("error: fewshot.l2_reg=select (--l2 select) holds out part of each few-shot set"), line
    assert not (tmp_path / "eval").exists()
    line = refused(*grid[:4], "--output", str(data_root / "digits"), *fewshot_only)
    assert (
        line
        == f"error: output={data_root / 'digits'} is a prepared dataset (it holds dataset.json); give the evaluation a folder of its own"
    )


def test_finetune_names_the_option_of_a_bad_value(checkpoint_and_data_root):
    checkpoint, data_root = checkpoint_and_data_root
    for lr in ("-1", "0"):  # 0 was taken for "not given": the protocol's learning rate, silently
        line = refused(
            "finetune", str(checkpoint), "-b", "digits", "--data-root", str(data_root), "--lr", lr, "--dry-run"
        )
        assert line.startswith(f"error: --lr {float(lr)}: must be a non-empty list of positive learning rates"), line


def test_an_error_no_command_foresaw_is_one_line_and_its_traceback_is_in_a_file(monkeypatch, capsys, tmp_path):
    def a_bug(*args, **kwargs):
        raise ZeroDivisionError("division by zero in a place nobody thought of", "s3://me:hunter2@store/x")

    monkeypatch.setattr(cli_main, "enable_token_auth_if_available", lambda: None)  # Ray's auth: not here
    monkeypatch.setattr(cli_app, "load_config", a_bug)  # the config load of `vitray pretrain`
    secret = "--set=data.storage_options.secret=hunter2"  # credentials are masked in the file
    monkeypatch.setattr(sys, "argv", ["vitray", "pretrain", "--set", "train.steps=4", secret])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit) as stopped:
        cli_main.main()
    assert stopped.value.code == exit_codes.FAILED
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "error: vitray pretrain failed: ZeroDivisionError: ('division by zero in a place nobody thought of', "
        "'s3://me:***@store/x') (the traceback: "
    ), line
    (saved,) = tmp_path.glob("vitray-error-*.txt")
    assert line.endswith(f"{saved})") and saved.stat().st_mode & 0o077 == 0  # its user's alone
    text = saved.read_text()
    assert text.startswith("vitray pretrain --set train.steps=4 --set=data.storage_options.secret=***\n"), text
    assert "in a_bug" in text and "Traceback" in text and "hunter2" not in text


def test_s3_mistakes_of_the_checkpoint_commands_are_one_line_each(seaweed_s3, tmp_path, monkeypatch):
    """A wrong key for the checkpoint's store ended `export`, `fewshot` and `inspect` as an unforeseen
    error (exit 1, a traceback file) and `evaluate` with advice to resume; an `evaluate` output in a
    bucket that does not exist was met by the grid after its cells had run (or the store made it)."""
    import s3fs

    monkeypatch.setenv("COLUMNS", "1000")
    local = tmp_path / "checkpoint_2026-01-01_00-00-00.000001"
    make_checkpoint(local)
    s3fs.S3FileSystem().put(str(local), f"{seaweed_s3.bucket}/runs/r/{local.name}", recursive=True)
    run = seaweed_s3.url("runs", "r")
    fewshot = ["--data-root", seaweed_s3.url("data"), "-b", "digits"]
    grid = ["--data-root", seaweed_s3.url("data"), "--set", "benchmarks=[digits]"]
    line = refused("evaluate", run, *grid, "--output", "s3://no-such-bucket-vitray/eval")
    assert "no such bucket 'no-such-bucket-vitray'" in line and "s3://no-such-bucket-vitray/eval" in line
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
    s3fs.S3FileSystem.clear_instance_cache()
    for command in (
        ["export", run, "--out", str(tmp_path / "m.npz")],
        ["fewshot", run, *fewshot],
        ["evaluate", run, *grid, "--output", seaweed_s3.url("eval")],
        ["inspect", run, "--out", str(tmp_path / "figures")],
    ):
        line = refused(*command)
        assert "the S3 credentials were rejected" in line and "AWS_SECRET_ACCESS_KEY" in line, (command, line)
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_full_disk_or_a_refused_permission_is_said_as_such_in_one_line(tmp_path, monkeypatch, capsys):
    """`vitray data prepare` into a disk that fills (and export, inspect, verify alike) ended with the
    catch-all "failed: OSError: [Errno 28] No space left on device" and a traceback file, naming no
    folder: the place, its free space and the fix, and no traceback file for what is no bug."""
    import errno

    from disk_helpers import mounted_tmpfs

    from vitray.common.failures import environment_problem

    monkeypatch.setattr(cli_main, "enable_token_auth_if_available", lambda: None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a traceback file would go
    with mounted_tmpfs(tmp_path / "disk", "256k") as disk:
        dest = disk / "digits"
        monkeypatch.setattr(sys, "argv", ["vitray", "data", "prepare", "builtin:digits", str(dest), "--serial"])
        with pytest.raises(SystemExit) as stopped:
            cli_main.main()
        assert stopped.value.code == exit_codes.FAILED
        (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        # (the write's error names no file here: the places it may be are said)
        assert line.startswith("error: vitray data prepare failed: no space left on a disk it writes to"), line
        assert "free space where its output, run folder or temporary folder (TMPDIR) lies" in line, line
    assert not list(tmp_path.glob("vitray-error-*.txt"))
    denied = PermissionError(errno.EACCES, "Permission denied", "/data/other/dataset.json")
    assert environment_problem(RuntimeError("wrapped")) is None
    try:
        raise RuntimeError("reading it failed") from denied
    except RuntimeError as wrapped:
        assert environment_problem(wrapped) == (
            "/data/other/dataset.json: permission denied (Permission denied): give a place your user may read and "
            "write, or change its permissions"
        )
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "model.npz"))
    assert environment_problem(full).startswith(f"no space left on the disk of {tmp_path / 'out'} (No space left on")
    read_only = OSError(errno.EROFS, "Read-only file system", "/mnt/ro/run/vitray/lease.json.lock")
    assert environment_problem(read_only).endswith("is on a read-only file system: give a place it may write")
