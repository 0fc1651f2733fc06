"""The workers' torch process group, bound to the address Ray knows each node by.

Gloo (the process group of CPU runs, and of the small collectives beside NCCL) picks the network
interface it listens on from the machine's hostname, unless `GLOO_SOCKET_IFNAME` names one. Where the
hostname resolves to a loopback address (Debian's default 127.0.1.1, containers, several nodes on one
machine) or to an address the worker cannot bind, gloo falls back to 127.0.0.1, and the ranks of
other machines then fail to connect ("Gloo connectFullMesh failed ... remote=[127.0.0.1]"). Before
Ray Train sets up the process group, each worker binds gloo to the interface that holds its node's
Ray address; a `GLOO_SOCKET_IFNAME` the user set is left alone. Where no interface holds that
address (a NAT'ed node address), gloo keeps its own choice and the worker's log says so, naming the
interfaces it has, as does a process group that then fails to connect.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

logger = logging.getLogger(__name__)


def interface_holding(address: str) -> str | None:
    """The name of this machine's network interface that has ``address``, if any."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address for a in addresses):
            return name
    return None


def bind_gloo_to_node_address() -> str:
    """In a worker: GLOO_SOCKET_IFNAME set to the interface of the node's Ray address, if unset.
    Returns what gloo listens on, in words (for the driver's message if the group fails to connect)."""
    import psutil
    import ray.util

    address = ray.util.get_node_ip_address()
    chosen = os.environ.get("GLOO_SOCKET_IFNAME")
    if chosen:
        return f"{address}: GLOO_SOCKET_IFNAME={chosen} (set before vitray)"
    name = interface_holding(address)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        return f"{address}: {name}"
    interfaces = ", ".join(sorted(psutil.net_if_addrs()))
    logger.warning(
        "no network interface here holds the node's Ray address %s (interfaces: %s): gloo picks one "
        "from the hostname; set GLOO_SOCKET_IFNAME to choose",
        address,
        interfaces,
    )
    return f"{address}: no interface holds it (interfaces: {interfaces}); gloo's choice from the hostname"


class _NodeBoundBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config) -> None:
        bound = worker_group.execute(bind_gloo_to_node_address)
        try:
            super().on_start(worker_group, backend_config)
        except Exception as error:
            # Gloo's own message names a peer's address but not why it listens there.
            error.add_note("gloo's interface on each rank: " + "; ".join(f"rank {r}: {b}" for r, b in enumerate(bound)))
            raise


@dataclass
class NodeBoundTorchConfig(TorchConfig):
    """Ray Train's TorchConfig, whose workers first bind gloo to their node's Ray address."""

    @property
    def backend_cls(self):
        return _NodeBoundBackend
