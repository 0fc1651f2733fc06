"""Ray that cannot be started or joined is one line naming the address and the fix (issue 26),
within seconds, not Ray's minutes of retries and a 50-line traceback. Only the last test starts Ray
(in a process of its own)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from unittest import mock

import pytest
import ray

from vitray.cluster import runtime
from vitray.cluster.runtime import RayUnavailable, connect


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_nobody_answers_is_refused_at_once(monkeypatch):
    # Set, so that connect() does not switch on token auth for the rest of this test process.
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    address = f"127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(RayUnavailable) as caught:
        connect(address)
    assert time.monotonic() - started < runtime.REACH_TIMEOUT_S + 2
    message = str(caught.value)
    assert f"no Ray cluster answers at {address}" in message and "cluster.address" in message and "\n" not in message
    assert not ray.is_initialized()


def test_a_local_start_that_times_out_is_one_line(monkeypatch):
    def timed_out(**_):
        raise Exception(  # what ray/_private/node.py raises
            "The current node timed out during startup. This could happen because some of the raylet failed to "
            "startup or the GCS has become overloaded."
        )

    starts, stops = [], []
    monkeypatch.setattr(ray, "init", lambda **kwargs: starts.append(kwargs) or timed_out())
    monkeypatch.setattr(runtime, "_stop_own_ray_processes", lambda: stops.append(1) or 0)
    with pytest.raises(RayUnavailable) as caught:
        connect(None)
    assert len(starts) == 2 and len(stops) == 1  # started again once, the first one's processes stopped
    message = str(caught.value)
    assert message.startswith(
        "the local Ray instance did not start (Exception: The current node timed out during startup"
    )
    assert "ray stop" in message and "\n" not in message


def test_the_cli_says_it_in_one_line(tmp_path):
    address = f"127.0.0.1:{closed_port()}"
    command = [
        sys.executable,
        "-m",
        "vitray.cli",
        "data",
        "prepare",
        "builtin:digits",
        str(tmp_path / "d"),
        "--address",
        address,
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "1000"})
    assert out.returncode == 2, out.stderr
    # What it did before (the listing, "connecting to Ray at ...") and then the error, in one line
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-2:] == [f"connecting to Ray at {address} ...", lines[-1]], out.stderr
    assert lines[-1].startswith(f"error: no Ray cluster answers at {address}"), out.stderr
    assert "Traceback" not in out.stderr and sum(line.startswith("error:") for line in lines) == 1, out.stderr


def test_a_run_on_a_cluster_that_does_not_answer_writes_nothing(digits_dataset, tmp_path):
    """Refused with exit 2 before the lease: no run folder, no attempt record (docs/resuming-and-faults.md: exit 2 writes nothing)."""
    from pretrain_helpers import pretrain_args

    address = f"127.0.0.1:{closed_port()}"
    command = pretrain_args(str(digits_dataset), str(tmp_path / "runs"), "r", f"cluster.address={address}")
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "1000"})
    assert out.returncode == 2, out.stderr
    assert f"error: no Ray cluster answers at {address}" in out.stderr
    assert not (tmp_path / "runs").exists(), sorted(p.name for p in (tmp_path / "runs").rglob("*"))


def test_gloo_is_bound_to_the_interface_of_the_nodes_ray_address(monkeypatch, caplog):
    """Where the hostname resolves to a loopback address, gloo would listen on 127.0.0.1 and ranks
    on other machines could not connect (`tests/test_multinode.py` runs them on hosts of their own)."""
    from vitray.cluster.process_group import bind_gloo_to_node_address, interface_holding

    assert interface_holding("127.0.0.1") == "lo"
    assert interface_holding("198.51.100.77") is None  # an address this machine does not have
    # The whole environment is put back afterwards: the function under test sets the variable
    # itself, which monkeypatch would not undo, and a GLOO_SOCKET_IFNAME=lo left in this process
    # would reach the nodes later tests start (test_multinode's hosts could then not connect).
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    with mock.patch.dict(os.environ):
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
        monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
        assert bind_gloo_to_node_address() == "127.0.0.1: lo"
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
        os.environ["GLOO_SOCKET_IFNAME"] = "eth7"  # the user's choice stays
        assert bind_gloo_to_node_address() == "127.0.0.1: GLOO_SOCKET_IFNAME=eth7 (set before vitray)"
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
        # A node address no interface holds (NAT): gloo keeps its own choice, and the log says so.
        del os.environ["GLOO_SOCKET_IFNAME"]
        monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "198.51.100.77")
        bound = bind_gloo_to_node_address()
        assert "GLOO_SOCKET_IFNAME" not in os.environ
        assert bound.startswith("198.51.100.77: no interface holds it (interfaces: ") and "lo" in bound
        assert "no network interface here holds the node's Ray address 198.51.100.77" in caplog.text
    assert os.environ.get("GLOO_SOCKET_IFNAME") == before


# A local start whose raylet does not register within Ray's 30 s (what a machine busy with other work
# gives): the real start, then Ray's own exception, once. Run in a process of its own, whose Ray
# processes are its children.
_SLOW_FIRST_START = """
import psutil, ray, ray._private.node as node
from vitray.cluster.runtime import connect

real_init, first = node.Node.__init__, []
def registered_too_late(self, *args, **kwargs):
    real_init(self, *args, **kwargs)  # every process of the instance started
    if not first:
        first.append([p.pid for p in psutil.Process().children(recursive=True) if p.name() == "gcs_server"])
        raise Exception("The current node timed out during startup. This could happen because some of the "
                        "raylet failed to startup or the GCS has become overloaded.")
node.Node.__init__ = registered_too_late

connect(None, num_cpus=1)
assert ray.get(ray.remote(lambda: 41).remote()) + 1 == 42
(old_gcs,) = first[0]
gcs = [p.pid for p in psutil.Process().children(recursive=True) if p.name() == "gcs_server"]
assert len(gcs) == 1 and old_gcs not in gcs and not psutil.pid_exists(old_gcs), (old_gcs, gcs)
ray.shutdown()
print("ok")
"""


def test_a_local_start_whose_raylet_registers_too_late_is_started_again():
    out = subprocess.run(
        [sys.executable, "-c", _SLOW_FIRST_START], capture_output=True, text=True, timeout=240, start_new_session=True
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]
    said = [line for line in out.stderr.splitlines() if line.startswith("vitray:")]
    assert len(said) == 1 and "did not start within Ray's 30 s" in said[0] and "starting it again" in said[0], said
