"""Hosts with a network of their own on this machine, for the multi-host tests: each host is a
network namespace with one address on a veth pair to a bridge, as a rack's machines sit on one
switch. The addresses come from 198.18.0.0/15, the range set aside for benchmarking networks
(RFC 2544): never a private or public one. The test process reaches every host through the
bridge's own address (`Network.gateway`); a process started on a host (`Host.popen`) sees only
that host's address and its own loopback.

A host's link can be cut and restored (`cut`, `restore`: the bridge side of its veth down and up,
the host's processes keep running, as when a switch port or cable fails) and its rate capped both
ways (`cap`, a `tc` token bucket: this kernel has no `netem`), and the path between two hosts cut
alone (`cut_from`, `reconnect`: a blackhole route on each to the other, as a failed route or a
firewall rule leaves one pair of machines apart while both reach the rest). Made with `ip` and `tc` as root, as
these machines and CI run; `network()` removes every namespace, link and queue it made, and kills
the processes left in its namespaces by pid, when its block ends, also when a test fails.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field


def _ip(*args: str) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def available() -> str | None:
    """Why this machine cannot make such hosts (not root, no `ip`), or None when it can."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    try:
        _ip("netns", "list")
    except (OSError, RuntimeError) as error:
        return f"`ip netns` does not work here: {error}"
    return None


@dataclass
class Host:
    """One host: its namespace `name`, its `address`, and `link`, the bridge side of its veth."""

    name: str
    address: str
    link: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run on this host (`ip netns exec` enters the namespace, then execs `argv`: the
        process's pid is the command's own)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """`argv` started on this host in a session of its own (killed whole by its pid)."""
        return subprocess.Popen(self.command(argv), start_new_session=True, **kwargs)

    def run(self, argv: Sequence[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout, **kwargs)

    def cut(self) -> None:
        """The host's link down: it reaches nothing and nothing reaches it; its processes go on."""
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")

    def cut_from(self, other: Host) -> None:
        """No path between this host and `other`, both ways; each still reaches every other host."""
        for host, peer in ((self, other), (other, self)):
            _ip("-n", host.name, "route", "add", "blackhole", f"{peer.address}/32")

    def reconnect(self, other: Host) -> None:
        for host, peer in ((self, other), (other, self)):
            _ip("-n", host.name, "route", "del", "blackhole", f"{peer.address}/32")

    def cap(self, rate: str = "20mbit") -> None:
        """At most `rate` out of and into the host (a token bucket on each end of its veth)."""
        for netns, device in (((), self.link), (("-n", self.name), "eth0")):
            bucket = (
                "qdisc",
                "replace",
                "dev",
                device,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "64kb",
                "latency",
                "200ms",
            )
            out = subprocess.run(["tc", *netns, *bucket], capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                raise RuntimeError(f"tc on {device} ({self.name}): {out.stderr.strip()}")

    def pids(self) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", self.name).split()]

    def kill_processes(self) -> None:
        """SIGKILL to every process on the host, by pid (a machine lost)."""
        for pid in self.pids():
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@dataclass
class Network:
    """A bridge with the test process's `gateway` address on it, and the hosts added to it."""

    tag: str  # in every name this network makes: two networks on one machine never collide
    subnet: int  # the third octet: the hosts are 198.18.<subnet>.<n>/24
    hosts: list[Host] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"vt{self.tag}br"

    @property
    def gateway(self) -> str:
        return f"198.18.{self.subnet}.254"

    def add_host(self, role: str) -> Host:
        """A new host on the bridge (its namespace named after `role`, e.g. `head`, `s3`)."""
        number = len(self.hosts) + 1
        host = Host(
            name=f"vt{self.tag}-{role}", address=f"198.18.{self.subnet}.{number}", link=f"vt{self.tag}v{number}"
        )
        _ip("netns", "add", host.name)
        self.hosts.append(host)  # from here on, close() removes it
        _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.name)
        _ip("link", "set", host.link, "master", self.bridge, "up")
        _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.name, "link", "set", "eth0", "up")
        _ip("-n", host.name, "link", "set", "lo", "up")
        return host

    def close(self) -> None:
        """Every process left on a host killed by its pid, every namespace and link removed."""
        for host in self.hosts:
            with suppress(RuntimeError):  # a namespace whose creation failed
                host.kill_processes()
        for host in self.hosts:
            deadline = time.monotonic() + 10
            while _exists("netns", host.name) and host.pids() and time.monotonic() < deadline:
                time.sleep(0.1)
            for args in (("link", "del", host.link), ("netns", "del", host.name)):
                with suppress(RuntimeError):  # already gone (a veth goes with its namespace)
                    _ip(*args)
        with suppress(RuntimeError):
            _ip("link", "del", self.bridge)


def _exists(kind: str, name: str) -> bool:
    return name in _ip(kind, "list").split()


def _free_subnet() -> int:
    """A third octet of 198.18.x.0/24 that no route of this machine uses yet."""
    routes = _ip("route", "show")
    for _ in range(200):
        subnet = secrets.randbelow(250) + 1
        if f"198.18.{subnet}." not in routes:
            return subnet
    raise RuntimeError("no free /24 in 198.18.0.0/16 for a test network")


@contextmanager
def network() -> Iterator[Network]:
    """A new, empty network (`add_host` to fill it), removed with all it holds when the block ends."""
    net = Network(tag=secrets.token_hex(2), subnet=_free_subnet())
    try:
        _ip("link", "add", net.bridge, "type", "bridge")
        _ip("addr", "add", f"{net.gateway}/24", "dev", net.bridge)
        _ip("link", "set", net.bridge, "up")
        yield net
    finally:
        net.close()
