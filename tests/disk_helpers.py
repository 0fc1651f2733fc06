"""Real full disks for the fault tests (small tmpfs mounts), and what a process has read."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A real, small file system of ``size`` (e.g. ``"4m"``) mounted at a new ``folder``, that runs
    out of space; skips the test where mounting needs root and this is not it."""
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a small tmpfs needs root: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def bytes_read() -> int:
    """The bytes this process has read so far (/proc/self/io's rchar: every read call, of any file,
    page cache or not)."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])
