"""`debug.record_sample_keys`: every rank appends (step, key) for each sample it trains on.

Each attempt (a start or restart of the worker group) writes its own files, named by its first
step and an attempt id shared by its ranks, so nothing is overwritten. `collect_keys` replays
the attempts in order: the steps an attempt redid after a crash replace what the crashed
attempt had recorded for them, so an audit compares a resumed run step by step with an
uninterrupted one.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

_NAME = "keys-attempt{attempt:020d}-from{start:09d}-rank{rank:04d}.tsv"
_PATTERN = re.compile(r"keys-attempt(\d+)-from(\d+)-rank(\d+)\.tsv$")


class SampleKeyRecorder:
    def __init__(self, folder: str | Path, *, rank: int, start_step: int, attempt: int):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._file = open(folder / _NAME.format(attempt=attempt, start=start_step, rank=rank), "a", encoding="utf-8")

    def record(self, step: int, keys: list[str]) -> None:
        self._file.write("".join(f"{step}\t{key}\n" for key in keys))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def collect_keys(folder: str | Path) -> dict[int, list[str]]:
    """step -> the sorted keys trained on at that step across ranks, the latest attempt winning."""
    attempts: dict[int, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in Path(folder).glob("keys-attempt*.tsv"):
        attempt = int(_PATTERN.search(path.name).group(1))
        for line in path.read_text().splitlines():
            step, key = line.split("\t")
            attempts[attempt][int(step)].append(key)
    result: dict[int, list[str]] = {}
    for attempt in sorted(attempts):
        result.update(attempts[attempt])
    return {step: sorted(keys) for step, keys in sorted(result.items())}
