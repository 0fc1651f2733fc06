"""The Checkpointer with a fake backend (no DeepSpeed, no process group): cadence, the background
write straight into the run folder and its completion record, the hand-over to the run with its
costs, and restore (sizes and CRCs checked); a writer killed mid-checkpoint leaves nothing a resume
takes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import pytest
import torch
from safetensors.torch import load_file

from vitray.runfolder import checkpoint_folders as ckpt
from vitray.trainers.checkpoint import checked_copy, rank_files
from vitray.trainers.checkpoint.checkpointer import Checkpointer
from vitray.trainers.engines.seam import PendingSave, Written
from vitray.trainers.step.ema import Ema, WholeWeights

COSTS = {
    "checkpoint_write_s",
    "checkpoint_bytes",
    "checkpoint_blocked_s",
    "checkpoint_snapshot_s",
    "checkpoint_wait_s",
    "checkpoint_report_s",
}


class FakeBackend:
    name = "fake"
    device = torch.device("cpu")

    def __init__(self, gate: threading.Event | None = None, fail: bool = False):
        self.module = torch.nn.Linear(2, 2)
        self.gate, self.fail = gate, fail
        self.shard = b"shard"
        self.loaded: list[tuple[Path, dict]] = []
        self._pool = ThreadPoolExecutor(max_workers=1)

    def save(self, folder: str) -> PendingSave:
        def write() -> Written:
            if self.gate is not None:
                self.gate.wait(timeout=30)
            if self.fail:
                raise OSError("disk full")
            return rank_files.write_file(folder, "fake/shard.bin", lambda f: f.write(self.shard))

        return PendingSave([self._pool.submit(write)])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def to_host(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().clone() for k, v in tensors.items()}

    def load(self, folder: Path, state: dict) -> None:
        self.loaded.append((folder, state))


class FakeLoader:
    def __init__(self, position: int = 0):
        self.position = position

    def state_dict(self) -> dict:
        return {"epoch": 0, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def checkpointer(backend, reports, loader, ema, every=2, last_step=5, run_dir=None, **kwargs) -> Checkpointer:
    return Checkpointer(
        backend,
        rank=0,
        world_size=1,
        every=every,
        last_step=last_step,
        report=lambda m, d: reports.append((m, d)),
        states={"data": loader},
        weights={ckpt.EMA_FILE: ema} if ema is not None else {},
        record={"num_classes": 2, "label_kind": "single"},
        run_dir=str(run_dir or Path(tempfile.mkdtemp(prefix="vitray-test-run-"))),
        **kwargs,
    )


def test_a_checkpoint_whose_last_check_fails_does_not_count():
    """`before_record` (the loop's: the run's driver still holds its lease) is asked by rank 0 just
    before its completion record: when it raises, the checkpoint's files are there but it never
    counts, and the error reaches the training thread."""
    from vitray.runfolder.lease import DriverGone

    def driver_gone():
        raise DriverGone("the run's driver (x) released it: this worker stops without completing its checkpoint")

    reports: list = []
    saver = checkpointer(FakeBackend(), reports, FakeLoader(), None)
    saver.before_record = driver_gone
    saver.save(2, {})
    with pytest.raises(RuntimeError, match="writing the checkpoint failed: the run's driver .* released it"):
        saver.finish(wait=True)
    assert reports == []
    assert ckpt.latest_complete_checkpoint(saver.run_dir) is None
    assert [p.name for p in Path(saver.run_dir).iterdir() if p.name.startswith("checkpoint_")]  # written, not counted


def test_saves_every_n_steps_and_at_the_last():
    saver = checkpointer(FakeBackend(), [], FakeLoader(), None, every=2, last_step=5)
    assert [step for step in range(1, 6) if saver.due(step)] == [2, 4, 5]


def test_save_writes_a_complete_checkpoint_that_restores():
    backend, loader, reports = FakeBackend(), FakeLoader(position=7), []
    ema = Ema(WholeWeights(backend.module), decay=0.5)
    saver = checkpointer(backend, reports, loader, ema)
    saver.save(2, {"loss": 1.5})
    assert saver.take_costs() == {}
    saver.finish(wait=True)
    [(metrics, folder)] = reports
    folder = Path(folder)
    assert folder.name.startswith("checkpoint_")  # in the run folder, where Ray Train finds it
    assert metrics["step"] == 2 and metrics["loss"] == 1.5 and metrics["checkpoint_write_s"] >= 0
    state = ckpt.verify_complete(folder)
    assert state == {
        "step": 2,
        "world_size": 1,
        "backend": "fake",
        "data": {"epoch": 0, "position": 7},
        "num_classes": 2,
        "label_kind": "single",
    }
    assert (folder / "fake" / "shard.bin").read_bytes() == b"shard"
    weights = load_file(str(folder / ckpt.MODEL_FILE))
    assert all(torch.equal(weights[k], v) for k, v in backend.module.state_dict().items())
    assert load_file(str(folder / ckpt.EMA_FILE)).keys() == weights.keys()
    costs = saver.take_costs()
    assert set(costs) == COSTS and costs["checkpoint_write_s"] == metrics["checkpoint_write_s"]
    assert costs["checkpoint_blocked_s"] == pytest.approx(
        costs["checkpoint_snapshot_s"] + costs["checkpoint_wait_s"] + costs["checkpoint_report_s"]
    )
    assert saver.take_costs() == {}  # handed out once

    fresh_backend, fresh_loader = FakeBackend(), FakeLoader()
    fresh_ema = Ema(WholeWeights(fresh_backend.module), decay=0.5)
    restored = checkpointer(fresh_backend, [], fresh_loader, fresh_ema)
    assert restored.restore(folder, state) == 2
    assert fresh_backend.loaded == [(folder, state)] and fresh_loader.position == 7
    assert all(torch.equal(fresh_ema.state_dict()[k], v) for k, v in ema.state_dict().items())


def test_hand_over_waits_for_the_background_write():
    gate, reports = threading.Event(), []
    saver = checkpointer(FakeBackend(gate=gate), reports, FakeLoader(), None)
    saver.save(2, {})
    saver.finish(wait=False)  # the shards are still being written: nothing is handed over
    assert reports == []
    gate.set()
    saver.finish(wait=True)
    assert len(reports) == 1 and ckpt.verify_complete(reports[0][1])["step"] == 2
    saver.finish(wait=True)  # nothing in flight any more
    assert len(reports) == 1


def test_a_failed_write_stops_training_and_is_never_handed_over():
    reports = []
    saver = checkpointer(FakeBackend(fail=True), reports, FakeLoader(), None)
    saver.save(2, {})
    with pytest.raises(RuntimeError, match="disk full"):
        saver.finish(wait=True)
    assert reports == []


def test_every_file_and_folder_is_fsynced_before_the_record_which_is_renamed_into_place(tmp_path, monkeypatch):
    """Durable on a local disk: each file is fsynced as it is closed, every folder that gained an
    entry (up to the run folder) before the completion record, and the record goes to a temporary
    name, is fsynced and renamed into place, its folder fsynced after."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = rank_files.os.fsync, rank_files.os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(rank_files.os, "fsync", fsync)
    monkeypatch.setattr(rank_files.os, "replace", replace)
    reports = []
    saver = checkpointer(FakeBackend(), reports, FakeLoader(), None, run_dir=tmp_path)
    saver.save(2, {})
    saver.finish(wait=True)
    folder = Path(reports[0][1])
    record = folder / ckpt.completion_record(0)
    renamed = events.index(("rename", str(record)))
    before = {path for kind, path in events[:renamed] if kind == "fsync"}
    files = {str(folder / name) for name in ("fake/shard.bin", ckpt.MODEL_FILE, ckpt.STATE_FILE)}
    assert files | {str(folder / "fake"), str(folder), str(tmp_path)} <= before
    assert str(folder / f".{record.name}.tmp") in before  # the record's bytes, before its name
    assert ("fsync", str(folder)) in events[renamed + 1 :]  # and its name, after


