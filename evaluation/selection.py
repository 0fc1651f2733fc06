"""Fine-tuning model selection: the learning rate with the best held-out top-1, and its test top-1.

Every fine-tune *selection* cell (one learning rate of a sweep, see
:mod:`vitray.evaluation.methods.finetune`) records two metrics: `val_accuracy` on the held-out slice of the
train split and `accuracy` on the test split. Per (checkpoint, benchmark, seed, other settings)
the reported number is the test top-1 of the lr with the best `val_accuracy` -- or, where the
protocol re-trains that lr on the final train split (VTAB-1k), the final run's test top-1. The
per-lr rows stay in the results table; :func:`selected_finetune` derives the selection from them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import pandas as pd

from vitray.evaluation.methods.base import METRIC
from vitray.evaluation.methods.finetune import TRAIN_SPLIT, VAL_METRIC, VAL_SPLIT, select_lr

SWEEP_KEYS = ("lr", TRAIN_SPLIT, VAL_SPLIT)  # what varies inside one selection (or names its data)

SELECTED_COLUMNS = [
    "checkpoint",
    "step",
    "benchmark",
    "seed",
    "common",
    "lr",
    "lrs",
    "val_split",
    "val",
    "test",
    "train_split",
    "final",
]


def common_settings(settings: Mapping[str, object]) -> str:
    """A fine-tune cell's settings without lr and splits, as canonical JSON: what a sweep shares."""
    kept = {k: v for k, v in settings.items() if k not in SWEEP_KEYS}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"))


def selected_finetune(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (checkpoint, step, benchmark, seed, common settings): the selected learning rate.

    Columns: checkpoint, step, benchmark, seed, common (JSON), lr (selected), lrs (the sweep,
    sorted), val_split, val (its validation top-1), test (the reported test top-1), train_split
    (of the run whose test top-1 is reported), final (True when that is a final re-run).
    Final runs without a sweep (one lr: nothing to select) are rows of their own. Only "ok" rows
    count; a sweep with an unscored lr still selects among the scored ones.
    """
    ok = frame[(frame["method"] == "finetune") & (frame["status"] == "ok")]
    if ok.empty:
        return pd.DataFrame(columns=SELECTED_COLUMNS)
    cells: dict[str, dict] = {}
    for row in ok.itertuples():
        cell = cells.setdefault(
            row.cell_id,
            {
                "checkpoint": row.checkpoint,
                "step": row.step,
                "benchmark": row.benchmark,
                "seed": int(row.seed),
                "settings": json.loads(row.settings),
                "metrics": {},
            },
        )
        cell["metrics"][row.metric] = float(row.value)
    groups: dict[tuple, dict[str, list]] = {}
    for cell in cells.values():
        settings = cell["settings"]
        key = (cell["checkpoint"], _step_key(cell["step"]), cell["benchmark"], cell["seed"], common_settings(settings))
        kind = "sweep" if VAL_SPLIT in settings else "final"
        groups.setdefault(key, {"sweep": [], "final": []})[kind].append(cell)
    rows = []
    for (checkpoint, _, benchmark, seed, common), members in groups.items():
        step = (members["sweep"] or members["final"])[0]["step"]
        base = {"checkpoint": checkpoint, "step": step, "benchmark": benchmark, "seed": seed, "common": common}
        rows += _select(base, members["sweep"], members["final"])
    return pd.DataFrame(rows, columns=SELECTED_COLUMNS)


def _select(base: dict, sweep: list[dict], finals: list[dict]) -> list[dict]:
    finals_by_lr = {float(c["settings"]["lr"]): c for c in finals if METRIC in c["metrics"]}
    scored = {float(c["settings"]["lr"]): c for c in sweep if VAL_METRIC in c["metrics"] and METRIC in c["metrics"]}
    if not scored:  # final runs of a single lr: each is its own result
        return [
            {
                **base,
                "lr": lr,
                "lrs": [lr],
                "val_split": None,
                "val": None,
                "test": c["metrics"][METRIC],
                "train_split": c["settings"].get(TRAIN_SPLIT),
                "final": True,
            }
            for lr, c in sorted(finals_by_lr.items())
        ]
    lr = select_lr({k: c["metrics"][VAL_METRIC] for k, c in scored.items()})
    chosen = scored[lr]
    reported = finals_by_lr.get(lr, chosen)
    return [
        {
            **base,
            "lr": lr,
            "lrs": sorted(scored),
            "val_split": chosen["settings"][VAL_SPLIT],
            "val": chosen["metrics"][VAL_METRIC],
            "test": reported["metrics"][METRIC],
            "train_split": reported["settings"][TRAIN_SPLIT],
            "final": reported is not chosen,
        }
    ]


def _step_key(step: object) -> int:
    return -1 if step is None or pd.isna(step) else int(step)
