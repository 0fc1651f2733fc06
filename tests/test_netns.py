"""The multi-host tests' hosts (`tests/netns.py`): each its own address, reachable from the others
and from the test process, cut off and capped on demand, and nothing left behind."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from netns import available, network

pytestmark = pytest.mark.skipif(available() is not None, reason=f"{available()}")

SERVE = "import http.server as h; h.ThreadingHTTPServer(('{ip}', 8000), h.SimpleHTTPRequestHandler).serve_forever()"
FETCH = (
    "import sys, time, urllib.request; t = time.monotonic(); "
    "n = len(urllib.request.urlopen('http://{ip}:8000/{path}', timeout=3).read()); print(n, time.monotonic() - t)"
)


def test_hosts_reach_each_other_until_cut_and_everything_goes_at_the_end(tmp_path):
    (tmp_path / "blob").write_bytes(b"x" * 2_000_000)
    with network() as net:
        server, client = net.add_host("server"), net.add_host("client")
        assert (server.address, client.address) != (net.gateway,) * 2
        serving = server.popen([sys.executable, "-c", SERVE.format(ip=server.address)], cwd=tmp_path)

        def fetch(host_run, path="blob"):
            return host_run([sys.executable, "-c", FETCH.format(ip=server.address, path=path)])

        deadline = time.monotonic() + 30
        while (got := fetch(client.run)).returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert got.returncode == 0 and got.stdout.split()[0] == "2000000", got.stderr[-2000:]
        # The test process reaches the hosts through the bridge.
        direct = subprocess.run(
            [sys.executable, "-c", FETCH.format(ip=server.address, path="blob")],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert direct.returncode == 0, direct.stderr[-2000:]
        # A host's loopback is its own: nothing listens on the client's.
        assert client.run([sys.executable, "-c", FETCH.format(ip="127.0.0.1", path="")]).returncode != 0

        server.cut()
        assert fetch(client.run).returncode != 0
        server.restore()
        server.cap("8mbit")  # 2 MB at 8 Mbit/s: ~2 s, against milliseconds on the open link
        capped = fetch(client.run)
        assert capped.returncode == 0 and float(capped.stdout.split()[1]) > 1.0, capped.stdout + capped.stderr
        names = [h.name for h in net.hosts]
        bridge = net.bridge
    assert serving.wait(timeout=10) is not None  # killed with its host
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names) and bridge not in links