def test_a_rank_that_wrote_no_file_records_its_completion_before_rank_0_made_the_folder(tmp_path):
    """ZeRO-0 on 2 workers: DeepSpeed saves from rank 0 alone, so rank 1 writes no file, and it
    reached its folder's fsync before rank 0 had made the folder (FileNotFoundError: the run failed
    at its first checkpoint)."""
    folder = str(tmp_path / "run" / "checkpoint_s000000000002_2026-01-01_00-00-00.000001")
    rank_files.sync_folders(folder, [])
    rank_files.mark_complete(folder, 1, [])
    assert json.loads(Path(folder, ckpt.completion_record(1)).read_text()) == {}


def test_the_record_lists_crc32c_and_a_restore_refuses_a_corrupt_file(tmp_path):
    reports = []
    saver = checkpointer(FakeBackend(), reports, FakeLoader(), None, run_dir=tmp_path)
    saver.save(2, {})
    saver.finish(wait=True)
    folder = Path(reports[0][1])
    listing = json.loads((folder / ckpt.completion_record(0)).read_text())
    assert listing["fake/shard.bin"] == {"size": 5, "crc32c": f"{google_crc32c.value(b'shard'):08x}"}
    restore_dir = tmp_path / "restore"
    assert checked_copy.rank_copy(str(folder), None, restore_dir, 0)[1]["step"] == 2
    (folder / "fake" / "shard.bin").write_bytes(b"sharp")  # same size: only the checksum tells
    assert ckpt.verify_complete(folder)["step"] == 2  # listing sizes alone would take it
    with pytest.raises(ckpt.IncompleteCheckpointError, match="fake/shard.bin does not have the CRC-32C"):
        checked_copy.rank_copy(str(folder), None, restore_dir, 0)


