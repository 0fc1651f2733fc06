"""Weights files that appear under their name only once written whole (the Python API's
`save_npz` / `save_safetensors`: a failure part-way must not leave a truncated file that a later
load would take for the model). `vitray export` publishes through `vitray.storage` instead. And a
file its format's reader cannot parse refused in one line that names it (`read_as`)."""

from __future__ import annotations

import contextlib
import os
import pickle
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


class UnreadableWeights(ValueError):
    """A weights file its format's reader cannot parse: damaged, cut short, or of another format."""


# What each reader's file is, for the message (`read_as`'s `fmt`).
_FORMATS = {
    "npz": "a NumPy .npz archive of arrays (the original ViT layout)",
    "safetensors": "a safetensors file",
    "torch": "a torch state dict (torch.save of a mapping of names to tensors)",
}


@contextlib.contextmanager
def read_as(path: str | os.PathLike, fmt: str) -> Iterator[None]:
    """Parses `path` as `fmt` (a key of `_FORMATS`) in the block; a parse failure becomes one
    :class:`UnreadableWeights` naming the file and what it should be. The readers' own messages name
    neither (NumPy's BadZipFile, safetensors' "header too large"), and NumPy's and torch's advise
    loading the file unsafely (pickles run code): vitray never does."""
    try:
        yield
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as error:
        # torch's weights-only unpickler met a class it does not allow (a checkpoint's args, an optimizer)
        if fmt == "torch" and isinstance(error, pickle.UnpicklingError) and "Unsupported global" in str(error):
            why = (
                "it holds Python objects besides tensors, which vitray does not unpickle (that runs code); "
                "save the state dict alone (torch.save(model.state_dict(), PATH)) or as .safetensors"
            )
        else:
            why = "it is damaged, cut short, or of another format (vitray never loads pickled objects)"
        raise UnreadableWeights(f"{os.fspath(path)} is not {_FORMATS[fmt]}: {why}") from None
