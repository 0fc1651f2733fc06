"""Flaky object storage: a real S3 store (SeaweedFS) behind a proxy that answers a share of the requests with
503 SlowDown, 500 InternalError, a dropped connection (for object GETs: cut off mid-body) or a
slow answer (`tests/s3_proxy.py`), on a seeded schedule.

Everything vitray reads and writes on S3 must come through unchanged: prepared shards, the
samples read back, a results table, small run files -- and a whole pre-training run with its
data and checkpoints on S3 ends with the weights of a run on local disk. Storage calls of a run
(the stop-file check, checkpoint uploads, opening shards, evaluations) wait for a store that went away
(`run.storage_outage_s`); a whole run riding out a store cut off for 45 s is `test_multinode.py`'s.
"""

from __future__ import annotations

import contextlib
import json
import re
import time

import pytest
import torch
from pretrain_helpers import (
    REFERENCE,
    REFERENCE_NAME,
    REFERENCE_STEPS,
    assert_same_weights,
    pretrain_args,
    run,
)
from s3_proxy import FlakyS3Proxy
from safetensors.torch import load

from vitray import storage
from vitray.data import EvalLoader, prepare_dataset
from vitray.runfolder.checkpoint_folders import latest_complete_checkpoint
from vitray.trainers.checkpoint import rank_files


@pytest.fixture
def flaky_s3(seaweed_s3, monkeypatch):
    """The store's endpoint, with the AWS environment pointed at a fault-injecting proxy in front."""
    import s3fs

    proxy = FlakyS3Proxy(seaweed_s3.endpoint_url, rate=0.15, seed=1, slow_s=0.5).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield seaweed_s3, proxy
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        proxy.stop()


def _faults(proxy: FlakyS3Proxy, operation: str) -> int:
    return sum(n for (fault, op), n in proxy.injected.items() if op == operation)


def _read_all(path: str) -> tuple[list[str], torch.Tensor]:
    batches = list(EvalLoader(path, "train", batch_size=100, img_size=8, num_workers=0))
    return [k for b in batches for k in b.keys], torch.cat([b.images for b in batches])


def test_shards_run_files_and_results_come_through_a_flaky_store_unchanged(flaky_s3, digits_dataset, tmp_path):
    store, proxy = flaky_s3
    remote = store.url("datasets", "digits")
    prepare_dataset("builtin:digits", remote, samples_per_shard=100)  # uploads through the proxy
    keys, images = _read_all(remote)
    local_keys, local_images = _read_all(str(digits_dataset))
    assert keys == local_keys and torch.equal(images, local_images)

    for i in range(20):  # small run files (stop notices, leases, metrics parts) written and read back
        path = store.url("runs", "r", f"file-{i}.json")
        storage.write_bytes_atomic(path, f"payload {i}".encode() * 100)
        assert storage.read_bytes(path) == f"payload {i}".encode() * 100

    from vitray.evaluation.results import Cell, ResultsTable

    table = ResultsTable(store.url("results", "grid"))
    cells = [Cell("ckpt", f"bench{i}", "fewshot", {"shots": 10}, seed=i) for i in range(12)]
    for i, cell in enumerate(cells):
        table.append(cell.ok({"accuracy": i / 10}, 1.0))
    assert table.finished_cell_ids() == {c.cell_id for c in cells}
    assert sorted(table.to_pandas()["value"].tolist()) == [i / 10 for i in range(12)]

    assert _faults(proxy, "get-object") > 0 and _faults(proxy, "upload") > 0, proxy.injected
    assert {fault for fault, _ in proxy.injected} == {"slowdown", "error", "reset", "slow"}, proxy.injected


