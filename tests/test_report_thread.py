"""Metrics-only reports to Ray Train are made off the training thread (`cluster/pretrain.py`): Ray
Train V2 blocks a second report until its controller collects the first (every 2 s)."""

from __future__ import annotations

import threading
import time

import pytest

from vitray.cluster import pretrain


def test_reports_never_block_the_caller_and_the_newest_is_made(monkeypatch):
    made, release = [], threading.Event()

    def slow_report(metrics):  # as Ray does while its controller has not collected the last one
        release.wait(5)
        made.append(metrics["step"])

    monkeypatch.setattr(pretrain.ray.train, "report", slow_report)
    reports = pretrain._LatestReport()
    started = time.perf_counter()
    for step in range(1, 6):
        reports.post({"step": step})
    assert time.perf_counter() - started < 1.0  # none waited for Ray
    release.set()
    reports.flush()
    assert made[-1] == 5 and made == sorted(made) and len(made) < 5  # waiting ones replaced by newer ones
    reports.close()


def test_a_failed_report_is_raised_on_the_training_thread(monkeypatch):
    def failing_report(metrics):
        raise RuntimeError("controller gone")

    monkeypatch.setattr(pretrain.ray.train, "report", failing_report)
    reports = pretrain._LatestReport()
    reports.post({"step": 1})
    with pytest.raises(RuntimeError, match="controller gone"):
        reports.flush()
    reports.close()
