"""`import deepspeed` without the seconds DeepSpeed spends on what vitray never uses.

Two costs in the start-up of every training worker, paid again by every run and restart:

- DeepSpeed's autotuner imports mlflow at import time whenever it is installed (the `trackers`
  extra installs it for log.mlflow): about 1 s of CPU. mlflow is hidden from that one import, so
  the autotuner takes it as absent; everything else (vitray's MLflow tracker, trainers/trackers.py)
  imports it as usual afterwards.
- Every `deepspeed.initialize` with ZeRO, and every ZeRO gradient reduction, imports DeepSpeed's
  Muon optimizer to check whether the optimizer is one (vitray's never is: adamw or sgd). That
  module applies `torch.compile` to three functions as it is imported, and `torch.compile` imports
  torch's inductor compiler: about 1.5 s of CPU per worker. It is imported here once with
  `torch.compile` standing aside, so those three functions stay eager (they only ever run for
  Muon); `torch.compile` itself is untouched afterwards (vitray's `train.compile` uses it).

Import this module before anything from deepspeed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vitray.common.imports import import_without


def _left_eager(model: Callable[..., Any] | None = None, **_: Any) -> Any:
    """`torch.compile`'s signature, compiling nothing (as a decorator, with or without arguments)."""
    return model if model is not None else (lambda fn: fn)


def _import_muon_uncompiled() -> None:
    import torch

    compile_ = torch.compile
    torch.compile = _left_eager  # type: ignore[assignment]
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    finally:
        torch.compile = compile_


import_without("deepspeed", hidden=("mlflow",))
_import_muon_uncompiled()
