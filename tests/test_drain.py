"""Ray drains the node that holds the workers -- what KubeRay or Ray's autoscaler does before a spot
node is reclaimed -- during a real pre-training run on a cluster of `ray start` nodes on 127.0.0.1.

The workers checkpoint at the next check step and stop, the driver starts a new worker group on
the node that joined meanwhile (a replacement node, as an autoscaler would add), and the run ends
by itself with the weights of an uninterrupted run; its attempts say what happened.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from pretrain_helpers import assert_same_weights, final_weights, pretrain_args, run, running
from vitray.trainers.checkpoint import latest_complete_checkpoint
from vitray.trainers.run_files import RunFiles

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
STEPS, EVERY = 30, 25
COMMON = (f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "checkpoint.preemption_check_every=2",
          "data.min_crop_area=1.0")  # fmt: skip
ON_WORKER_NODES = ("cluster.resources_per_worker={vitray_node: 1}",)  # never on the head node


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackCluster:
    """A head node and worker nodes started with `ray start --block` on 127.0.0.1, each in its own
    process group (stopped whole at the end), sharing one temp dir."""

    def __init__(self) -> None:
        # Ray's socket paths live under the temp dir and must stay under the 107-byte socket limit.
        self.temp_dir = tempfile.mkdtemp(prefix="vd", dir="/tmp")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token"}
        self.env.pop("RAY_ADDRESS", None)
        self.nodes: list[subprocess.Popen] = []

    def start_head(self) -> None:
        self._start("--head", f"--port={self.port}", "--num-cpus=1", "--include-dashboard=false",
                    f"--temp-dir={self.temp_dir}")  # fmt: skip

    def add_worker_node(self, resources: dict[str, float]) -> str:
        """Start a node with 2 CPUs and `resources`; returns its node id."""
        before = set(self.node_ids())
        self._start(f"--address={self.address}", "--num-cpus=2", f"--resources={json.dumps(resources)}")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            new = set(self.node_ids()) - before
            if new:
                return new.pop()
            time.sleep(1)
        raise AssertionError("the new node never registered with the head")

    def node_ids(self) -> list[str]:
        script = "import json, ray; ray.init(address='%s', logging_level='ERROR'); " \
                 "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']]))" % self.address  # fmt: skip
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=self.env, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def nodes_in_use(self, resource: str) -> list[str]:
        """Ids of the nodes where some of `resource` is taken (by the run's workers)."""
        script = (
            "import json, ray; from ray._private.state import available_resources_per_node as free; "
            f"ray.init(address='{self.address}', logging_level='ERROR'); "
            f"total = {{n['NodeID']: n['Resources'].get('{resource}', 0) for n in ray.nodes() if n['Alive']}}; "
            f"print(json.dumps([n for n, t in total.items() if t and free().get(n, {{}}).get('{resource}', 0) < t]))"
        )
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=self.env, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def drain(self, node_id: str, deadline_s: int) -> None:
        out = subprocess.run(
            [str(BIN / "ray"), "drain-node", f"--address={self.address}", f"--node-id={node_id}",
             "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=spot instance reclaimed (test)",
             f"--deadline-remaining-seconds={deadline_s}"],
            capture_output=True, text=True, env=self.env, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, f"ray drain-node failed: {out.stderr[-3000:]}"

    def _start(self, *args: str) -> None:
        node = subprocess.Popen(
            [str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
             "--object-store-memory=150000000", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=self.env, start_new_session=True,
        )  # fmt: skip
        self.nodes.append(node)
        time.sleep(3)
        if node.poll() is not None:
            raise AssertionError(f"ray start {' '.join(args)} failed: {node.stderr.read()[-3000:]}")

    def stop(self) -> None:
        for node in reversed(self.nodes):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(node.pid, sig)
                    node.wait(timeout=30)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@contextmanager
def loopback_cluster():
    cluster = LoopbackCluster()
    try:
        cluster.start_head()
        yield cluster
    finally:
        cluster.stop()


def _logged_step(run_dir: str) -> int:
    metrics = RunFiles(run_dir).read_metrics()
    return metrics[-1]["step"] if metrics else 0


def test_a_drained_worker_node_is_left_at_a_checkpoint_and_the_run_ends_as_uninterrupted(digits_dataset, tmp_path):
    reference = tmp_path / "reference"
    run(pretrain_args(str(digits_dataset), str(reference), "ref", *COMMON))

    storage = tmp_path / "drained"
    run_dir = str(storage / "ref")
    with loopback_cluster() as cluster:
        for _ in range(2):  # room for the two workers on either node
            cluster.add_worker_node({"vitray_node": 2})
        args = pretrain_args(str(digits_dataset), str(storage), "ref", *COMMON, *ON_WORKER_NODES,
                             f"cluster.address={cluster.address}")  # fmt: skip
        with running(args) as driver:
            deadline = time.monotonic() + 300
            while _logged_step(run_dir) < 2:
                assert driver.poll() is None, f"the run ended early:\n{driver.stderr.read()[-4000:]}"
                assert time.monotonic() < deadline, "no step logged in time"
                time.sleep(0.2)
            in_use = cluster.nodes_in_use("vitray_node")
            assert in_use, "the workers hold no vitray_node: they did not run on the worker nodes"
            cluster.drain(in_use[0], deadline_s=240)  # the other node has room for the whole group
            stdout, stderr = driver.communicate(timeout=420)
        assert driver.returncode == 0, f"the run failed:\n{stdout[-2000:]}\n{stderr[-5000:]}"

    text = " ".join(stderr.split())
    assert "Ray is draining node" in text and "starting a new worker group away from that node" in text, text[-3000:]
    attempts = RunFiles(run_dir).read_attempts()
    assert [a["status"] for a in attempts] == ["stopped", "finished"], attempts
    stopped, resumed = attempts
    assert "Ray is draining node" in stopped["error"]
    # The drain's own checkpoint (before the every-25 one) is where the new group resumed.
    assert 2 <= stopped["checkpoint_step"] < EVERY and resumed["resumed_from_step"] == stopped["checkpoint_step"]
    assert latest_complete_checkpoint(run_dir).step == STEPS
    assert_same_weights(final_weights(run_dir), final_weights(str(reference / "ref")))
