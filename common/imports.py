"""Importing a library without the optional integrations it loads for itself at import time."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


def import_without(module: str, hidden: tuple[str, ...]) -> ModuleType:
    """`import module`, with each of `hidden` that is not imported yet made to look absent while it
    runs (its `import` raises ImportError: Python's rule for a None in `sys.modules`). A library
    that probes an optional integration as it is imported (`try: import x / except ImportError`)
    then takes it as not installed and skips loading it; afterwards the hidden modules import as
    usual for everyone else. Only for integrations the caller never uses through that library."""
    blocked = [name for name in hidden if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        return importlib.import_module(module)
    finally:
        for name in blocked:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
