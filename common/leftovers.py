"""What a killed vitray process leaves in the temporary folder -- rank 0's local copy of the
metrics, the driver's notes of worker failures -- removed by a later start once nothing has
written it for a day. Nothing else would: a SIGKILL runs no clean-up, and a node that runs attempt
after attempt of a preempted run gathered one copy of the run's whole metrics history a kill."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

# Far longer than any live process goes without writing its file (a log step, a failure note is
# appended; an idle notes file of a live driver is a day old only if its run is, and then it is
# empty and made again at the next start).
STALE_AFTER_S = 24 * 3600.0


def remove_stale(prefix: str, *, stale_after_s: float = STALE_AFTER_S) -> list[str]:
    """Remove this user's entries `TMPDIR/PREFIX*` not written for `stale_after_s`; returns their
    paths. Best effort: an entry that goes away or cannot be removed meanwhile is left."""
    removed, now = [], time.time()
    try:
        entries = list(os.scandir(tempfile.gettempdir()))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if now - _last_written(entry.path) < stale_after_s:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed.append(entry.path)
        except OSError:
            continue
    return removed


def _last_written(path: str) -> float:
    """The newest modification time of `path` and, for a folder, of everything in it."""
    newest = os.lstat(path).st_mtime
    for folder, _, files in os.walk(path):
        for name in files:
            newest = max(newest, os.lstat(os.path.join(folder, name)).st_mtime)
    return newest