@pytest.mark.parametrize("damaged", [ckpt.MODEL_FILE, ckpt.EMA_FILE])
def test_weights_read_whole_are_checked_against_their_crc32c(tmp_path, damaged):
    """model.safetensors and ema.safetensors, which evaluation, `vitray export` and fine-tuning read
    whole (`load_model`, `model_weights`), are checked against the CRC-32C rank 0's record lists:
    a bit flipped since they were written keeps the size that makes the checkpoint count, and the
    weights loaded from it were evaluated and exported without a word."""
    import fsspec

    from vitray.models import ModelConfig, create_model_from_config

    model_cfg = ModelConfig(name="Ti/4", img_size=8, depth=1)
    backend = FakeBackend()
    backend.module = create_model_from_config(model_cfg, num_classes=2)
    ema = Ema(WholeWeights(backend.module), decay=0.5)
    reports = []
    saver = checkpointer(backend, reports, FakeLoader(), ema, run_dir=tmp_path)
    saver.record.update({"model": model_cfg.model_dump()})
    saver.save(2, {})
    saver.finish(wait=True)
    folder = reports[0][1]
    whole = backend.full_state_dict()
    for use_ema in (False, True):
        model, state = ckpt.load_model(folder, ema=use_ema)
        assert state["weights_file"] == (ckpt.EMA_FILE if use_ema else ckpt.MODEL_FILE)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in whole.items())

    path = Path(folder) / damaged
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # a bit of the last tensor's bytes: the file still parses
    path.write_bytes(bytes(data))
    assert ckpt.verify_complete(folder)["step"] == 2  # the sizes alone take it for whole
    corrupt = pytest.raises(
        ckpt.IncompleteCheckpointError,
        match=f"{damaged} does not have the CRC-32C its record lists.*earlier checkpoint",
    )
    with corrupt:
        ckpt.load_model(folder, ema=damaged == ckpt.EMA_FILE)
    if damaged == ckpt.MODEL_FILE:
        with corrupt:
            ckpt.model_weights(folder, fsspec.filesystem("file"), state)
    else:  # the raw weights, whole, still load
        assert ckpt.load_model(folder, ema=False)[1]["weights_file"] == ckpt.MODEL_FILE


