"""The Checkpointer with a fake backend (no DeepSpeed, no process group): cadence, the background
write and its completion record, the hand-over to the run with its costs, and restore."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitray.runfolder import checkpoint_folders as ckpt
from vitray.trainers.checkpoint.checkpointer import Checkpointer
from vitray.trainers.engines.seam import PendingSave
from vitray.trainers.step.ema import Ema, WholeWeights

COSTS = {
    "checkpoint_write_s",
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
        self.loaded: list[tuple[Path, dict]] = []
        self._pool = ThreadPoolExecutor(max_workers=1)

    def save(self, folder: Path) -> PendingSave:
        def write() -> None:
            if self.gate is not None:
                self.gate.wait(timeout=30)
            if self.fail:
                raise OSError("disk full")
            (folder / "fake").mkdir()
            (folder / "fake" / "shard.bin").write_bytes(b"shard")

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


def checkpointer(backend, reports, loader, ema, every=2, last_step=5) -> Checkpointer:
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
    )


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
