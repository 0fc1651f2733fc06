"""TPU slices by name ("v4-32", "v5e-16", "v6e-16"): chips, hosts, topology, Ray's accelerator type.

Plain arithmetic on Cloud TPU's naming, so a bad slice fails when the config is read, before Ray
is asked for anything. The number in a v4 / v5p name counts TensorCores (two per chip); in a
v5e (v5litepod) / v6e name it counts chips. Hosts have 4 chips, except v5e / v6e slices of up to
8 chips, which are one host. `cluster/` turns a slice into Ray Train's TPU `ScalingConfig`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# generation -> (Ray's accelerator type, cores per chip, topology rank)
_GENERATIONS = {
    "v4": ("TPU-V4", 2, 3),
    "v5p": ("TPU-V5P", 2, 3),
    "v5e": ("TPU-V5LITEPOD", 1, 2),
    "v5litepod": ("TPU-V5LITEPOD", 1, 2),
    "v6e": ("TPU-V6E", 1, 2),
}
_NAME = re.compile(r"^(v4|v5p|v5e|v5litepod|v6e)-(\d+)$")
_SINGLE_HOST_2D = 8  # v5e / v6e slices up to this many chips are one host
CHIPS_PER_HOST = 4


@dataclass(frozen=True)
class TpuSlice:
    name: str
    accelerator_type: str  # Ray's, e.g. "TPU-V4"
    chips: int
    topology: str  # e.g. "2x2x4"

    @property
    def hosts(self) -> int:
        """One Ray worker per host."""
        return 1 if self.chips <= self.chips_per_host else self.chips // CHIPS_PER_HOST

    @property
    def chips_per_host(self) -> int:
        single_host = self.accelerator_type in ("TPU-V5LITEPOD", "TPU-V6E") and self.chips <= _SINGLE_HOST_2D
        return self.chips if single_host else min(self.chips, CHIPS_PER_HOST)


def tpu_slice(name: str, topology: str | None = None) -> TpuSlice:
    """The slice `name` (e.g. "v4-32"), with its usual topology unless `topology` is given."""
    match = _NAME.match(name.strip().lower())
    if not match:
        raise ValueError(
            f"TPU slice {name!r}: expected GENERATION-SIZE with GENERATION one of {', '.join(_GENERATIONS)}, "
            "e.g. v4-32, v5e-16, v6e-16"
        )
    generation, size = match.group(1), int(match.group(2))
    accelerator, cores_per_chip, rank = _GENERATIONS[generation]
    chips = size // cores_per_chip
    smallest = 4 if rank == 3 else 1
    if size % cores_per_chip or chips < smallest or chips & (chips - 1):
        per = "TensorCores (2 per chip)" if cores_per_chip == 2 else "chips"
        raise ValueError(
            f"TPU slice {name!r}: the size counts {per} and must give a power-of-two number of chips "
            f"(at least {smallest}), e.g. {generation}-{smallest * cores_per_chip * 4}"
        )
    if topology is None:
        topology = default_topology(chips, rank)
    else:
        dims = topology.lower().split("x")
        if len(dims) != rank or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ValueError(
                f"TPU topology {topology!r}: expected {rank} dimensions like {default_topology(chips, rank)}"
            )
        if math.prod(int(d) for d in dims) != chips:
            raise ValueError(
                f"TPU topology {topology!r} has {math.prod(int(d) for d in dims)} chips, but {name} has {chips}"
            )
        topology = topology.lower()
    return TpuSlice(name=f"{generation}-{size}", accelerator_type=accelerator, chips=chips, topology=topology)


def default_topology(chips: int, rank: int) -> str:
    """Cloud TPU's usual shape for a slice: as square (2D) or cube-like (3D) as powers of two allow,
    e.g. 16 chips -> 4x4 or 2x2x4, 32 -> 4x8 or 2x4x4."""
    dims = [1, 1] if rank == 2 else [2, 2, 1]
    while math.prod(dims) < chips:
        smallest = min(dims)
        grow = max(i for i, d in enumerate(dims) if d == smallest)  # the rightmost smallest
        dims[grow] *= 2
    return "x".join(str(d) for d in dims)