def test_a_resume_checks_a_local_checkpoint_after_the_engine_loads_and_refuses_a_corrupt_one(tmp_path):
    """A local checkpoint's files that no reader checked as it read them (here: the fake backend
    reads its shard itself) are checked when the body of `restore_copy` ends, and a corrupt file
    fails the resume there -- also when the load failed on it first, with an error that did not
    say so."""
    import pickle
    from types import SimpleNamespace

    from vitray.trainers.checkpoint.restore import restore_copy
    from vitray.trainers.context import WorkerContext

    reports = []
    saver = checkpointer(FakeBackend(), reports, FakeLoader(), None, run_dir=tmp_path)
    saver.save(2, {})
    saver.finish(wait=True)
    folder = Path(reports[0][1])
    every_file = SimpleNamespace(restore_files=lambda cfg, rank, world: None)
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(staging_dir=str(tmp_path / "staging")), engine=every_file)
    ctx = WorkerContext(
        rank=0, world_size=1, run_dir=str(tmp_path), report=None, resume_from=str(folder), resume_step=2
    )
    with restore_copy(cfg, ctx) as (local, state):
        assert state["step"] == 2 and (local / "fake" / "shard.bin").read_bytes() == b"shard"

    (folder / "fake" / "shard.bin").write_bytes(b"sharp")  # same size: only the checksum tells
    loaded = []
    corrupt = pytest.raises(ckpt.IncompleteCheckpointError, match="fake/shard.bin does not have the CRC-32C")
    with corrupt, restore_copy(cfg, ctx) as (local, _):
        loaded.append((local / "fake" / "shard.bin").read_bytes())
    assert loaded == [b"sharp"]  # loaded, never trained on: the resume fails when the body ends
    # ... and it no longer counts, so that the next attempt (a re-run, Ray's restart of the workers,
    # which knows it as the announced one) resumes from the checkpoint before it, not from it again.
    why = "found corrupt by a resume: fake/shard.bin does not have the CRC-32C its record lists"
    with pytest.raises(ckpt.IncompleteCheckpointError, match=why):
        ckpt.verify_complete(folder)
    for known in (None, ckpt.CheckpointInfo(str(folder), 2, True)):
        chosen, (skipped,) = ckpt.resume_point(str(tmp_path), known=known)
        assert chosen is None and skipped.path == str(folder) and skipped.problem.startswith(why)
    from vitray.trainers.checkpoint.restore import choose_checkpoint

    for restarted in (False, True):  # the driver announced it; Ray's next group passes it over
        assert choose_checkpoint(str(tmp_path), str(folder), 2, restarted=restarted) is None
    (folder / ckpt.CORRUPT_FILE).unlink()  # (taken for whole again, for what follows)
    with pytest.raises(ckpt.IncompleteCheckpointError, match="fake/shard.bin") as raised, restore_copy(cfg, ctx):
        raise pickle.UnpicklingError("invalid load key, 'x'.")
    assert isinstance(raised.value.__cause__, pickle.UnpicklingError)
    (folder / "fake" / "shard.bin").write_bytes(b"shard")
    (folder / ckpt.CORRUPT_FILE).unlink()
    with pytest.raises(ValueError, match="not about the files"), restore_copy(cfg, ctx):
        raise ValueError("not about the files")  # the body's own errors stay its own


def test_a_checkpoint_on_s3_comes_down_in_ranges_checked_and_a_corrupt_object_is_refused(
    seaweed_s3, tmp_path, monkeypatch
):
    """On a real S3 store (SeaweedFS): a large file goes up as a multipart upload (parts of 5 MiB,
    S3's least, here; 8 MiB in use), the files come down in ranges (1 MiB here, 16 MiB in use)
    fetched concurrently, equal to what was written, their CRC-32C joined from the ranges'; an
    object replaced by other bytes of the same size is refused by its CRC."""
    from vitray import storage

    monkeypatch.setattr(storage.upload_stream, "UPLOAD_PART_BYTES", 5 * 2**20)
    monkeypatch.setattr(checked_copy, "DOWNLOAD_RANGE_BYTES", 2**20)
    backend = FakeBackend()
    backend.shard = bytes(range(256)) * 40960 + b"tail"  # 10 MiB + 4 bytes: 3 parts, 11 ranges
    reports = []
    saver = checkpointer(backend, reports, FakeLoader(), None, run_dir=seaweed_s3.url("runs/one"))
    saver.save(2, {})
    saver.finish(wait=True)
    folder = reports[0][1]
    local, state = checked_copy.rank_copy(folder, None, tmp_path / "node", 0)
    assert state["step"] == 2 and (local / "fake" / "shard.bin").read_bytes() == backend.shard
    assert not list(local.rglob("*.part-*"))

    fs, fs_path = storage.filesystem(folder)
    assert fs.info(f"{fs_path}/fake/shard.bin")["ETag"].strip('"').endswith("-3")  # a multipart ETag: 3 parts
    fs.pipe_file(f"{fs_path}/fake/shard.bin", backend.shard[::-1])  # same size, other bytes
    with pytest.raises(ckpt.IncompleteCheckpointError, match="fake/shard.bin does not have the CRC-32C"):
        checked_copy.rank_copy(folder, None, tmp_path / "elsewhere", 0)
    assert not (tmp_path / "elsewhere" / "fake" / "shard.bin").exists()  # never taken for a whole one