@pytest.mark.slow
def test_a_pretraining_run_on_a_flaky_store_ends_with_the_clean_runs_weights(flaky_s3, reference_run):
    """The run of `reference_run` (on local disk, shared with the other fault tests) again, with its
    data and checkpoints on the flaky store: the same weights."""
    store, proxy = flaky_s3
    data = store.url("datasets", "digits")
    prepare_dataset("builtin:digits", data, samples_per_shard=100)
    before = sum(proxy.injected.values())
    run(pretrain_args(data, store.url("runs"), REFERENCE_NAME, *REFERENCE, "checkpoint.every=10"), timeout=600)
    assert sum(proxy.injected.values()) > before + 5, f"too few faults met the run: {proxy.injected}"
    assert _faults(proxy, "upload") > 0 and _faults(proxy, "get-object") > 0, proxy.injected
    latest = latest_complete_checkpoint(store.url("runs", REFERENCE_NAME))
    assert latest is not None and latest.step == REFERENCE_STEPS
    remote_weights = load(storage.read_bytes(f"{latest.path}/model.safetensors"))
    assert_same_weights(remote_weights, reference_run["weights"])


def _until_an_outage_is_ridden_out(timeout: float = 120) -> None:
    """Wait until a call has failed past botocore's and s3fs's own retries (~7 s idle, longer on
    a loaded machine) and ride_out waits for the store: an outage began in this process."""
    deadline = time.monotonic() + timeout
    while storage.retries.outage_since() is None:
        assert time.monotonic() < deadline, f"no call met the outage in {timeout} s"
        time.sleep(0.2)


@contextlib.contextmanager
def _behind_a_cuttable_proxy(seaweed_s3, monkeypatch):
    """The store reached through a proxy the test can cut and restore (`FlakyS3Proxy`, no random
    faults), riding out with waits of at most 0.5 s; the proxy stopped and s3fs's cached clients
    dropped at the end."""
    import s3fs

    proxy = FlakyS3Proxy(seaweed_s3.endpoint_url, rate=0.0).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setattr(storage.retries, "OUTAGE_MAX_DELAY_S", 0.5)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield proxy
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        proxy.stop()


def _finished_only_after_a_cut(seaweed_s3, monkeypatch, call, what: str, join_s: float):
    """`call()` in a thread while the store, behind a proxy, refuses connections: it must meet the
    outage and still be waiting 10 s later (longer than the bounded retries of a listing or of a
    shard's opening, ~4-12 s, would last), then finish within `join_s` once the store is back.
    Returns what it returned."""
    import threading

    done: list = []
    with _behind_a_cuttable_proxy(seaweed_s3, monkeypatch) as proxy:
        proxy.cut()
        caller = threading.Thread(target=lambda: done.append(call()))
        caller.start()
        _until_an_outage_is_ridden_out()
        time.sleep(10)
        assert caller.is_alive() and not done, f"{what} gave up on (or read from) a store that was cut"
        proxy.restore()
        caller.join(join_s)
        (result,) = done
        return result


def test_a_shard_whose_every_read_is_cut_short_fails_naming_the_shard(seaweed_s3, monkeypatch):
    """Retries are bounded: botocore and s3fs repeat a cut-short GET, the reader reopens the shard
    at the sample (aiohttp's payload error counts as transient), each a few times with backoff;
    then the error names the shard, the attempts and the last error."""
    import s3fs

    from vitray.data.reader import ShardCursor

    dataset = seaweed_s3.url("datasets", "digits")
    prepare_dataset("builtin:digits", dataset, samples_per_shard=100)  # no proxy yet
    shard = storage.join(dataset, "train-000000.tar")
    proxy = FlakyS3Proxy(seaweed_s3.endpoint_url, rate=1.0, faults=("reset",), operations=("get-object",)).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setattr(storage.retries, "RETRY_BASE_DELAY_S", 0.05)  # the bound is tested, not the waiting
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(
            OSError, match=rf"shard {shard} failed {storage.retries.RETRY_ATTEMPTS} times; the last error: "
        ):
            cursor = ShardCursor(shard)
            for _ in range(100):
                cursor.read(True)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        proxy.stop()
    assert proxy.injected[("reset", "get-object")] >= storage.retries.RETRY_ATTEMPTS, proxy.injected


