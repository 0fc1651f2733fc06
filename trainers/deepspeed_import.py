"""`import deepspeed` without the second DeepSpeed spends importing mlflow.

DeepSpeed's autotuner, which vitray never runs, imports mlflow at import time whenever it is
installed (the `trackers` extra installs it for log.mlflow): about 1 s of CPU in the start-up of
every training worker, for nothing. mlflow is hidden from that one import, so the autotuner takes
it as absent; everything else (vitray's MLflow tracker, trainers/trackers.py) imports it as usual
afterwards. Import this module before anything from deepspeed.
"""

from __future__ import annotations

import sys


def _import_deepspeed_without_mlflow() -> None:
    hidden = "mlflow" not in sys.modules
    if hidden:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` now raises ImportError
    try:
        import deepspeed  # noqa: F401
    finally:
        if hidden and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]


_import_deepspeed_without_mlflow()
