"""Config errors through the CLI (issue 26): blamed on the `--set` that gave the value, not the
YAML file; a rule across keys in one line without a dump of the config; no `-c` at all said as
such; a warm-up longer than the run refused. All before Ray starts, with exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from typer.testing import CliRunner

from vitray.cli.main import app

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "demo.yaml")


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # rich would wrap the message at 80 columns otherwise


def refused(*args: str) -> list[str]:
    """The error lines of `vitray ARGS`, which must fail with exit code 2 before Ray starts."""
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and not ray.is_initialized()
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[0].startswith("error: "), result.output
    return lines


def test_a_set_value_is_blamed_on_the_set_not_the_file():
    lines = refused("pretrain", "-c", DEMO, "--set", "train.steps=abc", "--dry-run")
    assert lines[0] == "error: invalid config (--set train.steps=abc):"
    assert lines[1].strip().startswith("train.steps: Input should be a valid integer") and "'abc'" in lines[1]
    assert "demo.yaml" not in "\n".join(lines)


def test_a_bad_file_value_is_blamed_on_the_file(tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text("data: {train: d}\ntrain: {steps: abc}\n")
    lines = refused("pretrain", "-c", str(recipe), "--set", "optim.lr=0.1", "--dry-run")
    assert lines[0] == f"error: invalid config ({recipe}):"


def test_a_batch_that_micro_batches_do_not_divide_is_one_line():
    lines = refused("pretrain", "-c", DEMO, "--set", "train.batch_size=100", "--dry-run")
    # The rule's sentence names both keys and values; the file gave one, the --set the other.
    assert lines[0] == f"error: invalid config ({DEMO}, --set train.batch_size=100):"
    assert len(lines) == 2
    assert lines[1].strip().startswith("train.batch_size=100 must be a multiple of train.micro_batch_size x ")
    assert "top level" not in lines[1] and "Value error" not in lines[1] and "{" not in lines[1]


def test_no_config_at_all_says_to_pass_one():
    (line,) = refused("pretrain", "--dry-run")
    assert line == "error: no config given: pass -c FILE.yaml (see configs/, e.g. configs/demo.yaml); it must set data"


def test_no_grid_at_all_points_to_a_grid_and_the_option_that_sets_what_it_lacks(tmp_path):
    lines = refused("evaluate", str(tmp_path), "--dry-run")
    assert lines == [
        "error: no config given: pass -c FILE.yaml (see configs/, e.g. configs/grid_digits.yaml); it must set data_root",
        "  (data_root: give --data-root ROOT, or `data_root:` in the -c file)",
    ]


def test_another_commands_config_is_said_to_be_one(tmp_path):
    grid = str(REPO / "configs" / "grid_digits.yaml")
    lines = refused("pretrain", "-c", grid, "--dry-run")
    assert lines[-1].strip() == (
        "(none of its sections belong here: pretrain and finetune take a training config such as configs/demo.yaml, "
        "evaluate and fewshot a grid such as configs/grid_digits.yaml)"
    )
    assert not any("--data-root" in line for line in lines)  # the grid's data_root is no key of pretrain's
    assert refused("evaluate", str(tmp_path), "-c", DEMO, "--dry-run")[-2].strip().startswith("(none of its sections")


def test_a_value_yaml_reads_as_another_type_says_how_to_write_it(tmp_path):
    (_, line) = refused("pretrain", "-c", DEMO, "--set", "run.name=123", "--dry-run")
    assert line.endswith("(got 123); YAML read a number: quote it to give a string, --set 'run.name=\"123\"'"), line
    (_, line) = refused("pretrain", "-c", DEMO, "--set", "run.name=on", "--dry-run")
    assert line.endswith("(got True); YAML read a boolean: quote it to give a string, --set 'run.name=\"...\"'"), line
    grid = str(REPO / "configs" / "grid_digits.yaml")
    (_, line) = refused("evaluate", str(tmp_path), "-c", grid, "--set", "benchmarks=digits", "--dry-run")
    assert line.endswith("(got 'digits'); a list is written in brackets: --set 'benchmarks=[digits]'"), line


def test_a_warmup_longer_than_the_run_is_refused():
    lines = refused("pretrain", "-c", DEMO, "--set", "train.steps=20", "--dry-run")
    assert lines[0] == f"error: invalid config ({DEMO}, --set train.steps=20):"
    assert "schedule.warmup_steps=30 is longer than the run (train.steps=20)" in lines[1]
    assert "at most 20" in lines[1]
    ok = CliRunner().invoke(
        app, ["pretrain", "-c", DEMO, "--set", "train.steps=20", "--set", "schedule.warmup_steps=20", "--dry-run"]
    )
    assert ok.exit_code == 0, ok.output


def test_a_final_learning_rate_above_the_peak_is_refused():
    """`schedule.min_lr` above `optim.lr` (a misplaced exponent): the "decay" raised the learning rate
    tenfold over the run, without a word."""
    lines = refused("pretrain", "-c", DEMO, "--set", "optim.lr=0.001", "--set", "schedule.min_lr=0.01", "--dry-run")
    assert "schedule.min_lr=0.01 is above optim.lr=0.001: the decay after the warm-up would raise" in lines[1]
    assert "set schedule.min_lr at most optim.lr" in lines[1]


def test_config_input_that_would_be_dropped_is_refused(tmp_path):
    """A key given twice in a file (a second `optim:` section reset the first's lr to its default), -c
    given twice (the last file alone was read) and a fine-tune's CHECKPOINT beside --set
    init.checkpoint (the --set won): each took one of the two without a word."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("optim:\n  lr: 0.05\ntrain:\n  steps: 4\noptim:\n  weight_decay: 0.3\n")
    (line,) = refused("pretrain", "-c", str(twice), "--dry-run")
    assert line == (
        f"error: config file {twice}: 'optim' is given twice (lines 1 and 5): YAML keeps only the second, whole; "
        "merge them into one"
    )
    nested = tmp_path / "nested.yaml"
    nested.write_text("train:\n  steps: 4\n  batch_size: 8\n  steps: 8\n")
    assert "'steps' is given twice (lines 2 and 4)" in refused("pretrain", "-c", str(nested), "--dry-run")[0]
    result = CliRunner().invoke(app, ["pretrain", "-c", DEMO, "-c", str(nested), "--dry-run"])
    said = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and f"given 2 times ({DEMO}, {nested}): a command reads one config file" in said
    finetune = str(REPO / "configs" / "finetune_digits.yaml")
    (line,) = refused("finetune", "/runs/a", "-c", finetune, "--set", "init.checkpoint=/runs/b", "--dry-run")
    assert line == "error: give the checkpoint once: CHECKPOINT (/runs/a) or --set init.checkpoint=/runs/b, not both"


def test_the_demos_grid_values_are_blamed_on_grid_set(tmp_path):
    # The demo's two option lists: a grid value is the user's --grid-set, and is said so.
    lines = refused("demo", "--out", str(tmp_path / "demo"), "--grid-set", "fewshot.l2_reg=-1")
    assert lines[0] == "error: invalid config (--grid-set fewshot.l2_reg=-1):"
    (line,) = refused("demo", "--out", str(tmp_path / "demo"), "--grid-set", "fewshot")
    assert line == "error: --grid-set 'fewshot': expected dotted.key=value, e.g. --grid-set finetune.steps=50"


def test_a_validators_sentence_that_quotes_the_value_is_not_followed_by_it_again():
    lines = refused("fewshot", "CKPT", "--data-root", "data", "--l2", "-5")
    (line,) = [line for line in lines[1:] if "l2_reg" in line]
    assert lines[0] == "error: invalid config (--l2 -5):"  # the option as typed, not a --set
    assert line.strip() == 'fewshot.l2_reg: must be a positive number or "select", got -5'


@pytest.mark.parametrize(
    "args, line",
    [
        (  # Hydra's form
            ["pretrain", "-c", DEMO, "optim.lr=0.1", "--dry-run"],
            "error: unexpected argument optim.lr=0.1: a config value is given with --set (--set optim.lr=0.1)",
        ),
        (  # big_vision's (ml_collections) form
            ["pretrain", "-c", DEMO, "--config.optim.lr=0.1"],
            "error: unexpected argument --config.optim.lr=0.1: a config value is given with --set (--set optim.lr=0.1)",
        ),
        (  # a secret's value is not echoed
            ["finetune", "CKPT", "data.storage_options.secret=abc"],
            "error: unexpected argument data.storage_options.secret=***: a config value is given with --set"
            " (--set data.storage_options.secret=***)",
        ),
    ],
)
def test_a_config_value_given_without_set_is_pointed_to_set(args, line):
    from vitray.cli.main import config_value_without_set

    assert config_value_without_set(["vitray", *args]) == line.removeprefix("error: ")
    # What the console says, through the console script itself (click would say "extra argument").
    done = subprocess.run(
        [sys.executable, "-m", "vitray.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "1000"},
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [line], done.stderr


def test_values_of_options_and_set_itself_are_not_taken_for_bare_config_values():
    from vitray.cli.main import config_value_without_set

    assert config_value_without_set(["vitray", "pretrain", "-c", DEMO, "--set", "optim.lr=0.1"]) is None
    assert config_value_without_set(["vitray", "finetune", "CKPT", "--name", "my.run=1"]) is None
    assert config_value_without_set(["vitray", "export", "CKPT", "a.b=1"]) is None  # no --set: click's own


def test_an_integer_written_with_an_exponent_is_told_to_be_written_out():
    # YAML 1.1 (PyYAML) reads 1e3 as a string; an int key takes no exponent.
    lines = refused("pretrain", "-c", DEMO, "--set", "train.steps=1e3", "--dry-run")
    assert lines[1].strip().endswith("(got '1e3'); write the integer out: train.steps=1000"), lines
    lines = refused("pretrain", "-c", DEMO, "--set", "train.steps=2.55e1", "--dry-run")
    assert "write the integer out" not in lines[1] and "(got '2.55e1')" in lines[1], lines
