"""Free TCP ports of 127.0.0.1 for the servers the tests start (Ray, SeaweedFS, the S3 proxy)."""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports (held open together while picked, so none repeats)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def free_port() -> int:
    (port,) = free_ports(1)
    return port
