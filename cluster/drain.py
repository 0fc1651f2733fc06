"""Ray's drain notices: the cluster saying it will take a node away, and when.

KubeRay and Ray's autoscaler drain a node before they remove it (a spot or pre-emptible instance
reclaimed, a scale-down), and `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds N` does the same by hand. A draining node takes no new work and is
killed at its deadline. A run whose worker sits on such a node would otherwise lose everything
since its last checkpoint and count a failure.

`drain_watch` gives rank 0 a check (run at the loop's pre-emption check steps, see
`vitray.trainers.preemption`) of whether any rank's node is draining; the workers then checkpoint
and stop, and the driver (`cluster/pretrain.py`) starts a new worker group, which Ray places away
from the draining node, resuming from that checkpoint. The draining nodes come from the GCS
(`get_draining_nodes`, the call Ray Serve's controller makes to move replicas off them, and Ray
Train's own pre-emption watcher polls).

Why a private Ray call (checked against Ray 2.60): Ray has no public API that lists draining nodes
and their deadlines to any process. `ray.util.state.list_nodes()` / `ray.nodes()` say ALIVE or
DEAD only; `ray.train.get_preemption_info()` (public, alpha) gives a worker the same drain notice
but is a collective that every rank must call at the same steps, while vitray asks on rank 0 only
(`PreemptionWatch` reads the stop file there first), and the driver -- which must know whether its
own node is draining -- is no Train worker at all. Ray Train's watcher reads this same accessor
(`ray._private.state.state.get_draining_nodes`), so it lives as long as that public API does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray
import torch.distributed as dist

from vitray.runfolder.files import RunFiles

# A drain without a deadline ("0" in the GCS) still means the node is going: stop as for a
# pre-emption notice with this much time.
NO_DEADLINE_GRACE_S = 300.0


def draining_nodes() -> dict[str, float]:
    """Node id (hex) -> drain deadline (epoch seconds) of every node Ray is draining now."""
    # Private: no public Ray API lists draining nodes (see the module docstring); this is the
    # accessor Ray Train's PreemptionWatcher (behind ray.train.get_preemption_info) polls.
    from ray._private.state import state as ray_global_state

    now = time.time()
    draining = ray_global_state.get_draining_nodes()
    return {node: (ms / 1000 if ms else now + NO_DEADLINE_GRACE_S) for node, ms in draining.items()}


def current_node() -> str:
    return ray.get_runtime_context().get_node_id()


def drain_watch(world_size: int) -> Callable[[], tuple[str, float] | None]:
    """Built in every worker of a group (collective: the ranks exchange their node ids); the
    returned check, called on rank 0, gives (reason, deadline) when a rank's node is draining."""
    nodes: list[str | None] = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(nodes, current_node())
    else:
        nodes = [current_node()]

    def notice() -> tuple[str, float] | None:
        try:
            draining = draining_nodes()
        except Exception:
            return None
        hit = sorted({node for node in nodes if node in draining})
        if not hit:
            return None
        ranks = [rank for rank, node in enumerate(nodes) if node in draining]
        deadline = min(draining[node] for node in hit)
        names = ", ".join(node[:12] for node in hit)
        return f"Ray is draining node {names} (ranks {ranks}; deadline in {deadline - time.time():.0f} s)", deadline

    return notice


def stopped_for_drain(folder: str) -> str | None:
    """On the driver, after the workers stopped: the reason they gave when they stopped for a node
    drain, else None."""
    notice = RunFiles(folder).read_stop()
    return notice["reason"] if notice and notice.get("kind") == "drain" else None
