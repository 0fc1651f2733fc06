"""Which steps a worker reports to Ray Train (`cluster/pretrain.py`): only checkpoint steps. Each
report is a barrier across the ranks, held until Ray's controller collects it (every 2 s)."""

from __future__ import annotations

from pathlib import Path

from vitray.cluster.pretrain import reported_to_ray


def test_only_checkpoint_steps_are_reported_to_ray(tmp_path: Path):
    assert reported_to_ray(tmp_path / "checkpoint_000010")
    assert not reported_to_ray(None)  # a log step: vitray's metrics file has it, Ray does not wait for it
