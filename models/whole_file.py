"""Weights files that appear under their name only once written whole (the Python API's
`save_npz` / `save_safetensors`: a failure part-way must not leave a truncated file that a later
load would take for the model). `vitray export` publishes through `vitray.storage` instead."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def written_whole(path: str | os.PathLike) -> Iterator[str]:
    """A temporary path beside ``path`` to write to; renamed to ``path`` when the block succeeds,
    removed when it raises."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path) or ".")
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; a weights file is as readable as any other
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