def test_a_file_checksummed_in_parallel_ranges_has_the_crc32c_of_one_pass(tmp_path, monkeypatch):
    """Ranges of 1,000 bytes (16 MiB in use) read in parallel, their CRCs joined in order: the
    CRC-32C of the whole file read in one pass, for lengths on and off the range boundaries."""
    import random

    from vitray.trainers.checkpoint import checksums

    monkeypatch.setattr(checksums, "SLICE_BYTES", 1000)
    rng = random.Random(0)
    files = {}
    for size in (0, 1, 999, 1000, 1001, 7321, 20_000):
        data = rng.randbytes(size)
        (tmp_path / str(size)).write_bytes(data)
        files[str(size)] = (tmp_path / str(size), size, google_crc32c.value(data))
    crcs = checksums.files_crc32c({name: (path, size) for name, (path, size, _) in files.items()}, threads=3)
    assert crcs == {name: crc for name, (_, _, crc) in files.items()}
    a, b = rng.randbytes(12345), rng.randbytes(678)
    joined = checksums.crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b))
    assert joined == google_crc32c.value(a + b)


def test_a_tensor_over_2_gib_reaches_the_file_whole(tmp_path):
    """Linux writes at most 2 GiB - 4 KiB in one call: a tensor larger than that (an H/14's fp32
    master weights on one rank are 2.5 GB) is written whole, and the size and CRC-32C the writer
    lists are the file's."""
    from vitray.trainers.checkpoint import checksums

    data = torch.zeros(2**31 + 2**20, dtype=torch.uint8)
    data[-3:] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    written = rank_files.write_file(str(tmp_path), "big.bin", lambda f: f.write(memoryview(data.numpy())))
    path = tmp_path / "big.bin"
    try:
        assert written.size == path.stat().st_size == data.numel()
        with open(path, "rb") as f:
            f.seek(-4, os.SEEK_END)
            assert f.read() == b"\0\1\2\3"
        assert written.crc32c == checksums.files_crc32c({"big": (path, written.size)})["big"]
    finally:
        path.unlink()


def test_a_record_of_an_older_checkpoint_with_sizes_only_still_resumes(tmp_path):
    """Checkpoints written before records listed CRCs (name -> size) are still read."""
    reports = []
    saver = checkpointer(FakeBackend(), reports, FakeLoader(), None, run_dir=tmp_path)
    saver.save(2, {})
    saver.finish(wait=True)
    folder = Path(reports[0][1])
    record = folder / ckpt.completion_record(0)
    listing = json.loads(record.read_text())
    record.write_text(json.dumps({name: entry["size"] for name, entry in listing.items()}))
    assert ckpt.resume_point(str(tmp_path))[0].step == 2
    assert checked_copy.rank_copy(str(folder), None, tmp_path / "restore", 0)[1]["step"] == 2


# A writer process: saves a checkpoint at step 2 (handed over), then one at step 4 whose shard is
# written slowly, saying how far it got; the test kills it with SIGKILL somewhere in that write.
_KILLED_WRITER = """
import sys, time
sys.path.insert(0, {tests!r})
from test_checkpointer import FakeBackend, FakeLoader, checkpointer

class Slow(FakeBackend):
    def save(self, folder):
        from vitray.trainers.engines.seam import PendingSave
        from vitray.trainers.checkpoint import rank_files

        def write(f):
            for i in range(self.chunks):
                f.write(b"x" * 65536)
                f.flush()
                time.sleep(self.pause)
        return PendingSave([self._pool.submit(rank_files.write_file, folder, "fake/shard.bin", write)])

backend, reports = Slow(), []
backend.chunks, backend.pause = 1, 0
saver = checkpointer(backend, reports, FakeLoader(), None, every=2, last_step=10, run_dir={run_dir!r})
saver.save(2, {{}})
saver.finish(wait=True)
print("complete", flush=True)
backend.chunks, backend.pause = 200, 0.005
saver.save(4, {{}})
saver.finish(wait=True)
print("complete", flush=True)
"""


