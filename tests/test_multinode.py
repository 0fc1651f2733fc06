"""Pre-training on a Ray cluster of several hosts, each with a network of its own
(`tests/netns.py`: a network namespace and an address on a bridge), started with `ray start` as on
machines of their own (`tests/ray_cluster.py`): a head host (where the driver runs), two worker
hosts and an object-store host with SeaweedFS, where the data and the run live:

- the two workers land on different hosts (each has room for one);
- one worker host's link is capped (a `tc` token bucket) for the whole run; the object-store host
  is cut off for 45 s as the first checkpoint is being written (the run waits for it: no restart,
  that checkpoint completes); then the other worker host is cut off for good, longer than Ray's
  node timeout: a replacement host joins, and the run goes on by itself (`cluster.max_failures`)
  from its latest complete checkpoint; as the new group comes to its next checkpoint, the path
  between the capped host and the store alone is cut for a while (that rank's share cannot go up:
  the checkpoint is not taken until it can, then completes; no restart); the run finishes with the
  weights and the samples (none repeated or skipped) of an uninterrupted run on an open network;
- local paths on such a cluster are refused at once, naming them and what to use instead.

The tests share one network and cluster (started once for the module instead of once a test).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import S3Endpoint, seaweed_bucket
from netns import Network, available, network
from pretrain_helpers import (
    REFERENCE,
    REFERENCE_NAME,
    REFERENCE_STEPS,
    assert_same_weights,
    final_weights,
    pretrain_args,
    running,
)
from ray_cluster import RayCluster, ray_cluster
from seaweed import SeaweedS3

from vitray import storage
from vitray.data import prepare_dataset
from vitray.runfolder.checkpoint_folders import find_checkpoints, latest_complete_checkpoint
from vitray.runfolder.files import RunFiles
from vitray.trainers.keys import collect_keys

pytestmark = [pytest.mark.slow, pytest.mark.skipif(available() is not None, reason=f"{available()}")]

STEPS, EVERY = REFERENCE_STEPS, 10
# Half a second a step: the host is cut once a checkpoint shows on S3, and the
# run must still have steps to go then.
COMMON = (*REFERENCE, f"checkpoint.every={EVERY}", "debug.step_delay_s=0.5")
STORE_CUT_S = 45
PAIR_CUT_S = 20
# A capped link carries a step's gradients (the suite's 2-block Ti/4: 3.6 MB in fp32) in about a sixth of a
# second (Ti's 12 blocks: 21 MB, about a second).
CAP = "200mbit"
# Ray's node timeout on these hosts: a node whose health checks fail for ~10-20 s is dead (Ray's
# default is ~30-60 s; tighter than this, a node starting on a loaded machine can be declared
# dead before it registers). The cut lasts until the end of the test, far longer.
NODE_TIMEOUT = {
    "RAY_health_check_period_ms": "2000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "5",
}
ONE_PER_NODE = ("cluster.resources_per_worker={vitray_node: 1}",)


def _latest_step(run_dir: str) -> int | None:
    storage.filesystem(run_dir)[0].invalidate_cache()  # s3fs caches listings; the run adds checkpoints
    latest = latest_complete_checkpoint(run_dir)
    return latest.step if latest else None


def _checkpoint_folders(run_dir: str) -> int:
    """How many checkpoint folders the run folder holds, finished or not."""
    fs, path = storage.filesystem(run_dir)
    fs.invalidate_cache()
    return sum(p.rsplit("/", 1)[-1].startswith("checkpoint_") for p in fs.ls(path)) if fs.exists(path) else 0


def _attempts(keys: Path) -> int:
    """How many worker groups recorded sample keys (`debug.record_sample_keys`: a file a rank and group)."""
    return len({p.name.split("-from")[0] for p in keys.glob("keys-attempt*.tsv")})


def _group_step(keys: Path) -> int:
    """The latest step the newest worker group recorded (-1 before it has one)."""
    files = sorted(keys.glob("keys-attempt*.tsv"))  # zero-padded attempt ids, increasing
    if not files:
        return -1
    newest = files[-1].name.split("-from")[0]
    lines = [line for p in files if p.name.startswith(newest) for line in p.read_text().splitlines()]
    return max((int(line.split("\t", 1)[0]) for line in lines if "\t" in line), default=-1)


def _logged_step(run_dir: str) -> int:
    metrics = RunFiles(run_dir).read_metrics()
    return metrics[-1]["step"] if metrics else 0


def _wait(
    driver: subprocess.Popen, condition, what: str, cluster: RayCluster, run_dir: str, timeout: float = 400
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert driver.poll() is None, (
            f"the run ended before {what}:\n{driver.stderr.read()[-4000:]}{_why(cluster, run_dir)}"
        )
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _why(cluster: RayCluster, run_dir: str) -> str:
    """The last attempt's error (its traceback) and the network lines of the nodes' worker logs."""
    attempts = RunFiles(run_dir).read_attempts()
    error = str(attempts[-1].get("error", ""))[-3000:] if attempts else "(no attempt recorded)"
    lines = [
        f"{log.name}: {line}"
        for log in Path(cluster.temp_dir).rglob("worker-*.err")
        for line in log.read_text(errors="replace").splitlines()
        if "gloo" in line.lower() or "interface" in line.lower()
    ]
    return f"\nlast attempt's error:\n{error}\nworker log lines on gloo:\n" + "\n".join(lines[-40:])


@pytest.fixture(scope="module")
def net() -> Iterator[Network]:
    with network() as net:
        yield net


@pytest.fixture(scope="module")
def s3(net, tmp_path_factory) -> Iterator[S3Endpoint]:
    """A SeaweedFS store on a host of its own, for the whole module: the cluster's nodes (and so the
    run's workers) take its endpoint and credentials from the environment they are started in."""
    store = SeaweedS3(tmp_path_factory.mktemp("store"), host=net.add_host("s3"))
    try:
        store.start()
        with (
            pytest.MonkeyPatch.context() as env,
            seaweed_bucket(env, store, "vitray-test-multinode", AWS_EC2_METADATA_DISABLED="true") as endpoint,
        ):
            yield endpoint
    finally:
        store.stop()