def test_a_runs_shard_reader_waits_for_a_store_that_went_away(seaweed_s3, monkeypatch, capsys):
    """A run's reader (`outage_s`: run.storage_outage_s) opening a shard while its store refuses
    connections waits for the store instead of failing after its bounded retries, says so once,
    and then reads the shard whole."""
    from vitray.data.reader import ShardCursor

    dataset = seaweed_s3.url("datasets", "digits")
    prepare_dataset("builtin:digits", dataset, samples_per_shard=100)  # no proxy yet
    shard = storage.join(dataset, "train-000001.tar")
    before = ShardCursor(shard)
    expected = [before.read(True).key for _ in range(100)]
    before.close()

    def open_and_read() -> list[str]:
        cursor = ShardCursor(shard, outage_s=120)
        try:
            return [cursor.read(True).key for _ in range(100)]
        finally:
            cursor.close()

    assert _finished_only_after_a_cut(seaweed_s3, monkeypatch, open_and_read, "the reader", join_s=60) == expected
    said = capsys.readouterr().err
    assert said.count(f"vitray: storage unreachable (opening shard {shard}") == 1, said
    assert said.count("vitray: storage reachable again after") == 1, said


def test_a_runs_evaluators_wait_for_a_store_that_went_away(seaweed_s3, monkeypatch, capsys):
    """A run's evaluators (`Worker.outage_s`: run.storage_outage_s) scoring while the store refuses
    connections -- the val evaluator listing and reading its split, the few-shot probe reading
    labels, dataset info and images -- wait for the store instead of failing the worker, say so
    once, and then score exactly what they score on a store that never went away."""
    from vitray.data.config import DataConfig
    from vitray.evaluation.evaluators import Forward, Worker, build_evaluator
    from vitray.evaluation.evaluators.fewshot import FewshotEvalConfig
    from vitray.evaluation.evaluators.val import ValEvalConfig
    from vitray.models import create_model

    dataset = seaweed_s3.url("datasets", "digits")
    prepare_dataset("builtin:digits", dataset, samples_per_shard=100)  # no proxy yet
    torch.manual_seed(0)
    model = create_model("Ti/4", num_classes=10, img_size=16)
    forward = Forward("cpu", torch.float32, lambda values: values)
    configs = [
        ValEvalConfig(type="val", every=1, path=dataset, split="test", batch_size=128),
        FewshotEvalConfig(type="fewshot", every=1, datasets={"digits": dataset}, shots=[2], batch_size=128),
    ]

    def score(outage_s: float | None) -> list[dict[str, float]]:
        worker = Worker(
            rank=0, world_size=1, img_size=16, data=DataConfig(train=dataset, num_workers=0), outage_s=outage_s
        )
        return [dict(build_evaluator(config, worker).run(model, forward)) for config in configs]

    expected = score(None)
    assert (
        _finished_only_after_a_cut(seaweed_s3, monkeypatch, lambda: score(120), "an evaluator", join_s=120) == expected
    )
    said = capsys.readouterr().err
    assert said.count("vitray: storage unreachable (") == 1, said
    assert said.count("vitray: storage reachable again after") == 1, said


def test_ride_out_waits_for_a_store_that_went_away_and_says_so_once(seaweed_s3, monkeypatch, capsys):
    """`storage.ride_out` against the store behind a proxy that is cut: two threads wait for it (a
    read, and a checkpoint file's upload), the console gets one line as the outage starts and one as
    it ends; with a shorter time than the outage, the call fails naming the setting."""
    import threading

    path = seaweed_s3.url("runs", "r", "vitray", "stop.json")
    storage.write_bytes_atomic(path, b"{}")
    with _behind_a_cuttable_proxy(seaweed_s3, monkeypatch) as proxy:
        storage.read_bytes(path)  # connections open before the cut
        proxy.cut()
        with pytest.raises(OSError, match=r"storage unreachable for 1 s, run.storage_outage_s"):
            storage.ride_out(lambda: storage.read_bytes(path), what="reading the stop file", within_s=1)
        read: list[bytes] = []
        uploaded: list[rank_files.Written] = []
        checkpoint = seaweed_s3.url("runs", "r", "checkpoint_1")
        riders = [
            threading.Thread(
                target=lambda: read.append(storage.ride_out(lambda: storage.read_bytes(path), what="reading"))
            ),
            threading.Thread(
                target=lambda: uploaded.append(rank_files.write_bytes(checkpoint, "weights.bin", b"w" * 999))
            ),
        ]
        for rider in riders:
            rider.start()
        _until_an_outage_is_ridden_out()
        assert not read and not uploaded, "read from or wrote to a store that was cut"
        proxy.restore()
        for rider in riders:
            rider.join(60)
        assert storage.read_bytes(f"{checkpoint}/weights.bin") == b"w" * 999  # uploaded whole once the store came back
    assert read == [b"{}"] and [(w.name, w.size) for w in uploaded] == [("weights.bin", 999)]
    said = capsys.readouterr().err
    # The failed call's outage, then the one both threads rode out: one start and one end line each.
    assert said.count("vitray: storage unreachable (") == 2, said
    assert said.count("retrying for up to 1 s (run.storage_outage_s)") == 1, said
    assert said.count("retrying for up to 300 s (run.storage_outage_s)") == 1, said
    assert said.count("vitray: storage reachable again after") == 1, said


