"""The workers' torch process group, bound to the address Ray knows each node by.

Gloo (the process group of CPU runs, and of the small collectives beside NCCL) picks the network
interface it listens on from the machine's hostname, unless `GLOO_SOCKET_IFNAME` names one. Where the
hostname resolves to a loopback address (Debian's default 127.0.1.1, containers, several nodes on one
machine) or to an address the worker cannot bind, gloo falls back to 127.0.0.1, and the ranks of
other machines then fail to connect ("Gloo connectFullMesh failed ... remote=[127.0.0.1]"). Before
Ray Train sets up the process group, each worker binds gloo to the interface that holds its node's
Ray address; a `GLOO_SOCKET_IFNAME` the user set is left alone.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend


def interface_holding(address: str) -> str | None:
    """The name of this machine's network interface that has ``address``, if any."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address for a in addresses):
            return name
    return None


def bind_gloo_to_node_address() -> None:
    """In a worker: GLOO_SOCKET_IFNAME set to the interface of the node's Ray address, if unset."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    import ray.util

    name = interface_holding(ray.util.get_node_ip_address())
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name


class _NodeBoundBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config) -> None:
        worker_group.execute(bind_gloo_to_node_address)
        super().on_start(worker_group, backend_config)


@dataclass
class NodeBoundTorchConfig(TorchConfig):
    """Ray Train's TorchConfig, whose workers first bind gloo to their node's Ray address."""

    @property
    def backend_cls(self):
        return _NodeBoundBackend
