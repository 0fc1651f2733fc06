"""Readers' holds on the checkpoints of a run that is still training.

`vitray evaluate`, `fewshot` and `finetune` of a run folder read a checkpoint the run's own
`checkpoint.keep` may delete meanwhile (a grid's fine-tunes start hours after it resolved the run's
latest checkpoint; `--watch` follows a live run): they failed with "does not exist: check the path".
Such a command pins the checkpoints it reads for as long as it runs, and the run's pruning
(`checkpoint_folders.prune_checkpoints`) leaves a pinned checkpoint for a later prune.

`<run>/vitray/pins/<owner>.json` names the checkpoint folders and the reader (owner id, host, pid,
a heartbeat refreshed every `timeout_s`/4, as the run lease's record). A pin whose heartbeat is older
than its timeout, or whose reader was on this host and is gone, holds nothing: a reader killed -9
never keeps a checkpoint for ever. A reader that may not write to the run folder (read-only
credentials) reads unpinned, and says so once.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, fields

from vitray import storage
from vitray.runfolder.files import RunFiles
from vitray.runfolder.lease import LeaseRecord

PINS_FOLDER = "pins"
TIMEOUT_S = 120.0


def _pins_folder(run_dir: str) -> str:
    return storage.join(RunFiles(run_dir).root, PINS_FOLDER)


def _run_of(checkpoint: str) -> tuple[str, str] | None:
    """(its run folder, its folder name) for a checkpoint inside a run folder (one with vitray's
    own folder), else None: a checkpoint copied elsewhere is nobody's to prune."""
    run_dir, _, name = str(checkpoint).rstrip("/").rpartition("/")
    return (run_dir, name) if run_dir and storage.exists(RunFiles(run_dir).root) else None


def pinned_checkpoints(run_dir: str) -> set[str]:
    """The folder names of `run_dir`'s checkpoints that a live reader pins (no pins: one listing)."""
    folder = _pins_folder(run_dir)
    names: set[str] = set()
    entries = storage.list_names(folder)  # (none: the folder is not there)
    known = {f.name for f in fields(LeaseRecord)}
    for entry in entries:
        if not entry.endswith(".json"):
            continue
        try:
            pin = json.loads(storage.read_bytes(storage.join(folder, entry)))
            reader = LeaseRecord(**{key: value for key, value in pin.items() if key in known})
        except (FileNotFoundError, ValueError, TypeError):
            continue  # removed meanwhile, or not a pin this vitray wrote
        if reader.fresh():
            names.update(str(name) for name in pin.get("checkpoints", []))
    return names


class CheckpointPins:
    """Pins `checkpoints` (paths; those outside a run folder are left out) from `__enter__` to
    `__exit__`, refreshing the pins every `timeout_s`/4 on a background thread."""

    def __init__(self, checkpoints: Iterable[str], *, timeout_s: float = TIMEOUT_S):
        self.by_run: dict[str, list[str]] = {}
        for checkpoint in checkpoints:
            try:
                found = _run_of(checkpoint)
            except Exception:  # (a store this command cannot look into: the read itself will say so)
                found = None
            if found is not None:
                self.by_run.setdefault(found[0], []).append(found[1])
        self.reader = LeaseRecord.of_this_process(timeout_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unpinned: set[str] = set()  # run folders this reader could not write its pin to

    def _path(self, run_dir: str) -> str:
        return storage.join(_pins_folder(run_dir), f"{self.reader.owner}.json")

    def _write_all(self) -> None:
        self.reader.heartbeat = time.time()
        for run_dir, names in self.by_run.items():
            if run_dir in self._unpinned:
                continue
            try:
                record = {**asdict(self.reader), "checkpoints": sorted(set(names))}
                storage.write_bytes_atomic(self._path(run_dir), json.dumps(record, indent=1).encode())
            except Exception as error:  # read-only credentials, a full disk: read on, unpinned (a pin is a courtesy)
                self._unpinned.add(run_dir)
                print(
                    f"vitray: could not pin the checkpoints read from {run_dir} ({type(error).__name__}: {error}): "
                    "the run's checkpoint.keep may delete one while this command reads it",
                    file=sys.stderr,
                    flush=True,
                )

    def _beat(self) -> None:
        while not self._stop.wait(self.reader.timeout_s / 4):
            self._write_all()

    def __enter__(self) -> CheckpointPins:
        if self.by_run:
            self._write_all()
            self._thread = threading.Thread(target=self._beat, name="vitray-checkpoint-pins", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for run_dir in self.by_run:
            if run_dir not in self._unpinned:
                with contextlib.suppress(OSError):
                    storage.remove(self._path(run_dir))
