"""Pre-training on a Ray cluster of several nodes, started with `ray start` on 127.0.0.1
(`tests/ray_cluster.py`), with the data and the run on S3 (moto):

- the two workers land on different nodes (each node has room for one);
- one node is killed with SIGKILL mid-run (its raylet and worker at once: a machine lost), a
  replacement node joins, and the run finishes by itself (`cluster.max_failures`) from its latest
  complete checkpoint, with the weights of an uninterrupted run;
- local paths on such a cluster are refused at once, naming them and what to use instead.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from pretrain_helpers import (
    HELD,
    REFERENCE,
    REFERENCE_NAME,
    REFERENCE_STEPS,
    assert_same_weights,
    pretrain_args,
    running,
)
from ray_cluster import loopback_cluster
from safetensors.torch import load

from vitray.data import prepare_dataset, storage
from vitray.runfolder.checkpoints import latest_complete_checkpoint
from vitray.runfolder.files import RunFiles

pytestmark = pytest.mark.slow

STEPS, EVERY = REFERENCE_STEPS, 10
COMMON = (*REFERENCE, f"checkpoint.every={EVERY}", HELD)
ONE_PER_NODE = ("cluster.resources_per_worker={vitray_node: 1}",)


def _latest_step(run_dir: str) -> int | None:
    storage.filesystem(run_dir)[0].invalidate_cache()  # s3fs caches listings; the run adds checkpoints
    latest = latest_complete_checkpoint(run_dir)
    return latest.step if latest else None


def _logged_step(run_dir: str) -> int:
    metrics = RunFiles(run_dir).read_metrics()
    return metrics[-1]["step"] if metrics else 0


def _wait(driver: subprocess.Popen, condition, what: str, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert driver.poll() is None, f"the run ended before {what}:\n{driver.stderr.read()[-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def test_local_paths_on_a_multi_node_cluster_are_refused(digits_dataset, tmp_path):
    with loopback_cluster() as cluster:
        cluster.add_worker_node({"vitray_node": 1})
        args = pretrain_args(
            str(digits_dataset), str(tmp_path), "local", *ONE_PER_NODE, f"cluster.address={cluster.address}"
        )
        out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    text = " ".join(out.stderr.split())
    assert out.returncode == 2, text[-3000:]
    assert f"run.storage={tmp_path}, data.train={digits_dataset}: local paths, but the Ray cluster has 2 nodes" in text
    assert "s3://" in text and "cluster.shared_filesystem=true" in text
    assert latest_complete_checkpoint(str(tmp_path / "local")) is None


def test_a_node_killed_mid_run_is_replaced_and_the_run_ends_as_uninterrupted(moto_server, reference_run):
    data, runs = moto_server.url("datasets", "digits"), moto_server.url("runs")
    prepare_dataset("builtin:digits", data, samples_per_shard=100)
    run_dir = f"{runs}/{REFERENCE_NAME}"
    with loopback_cluster() as cluster:
        first, second = (cluster.add_worker_node({"vitray_node": 1}) for _ in range(2))
        args = pretrain_args(
            data,
            runs,
            REFERENCE_NAME,
            *COMMON,
            *ONE_PER_NODE,
            "cluster.max_failures=2",
            f"cluster.address={cluster.address}",
        )
        with running(args) as driver:
            _wait(driver, lambda: _logged_step(run_dir) >= 2, "step 2 logged")
            assert sorted(cluster.nodes_in_use("vitray_node")) == sorted([first, second])  # one worker per node
            _wait(driver, lambda: (_latest_step(run_dir) or 0) >= EVERY, f"a checkpoint at step {EVERY}")
            cluster.kill_node(second)
            assert driver.poll() is None and _latest_step(run_dir) < STEPS, "killed too late"
            cluster.add_worker_node({"vitray_node": 1})  # the replacement an autoscaler would bring
            stdout, stderr = driver.communicate(timeout=600)
        assert driver.returncode == 0, f"the run failed:\n{stdout[-2000:]}\n{stderr[-5000:]}"

    storage.filesystem(run_dir)[0].invalidate_cache()
    latest = latest_complete_checkpoint(run_dir)
    assert latest.step == STEPS
    weights = load(storage.read_bytes(f"{latest.path}/model.safetensors"))
    assert_same_weights(weights, reference_run["weights"])
