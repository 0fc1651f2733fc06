"""`log.mlflow` and `log.wandb`: rank 0 logs the run's config and the same metrics as
metrics.jsonl to MLflow (a file store under tmp) and W&B (offline mode), read back here from what
each wrote; a resumed run goes on in the same tracker run."""

from __future__ import annotations

import pytest
from pretrain_helpers import in_process_loop
from wandb_records import config as wandb_config
from wandb_records import history as wandb_history

from vitray.runfolder.files import RunFiles
from vitray.trainers.trackers import MlflowSettings, Trackers, WandbSettings


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants a database; a file store suits a test
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _mlflow_runs(uri: str):
    from mlflow.tracking import MlflowClient

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
