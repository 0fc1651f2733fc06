"""A Ray cluster of several nodes on this machine, started as users start one (`ray start`), for
the multi-node tests: a head node and worker nodes, each on a host of its own (`tests/netns.py`:
its own network namespace, address and temp dir). Each node runs in its own process group, so that a test can kill one with SIGKILL (all its processes:
raylet, workers: a machine lost) or stop all."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from netns import Host
from ports import free_port

BIN = Path(sys.executable).parent


NOT_INHERITED = {"RAY_ADDRESS", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GLOO_SOCKET_IFNAME"}


class RayCluster:
    """A head node and worker nodes started with `ray start --block`, each in its own process group
    (stopped whole at the end): on `head` and the hosts given to `add_worker_node`, each with a temp
    dir of its own."""

    def __init__(self, head: Host, env: dict[str, str] | None = None) -> None:
        self.head = head
        # Ray's socket paths live under the temp dir and must stay under the 107-byte socket limit.
        self.temp_dir = tempfile.mkdtemp(prefix="vd", dir="/tmp")
        self.port = free_port()
        self.address = f"{head.address}:{self.port}"
        # Nodes are machines of their own: not the test process's Ray address, nor the variables of
        # the one-rank process group earlier tests made in it (conftest's `process_group`).
        inherited = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        self.env = {**inherited, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token", **(env or {})}
        self.nodes: list[subprocess.Popen] = []
        self.processes: dict[str, subprocess.Popen] = {}
        self.hosts: dict[str, Host] = {}  # node id -> its host

    def start_head(self) -> None:
        self._start(
            "--head",
            f"--port={self.port}",
            "--num-cpus=1",
            "--include-dashboard=false",
            *self._temp_dir_args(self.head),
            host=self.head,
        )

    def add_worker_node(self, resources: dict[str, float], host: Host, *, retried: bool = False) -> str:
        """Start a node with 2 CPUs and `resources` (on `host`); returns its node id
        (`self.processes[id]` is its `ray start` process, the leader of the node's process group)."""
        before = set(self.node_ids())
        # No settling time: the wait for the node to register below also notices a failed start.
        process = self._start(
            f"--address={self.address}",
            "--num-cpus=2",
            f"--resources={json.dumps(resources)}",
            *self._temp_dir_args(host),
            settle_s=0,
            host=host,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if process.poll() is not None:
                error = process.stderr.read().decode(errors="replace")
                if "timed out during startup" in error and not retried:
                    # Ray gives a new node's raylet a fixed 30 s to register with the GCS, which a
                    # loaded 2-core machine can miss (CI, once): started again, as an autoscaler
                    # retries a failed launch.
                    _kill_group(process)
                    return self.add_worker_node(resources, host, retried=True)
                raise AssertionError(f"ray start of a worker node failed: {error[-3000:]}")
            new = set(self.node_ids()) - before
            if new:
                node = new.pop()
                self.processes[node] = process
                self.hosts[node] = host
                return node
            time.sleep(1)
        raise AssertionError("the new node never registered with the head")

    def node_ids(self) -> list[str]:
        script = (
            f"import json, ray; ray.init(address='{self.address}', logging_level='ERROR'); "
            "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']]))"
        )
        return self._python_list(script)

    def actor_classes(self) -> set[str]:
        """Class names of every actor the cluster has run, finished ones included."""
        # From the GCS's actor table (the state API needs the dashboard, which these nodes leave out).
        script = (
            "import json, ray; from ray._private.state import actors; "
            f"ray.init(address='{self.address}', logging_level='ERROR'); "
            "print(json.dumps(sorted({a['ActorClassName'] for a in actors().values()})))"
        )
        return set(self._python_list(script))

    def nodes_in_use(self, resource: str) -> list[str]:
        """Ids of the nodes where some of `resource` is taken (by the run's workers)."""
        script = (
            "import json, ray; from ray._private.state import available_resources_per_node as free; "
            f"ray.init(address='{self.address}', logging_level='ERROR'); "
            f"total = {{n['NodeID']: n['Resources'].get('{resource}', 0) for n in ray.nodes() if n['Alive']}}; "
            f"print(json.dumps([n for n, t in total.items() if t and free().get(n, {{}}).get('{resource}', 0) < t]))"
        )
        return self._python_list(script)

    def on_head(self, argv: list[str]) -> list[str]:
        """`argv` as run on the head's host (a driver runs there: Ray drivers join the cluster
        through a node of their own machine)."""
        return self.head.command(argv)

    def _python_list(self, script: str) -> list:
        """The JSON list `script` prints last, run on the head's host."""
        out = subprocess.run(
            self.on_head([sys.executable, "-c", script]), capture_output=True, text=True, env=self.env, timeout=120
        )
        assert out.returncode == 0, out.stderr[-3000:]
        # The list is the script's own last line; Ray may print a line of its own after it.
        return json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith("[")))

    def drain(self, node_id: str, deadline_s: int) -> None:
        out = subprocess.run(
            self.on_head(
                [
                    str(BIN / "ray"),
                    "drain-node",
                    f"--address={self.address}",
                    f"--node-id={node_id}",
                    "--reason=DRAIN_NODE_REASON_PREEMPTION",
                    "--reason-message=spot instance reclaimed (test)",
                    f"--deadline-remaining-seconds={deadline_s}",
                ]
            ),
            capture_output=True,
            text=True,
            env=self.env,
            timeout=120,
        )
        assert out.returncode == 0, f"ray drain-node failed: {out.stderr[-3000:]}"

    def _temp_dir_args(self, host: Host) -> list[str]:
        """A host's node keeps its files in a temp dir of its own (as on a machine of its own)."""
        own = Path(self.temp_dir) / host.address.rsplit(".", 1)[-1]
        own.mkdir(exist_ok=True)
        return [f"--temp-dir={own}"]

    def _start(self, *args: str, host: Host, settle_s: float = 3) -> subprocess.Popen:
        argv = [
            str(BIN / "ray"),
            "start",
            "--block",
            f"--node-ip-address={host.address}",
            "--disable-usage-stats",
            "--object-store-memory=150000000",
            # Not Ray's fixed default port (52365): that belongs to whichever Ray instance on the
            # machine binds it first, and test_submit's head needs its own for the Jobs API.
            "--dashboard-agent-listen-port=0",
            *args,
        ]
        node = subprocess.Popen(
            host.command(argv),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=self.env,
            start_new_session=True,
        )
        self.nodes.append(node)
        time.sleep(settle_s)
        if node.poll() is not None:
            raise AssertionError(f"ray start {' '.join(args)} failed: {node.stderr.read()[-3000:]}")
        return node

    def stop(self) -> None:
        for node in reversed(self.nodes):
            _kill_group(node)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _kill_group(node: subprocess.Popen) -> None:
    """A node's processes (its `ray start` leads their process group), SIGTERM then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(node.pid, sig)
            node.wait(timeout=3)  # then SIGKILL: nothing of a throw-away node needs saving
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def ray_cluster(head: Host, env: dict[str, str] | None = None) -> Iterator[RayCluster]:
    """A cluster with its head node started on `head`, stopped at the end;
    `env`: more variables for its nodes (Ray's settings, `RAY_<name>`)."""
    cluster = RayCluster(head, env)
    try:
        cluster.start_head()
        yield cluster
    finally:
        cluster.stop()
