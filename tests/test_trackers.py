"""`log.mlflow` and `log.wandb`: rank 0 logs the run's config and the same metrics as
metrics.jsonl to MLflow (a file store under tmp) and W&B (offline mode), read back here from what
each wrote; a resumed run goes on in the same tracker run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pretrain_helpers import in_process_loop
from wandb_records import config as wandb_config
from wandb_records import history as wandb_history

from vitray.runfolder.files import RunFiles
from vitray.trainers.trackers import MlflowSettings, Trackers, WandbSettings


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # As a user's shell has it: MLflow 3 refuses a folder store unless told, and vitray tells it.
    # (Set first, so that the variable as it was comes back after the test, whoever set it since:
    # a delenv of an absent variable records nothing to undo.)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _mlflow_runs(uri: str):
    import os

    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # reading it back here (the fixture restores the variable)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("vitray")
    return client, client.search_runs([experiment.experiment_id])


def test_mlflow_and_wandb_hold_the_runs_metrics_and_config(process_group, digits_dataset, tmp_path):
    uri = f"file://{tmp_path / 'mlruns'}"
    loop = in_process_loop(
        digits_dataset,
        tmp_path,
        "log.every=2",
        f"log.mlflow={{tracking_uri: '{uri}'}}",
        f"log.wandb={{mode: offline, dir: '{tmp_path}'}}",
        "run.name=tracked",
    )
    loop.run()
    logged = [m for m in RunFiles(str(tmp_path / "run")).read_metrics() if "loss" in m]
    assert [m["step"] for m in logged] == [2, 4]

    client, runs = _mlflow_runs(uri)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].info.run_name == "tracked"
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert [(h.step, h.value) for h in history] == [(m["step"], m["loss"]) for m in logged]
    assert runs[0].data.params["train.steps"] == "4" and runs[0].data.params["model.name"] == "Ti/4"

    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    rows = [r for r in wandb_history(log) if "loss" in r]
    assert [(r["_step"], r["loss"]) for r in rows] == [(m["step"], m["loss"]) for m in logged]
    assert wandb_config(log)["train"]["steps"] == 4


def test_a_resumed_run_goes_on_in_the_same_tracker_runs(tmp_path):
    uri = f"file://{tmp_path / 'mlruns'}"
    for step in (1, 2):  # two attempts of one run folder
        trackers = Trackers(
            MlflowSettings(tracking_uri=uri),
            WandbSettings(mode="offline", dir=str(tmp_path)),
            run_name="r",
            run_dir="s3://bucket/runs/r",
            config={"seed": 0},
        )
        trackers.log(step, {"loss": 1.0 / step, "note": "not a number"})
        trackers.close()
    client, runs = _mlflow_runs(uri)
    assert len(runs) == 1
    assert [(h.step, h.value) for h in client.get_metric_history(runs[0].info.run_id, "loss")] == [(1, 1.0), (2, 0.5)]
    logs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len({log.name for log in logs}) == 1, "both attempts write the one W&B run id"


def test_log_mlflow_defaults_to_a_folder_store_where_the_command_runs(tmp_path, monkeypatch):
    """`log.mlflow: {}` without MLFLOW_TRACKING_URI: the folder `mlruns` where the config is read
    (MLflow 3's own default, a SQLite file, needs SQLAlchemy, which mlflow-skinny has not), used
    although MLflow 3 refuses folder stores unless MLFLOW_ALLOW_FILE_STORE is set."""
    from vitray.trainers.trackers import mlflow_store_problem

    monkeypatch.chdir(tmp_path)
    settings = MlflowSettings.model_validate({})
    assert settings.tracking_uri == str(tmp_path / "mlruns")
    assert mlflow_store_problem(settings) is None
    trackers = Trackers(settings, None, run_name="r", run_dir=str(tmp_path / "r"), config={"seed": 0})
    trackers.log(1, {"loss": 0.5})
    trackers.close()
    client, (run,) = _mlflow_runs(settings.tracking_uri)
    assert run.info.status == "FINISHED" and client.get_metric_history(run.info.run_id, "loss")[0].value == 0.5
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "elsewhere")
    assert MlflowSettings.model_validate({}).tracking_uri == str(tmp_path / "elsewhere")


def test_an_mlflow_store_that_cannot_be_opened_is_refused_before_ray(digits_dataset, tmp_path):
    """A SQLite store without SQLAlchemy, a server that does not answer: refused by the pre-flight in
    one line, in seconds (MLflow's own retries wait minutes), not met by rank 0 after Ray started."""
    import time

    from vitray.common.config import load_config
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.driver_checks.preflight import PreflightError, check_inputs

    for uri, said in [
        ("sqlite:///mlflow.db", "a sqlite:/// store needs SQLAlchemy and Alembic: pip install mlflow"),
        ("http://127.0.0.1:9", "the MLflow store cannot be opened: API request to http://127.0.0.1:9"),
    ]:
        cfg = load_config(
            TrainingConfig,
            None,
            [f"data.train={digits_dataset}", f"run.storage={tmp_path}", f"log.mlflow={{tracking_uri: '{uri}'}}"],
        )
        started = time.monotonic()
        with pytest.raises(PreflightError, match="log.mlflow.tracking_uri=") as refused:
            check_inputs(cfg)
        assert said in str(refused.value) and "\n" not in str(refused.value)
        assert time.monotonic() - started < 30


def test_the_progress_bar_reads_only_the_new_lines_of_the_metrics_file(tmp_path):
    from vitray.runfolder.progress import MetricsTail

    path = tmp_path / "metrics.jsonl"
    lines = [f'{{"step": {s}, "loss": {1 / s}}}\n' for s in range(1, 6)]
    path.write_text("".join(lines[:2]) + '{"step": 3, "lo')  # a line being written
    tail = MetricsTail(str(path))
    assert [r["step"] for r in tail.read()] == [1, 2] and tail.offset == len("".join(lines[:2]))
    path.write_text("".join(lines[:4]))  # replaced whole by a longer copy
    assert [r["step"] for r in tail.read()] == [1, 2, 3, 4] and tail.offset == path.stat().st_size
    path.write_text(
        "".join(lines[:2]) + '{"step": 3, "loss": 9.0}\n{"step": 4, "loss": 8.0}\n{"step": 5, "loss": 7.0}\n'
    )
    records = tail.read()  # a resumed attempt rewrote it from step 2, and it grew past the old length
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 0.5), (3, 9.0), (4, 8.0), (5, 7.0)]


