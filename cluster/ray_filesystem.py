"""The filesystem Ray Train is given for a run folder on object storage: pyarrow's handler over
vitray's fsspec filesystem, every call riding out an outage (`vitray.storage.ride_out`).

Ray Train writes little there itself -- the workers write the checkpoints, handed to Ray where
they lie (`train_worker`) -- but its controller writes its list of the run's checkpoints after each
one, and reads and lists the run folder: a store that stopped answering for a moment then failed
the whole run, where every call of vitray's own waits for it (run.storage_outage_s). Writes are
kept in memory and uploaded whole on close (small: a JSON file), so that the upload can be tried
again; a stream cannot be.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pyarrow
import pyarrow.fs

from vitray import storage

# The calls of pyarrow's FileSystemHandler that are asked again while the store is down; each is
# safe to repeat (a read, a listing, a make or delete of what a retry finds made or deleted).
_REPEATABLE = (
    "get_file_info",
    "get_file_info_selector",
    "create_dir",
    "delete_dir",
    "delete_dir_contents",
    "delete_root_dir_contents",
    "delete_file",
    "move",
    "copy_file",
    "open_input_stream",
    "open_input_file",
)


class RidingOutHandler(pyarrow.fs.FSSpecHandler):
    """`FSSpecHandler(fs)`, each call riding out an outage of up to `outage_s` (None: the process's
    budget, `storage.retries`)."""

    def __init__(self, fs: Any, outage_s: float | None = None):
        super().__init__(fs)
        self.outage_s = outage_s

    def __reduce__(self):  # Ray sends it to its controller and workers
        return type(self), (self.fs, self.outage_s)

    def _ride_out(self, what: str, call: Callable[[], Any]) -> Any:
        return storage.ride_out(call, what=f"{what} (Ray Train's run folder)", within_s=self.outage_s)

    def open_output_stream(self, path: str, metadata: Any = None) -> Any:
        def upload(data: bytes) -> None:
            self._ride_out(f"writing {path}", lambda: self.fs.pipe_file(path, data))

        return pyarrow.PythonFile(_UploadedOnClose(upload), mode="w")


def _riding_out(name: str) -> Callable[..., Any]:
    plain = getattr(pyarrow.fs.FSSpecHandler, name)

    def call(self: RidingOutHandler, *args: Any, **kwargs: Any) -> Any:
        return self._ride_out(f"{name} {args[0] if args else ''}".strip(), lambda: plain(self, *args, **kwargs))

    call.__name__ = name
    return call


for _name in _REPEATABLE:
    setattr(RidingOutHandler, _name, _riding_out(_name))


class _UploadedOnClose(io.BytesIO):
    """What is written, uploaded whole by `upload(bytes)` when closed."""

    def __init__(self, upload: Callable[[bytes], None]):
        super().__init__()
        self._upload = upload

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            super().close()
            self._upload(data)