def test_ride_out_counts_the_outage_from_the_start_of_its_first_failed_try(capsys):
    """A try against a cut store takes seconds to fail (botocore's own retries): ride_out's budget and
    its "reachable again after N s" count from when that try began, not from when it failed, so that
    an outage longer than the budget is given up on after the budget and one try, not two tries more."""
    try_s, budget_s = 1.5, 3.0

    def slow_refusal():
        time.sleep(try_s)
        raise ConnectionRefusedError("refused after botocore's retries")

    started = time.monotonic()
    with pytest.raises(OSError, match=r"storage unreachable for 3 s, run.storage_outage_s"):
        storage.ride_out(slow_refusal, what="reading", within_s=budget_s)
    # Tries begin at 0 and at about 2 s, the second failing by 3.75 s, past the budget; counted from
    # the first failure (1.5 s), a third would begin at about 4.5 s and the call give up at about 6 s.
    assert time.monotonic() - started < 4.6

    tries = []

    def refused_once():
        tries.append(time.sleep(try_s))
        if len(tries) == 1:
            raise ConnectionRefusedError("refused")

    capsys.readouterr()
    storage.ride_out(refused_once, what="reading", within_s=budget_s)
    # Both tries and the wait between them (3.25-3.75 s), not the wait and the second try alone (about 2 s).
    said = re.search(r"vitray: storage reachable again after (\d+) s", capsys.readouterr().err)
    assert said and int(said.group(1)) >= 3, said

    # A wait ended by its caller (an aborted upload) ends the outage as this process saw it: the
    # next one is said again, not taken for the same one going on.
    import threading

    for _ in range(2):
        aborted, calls = threading.Event(), []

        def refused_then_aborted():
            if calls:
                aborted.set()  # the caller gave up on it while it waited
            calls.append(1)
            raise ConnectionRefusedError("refused")

        with pytest.raises(ConnectionRefusedError):
            storage.ride_out(refused_then_aborted, what="uploading", within_s=budget_s, stop=aborted)
    assert capsys.readouterr().err.count("vitray: storage unreachable (uploading") == 2


def test_the_stop_file_check_rides_out_a_store_that_went_away(seaweed_s3, process_group, monkeypatch, capsys):
    """Rank 0's check for a stop notice while the run folder's store is cut: it waits for the store
    (botocore's EndpointConnectionError is not the end of the worker) and then reads the notice."""
    import threading

    from vitray.trainers.preemption import PreemptionWatch

    run_dir = seaweed_s3.url("runs", "r")
    decided: list = []
    with _behind_a_cuttable_proxy(seaweed_s3, monkeypatch) as proxy:
        watch = PreemptionWatch(run_dir, rank=0, every=1, device=torch.device("cpu"))
        assert watch.check(1) is None  # no notice: the store answers
        proxy.cut()
        checking = threading.Thread(target=lambda: decided.append(watch.check(2)))
        checking.start()
        _until_an_outage_is_ridden_out()
        assert checking.is_alive() and not decided, decided
        # The driver's notice, written meanwhile straight to the store (not through the cut proxy).
        notice = {
            "reason": "a test's notice",
            "kind": "sigterm",
            "requested": time.time(),
            "deadline": time.time() + 60,
        }
        storage.write_bytes_atomic(watch.path, json.dumps(notice).encode(), seaweed_s3.storage_options)
        proxy.restore()
        checking.join(60)
    assert len(decided) == 1 and decided[0] is not None and decided[0].step == 2 and decided[0].save, decided
    said = capsys.readouterr().err
    assert said.count("vitray: storage unreachable (checking s3://") == 1, said
    assert said.count("vitray: storage reachable again after") == 1, said