def test_without_a_terminal_each_record_is_a_log_line(tmp_path, capsys):
    """`ray job logs`, a pod log or `> log`: a line per log step (step/total, loss, img/s, data
    wait, eta, the record's evaluations), not a bar that shows nothing until the run ends."""
    from vitray.runfolder.progress import TrainingProgress

    run_dir = str(tmp_path / "run")
    metrics = Path(RunFiles(run_dir).metrics_path)
    metrics.parent.mkdir(parents=True)
    record = {"loss": 2.0, "images_per_s": 50.0, "data_wait_fraction": 0.012, "lr": 0.0003}
    with metrics.open("w") as f:
        f.write(json.dumps({"step": 10, "time": 1000.0, **record}) + "\n")
        f.write(
            json.dumps({"step": 20, "time": 1010.0, **record, "val/top1": 0.5, "fewshot/digits_10shot": 0.25}) + "\n"
        )
    progress = TrainingProgress(run_dir, total_steps=100, poll_seconds=0.05)
    assert progress.lines  # pytest's captured stdout is not a terminal
    with progress:
        pass
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "step 10/100  loss 2.0000  50.0 img/s  data wait 1%  lr 3.00e-04",
        "step 20/100  loss 2.0000  50.0 img/s  data wait 1%  lr 3.00e-04  eta 0:01:20  fewshot/digits_10shot 0.250  val/top1 0.500",
    ]
    with metrics.open("a") as f:  # only what is new is printed on the next look
        f.write(json.dumps({"step": 30, "time": 1020.0, **record}) + "\n")
    progress._refresh()  # the next poll
    assert capsys.readouterr().out.splitlines() == [
        "step 30/100  loss 2.0000  50.0 img/s  data wait 1%  lr 3.00e-04  eta 0:01:10"
    ]


