"""Shared fixtures: an S3 store on this machine (SeaweedFS, a real one) and a small prepared dataset."""

from __future__ import annotations

import importlib.util
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from ports import free_port
from seaweed import SeaweedS3

pytest_plugins = ["timeline"]

# One OpenMP thread in every test process and what it starts (the drivers of end-to-end runs; Ray
# gives its one-CPU workers one already), set before any of them imports torch. The suite runs two
# pytest workers on CI's two cores: torch's default of a thread per core put four busy threads on
# two cores, and OpenMP's waiting threads spin. Measured on two cores: the in-process training
# modules (test_checkpointer, test_trainer_parts, test_masked_patch) took 114-119 s and 180-187
# CPU-s with the default, 74-76 s and 104-106 CPU-s with one thread. (Tiny models: a second thread
# hardly speeds their steps on any machine.)
os.environ.setdefault("OMP_NUM_THREADS", "1")


# The modules that start the most runs, costliest first (their minutes on a CI worker, from
# `python tests/timeline.py FILE`): collected first, they are handed out first by pytest-xdist
# (`make test` passes --no-loadscope-reorder, which keeps the collection's order instead of putting
# the modules with the most tests first), so that both workers end on short modules together.
COSTLIEST_FIRST = (
    "test_faults_pretrain",
    "test_zero_stages",
    "test_xla",
    "test_nonfinite",
    "test_multinode",
    "test_evaluate",
    "test_recipes",
    "test_pretrain",
    "test_faults_s3",
    "test_step_overhead",
    "test_feed",
    "test_pretrain_s3",
    "test_drain",
    "test_masked_patch",
    "test_finetune",
    "test_trainer_parts",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The costliest modules first (COSTLIEST_FIRST), the rest in their own order. `xla` tests need
    torch-xla (the `xla` extra, which `make install` includes): skipped where it is not installed."""
    rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's tests keep their order
    if importlib.util.find_spec("torch_xla") is not None:
        return
    skip = pytest.mark.skip(reason="needs torch-xla: pip install -e '.[xla]' (make install does)")
    for item in items:
        if "xla" in item.keywords:
            item.add_marker(skip)


AWS_TEST_ENV = {"AWS_DEFAULT_REGION": "us-east-1"}
# Variables that would point the clients at real accounts or another endpoint.
AWS_CLEARED_ENV = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_ENDPOINT_URL_S3",
)


@dataclass(frozen=True)
class S3Endpoint:
    """An S3 server on 127.0.0.1 (SeaweedFS) with one empty bucket; the AWS env vars point at it."""

    endpoint_url: str
    bucket: str
    key: str
    secret: str

    def url(self, *parts: str) -> str:
        """``s3://BUCKET/part/...``"""
        return "/".join([f"s3://{self.bucket}", *parts])

    @property
    def storage_options(self) -> dict:
        """Explicit fsspec options, for code that does not read the environment."""
        return {"endpoint_url": self.endpoint_url, "key": self.key, "secret": self.secret}


def _clear_s3fs_cache() -> None:
    # s3fs caches filesystem instances by their options, not by the environment they read.
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def seaweed_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """One SeaweedFS store (tests/seaweed.py) for this test session (each pytest-xdist worker is a
    session of its own), started on free ports the first time a test needs it (~15 s) and killed
    by its pid at the session's end, also when tests failed; its data goes with it."""
    folder = tmp_path_factory.mktemp("seaweed")
    store = SeaweedS3(folder)
    try:
        store.start()
        yield store
    finally:
        store.stop()
        shutil.rmtree(folder / "data", ignore_errors=True)


@contextmanager
def seaweed_bucket(env: pytest.MonkeyPatch, store: SeaweedS3, bucket: str, **extra_env: str) -> Iterator[S3Endpoint]:
    """A new bucket `bucket` on `store`, with the AWS_* variables (and `extra_env`) pointing at it
    through `env` (restored when its owner undoes it)."""
    endpoint = S3Endpoint(store.endpoint_url, bucket, store.access_key, store.secret_key)
    for name in AWS_CLEARED_ENV:
        env.delenv(name, raising=False)
    credentials = {"AWS_ACCESS_KEY_ID": store.access_key, "AWS_SECRET_ACCESS_KEY": store.secret_key}
    for name, value in {**AWS_TEST_ENV, **credentials, "AWS_ENDPOINT_URL": store.endpoint_url, **extra_env}.items():
        env.setenv(name, value)
    _clear_s3fs_cache()
    try:
        store.client().create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        _clear_s3fs_cache()


@pytest.fixture
def seaweed_s3(seaweed_store: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Endpoint]:
    """The session's SeaweedFS store with a fresh bucket for this test and the AWS environment
    pointing at it (restored after the test)."""
    with seaweed_bucket(monkeypatch, seaweed_store, f"vitray-test-{uuid.uuid4().hex[:8]}") as endpoint:
        yield endpoint


DIGITS_SAMPLES_PER_SHARD = 100


@pytest.fixture(scope="session")
def digits_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``builtin:digits`` prepared once per session (100 samples per shard): 1,437 train and 360
    test samples, 10 classes, 8x8 grayscale PNGs. Treat it as read-only."""
    from vitray.data import prepare_dataset

    return built_once(
        tmp_path_factory,
        "digits",
        lambda dest: prepare_dataset("builtin:digits", str(dest), samples_per_shard=DIGITS_SAMPLES_PER_SHARD),
    )


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder `name`, filled by `build(folder)` once in the whole test run, for a session
    fixture that is costly (a real pre-training run) or that others' results point at.

    On pytest-xdist every worker is a session of its own and would build each session fixture
    again (one more reference run per worker): the workers share the folder above their own temp
    folders, and the first to need `name` builds it under a file lock while another waits for it.
    Only a finished build is reused (one that failed is removed and built again)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, finished = shared / name, shared / f"{name}.built"
    with FileLock(shared / f"{name}.lock"):
        if not finished.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            finished.touch()
    return folder


@pytest.fixture(scope="session", autouse=True)
def _private_temp_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The temp folders of code running in the test process (checkpoint shares staged by
    in-process loops, whose stand-in reporters never upload them; local metrics copies) go to a
    folder of this session's, removed at its end. Never a cleanup of the machine's /tmp: other
    jobs there (a real run, a benchmark, another test session) have vitray-* folders of their own."""
    import multiprocessing.util
    import tempfile

    tmp_path_factory.getbasetemp()  # pytest's own folders stay where they are (failed tests' are kept)
    # multiprocessing's own temp folder (forkserver sockets) too: it removes it at exit, after this
    # fixture (removing it here made that exit print a FileNotFoundError traceback).
    multiprocessing.util.get_temp_dir()
    private = tempfile.mkdtemp(prefix="vt-")
    saved, tempfile.tempdir = tempfile.tempdir, private
    try:
        yield
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(private, ignore_errors=True)


def _put_ray_auth_back_in_step() -> str | None:
    """How `RAY_AUTH_MODE` and Ray's own auth mode in this process disagreed, if they did; the
    variable is then set back to Ray's mode, so that only the test that left it so fails.

    Ray reads the mode into its config once, at import; a local `ray.init` that switches token auth
    on sets both. vitray switches it on in its environment only, before Ray is imported (in its own
    process). Done in the test process, every later local Ray instance of the worker would start its
    GCS with token auth, and this process's Ray client, still without it, is refused by it."""
    import sys

    if "ray._raylet" not in sys.modules:
        return None  # Ray, once imported, reads the variable as it is then
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    variable, active = os.environ.get("RAY_AUTH_MODE"), is_token_auth_enabled()
    if (str(variable).lower() == "token") == active:
        return None
    if active:
        os.environ["RAY_AUTH_MODE"] = "token"
    else:
        os.environ.pop("RAY_AUTH_MODE", None)
    return f"RAY_AUTH_MODE={variable!r}, Ray's own mode token={active}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A test that leaves RAY_AUTH_MODE out of step with Ray's own auth mode in the test process
    fails (checked once its fixtures, monkeypatch too, are undone)."""
    result = yield
    disagreement = _put_ray_auth_back_in_step()
    if disagreement:
        raise AssertionError(f"{item.nodeid} left {disagreement} in the test process (see tests/conftest.py)")
    return result


@pytest.fixture(autouse=True)
def _no_instance_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep botocore from probing the cloud instance-metadata address for credentials."""
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(scope="session")
def process_group() -> Iterator[None]:
    """A one-rank gloo process group for running the training loop in the test process.

    One per session: DeepSpeed caches its groups globally, so an engine built after the group was
    destroyed and re-created would find stale ones.
    """
    import torch.distributed as dist

    init_one_rank_group()
    yield
    dist.destroy_process_group()


def init_one_rank_group() -> None:
    """A one-rank gloo process group on a free port of 127.0.0.1, in this process (`process_group`,
    and tests that train in a process of their own)."""
    import torch.distributed as dist

    # The port is free when picked and bound only later, by the group's store: a server another
    # test worker starts meanwhile (Ray, SeaweedFS) can take it, so a taken port means another try.
    for attempt in range(5):
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
        try:
            dist.init_process_group("gloo", rank=0, world_size=1)
            return
        except dist.DistNetworkError as error:
            if "EADDRINUSE" not in str(error) or attempt == 4:
                raise


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """One torch thread for the module's tests (tiny models; avoids OpenMP contention)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def pretrained(digits_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Ti/4 of 2 blocks (pretrain_helpers.BASE) pre-trained at 16 px on digits (2 Ray workers, 8
    steps, checkpoints at steps 4 and 8);
    returns the run folder. Treat it as read-only (copy it to change it)."""
    from pretrain_helpers import pretrain_args, run

    storage = built_once(
        tmp_path_factory,
        "pretrain",
        lambda storage: run(
            pretrain_args(str(digits_dataset), str(storage), "pre", "train.steps=8", "checkpoint.every=4")
        ),
    )
    return str(storage / "pre")


@pytest.fixture(scope="session")
def reference_run(digits_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run of `pretrain_helpers.REFERENCE` (checkpoints every 10 steps, the val
    evaluator and the few-shot probe at the last step, the keys of every step's samples recorded),
    shared by the modules whose stopped, killed or resumed runs must end with its weights and
    samples: ``{"run_dir", "weights", "keys", "stdout", "stderr"}`` (what the command printed). Treat it as
    read-only."""
    from pretrain_helpers import REFERENCE, REFERENCE_NAME, REFERENCE_STEPS, final_weights, pretrain_args, run

    from vitray.trainers.keys import collect_keys

    def build(root: Path) -> None:
        done = run(
            pretrain_args(
                str(digits_dataset),
                str(root / "runs"),
                REFERENCE_NAME,
                *REFERENCE,
                "checkpoint.every=10",
                # The train split: 718 samples a rank, read by evaluation workers (started from
                # their forkserver inside the Ray worker); the test split's 180 are read in process.
                f"evals.val={{type: val, every: {REFERENCE_STEPS}, split: train}}",
                f"evals.fewshot={{type: fewshot, every: {REFERENCE_STEPS}, datasets: {{digits: {digits_dataset}}}}}",
                f"debug.record_sample_keys={root / 'keys'}",
            )
        )
        # what `vitray pretrain` printed (progress on stdout, its messages on stderr), for its tests
        (root / "stdout.txt").write_text(done.stdout)
        (root / "stderr.txt").write_text(done.stderr)

    root = built_once(tmp_path_factory, "reference", build)
    keys = root / "keys"
    run_dir = str(root / "runs" / REFERENCE_NAME)
    printed = {name: (root / f"{name}.txt").read_text() for name in ("stdout", "stderr")}
    return {"run_dir": run_dir, "weights": final_weights(run_dir), "keys": collect_keys(keys), **printed}
