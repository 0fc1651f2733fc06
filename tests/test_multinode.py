"""Pre-training on a Ray cluster of several nodes, started with `ray start` on 127.0.0.1
(`tests/ray_cluster.py`), with the data and the run on S3 (SeaweedFS):

- the two workers land on different nodes (each node has room for one);
- one node is killed with SIGKILL mid-run (its raylet and worker at once: a machine lost), a
  replacement node joins, and the run finishes by itself (`cluster.max_failures`) from its latest
  complete checkpoint, with the weights of an uninterrupted run;
- local paths on such a cluster are refused at once, naming them and what to use instead.

Both tests share one cluster (a head and two worker nodes, started once for the module instead of
once a test) and one S3 endpoint, which the nodes' environment names, so it must exist first.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest
from conftest import S3Endpoint, seaweed_bucket
from pretrain_helpers import (
    REFERENCE,
    REFERENCE_NAME,
    REFERENCE_STEPS,
    assert_same_weights,
    pretrain_args,
    running,
)
from ray_cluster import LoopbackCluster, loopback_cluster
from safetensors.torch import load

from vitray import storage
from vitray.data import prepare_dataset
from vitray.runfolder.checkpoint_folders import latest_complete_checkpoint
from vitray.runfolder.files import RunFiles

pytestmark = pytest.mark.slow

STEPS, EVERY = REFERENCE_STEPS, 10
# Half a second a step: the node is killed once a checkpoint shows on S3, and the
# run must still have steps to go then.
COMMON = (*REFERENCE, f"checkpoint.every={EVERY}", "debug.step_delay_s=0.5")
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


@pytest.fixture(scope="module")
def s3(seaweed_store) -> Iterator[S3Endpoint]:
    """conftest's `seaweed_s3`, for the whole module: the cluster's nodes (and so the run's
    workers) take the S3 endpoint and credentials from the environment they are started in."""
    with (
        pytest.MonkeyPatch.context() as env,
        seaweed_bucket(env, seaweed_store, "vitray-test-multinode", AWS_EC2_METADATA_DISABLED="true") as endpoint,
    ):
        yield endpoint


@pytest.fixture(scope="module")
def cluster(s3) -> Iterator[LoopbackCluster]:
    """A head node and two worker nodes with room for one worker each (`vitray_node: 1`), shared by
    the module's tests; the kill test kills one of the two and adds a replacement."""
    with loopback_cluster() as cluster:
        for _ in range(2):
            cluster.add_worker_node({"vitray_node": 1})
        yield cluster


# The refusal test comes first on purpose (pytest runs a module's tests in file order): it needs the
# cluster as the fixture started it, all of whose nodes are alive. After the kill test, the killed
# node stays listed as alive until the head's health checks give up on it (~15 s) and a replacement
# has joined, so the number of nodes the refusal names would depend on timing.


def test_local_paths_on_a_multi_node_cluster_are_refused(cluster, digits_dataset, tmp_path):
    nodes = sum(node.poll() is None for node in cluster.nodes)  # the head and the worker nodes
    assert nodes > 1
    args = pretrain_args(
        str(digits_dataset), str(tmp_path), "local", *ONE_PER_NODE, f"cluster.address={cluster.address}"
    )
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    text = " ".join(out.stderr.split())
    assert out.returncode == 2, text[-3000:]
    expected = (
        f"run.storage={tmp_path}, data.train={digits_dataset}: local paths, but the Ray cluster has {nodes} nodes"
    )
    assert expected in text
    assert "s3://" in text and "cluster.shared_filesystem=true" in text
    assert latest_complete_checkpoint(str(tmp_path / "local")) is None


def test_a_node_killed_mid_run_is_replaced_and_the_run_ends_as_uninterrupted(cluster, s3, reference_run):
    data, runs = s3.url("datasets", "digits"), s3.url("runs")
    prepare_dataset("builtin:digits", data, samples_per_shard=100)
    run_dir = f"{runs}/{REFERENCE_NAME}"
    first, second = cluster.processes  # the fixture's two worker nodes (the refusal test ran nothing)
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
