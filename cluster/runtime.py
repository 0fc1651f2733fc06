"""Connecting to Ray and handing it vitray's storage.

With no address an embedded local Ray instance starts; with one, the driver connects. Clusters
started by `ray start --head` use token authentication: the token is read from
`~/.ray/auth_token` (or RAY_AUTH_TOKEN) by Ray itself once RAY_AUTH_MODE=token is set, which
`connect` does when it finds the token file.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from pathlib import Path

from vitray import storage

AUTH_TOKEN_FILE = Path.home() / ".ray" / "auth_token"

# Whether this process's Ray is a private instance `connect` started (one node, no autoscaler).
_started_local = False


# How long `connect` waits for a cluster's address to accept a connection before saying so.
REACH_TIMEOUT_S = 5


class RayUnavailable(RuntimeError):
    """Ray could not be started or joined; the message is one line naming the address (or the
    local start), the cause and what to do."""


class RayLost(RuntimeError):
    """Ray's GCS or this node's raylet stopped answering under running work (killed, out of memory,
    its node gone): the workers are gone with it. The message is one line: what stopped answering
    and that the same command resumes the work."""


class NotEnoughResources(ValueError):
    """The work asks for more than the local Ray instance has, so it would wait forever."""


def enable_token_auth_if_available() -> None:
    """Use the cluster token when there is one (where Ray looks for it: RAY_AUTH_TOKEN, the file
    RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token); must run before `ray` is first imported."""
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or AUTH_TOKEN_FILE)
    if "RAY_AUTH_MODE" not in os.environ and (os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file()):
        os.environ["RAY_AUTH_MODE"] = "token"


# Seconds between Ray Train controller polls of the workers (`connect`); Ray's default is 2.
TRAIN_POLL_INTERVAL_S = 0.5


def connect(address: str | None, *, num_cpus: int | None = None, verbose: bool = False) -> None:
    """Start or join Ray once per process.

    With no address, a process that Ray started as a job entrypoint (RAY_ADDRESS set to the
    cluster's GCS by the job supervisor) joins that cluster; anything else gets a private local
    instance.
    """
    address = _cluster_address(address)
    if address:
        enable_token_auth_if_available()  # before Ray is imported: it reads the auth mode once
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    # Ray Train's controller looks at its workers every 2 s by default: a run's start, its end and
    # each checkpoint report wait for that poll (about 2 s of every run). Ray Train passes this
    # setting on to the controller wherever it runs; an explicit value in the environment wins.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(TRAIN_POLL_INTERVAL_S))
    # Ray Train starts a pre-emption watcher actor for every run, which polls the GCS for the
    # drain notices behind `ray.train.get_preemption_info()`. vitray does not call that (the
    # workers read the notices themselves, see `vitray.cluster.drain`), and Ray Train's own
    # failure handling tells a pre-empted worker from its actor's death cause, not from the
    # watcher: the actor is a process's start-up and a poll every 5 s for nothing.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    global _started_local
    if address:
        _check_address_answers(address)
        try:
            ray.init(address=address, log_to_driver=verbose)
        except Exception as error:
            raise RayUnavailable(
                f"could not join the Ray cluster at {address} ({_cause(error)}): check that it is up (`ray status` on "
                "its head node) and that cluster.address / --address names its GCS (HOST:6379) or client (ray://HOST:10001)"
            ) from error
    else:
        # A new raylet starts one idle Python worker per CPU for the first driver, for tasks to come.
        # A run has none: Ray Train's actors each get a worker of their own (their runtime
        # environment differs), and the idle ones sit unused to the end, ~0.6 CPU-s each to start.
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
        _start_local(num_cpus, verbose)
        _started_local = True
    _lifeline.record()


# What Ray raises when the new raylet has not registered with the GCS within the 30 s that
# ray/_private/node.py allows it (a constant there, no setting).
_REGISTRATION_TIMED_OUT = "timed out during startup"


def _start_local(num_cpus: int | None, verbose: bool) -> None:
    """Start the private instance; once more if Ray gave up waiting for its raylet to register.

    On a machine whose CPUs are busy with other work (another job's start, a neighbour's build) a
    raylet can take longer than Ray's fixed 30 s to register, and the start fails although nothing
    is wrong; a second start, the first one's processes stopped, almost always makes it."""
    import ray

    for attempt in (1, 2):
        try:
            # address="local" always starts a private instance, never joins a `ray start` cluster by accident.
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=verbose,
                logging_level="info" if verbose else "warning",
            )
            return
        except Exception as error:
            if attempt == 1 and _REGISTRATION_TIMED_OUT in str(error):
                stopped = _stop_own_ray_processes()
                print(
                    f"vitray: the local Ray instance did not start within Ray's 30 s ({_cause(error)}); "
                    f"starting it again ({stopped} leftover Ray processes stopped)",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            raise RayUnavailable(
                f"the local Ray instance did not start ({_cause(error)}): check free memory and space in /tmp, stop "
                "leftover Ray processes (`ray stop`), then retry; --verbose shows Ray's own logs"
            ) from error


def _stop_own_ray_processes() -> int:
    """SIGKILL what a failed local start left running -- this process's own descendants that run
    Ray's binaries, scripts or workers, never another Ray on the machine -- and wait for them.
    Returns how many there were."""
    import psutil
    import ray

    ray_dir = os.path.dirname(ray.__file__)
    leftovers = []
    for process in psutil.Process().children(recursive=True):
        try:
            command = process.cmdline()
            if process.name().startswith("ray::") or any(part.startswith(ray_dir) for part in command[:4]):
                leftovers.append(process)
        except psutil.Error:
            continue  # already gone
    for process in leftovers:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(leftovers, timeout=10)
    return len(leftovers)


class _Lifeline:
    """The Ray processes this driver cannot go on without -- the cluster's GCS and this node's
    raylet -- by address, probed with a TCP connect (:func:`check_ray_alive`).

    Why vitray watches them itself: when the GCS goes, Ray's core worker in this process retries
    for 60 s in silence and then ends the process (exit 1, a line of Ray's own about its log
    files); when the raylet goes, sooner. Work that notices first (a run's `fit`, an evaluation
    grid's loop) ends its attempt record, releases its lease and says what happened in one line."""

    # A raylet refusing connections this long is gone (it does not come back; Ray ends the process
    # soon after). A GCS may come back (GCS fault tolerance restarts it, KubeRay with Redis), and
    # Ray waits for it for gcs_rpc_server_reconnect_timeout_s (60 s): it is given a third of that,
    # which leaves the rest for the driver to close its attempt and lease before Ray ends it.
    RAYLET_LOST_AFTER_S = 3.0
    PROBE_EVERY_S = 1.0

    def __init__(self):
        self.addresses: dict[str, tuple[str, int]] = {}
        self.lost_after: dict[str, float] = {}
        self._refused_since: dict[str, float] = {}  # address -> when it first refused, of the current streak
        self._probed = 0.0

    @staticmethod
    def gcs_lost_after_s() -> float:
        ray_waits = float(os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", 60))  # noqa: SIM112 (Ray's name)
        return max(_Lifeline.RAYLET_LOST_AFTER_S, ray_waits / 3)

    def record(self) -> None:
        import ray

        try:  # a Ray Client connection (ray://) has no GCS or raylet address of its own here
            context = ray.get_runtime_context()
            host, _, port = context.gcs_address.rpartition(":")
            gcs = f"the Ray GCS at {context.gcs_address}"
            self.addresses = {gcs: (host, int(port))}
            self.lost_after = {gcs: self.gcs_lost_after_s()}
            node_id = context.get_node_id()
            for node in ray.nodes():
                if node.get("NodeID") == node_id:
                    raylet = (node["NodeManagerAddress"], int(node["NodeManagerPort"]))
                    what = f"this node's raylet at {raylet[0]}:{raylet[1]}"
                    self.addresses[what] = raylet
                    self.lost_after[what] = self.RAYLET_LOST_AFTER_S
        except Exception:
            self.addresses = {}

    def lost(self) -> str | None:
        now = time.monotonic()
        if not self.addresses or now - self._probed < self.PROBE_EVERY_S:
            return None
        self._probed = now
        for what, address in self.addresses.items():
            try:
                socket.create_connection(address, timeout=self.PROBE_EVERY_S).close()
                self._refused_since.pop(what, None)
            except OSError:
                since = self._refused_since.setdefault(what, now)
                if now - since >= self.lost_after[what]:
                    return what
        return None


_lifeline = _Lifeline()


def check_ray_alive(doing: str) -> None:
    """Raise RayLost once Ray's GCS or this node's raylet has stopped answering (probed at most once
    a second; cheap to call in a wait loop). `doing` ends the message's first part: "the run"."""
    what = _lifeline.lost()
    if what is not None:
        raise RayLost(
            f"Ray went away under {doing}: {what} no longer answers (stopped, killed or out of memory) and the "
            "workers are gone with it; start the same command again to resume"
        )


def _cause(error: BaseException) -> str:
    text = " ".join(str(error).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _cluster_address(address: str | None) -> str | None:
    """The cluster a process joins: `address`, else the GCS that Ray's job supervisor put in
    RAY_ADDRESS (a job entrypoint), else None (a private local instance)."""
    if not address and os.environ.get("RAY_ADDRESS", "").split("://")[0] not in ("", "http", "https"):
        return os.environ["RAY_ADDRESS"]
    return address


def check_cluster_answers(address: str | None) -> None:
    """RayUnavailable at once when the cluster that :func:`connect` would join does not answer
    (nothing to check for a local instance): a command asks this before it writes anything."""
    address = _cluster_address(address)
    if address:
        _check_address_answers(address)


def _check_address_answers(address: str) -> None:
    """A cluster address whose port does not answer fails here within seconds: `ray.init` would
    retry in silence for minutes. "auto" (the address of a `ray start` on this machine) is left to Ray."""
    target = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = target.rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as error:
        why = "timed out" if isinstance(error, TimeoutError) else (error.strerror or type(error).__name__)
        raise RayUnavailable(
            f"no Ray cluster answers at {address} ({why} after at most {REACH_TIMEOUT_S} s): start it (`ray start --head`, "
            "or `ray up`) or fix cluster.address / --address / RAY_ADDRESS"
        ) from None


def check_local_resources(workers: int, per_worker: dict[str, float], settings: dict[str, str]) -> None:
    """Fail at once when `workers` x `per_worker` exceeds the private local instance.

    A cluster may grow (its autoscaler adds nodes), so there Ray Train waits for resources; the
    local instance never grows, and Ray Train would retry placing the workers forever in silence.
    `settings` names the config keys behind each resource, for the message.
    """
    if not _started_local:
        return
    import ray

    have = ray.cluster_resources()
    missing = {
        name: amount * workers for name, amount in per_worker.items() if amount and amount * workers > have.get(name, 0)
    }
    if missing:
        asked = "; ".join(
            f"{need:g} {name} ({settings.get(name, f'cluster.resources_per_worker[{name}]')} x {workers} workers) but it has "
            f"{have.get(name, 0):g}"
            for name, need in missing.items()
        )
        raise NotEnoughResources(
            f"the local Ray instance this command started (this machine) cannot place the workers: the run "
            f"needs {asked}. Lower cluster.num_workers or the per-worker resources, or set cluster.address to a "
            f"cluster that has them"
        )


class LocalPathsOnCluster(ValueError):
    """Local paths given for a run on a cluster of several nodes (see `check_paths_reach_every_node`)."""


def node_resources() -> list[dict[str, float]]:
    """The resources of each live node of the Ray cluster this process is connected to."""
    import ray

    return [dict(node.get("Resources", {})) for node in ray.nodes() if node.get("Alive")]


def check_paths_reach_every_node(paths: dict[str, str | None], *, shared_filesystem: bool) -> None:
    """Refuse local paths when the connected Ray cluster has more than one node, unless the user
    says they are on a shared filesystem: workers on other nodes would read and write their own
    disks (checkpoints scattered over the nodes, data missing). `paths` maps config keys to values.

    An autoscaling cluster that has only its head node when the run starts is not caught here."""
    local = {key: value for key, value in paths.items() if value and not storage.is_remote(value)}
    if not local or shared_filesystem or _started_local:
        return
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) > 1:
        listed = ", ".join(f"{key}={value}" for key, value in local.items())
        raise LocalPathsOnCluster(
            f"{listed}: local paths, but the Ray cluster has {len(nodes)} nodes, each with its own disk: workers on "
            "other nodes would not find the data and would write checkpoints a resume cannot find. Use object "
            "storage (s3://bucket/prefix) or, if these paths are on a filesystem every node mounts at the same "
            "place (NFS, Lustre), set cluster.shared_filesystem=true"
        )


def ray_storage(storage_path: str, outage_s: float | None = None):
    """(storage_path, storage_filesystem) for Ray Train's RunConfig.

    Remote storage goes through the same fsspec filesystem vitray uses everywhere (s3fs, so any
    S3-compatible endpoint from the AWS environment works), wrapped for pyarrow, each call riding
    out an outage of up to `outage_s` (run.storage_outage_s) as vitray's own calls do: Ray Train's
    controller writes its list of the run's checkpoints through it after each one, and a store down
    then failed the run.
    """
    if not storage.is_remote(storage_path):
        return os.path.abspath(storage_path), None
    import pyarrow.fs

    from vitray.cluster.ray_filesystem import RidingOutHandler

    fs, path = storage.filesystem(storage_path)
    return path, pyarrow.fs.PyFileSystem(RidingOutHandler(fs, outage_s))
