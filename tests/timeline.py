"""A pytest plugin for looking at where the suite's time goes: with VITRAY_TEST_TIMELINE=FILE set,
every test phase (setup, call, teardown) appends one JSON line to FILE: the xdist worker, the test,
the phase, its start and end (wall clock) and the machine's CPU-seconds busy meanwhile (all CPUs,
from /proc/stat: with two workers the share is both workers' and the other processes'). Off, it
does nothing. Read with `python tests/timeline.py FILE`."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

import pytest

_FILE = os.environ.get("VITRAY_TEST_TIMELINE")


def _cpu_busy_s() -> float:
    """CPU-seconds the machine has spent busy since boot (all CPUs; /proc/stat, in clock ticks)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _timed(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _timed(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _timed(item, "teardown")


def _timed(item, phase: str):
    if not _FILE:
        yield
        return
    start, busy = time.time(), _cpu_busy_s()
    yield
    record = {
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "test": item.nodeid,
        "phase": phase,
        "start": start,
        "end": time.time(),
        "cpu_busy_s": _cpu_busy_s() - busy,
    }
    with open(_FILE, "a") as out:
        out.write(json.dumps(record) + "\n")


def summary(path: str) -> str:
    """Per worker: busy and idle wall time and its last test's end; per module: wall time, the
    machine's CPU use meanwhile (of 2 CPUs = 200%), sorted by wall time."""
    records = [json.loads(line) for line in open(path)]
    t0 = min(r["start"] for r in records)
    lines, modules = [], defaultdict(lambda: [0.0, 0.0])
    for worker in sorted({r["worker"] for r in records}):
        own = [r for r in records if r["worker"] == worker]
        busy = sum(r["end"] - r["start"] for r in own)
        lines.append(
            f"{worker}: {busy / 60:.1f} min in tests, last test ended at {(max(r['end'] for r in own) - t0) / 60:.1f} min"
        )
    for r in records:
        module = modules[r["test"].split("::")[0]]
        module[0] += r["end"] - r["start"]
        module[1] += r["cpu_busy_s"]
    for name, (wall, cpu) in sorted(modules.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{wall / 60:6.1f} min  machine CPU {100 * cpu / max(wall, 1e-9):4.0f}%  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1]))
