"""`vitray submit` against a real `ray start --head` cluster on 127.0.0.1 (token auth on)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from vitray.data import read_dataset_info

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head node started the way users start one, stopped (whole process group) after."""
    port, dashboard = _free_port(), _free_port()
    # Ray's socket paths live under the temp dir and must stay under the 107-byte socket limit.
    temp_dir = tempfile.mkdtemp(prefix="vr", dir="/tmp")
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [
            str(BIN / "ray"), "start", "--head", "--block",
            "--node-ip-address=127.0.0.1", f"--port={port}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
            "--num-cpus=2", "--include-dashboard=true", f"--temp-dir={temp_dir}",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True,
    )  # fmt: skip
    address = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_jobs_api(address, head)
        yield address
    finally:
        _stop(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stop(head: subprocess.Popen) -> None:
    try:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)  # daemons left in the session
    except ProcessLookupError:
        pass
    head.wait()


def _wait_for_jobs_api(address: str, head: subprocess.Popen, timeout: float = 120) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise AssertionError(f"ray start failed: {head.stderr.read()[-3000:]}")
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=2)
            return
        except urllib.error.HTTPError:  # answering (401 without the token): it is up
            return
        except OSError:
            time.sleep(1)
    raise AssertionError("the Ray Jobs API did not come up")


def test_submit_runs_a_vitray_command_as_a_ray_job(ray_head, tmp_path):
    dest = tmp_path / "digits"
    out = subprocess.run(
        [str(BIN / "vitray"), "submit", "--address", ray_head, "--",
         "data", "prepare", "builtin:digits", str(dest), "--serial"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "submitted job" in out.stderr and "SUCCEEDED" in out.stderr
    followed = " ".join((out.stdout + out.stderr).split())  # the job's own output, followed
    assert "digits, 10 classes" in followed
    info = read_dataset_info(str(dest))
    assert info.splits["train"].num_samples + info.splits["test"].num_samples == 1797


def test_failed_job_fails_the_submit(ray_head, tmp_path):
    out = subprocess.run(
        [str(BIN / "vitray"), "submit", "--address", ray_head, "--", "data", "prepare", "nosuch:x", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1
    assert "FAILED" in out.stderr