@pytest.fixture(scope="module")
def cluster(net, s3) -> Iterator[RayCluster]:
    """A head host and two worker hosts with room for one worker each (`vitray_node: 1`), shared by
    the module's tests; the kill test kills one of the two and adds a replacement."""
    with ray_cluster(net.add_host("head"), env=NODE_TIMEOUT) as cluster:
        for number in (1, 2):
            cluster.add_worker_node({"vitray_node": 1}, host=net.add_host(f"w{number}"))
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
    out = subprocess.run(cluster.on_head(args), capture_output=True, text=True, timeout=300)
    text = " ".join(out.stderr.split())
    assert out.returncode == 2, text[-3000:]
    expected = (
        f"run.storage={tmp_path}, data.train={digits_dataset}: local paths, but the Ray cluster has {nodes} nodes"
    )
    assert expected in text
    assert "s3://" in text and "cluster.shared_filesystem=true" in text
    assert latest_complete_checkpoint(str(tmp_path / "local")) is None


def test_a_run_on_a_capped_link_rides_out_a_store_cut_and_goes_on_after_a_host_is_lost(
    cluster, net, s3, reference_run, tmp_path
):
    data, runs = s3.url("datasets", "digits"), s3.url("runs")
    prepare_dataset("builtin:digits", data, samples_per_shard=100)
    run_dir = f"{runs}/{REFERENCE_NAME}"
    first, second = cluster.processes  # the fixture's two worker nodes (the refusal test ran nothing)
    cluster.hosts[first].cap(CAP)
    keys = tmp_path / "keys"  # a debug record, on the disk the hosts share (not a run path)
    args = pretrain_args(
        data,
        runs,
        REFERENCE_NAME,
        *COMMON,
        *ONE_PER_NODE,
        "cluster.max_failures=2",
        f"cluster.address={cluster.address}",
        f"debug.record_sample_keys={keys}",
    )
    store = next(host for host in net.hosts if host.name.endswith("-s3"))
    with running(cluster.on_head(args)) as driver:
        _wait(driver, lambda: _logged_step(run_dir) >= 2, "step 2 logged", cluster, run_dir)
        assert sorted(cluster.nodes_in_use("vitray_node")) == sorted([first, second])  # one worker per node
        # The store cut off for 45 s as the first checkpoint's files go up: the uploads, the data
        # reads, the metrics, the lease and the stop-file check wait for it; no restart.
        _wait(driver, lambda: _checkpoint_folders(run_dir) > 0, "a checkpoint being written", cluster, run_dir)
        store.cut()
        time.sleep(STORE_CUT_S)
        store.restore()
        _wait(driver, lambda: (_latest_step(run_dir) or 0) >= EVERY, f"a checkpoint at step {EVERY}", cluster, run_dir)
        assert _attempts(keys) == 1, "the store's outage cost a worker-group restart"
        cluster.hosts[second].cut()  # for good: its processes go on, unreachable
        assert driver.poll() is None and _latest_step(run_dir) < STEPS, "cut too late"
        cluster.add_worker_node({"vitray_node": 1}, host=net.add_host("w3"))  # what an autoscaler would bring
        # The new group goes on from step EVERY. As it trains the last step before its next
        # checkpoint, the capped host and the store lose the path between them, and only that (the
        # head and the other worker reach both) for PAIR_CUT_S: that rank's share of the checkpoint
        # cannot go up, so the checkpoint is not taken -- the other rank's files are not a checkpoint
        # -- until the path is back; then it completes, and no restart is spent on it.
        _wait(
            driver,
            lambda: _attempts(keys) == 2 and _group_step(keys) >= 2 * EVERY - 1,
            "the new group's step 19",
            cluster,
            run_dir,
        )
        capped = cluster.hosts[first]
        capped.cut_from(store)
        try:
            until = time.monotonic() + PAIR_CUT_S
            while time.monotonic() < until:
                taken = _latest_step(run_dir) or 0
                assert taken < 2 * EVERY, f"the checkpoint at step {taken} was taken without the cut-off rank's share"
                time.sleep(1)
        finally:
            capped.reconnect(store)
        stdout, stderr = driver.communicate(timeout=600)
    assert driver.returncode == 0, f"the run failed:\n{stdout[-2000:]}\n{stderr[-5000:]}"

    storage.filesystem(run_dir)[0].invalidate_cache()
    latest = latest_complete_checkpoint(run_dir)
    assert latest.step == STEPS
    # The checkpoint written across the pair's cut completed (checkpoint.keep=2 keeps it).
    assert 2 * EVERY in [c.step for c in find_checkpoints(run_dir) if c.complete]
    assert_same_weights(final_weights(run_dir), reference_run["weights"])
    assert collect_keys(keys) == reference_run["keys"]
    # One attempt of the command, two worker groups in it: the first, and the one Ray Train started
    # after the host was lost (none after the store's outage).
    attempts = RunFiles(run_dir).read_attempts()
    assert [a["status"] for a in attempts] == ["finished"], attempts
    assert _attempts(keys) == 2
    # The driver's console (the workers' lines go to their logs): an outage its own calls meet is said
    # as it starts and as it ends. Whether they meet the store's cut depends on when they fall: a
    # connection attempt in flight as the link goes down waits it out (botocore's 60 s connect
    # timeout) and succeeds once it is back. (tests/test_faults_s3.py pins the lines themselves.)
    said = " ".join((stdout + stderr).split())
    started = said.count("vitray: storage unreachable (")
    assert said.count("vitray: storage reachable again after") == started, said[-3000:]
    assert not started or "retrying for up to 300 s (run.storage_outage_s)" in said, said[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
