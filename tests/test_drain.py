"""Ray drains the node that holds the workers -- what KubeRay or Ray's autoscaler does before a spot
node is reclaimed -- during a real pre-training run on a cluster of `ray start` nodes, each on a host with a network of
its own (`tests/netns.py`).

The workers checkpoint at the next check step and stop, the driver starts a new worker group on
the node that joined meanwhile (a replacement node, as an autoscaler would add), and the run ends
by itself with the weights of an uninterrupted run; its attempts say what happened.
"""

from __future__ import annotations

import time

import pytest
from netns import available, network
from pretrain_helpers import (
    REFERENCE,
    REFERENCE_NAME,
    REFERENCE_STEPS,
    assert_same_weights,
    final_weights,
    pretrain_args,
    running,
    steps_begun,
)
from ray_cluster import ray_cluster

from vitray.runfolder.checkpoint_folders import latest_complete_checkpoint
from vitray.runfolder.files import RunFiles

pytestmark = [pytest.mark.slow, pytest.mark.skipif(available() is not None, reason=f"{available()}")]

STEPS, EVERY = REFERENCE_STEPS, 25
# Half a second a step: the drain goes through `ray drain-node` and Ray's GCS before rank 0 sees it.
COMMON = (*REFERENCE, f"checkpoint.every={EVERY}", "checkpoint.preemption_check_every=2", "debug.step_delay_s=0.5")
# Never on the head node; the hosts share this machine's disk, which the run is told.
ON_WORKER_NODES = ("cluster.resources_per_worker={vitray_node: 1}", "cluster.shared_filesystem=true")


def test_a_drained_worker_node_is_left_at_a_checkpoint_and_the_run_ends_as_uninterrupted(
    digits_dataset, reference_run, tmp_path
):
    storage = tmp_path / "drained"
    run_dir = str(storage / REFERENCE_NAME)
    keys = tmp_path / "keys"  # rank 0's sample keys: a step as it begins (the metrics come 20 steps late)
    with network() as net, ray_cluster(net.add_host("head")) as cluster:
        for number in (1, 2):  # room for the two workers on either node
            cluster.add_worker_node({"vitray_node": 2}, host=net.add_host(f"w{number}"))
        args = pretrain_args(
            str(digits_dataset),
            str(storage),
            REFERENCE_NAME,
            *COMMON,
            *ON_WORKER_NODES,
            f"cluster.address={cluster.address}",
            f"debug.record_sample_keys={keys}",
        )
        with running(cluster.on_head(args)) as driver:
            deadline = time.monotonic() + 300
            while steps_begun(keys) < 2:
                assert driver.poll() is None, f"the run ended early:\n{driver.stderr.read()[-4000:]}"
                assert time.monotonic() < deadline, "no step begun in time"
                time.sleep(0.2)
            in_use = cluster.nodes_in_use("vitray_node")
            assert in_use, "the workers hold no vitray_node: they did not run on the worker nodes"
            cluster.drain(in_use[0], deadline_s=240)  # the other node has room for the whole group
            stdout, stderr = driver.communicate(timeout=420)
        assert driver.returncode == 0, f"the run failed:\n{stdout[-2000:]}\n{stderr[-5000:]}"
        # The drain was read by vitray's own watch: Ray Train's pre-emption watcher (an actor per
        # run, polling for `ray.train.get_preemption_info()`) is switched off.
        started = cluster.actor_classes()
        assert "TrainController" in started and "PreemptionWatcher" not in started, started

    text = " ".join(stderr.split())
    assert "Ray is draining node" in text and "starting a new worker group away from that node" in text, text[-3000:]
    attempts = RunFiles(run_dir).read_attempts()
    assert [a["status"] for a in attempts] == ["stopped", "finished"], attempts
    stopped, resumed = attempts
    assert "Ray is draining node" in stopped["error"]
    # The drain's own checkpoint (before the every-25 one) is where the new group resumed.
    assert 2 <= stopped["checkpoint_step"] < EVERY and resumed["resumed_from_step"] == stopped["checkpoint_step"]
    assert latest_complete_checkpoint(run_dir).step == STEPS
    assert_same_weights(final_weights(run_dir), reference_run["weights"])