def test_the_bar_keeps_the_latest_loss_and_top1_across_records_without_them(tmp_path):
    """On a terminal the bar shows the newest record's numbers: a record of an evaluation or a
    checkpoint alone (`evals.*.every` off `log.every`) made it "loss nan  0.0 img/s", and the next
    log step dropped the top-1."""
    from vitray.runfolder.progress import TrainingProgress

    run_dir = str(tmp_path / "run")
    metrics = Path(RunFiles(run_dir).metrics_path)
    metrics.parent.mkdir(parents=True)
    lines = [
        {"step": 10, "time": 1.0, "loss": 2.5, "images_per_s": 40.0, "lr": 0.001},
        {"step": 15, "time": 2.0, "val/top1": 0.25},  # an evaluation step that logged nothing else
    ]
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    progress = TrainingProgress(run_dir, total_steps=30, headline="val/top1", label="val top-1", poll_seconds=60)
    progress.lines = False  # as on a terminal
    progress._refresh()
    status = progress._progress.tasks[0].fields["status"]
    assert status == "loss 2.5000  40.0 img/s  lr 1.00e-03  val top-1 0.250", status
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 20, "time": 3.0, "loss": 2.0, "images_per_s": 50.0, "lr": 0.0005}) + "\n")
    progress._refresh()
    status = progress._progress.tasks[0].fields["status"]
    assert status == "loss 2.0000  50.0 img/s  lr 5.00e-04  val top-1 0.250", status


def test_a_resumed_attempt_shows_its_own_lines_and_eta_not_the_previous_attempts(tmp_path, capsys):
    """Until a resumed attempt's first upload the metrics file holds the previous attempt's lines,
    past its checkpoint too: they were printed as if training had started over, and the ETA counted
    the time between the attempts."""
    from vitray.runfolder.progress import TrainingProgress

    run_dir = str(tmp_path / "run")
    metrics = Path(RunFiles(run_dir).metrics_path)
    metrics.parent.mkdir(parents=True)
    record = {"loss": 2.0, "images_per_s": 50.0}
    with metrics.open("w") as f:  # the previous attempt: checkpointed at 20, died after 30
        for step in (10, 20, 30):
            f.write(json.dumps({"step": step, "time": 1000.0 + step, **record}) + "\n")
    progress = TrainingProgress(run_dir, total_steps=100, poll_seconds=60, resumed_from=20, attempt_started=5000.0)
    progress._refresh()
    assert capsys.readouterr().out == ""
    with metrics.open("w") as f:  # this attempt's first upload: the lines to its checkpoint, then its own
        for step, at in ((10, 1010.0), (20, 1020.0), (30, 5030.0), (40, 5040.0)):
            f.write(json.dumps({"step": step, "time": at, **record}) + "\n")
    progress._refresh()
    assert capsys.readouterr().out.splitlines() == [
        "step 30/100  loss 2.0000  50.0 img/s",
        "step 40/100  loss 2.0000  50.0 img/s  eta 0:01:00",  # 1 s a step since step 30, not since step 10
    ]


def test_a_log_says_when_no_new_metrics_come(tmp_path, capsys, monkeypatch):
    """Where a bar would move its clock, a log shows nothing: a line says how long it has been
    without metrics, then after twice as long, and again once new ones have come."""
    import time
    import types

    from vitray.runfolder import progress as progress_module
    from vitray.runfolder.progress import TrainingProgress

    # The display's own clock, moved by the test: a machine's stall between two looks does not
    # make a quiet time of its own (a loaded machine printed an extra line).
    clock = [1000.0]
    monkeypatch.setattr(progress_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=time.time))
    monkeypatch.setattr(TrainingProgress, "QUIET_S", 0.3)
    run_dir = str(tmp_path / "run")
    metrics = Path(RunFiles(run_dir).metrics_path)
    metrics.parent.mkdir(parents=True)
    progress = TrainingProgress(run_dir, total_steps=100, poll_seconds=60)
    progress._refresh()
    assert capsys.readouterr().out == ""
    clock[0] += 0.35
    progress._refresh()
    assert capsys.readouterr().out.startswith("no metrics yet after 0:00:00 (the workers are starting")
    clock[0] += 0.35
    progress._refresh()  # the next quiet time is twice as long
    assert capsys.readouterr().out == ""
    metrics.write_text(json.dumps({"step": 10, "time": time.time(), "loss": 2.0}) + "\n")
    progress._refresh()
    assert capsys.readouterr().out.splitlines() == ["step 10/100  loss 2.0000"]
    clock[0] += 0.35
    progress._refresh()
    assert capsys.readouterr().out.splitlines() == ["no new metrics for 0:00:00 since step 10"]
