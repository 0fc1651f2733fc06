"""The few small collectives the loop and its components use (metric averages, "every rank done?").

Each is a no-op without a process group (tests, one process), so components can call them freely.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def all_reduce(values: list[float], average: list[bool], device) -> list[float]:
    """Sums `values` over the ranks; those flagged in `average` are divided by the world size."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device(device))
    dist.all_reduce(tensor)
    world = dist.get_world_size()
    return [v / world if avg else v for v, avg in zip(tensor.tolist(), average)]


def broadcast_int(value: int, device) -> int:
    """Rank 0's `value` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=collective_device(device))
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def broadcast_json(value: Any, device) -> Any:
    """Rank 0's JSON-able `value` on every rank (other ranks pass anything, e.g. None)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    data = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    size = broadcast_int(len(data), device)
    tensor = torch.zeros(size, dtype=torch.uint8, device=collective_device(device))
    if dist.get_rank() == 0:
        tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(tensor, src=0)
    return json.loads(bytes(tensor.cpu().tolist()).decode())


def union_of_names(names: list[str]) -> list[str]:
    """The sorted union of every rank's `names` (a rare, small exchange: object gather)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return sorted(set(names))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    return sorted({name for rank_names in gathered for name in rank_names})


def collective_device(device):
    """NCCL reduces GPU tensors; gloo reduces CPU ones (also in an XLA worker, whose process group is gloo)."""
    return device if dist.get_backend() == "nccl" else "cpu"