def test_a_streamed_uploads_parts_ride_out_a_cut_store_and_an_abort_stops_waiting(seaweed_s3, monkeypatch, capsys):
    """storage.UploadStream's parts go up on threads of their own: when the store is cut in the
    middle of an object, the parts sent after the cut wait for it (run.storage_outage_s), and the
    object appears whole once it is back, its multipart upload closed. An error in the `with` block
    during an outage ends the parts' waits at once: the caller is not kept for the outage budget."""
    import threading

    monkeypatch.setattr(storage.upload_stream, "UPLOAD_PART_BYTES", 5 * 2**20)
    data = bytes(range(256)) * (4096 * 20) + b"end"  # 20 MiB + 3 bytes: 5 parts
    url = seaweed_s3.url("runs", "stream", "cut.bin")
    with _behind_a_cuttable_proxy(seaweed_s3, monkeypatch) as proxy:
        stream = storage.UploadStream(url, what="uploading cut.bin")
        stream.write(data[: 10 * 2**20])  # two parts under way before the cut
        proxy.cut()
        finished: list[int] = []

        def the_rest() -> None:
            with stream:
                stream.write(data[10 * 2**20 :])
            finished.append(stream.size)

        writer = threading.Thread(target=the_rest)
        writer.start()
        _until_an_outage_is_ridden_out()
        time.sleep(2)
        assert writer.is_alive() and not finished, "the upload gave up on a store that was cut"
        proxy.restore()
        writer.join(120)
        assert finished == [len(data)]

        aborted = storage.UploadStream(seaweed_s3.url("runs", "stream", "aborted.bin"), what="uploading aborted.bin")
        aborted.write(data[: 5 * 2**20])
        proxy.cut()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="serialisation failed"), aborted:
            aborted.write(data[5 * 2**20 : 10 * 2**20])  # this part's upload meets the outage
            time.sleep(1)
            raise RuntimeError("serialisation failed")
        assert time.monotonic() - started < 60  # not the 300 s outage budget
        proxy.restore()
        fs, fs_path = storage.filesystem(url)
        assert fs.cat_file(fs_path) == data
        assert fs.info(fs_path)["ETag"].strip('"').endswith("-5")
        assert not fs.exists(fs_path.replace("cut.bin", "aborted.bin"))
        bucket, key, _ = fs.split_path(fs_path)
        listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
        assert not listed.get("Uploads"), "the finished upload was left open"
    said = capsys.readouterr().err
    assert "vitray: storage unreachable (uploading cut.bin (part " in said, said
    # The abort ended the waits without a word: the store was not reachable again.
    assert said.count("vitray: storage reachable again after") == 1, said


def test_ray_trains_own_writes_and_reads_of_the_run_folder_ride_out_a_cut_store(seaweed_s3, monkeypatch):
    """Ray Train's controller writes its list of the run's checkpoints after each one through the
    filesystem vitray gives it: a store down at that moment failed the run (EndpointConnectionError),
    where every call of vitray's own waits for it."""
    import pickle

    import pyarrow.fs

    from vitray.cluster.runtime import ray_storage

    def write_then_read() -> bytes:
        root, fs = ray_storage(seaweed_s3.url("runs"), outage_s=120)
        fs = pickle.loads(pickle.dumps(fs))  # as Ray sends it to its controller
        with fs.open_output_stream(f"{root}/r/checkpoint_manager_snapshot.json") as f:
            f.write(b'{"checkpoints": []}')
        assert fs.get_file_info(f"{root}/r/checkpoint_manager_snapshot.json").type == pyarrow.fs.FileType.File
        with fs.open_input_stream(f"{root}/r/checkpoint_manager_snapshot.json") as f:
            return f.read()

    got = _finished_only_after_a_cut(seaweed_s3, monkeypatch, write_then_read, "Ray's filesystem", join_s=60)
    assert got == b'{"checkpoints": []}'