@pytest.mark.parametrize("kill_after_s", [0.05, 0.4, 0.9, 1.3])
def test_a_writer_killed_mid_checkpoint_leaves_nothing_a_resume_takes(tmp_path, kill_after_s):
    """kill -9 at some moment of a checkpoint's write (its shard, the weights and state, the
    record): the run resumes from the one before, and says why the newer one was skipped -- or,
    killed after its record was in place, from the newer one, whole."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = _KILLED_WRITER.format(tests=str(Path(__file__).parent), run_dir=str(run_dir))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path])}
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert writer.stdout.readline().strip() == "complete"  # step 2, handed over
        time.sleep(kill_after_s)
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    chosen, skipped = ckpt.resume_point(str(run_dir))
    folders = ckpt.checkpoint_folders(str(run_dir))
    assert chosen is not None and chosen.step in (2, 4)
    if kill_after_s < 1.0:  # the shard takes over 1 s to write: killed in the middle of it
        assert chosen.step == 2 and len(folders) == 2
        [newer] = skipped
        assert newer.path == folders[1] and ("not finished" in newer.problem or "never finished" in newer.problem)
    if chosen.step == 2:
        assert len(folders) == 1 or [c.path for c in skipped] == folders[1:]
    restored = checked_copy.rank_copy(chosen.path, None, tmp_path / "restore", 0)
    assert restored[1]["step"] == chosen.step


def _deepspeed_backend(stage: int, dtype: str = "bf16", frozen: tuple[str, ...] = ()):
    from vitray.common.config import load_config
    from vitray.models import create_model_from_config
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.engines.deepspeed.backend import DeepSpeedBackend

    settings = ["data.train=/unused", "model.name=Ti/16", "model.img_size=32", f"train.zero_stage={stage}"]
    settings += [f"precision.dtype={dtype}", "train.batch_size=2", "train.micro_batch_size=2", "cluster.num_workers=1"]
    cfg = load_config(TrainingConfig, None, settings)
    torch.manual_seed(0)
    model = create_model_from_config(cfg.model, 10)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    backend = DeepSpeedBackend(cfg, model, 1, None)
    return cfg, backend


@pytest.mark.parametrize(("stage", "dtype"), [(0, "bf16"), (0, "fp32"), (1, "bf16"), (3, "bf16")])
def test_a_zero_checkpoint_keeps_12_bytes_a_parameter_resumes_exactly_and_gives_its_weights(
    tmp_path, process_group, stage, dtype
):
    """(The session's one-rank group: DeepSpeed caches its groups, so a group of the test's own
    would clash with other tests' in the same worker.) AdamW at ZeRO 0, 1 and 3: the fp32 weights
    and two moments (12 bytes a parameter) and no more -- no bf16 module copy, no model.safetensors
    (checkpoint.model_weights=last, not the last step); a resume rounds the master copy to the very
    weights trained, and evaluation's loader derives the fp32 weights from the shards (ZeRO-3's
    layout: each parameter cut into one part a rank; ZeRO-0's: the module states, with the master
    copies named). (Several ranks' shards are joined by the end-to-end runs of
    tests/test_zero_stages.py and test_pretrain.py.)"""
    from vitray.runfolder.checkpoint_folders import load_model

    cfg, backend = _deepspeed_backend(stage=stage, dtype=dtype)
    for _ in range(2):
        backend.backward_step(backend(torch.randn(2, 3, 32, 32, dtype=backend.dtype)).float().square().mean())
    record = {"num_classes": 10, "model": cfg.model.model_dump(), "config": cfg.settings()}
    reports = []
    saver = checkpointer(backend, reports, FakeLoader(), None, every=2, last_step=4, run_dir=tmp_path)
    saver.record.update(record)
    saver.save(2, {})
    saver.finish(wait=True)
    folder = Path(reports[0][1])
    params = sum(getattr(p, "ds_numel", p.numel()) for p in backend.module.parameters())  # ZeRO-3: its whole size
    written = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert not (folder / ckpt.MODEL_FILE).exists()
    assert written / params <= 12.5, f"{written / params:.2f} bytes a parameter"
    # The host buffers were reserved after the first step: the first snapshot allocated none.
    assert backend._checkpoints._buffers.allocated_in_snapshots == 0

    whole = backend.full_state_dict()
    model, state = load_model(str(folder))
    assert state["weights_file"] == "deepspeed/state"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in whole.items())
    # The shards the weights are derived from are checked against their records' CRC-32C
    shard = max((p for p in (folder / "deepspeed").rglob("*.pt")), key=lambda p: p.stat().st_size)
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2] + bytes([good[len(good) // 2] ^ 0x40]) + good[len(good) // 2 + 1 :])
    with pytest.raises(ckpt.IncompleteCheckpointError, match=f"{shard.name} does not have the CRC-32C"):
        load_model(str(folder))
    shard.write_bytes(good)

    trained = {k: v.clone() for k, v in backend.module.state_dict().items()}
    _, fresh = _deepspeed_backend(stage=stage, dtype=dtype)
    local, state = checked_copy.rank_copy(str(folder), None, tmp_path / "restore", 0)
    fresh.load(local, state)
    # Nothing the run keeps may map the checkpoint's files (Adam's moments, left as mappings, would
    # hold a pruned checkpoint's disk space for the rest of the run).
    mapped = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()]
    assert not [path for path in mapped if path.startswith(str(tmp_path / "restore"))]
    if stage < 3:  # (ZeRO-3's module holds no weights outside its forward pass)
        assert all(torch.equal(fresh.module.state_dict()[k], v) for k, v in trained.items())
    assert all(torch.equal(fresh.full_state_dict()[k], v) for k, v in whole.items())
    # And it goes on as the run does: a step of each from one batch ends at the same weights (Adam's
    # moments, its step count and the schedule restored, not the weights alone).
    batch = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(backend.dtype)
    for engine in (backend, fresh):
        engine.backward_step(engine(batch).float().square().mean())
    went_on = backend.full_state_dict()
    assert all(torch.equal(fresh.full_state_dict()[k], v) for k, v in went_on.items())


def test_a_resume_reads_deepspeeds_shards_once_checked_as_read_and_refuses_a_corrupt_one(
    tmp_path, process_group, monkeypatch
):
    """DeepSpeed's shards are read by the checkpoint engine itself, straight into their tensors (the
    fp32 master weights into DeepSpeed's own partitions), each checked (size, CRC-32C) as it is
    read: the check left for the end reads only the files no reader took (here none of the
    shards); a shard with one byte changed inside a tensor fails the engine's load, naming the
    file."""
    from vitray.trainers.engines.deepspeed.resume_files import restore_files

    _, backend = _deepspeed_backend(stage=1)
    backend.backward_step(backend(torch.randn(2, 3, 32, 32, dtype=backend.dtype)).float().square().mean())
    reports = []
    saver = checkpointer(backend, reports, FakeLoader(), None, every=2, last_step=4, run_dir=tmp_path)
    saver.save(2, {})
    saver.finish(wait=True)
    folder = Path(reports[0][1])
    shards = sorted(p.relative_to(folder).as_posix() for p in (folder / "deepspeed").rglob("*.pt"))
    assert len(shards) == 2  # the module states and rank 0's optimizer shard

    checked_at_the_end = []
    real_check = checked_copy._check_crc32cs
    monkeypatch.setattr(
        checked_copy,
        "_check_crc32cs",
        lambda path, files, listed, crcs=None: (
            checked_at_the_end.append(sorted(files)) or real_check(path, files, listed, crcs)
        ),
    )
    from vitray.trainers.checkpoint import torch_file

    read_into = []
    real_read = torch_file._read
    monkeypatch.setattr(
        torch_file,
        "_read",
        lambda path, records, direct, targets: (
            read_into.extend(t.data_ptr() for t in targets.values()) or real_read(path, records, direct, targets)
        ),
    )
    _, fresh = _deepspeed_backend(stage=1)
    partitions = fresh.engine.optimizer.single_partition_of_fp32_groups
    local, state, checking = checked_copy.start_rank_copy(str(folder), restore_files(0, 1, 1), tmp_path / "r", 0)
    fresh.load(local, state)
    checking.result()
    assert checked_at_the_end == [[]]
    # The master weights were read straight into DeepSpeed's partitions, not copied there.
    assert sorted(read_into) == sorted(p.data_ptr() for p in partitions)
    assert all(torch.equal(a, b) for a, b in zip(partitions, backend.engine.optimizer.single_partition_of_fp32_groups))
    trained = backend.module.state_dict()
    assert all(torch.equal(fresh.module.state_dict()[k], v) for k, v in trained.items())

    optim = next(folder / name for name in shards if "optim_states" in name)
    data = bytearray(optim.read_bytes())
    data[len(data) // 2] ^= 1  # inside the master weights or a moment
    optim.write_bytes(bytes(data))
    _, again = _deepspeed_backend(stage=1)
    local, state, checking = checked_copy.start_rank_copy(str(folder), restore_files(0, 1, 1), tmp_path / "r2", 0)
    with pytest.raises(ckpt.IncompleteCheckpointError, match=f"{optim.name} does not have the CRC-32C"):
        again.load(local, state)
    assert checking.exception() is None  # (what is left to check: nothing the engine read)


@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_parameters_are_in_the_derived_weights(tmp_path, process_group, stage):
    """A frozen parameter lies outside the optimizer's master copy: ZeRO 1-2's module states keep it
    (and the derived weights take it from there); ZeRO-3 partitions it outside the optimizer, so its
    checkpoints carry model.safetensors."""
    from vitray.runfolder.checkpoint_folders import load_model

    cfg, backend = _deepspeed_backend(stage=stage, frozen=("pos_embed",))
    backend.backward_step(backend(torch.randn(2, 3, 32, 32, dtype=backend.dtype)).float().square().mean())
    reports = []
    saver = checkpointer(backend, reports, FakeLoader(), None, every=2, last_step=4, run_dir=tmp_path)
    saver.record.update({"num_classes": 10, "model": cfg.model.model_dump(), "config": cfg.settings()})
    saver.save(2, {})
    saver.finish(wait=True)
    folder = Path(reports[0][1])
    assert (folder / ckpt.MODEL_FILE).exists() == (stage == 3)
    whole = backend.full_state_dict()
    model, _ = load_model(str(folder))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in whole.items())


def test_an_upload_stream_sends_parts_as_they_fill_and_an_error_leaves_nothing(seaweed_s3, monkeypatch):
    """storage.UploadStream on a real S3 store (SeaweedFS): parts go up while the caller still
    writes (the multipart upload exists before the last byte is written); the object appears whole
    at close, `on_bytes` saw every byte in order; a small object is one PUT; an error in the `with`
    block aborts the upload: no object, no upload left open."""
    from vitray import storage

    monkeypatch.setattr(storage.upload_stream, "UPLOAD_PART_BYTES", 5 * 2**20)
    fs, fs_path = storage.filesystem(seaweed_s3.url("runs", "stream"))
    bucket, prefix, _ = fs.split_path(fs_path)

    def open_uploads() -> list[str]:
        listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        return [u["Key"] for u in listed.get("Uploads", [])]

    data = bytes(range(256)) * (4096 * 50) + b"end"  # 50 MiB + 3 bytes: 11 parts
    seen = bytearray()
    with storage.UploadStream(seaweed_s3.url("runs", "stream", "big.bin"), what="test", on_bytes=seen.extend) as f:
        for start in range(0, len(data), 3 * 2**20):
            f.write(data[start : start + 3 * 2**20])
            if start >= 12 * 2**20:
                assert open_uploads() == [f"{prefix}/big.bin"]  # under way while the caller writes
        assert not fs.exists(f"{fs_path}/big.bin")
    assert fs.cat_file(f"{fs_path}/big.bin") == data and bytes(seen) == data and f.size == len(data)
    assert fs.info(f"{fs_path}/big.bin")["ETag"].strip('"').endswith("-11")
    assert open_uploads() == []

    with storage.UploadStream(seaweed_s3.url("runs", "stream", "small.json"), what="test") as f:
        f.write(b"{}")
    assert fs.cat_file(f"{fs_path}/small.json") == b"{}"

    failing = storage.UploadStream(seaweed_s3.url("runs", "stream", "failed.bin"), what="test")
    with pytest.raises(RuntimeError, match="serialisation failed"), failing as f:
        f.write(data[: 12 * 2**20])  # two parts sent
        raise RuntimeError("serialisation failed")
    assert not fs.exists(f"{fs_path}/failed.bin")
    assert open_uploads() == []
