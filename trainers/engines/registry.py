"""The engines by name (`train.backend`): adding one is a folder under `trainers/engines/` and one
line here."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from torch import nn

from vitray.trainers.engines.deepspeed import engine as deepspeed
from vitray.trainers.engines.seam import Engine, TrainBackend
from vitray.trainers.engines.xla import engine as xla

ENGINES: dict[str, Engine] = {engine.name: engine for engine in (deepspeed.ENGINE, xla.ENGINE)}


def engine_named(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"train.backend={name!r}: expected one of {', '.join(map(repr, ENGINES))}") from None


def create_backend(
    cfg: Any, model: nn.Module, world_size: int, restore: tuple[Path, dict[str, Any]] | None
) -> TrainBackend:
    """The backend of the engine named by `train.backend` (`cfg`, a TrainingConfig), built around
    `model`. Its module is imported here, on the worker: DeepSpeed and torch-xla take seconds.

    `restore` is the checkpoint this run resumes from (folder, trainer state), which a backend
    may need before building its engine (e.g. to re-shard onto a new world size).
    """
    module, _, name = engine_named(cfg.train.backend).backend.partition(":")
    backend_class = getattr(importlib.import_module(module), name)
    return backend_class(cfg, model, world_size, restore)
