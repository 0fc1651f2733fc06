"""Starting worker processes that do not run the caller's main script again, nor draw from the
caller's random state.

A process started by `spawn` or the `forkserver` runs the main script of the process that started
it as `__mp_main__` (Python 3.11's forkserver never preloads it: it looks for a `main_path` that its
parent never sends): the script's imports each time, and a script without a `__main__` guard starts
workers of its own in each worker, which fails. vitray's workers unpickle only vitray's own classes,
never one of the main module's, so the main module is hidden while they start.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


def workers_generator() -> Any:
    """The generator a DataLoader draws its workers' base seed from when an iterator starts, in
    place of torch's global one: the caller's random state stays as it was (the training loop seeds
    the global generator for each step's dropout; a draw while the first batch is fetched shifted the
    first step of every attempt, so a resumed run's weights differed). A fixed seed: vitray's
    workers draw their augmentation from the data seed, never from the base seed."""
    import torch  # (the preparation's indexing pool imports this module, and needs no torch)

    return torch.Generator().manual_seed(0)


@contextlib.contextmanager
def main_script_hidden() -> Iterator[None]:
    """While inside, the main module names neither its file nor its module (`__file__`,
    `__spec__`): processes started meanwhile do not run it again."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    hidden_file = main.__dict__.pop("__file__", None)
    spec, main.__spec__ = getattr(main, "__spec__", None), None
    try:
        yield
    finally:
        main.__spec__ = spec
        if hidden_file is not None:
            main.__file__ = hidden_file
