"""Reading the results table: a rich console table, and a Markdown report with PNG plots.

Every number shown is the mean (and population std) over a cell group's seeds, where a group is
(checkpoint, step, benchmark, method, settings, metric) of the "ok" rows. Fine-tuning shows one
row per learning-rate sweep: per seed the test top-1 of the lr with the best validation top-1 (or
of its final re-run, VTAB-1k), see :mod:`vitray.evaluation.selection`; every lr's validation and
test top-1 are listed in a section of their own. Plots are drawn with
matplotlib's object API on the Agg canvas (no pyplot global state, safe in workers):

- `accuracy_per_benchmark.png`: each benchmark's metric for the newest checkpoint of every run;
- `vtab_groups.png`: VTAB-1k natural / specialized / structured / overall means (VTAB rows only);
- `fewshot_vs_shots.png`: few-shot metric against shots per benchmark (few-shot rows only);
- `accuracy_vs_step.png`: metric against pre-training step (runs with >= 2 evaluated steps).
"""

from __future__ import annotations

import json
import posixpath
import re
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable

from vitray.common.failures import describe_failure
from vitray.data.transforms import EVAL_CROP_FRACTION
from vitray.evaluation.methods.base import METRIC
from vitray.evaluation.methods.finetune import OVERRIDES, VAL_METRIC, VAL_SPLIT
from vitray.evaluation.results import ResultsTable
from vitray.evaluation.selection import selected_finetune
from vitray.evaluation.suite import BENCHMARKS, VTAB_GROUPS, TrainPreprocess

GROUP_KEYS = ["checkpoint", "step", "benchmark", "method", "settings", "metric"]
SUMMARY_COLUMNS = [*GROUP_KEYS, "label", "run", "mean", "std", "seeds", "lr"]
SWEEP_COLUMNS = [
    "checkpoint",
    "step",
    "benchmark",
    "lr",
    "train_split",
    "val_split",
    "val",
    "test",
    "seeds",
    "selected",
]


@dataclass(frozen=True)
class ReportFiles:
    """What :func:`write_report` wrote: the Markdown file and the plots by name."""

    markdown: Path
    plots: dict[str, Path] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------


def as_frame(table: ResultsTable | pa.Table | pd.DataFrame) -> pd.DataFrame:
    """The results as a DataFrame, whatever form they come in."""
    if isinstance(table, ResultsTable):
        return table.to_pandas()
    if isinstance(table, pa.Table):
        return table.to_pandas()
    if isinstance(table, pd.DataFrame):
        return table.copy()
    raise TypeError(f"expected a ResultsTable, pyarrow Table or pandas DataFrame, got {type(table).__name__}")


def setting_label(method: str, settings: str | dict[str, Any]) -> str:
    """Short human label of a cell's settings, e.g. "10-shot img_size=224 l2_reg=1024.0
    pp=resize(256)|central_crop(224)" or "finetune lr=0.01 steps=2500 pp=resmall_crop|flip_lr"."""
    values = json.loads(settings) if isinstance(settings, str) else dict(settings)
    preprocess = preprocess_label(method, values)
    shots = values.pop("shots", None)
    head = f"{shots}-shot" if method == "fewshot" and shots is not None else method
    if shots is not None and method != "fewshot":
        values["shots"] = shots
    rest = " ".join(_setting_words(values) + [preprocess] * bool(preprocess))
    return f"{head} {rest}".strip()


def _setting_words(values: dict[str, Any]) -> list[str]:
    """ "key=value" of each setting, a fine-tune's config overrides each as one of them."""
    values = dict(values)
    overrides = values.pop(OVERRIDES, None) or {}
    return [f"{k}={values[k]}" for k in sorted(values)] + [f"{k}={v}" for k, v in sorted(overrides.items())]


def preprocess_label(method: str, values: dict[str, Any]) -> str:
    """How a cell's images were made, in big_vision's spelling, taking the settings it names out of
    `values`: a few-shot probe's (the authors' few-shot resize and central crop at its resolution)
    or a fine-tune run's training crop and flip ("" for results written before cells recorded it)."""
    if method == "fewshot" and "img_size" in values:
        size = int(values["img_size"])
        return f"pp=resize({round(size / EVAL_CROP_FRACTION)})|central_crop({size})"
    if "crop" not in values:
        return ""
    crop, flip, area = values.pop("crop"), values.pop("flip", True), values.pop("min_crop_area", 0.05)
    return "pp=" + TrainPreprocess(crop, float(area), bool(flip)).describe()


def summarize(table: ResultsTable | pa.Table | pd.DataFrame, metric: str | None = None) -> pd.DataFrame:
    """Mean / std / number of seeds of every ok cell group (optionally of one metric only).

    Few-shot groups are the cells' own; fine-tuning is summarised per learning-rate sweep: the
    test top-1 (metric "accuracy") of the lr each seed selected on its validation split (see
    :func:`fine_tune_sweeps` for every lr's numbers).

    Columns: checkpoint, step, benchmark, method, settings, metric, label, run, mean, std, seeds,
    lr (the selected learning rate(s) of a fine-tuning row, as text; empty for few-shot rows).
    """
    frame = as_frame(table)
    ok = frame[(frame["status"] == "ok") & (frame["method"] != "finetune")]
    parts = []
    if not ok.empty:
        grouped = ok.groupby(GROUP_KEYS, dropna=False, sort=True)["value"]
        part = grouped.agg(mean="mean", std=lambda v: float(np.std(v)), seeds="count").reset_index()
        part["label"] = [setting_label(m, s) for m, s in zip(part["method"], part["settings"])]
        part["lr"] = ""
        parts.append(part)
    if (frame["method"] == "finetune").any():
        parts.append(_selected_summary(frame))
    parts = [p for p in parts if not p.empty]
    if metric is not None:
        parts = [p[p["metric"] == metric] for p in parts]
    if not parts or all(p.empty for p in parts):
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    summary = pd.concat(parts, ignore_index=True)
    summary["run"] = [run_of(c) for c in summary["checkpoint"]]
    # Order shots numerically (1, 5, 10, 25), not as text.
    summary["_shots"] = [json.loads(s).get("shots", -1) for s in summary["settings"]]
    order = ["checkpoint", "step", "benchmark", "method", "_shots", "settings", "metric"]
    summary = summary.sort_values(order, kind="stable", na_position="first").reset_index(drop=True)
    return summary[SUMMARY_COLUMNS]


def _selected_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Fine-tuning rows of :func:`summarize`: each sweep's selected test top-1, over seeds."""
    selected = selected_finetune(frame)
    if selected.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS[:-1])
    selected = selected.assign(
        _step=selected["step"].fillna(-1),
        _lrs=["/".join(f"{lr:g}" for lr in sweep) for sweep in selected["lrs"]],
        _val=selected["val_split"].fillna(""),
        _train=selected["train_split"].fillna(""),
        # Seeds of a sweep may select different lrs and still form one row; runs without a sweep
        # are told apart by their lr.
        _own_lr=[-1.0 if pd.notna(v) else lr for v, lr in zip(selected["val_split"], selected["lr"])],
    )
    rows = []
    keys = ["checkpoint", "_step", "benchmark", "common", "_val", "_train", "final", "_own_lr"]
    for _, part in selected.groupby(keys, sort=False):
        first = part.iloc[0]
        common = json.loads(first["common"])
        swept = bool(first["_val"])
        chosen = "/".join(f"{lr:g}" for lr in sorted(set(part["lr"])))
        settings = {
            **common,
            "lr": chosen if swept else float(first["lr"]),
            "lrs": first["_lrs"],
            "train_split": first["train_split"],
            VAL_SPLIT: first["val_split"] if swept else None,
        }
        rows.append(
            {
                "checkpoint": first["checkpoint"],
                "step": first["step"],
                "benchmark": first["benchmark"],
                "method": "finetune",
                "settings": json.dumps(settings, sort_keys=True),
                "metric": METRIC,
                "label": _sweep_label(common, first, swept),
                "mean": float(part["test"].mean()),
                "std": float(np.std(part["test"])),
                "seeds": len(part),
                "lr": chosen,
            }
        )
    return pd.DataFrame(rows, columns=[*SUMMARY_COLUMNS[:-2], "seeds", "lr"])


def _sweep_label(common: dict[str, Any], row: Any, swept: bool) -> str:
    """ "finetune lr of 0.01/0.03 best on train[90%:], trained on train[:90%] steps=..." (the chosen lr
    has a column of its own, so that sweeps of every task share one label), or, without a sweep,
    "finetune lr=0.01 on train[:1000] steps=..."."""
    common = dict(common)
    preprocess = preprocess_label("finetune", common)
    rest = " ".join(_setting_words(common) + [preprocess] * bool(preprocess))
    if not swept:
        head = f"finetune lr={row['lr']:g}" + (f" on {row['train_split']}" if row["train_split"] else "")
    else:
        trained = "re-trained" if row["final"] else "trained"
        head = f"finetune lr of {row['_lrs']} best on {row['val_split']}, {trained} on {row['train_split']}"
    return f"{head} {rest}".strip()


def fine_tune_sweeps(table: ResultsTable | pa.Table | pd.DataFrame) -> pd.DataFrame:
    """Every learning rate of every fine-tuning sweep: validation and test top-1 (means over seeds)
    and in how many seeds it was the one selected.

    Columns: checkpoint, step, benchmark, lr, train_split, val_split, val, test, seeds, selected.
    """
    frame = as_frame(table)
    ok = frame[(frame["method"] == "finetune") & (frame["status"] == "ok")]
    settings = [json.loads(s) for s in ok["settings"]]
    sweep = ok.assign(
        lr=[s.get("lr") for s in settings],
        train_split=[s.get("train_split") for s in settings],
        val_split=[s.get(VAL_SPLIT) for s in settings],
        step_key=ok["step"].fillna(-1),
    )[[VAL_SPLIT in s for s in settings]]
    if sweep.empty:
        return pd.DataFrame(columns=SWEEP_COLUMNS)
    index = ["checkpoint", "step_key", "benchmark", "lr", "train_split", "val_split"]
    wide = sweep.pivot_table(index=[*index, "seed"], columns="metric", values="value", aggfunc="last").reset_index()
    picks = selected_finetune(frame)
    picks = picks[picks["val_split"].notna()]
    picked = {
        (c, -1 if pd.isna(s) else s, b, sd, lr)
        for c, s, b, sd, lr in zip(picks["checkpoint"], picks["step"], picks["benchmark"], picks["seed"], picks["lr"])
    }
    wide["picked"] = [
        key in picked for key in zip(wide["checkpoint"], wide["step_key"], wide["benchmark"], wide["seed"], wide["lr"])
    ]
    rows = []
    for key, part in wide.groupby(index, sort=True):
        checkpoint, step, benchmark, lr, train_split, val_split = key
        rows.append(
            (
                checkpoint,
                None if step == -1 else int(step),
                benchmark,
                float(lr),
                train_split,
                val_split,
                _mean(part, VAL_METRIC),
                _mean(part, METRIC),
                len(part),
                int(part["picked"].sum()),
            )
        )
    return pd.DataFrame(rows, columns=SWEEP_COLUMNS)


def _mean(part: pd.DataFrame, metric: str) -> float:
    return float(part[metric].mean()) if metric in part else float("nan")


def run_of(checkpoint: str) -> str:
    """The run a checkpoint belongs to: its parent folder (`.../run/checkpoint_000100` -> `.../run`)."""
    parent = posixpath.dirname(str(checkpoint).rstrip("/"))
    return parent or str(checkpoint)


def newest_per_run(summary: pd.DataFrame) -> pd.DataFrame:
    """Rows of each run's newest evaluated checkpoint (largest step; unknown steps count as oldest)."""
    if summary.empty:
        return summary
    steps = summary.assign(_step=summary["step"].fillna(-1))
    newest = steps.groupby("run")["_step"].transform("max")
    kept = steps[steps["_step"] == newest]
    # Several checkpoints of one run without steps: keep them all, they are told apart by name.
    return kept.drop(columns="_step")


_PREPROCESS_WORD = re.compile(r" pp=\S+$")  # the last word of a setting label (`preprocess_label`)


def vtab_group_averages(summary: pd.DataFrame) -> pd.DataFrame:
    """Per (checkpoint, step, label, metric): the mean over VTAB-1k tasks of each group and overall
    (the label without the pre-processing, which is each task's own).

    Columns: checkpoint, step, label, metric, group, mean, tasks, total (tasks present / in group).
    A group mean over fewer tasks than the group has is marked by tasks < total.
    """
    group_of = {name: b.vtab_group for name, b in BENCHMARKS.items() if b.vtab_group}
    vtab = summary[summary["benchmark"].isin(group_of)]
    columns = ["checkpoint", "step", "label", "metric", "group", "mean", "tasks", "total"]
    if vtab.empty:
        return pd.DataFrame(columns=columns)
    totals = {g: sum(1 for v in group_of.values() if v == g) for g in VTAB_GROUPS}
    totals["all"] = len(group_of)
    # Each task trains with its own crop and flip (BiT's VTAB rules): one group's rows differ in their
    # labels' pre-processing, which must not split the group's average into partial ones.
    vtab = vtab.assign(label=[_PREPROCESS_WORD.sub("", label) for label in vtab["label"]])
    rows = []
    for key, part in vtab.groupby(["checkpoint", "step", "label", "metric"], dropna=False, sort=False):
        groups = part["benchmark"].map(group_of)
        for group in (*VTAB_GROUPS, "all"):
            members = part if group == "all" else part[groups == group]
            if not members.empty:
                rows.append((*key, group, float(members["mean"].mean()), len(members), totals[group]))
    return pd.DataFrame(rows, columns=columns)


# ---------------------------------------------------------------------------------------------
# Console
# ---------------------------------------------------------------------------------------------


def print_table(
    table: ResultsTable | pa.Table | pd.DataFrame, *, metric: str | None = None, console: Console | None = None
) -> None:
    """Prints the grid's results (mean ± std over seeds; fine-tuning: the test top-1 at the lr
    selected on the validation split, which the `lr` column shows), every lr of the fine-tuning
    sweeps, and any failed / missing cells."""
    console = console or Console()
    frame = as_frame(table)
    summary = summarize(frame, metric)
    results = RichTable(title="vitray evaluation results", show_lines=False)
    for name, justify in [
        ("checkpoint", "left"),
        ("step", "right"),
        ("benchmark", "left"),
        ("setting", "left"),
        ("metric", "left"),
        ("mean", "right"),
        ("± std", "right"),
        ("seeds", "right"),
        ("lr", "right"),
    ]:
        results.add_column(name, justify=justify)
    for row in summary.itertuples():
        results.add_row(
            escape(_short_checkpoint(row.checkpoint)),
            _step_text(row.step),
            escape(row.benchmark),
            escape(row.label),
            row.metric,
            f"{row.mean:.4f}",
            f"{row.std:.4f}",
            str(row.seeds),
            row.lr,
        )
    if not summary.empty:  # (no cell finished: the cells' table below says why)
        console.print(results)
    sweeps = fine_tune_sweeps(frame)
    if not sweeps.empty:
        lrs = RichTable(title="fine-tuning: every learning rate (the selected one is reported above)")
        for name, justify in [
            ("checkpoint", "left"),
            ("step", "right"),
            ("benchmark", "left"),
            ("lr", "right"),
            ("val split", "left"),
            ("val top-1", "right"),
            ("test top-1", "right"),
            ("seeds", "right"),
            ("selected", "right"),
        ]:
            lrs.add_column(name, justify=justify)
        for row in sweeps.itertuples():
            lrs.add_row(
                escape(_short_checkpoint(row.checkpoint)),
                _step_text(row.step),
                escape(row.benchmark),
                f"{row.lr:g}",
                escape(row.val_split),
                f"{row.val:.4f}",
                f"{row.test:.4f}",
                str(row.seeds),
                f"{row.selected}/{row.seeds}",
            )
        console.print(lrs)
    problems = problem_rows(frame)
    if problems:
        failed = RichTable(title="cells not finished", show_lines=True)
        for name in ("benchmark", "step", "setting", "seed", "status", "error"):
            failed.add_column(name, overflow="fold")
        for row in problems:
            style = "yellow" if row.status == "missing" else "red"
            failed.add_row(
                escape(row.benchmark),
                row.step,
                escape(row.setting),
                row.seed,
                f"[{style}]{row.status}[/{style}]",
                escape(row.cause),
            )
        console.print(failed)


def summary_json(table: ResultsTable | pa.Table | pd.DataFrame, *, metric: str | None = None) -> str:
    """What :func:`print_table` shows, as JSON for scripts (`vitray evaluate --format json`):
    {"results": the summary rows (:func:`summarize`'s columns, `settings` parsed),
    "not_finished": [{benchmark, method, settings, seed, status, cause}]}, the cause on one line."""
    frame = as_frame(table)
    results = json.loads(summarize(frame, metric).to_json(orient="records"))
    for row in results:
        row["settings"] = json.loads(row["settings"])
    problems = [
        {
            "checkpoint": row.checkpoint,
            "benchmark": row.benchmark,
            "method": row.method,
            "settings": json.loads(row.settings),
            "seed": int(row.seed),
            "status": row.status,
            "cause": problem_text(row.status, row.error),
        }
        for row in _problem_cells(frame).itertuples()
    ]
    return json.dumps({"results": results, "not_finished": problems}, indent=1)


# ---------------------------------------------------------------------------------------------
# Markdown + plots
# ---------------------------------------------------------------------------------------------


def write_report(
    table: ResultsTable | pa.Table | pd.DataFrame, out_dir: str | Path, *, metric: str = "accuracy"
) -> ReportFiles:
    """Writes `report.md` and the PNG plots that the data supports into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frame = as_frame(table)
    summary = summarize(frame)
    shown = summarize(frame, metric)
    plots: dict[str, Path] = {}
    newest = newest_per_run(shown)
    vtab = vtab_group_averages(newest)
    if not newest.empty:
        plots["accuracy_per_benchmark"] = _plot_per_benchmark(newest, metric, out / "accuracy_per_benchmark.png")
    if not vtab.empty:
        plots["vtab_groups"] = _plot_vtab_groups(vtab, metric, out / "vtab_groups.png")
    fewshot = newest[newest["method"] == "fewshot"]
    if fewshot["settings"].map(lambda s: json.loads(s).get("shots")).nunique() >= 2:
        plots["fewshot_vs_shots"] = _plot_fewshot_vs_shots(fewshot, metric, out / "fewshot_vs_shots.png")
    over_steps = shown.dropna(subset=["step"])
    if not over_steps.empty and over_steps.groupby("run")["step"].nunique().max() >= 2:
        plots["accuracy_vs_step"] = _plot_vs_step(over_steps, metric, out / "accuracy_vs_step.png")

    markdown = out / "report.md"
    markdown.write_text(_markdown(frame, summary, vtab_group_averages(summary), fine_tune_sweeps(frame), plots, metric))
    return ReportFiles(markdown=markdown, plots=plots)


_SELECTION_NOTE = (
    " Fine-tuning reports, per seed, the test top-1 of the learning rate (column lr) with the best top-1 on "
    "the held-out validation split, or of its re-run on the final train split where the protocol has one."
)


def _markdown(
    frame: pd.DataFrame,
    summary: pd.DataFrame,
    vtab: pd.DataFrame,
    sweeps: pd.DataFrame,
    plots: dict[str, Path],
    metric: str,
) -> str:
    counts = frame.drop_duplicates("cell_id")["status"].value_counts()
    lines = [
        "# vitray evaluation report",
        "",
        f"Generated {datetime.now(UTC):%Y-%m-%d %H:%M UTC} from {len(frame)} rows: "
        f"{counts.get('ok', 0)} cells ok, {counts.get('failed', 0)} failed, {counts.get('missing', 0)} missing. "
        "Values are the mean and population std over seeds."
        + (_SELECTION_NOTE if (summary["method"] == "finetune").any() else ""),
        "",
        "## Results",
        "",
        "| checkpoint | step | benchmark | setting | metric | mean | std | seeds | lr |",
        "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in summary.itertuples():
        lines.append(
            f"| {_cell(row.checkpoint)} | {_step_text(row.step)} | {_cell(row.benchmark)} | {_cell(row.label)} "
            f"| {_cell(row.metric)} | {row.mean:.4f} | {row.std:.4f} | {row.seeds} | {row.lr} |"
        )
    if summary.empty:
        lines.append("| (no finished cells) | | | | | | | | |")
    if not sweeps.empty:
        lines += [
            "",
            "## Fine-tuning: every learning rate",
            "",
            "| checkpoint | step | benchmark | lr | train split | val split | val top-1 | test top-1 | seeds "
            "| selected |",
            "| --- | ---: | --- | ---: | --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for row in sweeps.itertuples():
            lines.append(
                f"| {_cell(row.checkpoint)} | {_step_text(row.step)} | {_cell(row.benchmark)} | {row.lr:g} "
                f"| {_cell(row.train_split)} | {_cell(row.val_split)} | {row.val:.4f} | {row.test:.4f} "
                f"| {row.seeds} | {row.selected}/{row.seeds} |"
            )
    if not vtab.empty:
        lines += [
            "",
            "## VTAB-1k group averages",
            "",
            "| checkpoint | step | setting | metric | group | mean | tasks |",
            "| --- | ---: | --- | --- | --- | ---: | ---: |",
        ]
        for row in vtab.itertuples():
            lines.append(
                f"| {_cell(row.checkpoint)} | {_step_text(row.step)} | {_cell(row.label)} | "
                f"{_cell(row.metric)} | {row.group} | {row.mean:.4f} | {row.tasks}/{row.total} |"
            )
    problems = problem_rows(frame)
    if problems:
        lines += [
            "",
            "## Cells not finished",
            "",
            "| benchmark | step | setting | seed | status | error |",
            "| --- | ---: | --- | ---: | --- | --- |",
        ]
        for row in problems:
            lines.append(
                f"| {_cell(row.benchmark)} | {row.step} | {_cell(row.setting)} | {row.seed} | {row.status} | "
                f"{_cell(row.cause)} |"
            )
    if plots:
        lines += ["", "## Plots", ""]
        for name, path in plots.items():
            lines += [f"![{name.replace('_', ' ')} ({metric})]({path.name})", ""]
    return "\n".join(lines).rstrip() + "\n"


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


# Legend entries are whole setting labels (70-120 characters): wrapped to this many, under the plot.
LEGEND_WRAP = 90


def _legend_height(labels: Iterable[str]) -> float:
    """Inches a legend of `labels` below the plot takes (:func:`_legend_below`)."""
    return 0.25 + 0.19 * sum(len(textwrap.wrap(label, LEGEND_WRAP)) or 1 for label in labels)


def _legend_below(fig, axes) -> None:
    """One legend for the figure, under its plots, its labels wrapped: over the plot it hid the
    bars or lines, and at the side it squeezed them (the labels are long)."""
    entries: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        labels = ["\n".join(textwrap.wrap(label, LEGEND_WRAP)) for label in entries]
        fig.legend(list(entries.values()), labels, loc="outside lower center", fontsize="small", frameon=False)


def _colours(names: Iterable[str]) -> dict[str, Any]:
    """A colour per series name, the same in every panel of a figure."""
    from matplotlib import colormaps

    palette = colormaps["tab10"].colors
    return {name: palette[i % len(palette)] for i, name in enumerate(dict.fromkeys(names))}


def _series_name(row: Any, multi_run: bool) -> str:
    prefix = f"{_short_checkpoint(row.checkpoint)} · " if multi_run else ""
    return prefix + row.label


def _plot_per_benchmark(newest: pd.DataFrame, metric: str, path: Path) -> Path:
    multi_run = newest["checkpoint"].nunique() > 1
    newest = newest.assign(series=[_series_name(r, multi_run) for r in newest.itertuples()])
    benchmarks = list(dict.fromkeys(newest["benchmark"]))
    series = list(dict.fromkeys(newest["series"]))
    height = 0.8 / len(series)
    fig = _figure(8, 1.0 + 0.35 * len(benchmarks) * max(1, len(series) / 2) + _legend_height(series))
    ax = fig.add_subplot()
    positions = np.arange(len(benchmarks))
    for i, name in enumerate(series):
        part = newest[newest["series"] == name].set_index("benchmark").reindex(benchmarks)
        ax.barh(positions + i * height, part["mean"], height=height, xerr=part["std"], label=name, capsize=2)
    ax.set_yticks(positions + height * (len(series) - 1) / 2, benchmarks)
    ax.invert_yaxis()
    ax.set_xlabel(f"{metric} (mean over seeds)")
    ax.set_title(f"{metric} per benchmark")
    _legend_below(fig, [ax])
    fig.savefig(path, dpi=110)
    return path


def _plot_vtab_groups(vtab: pd.DataFrame, metric: str, path: Path) -> Path:
    groups = [g for g in (*VTAB_GROUPS, "all") if g in set(vtab["group"])]
    multi_run = vtab["checkpoint"].nunique() > 1
    vtab = vtab.assign(series=[_series_name(r, multi_run) for r in vtab.itertuples()])
    series = list(dict.fromkeys(vtab["series"]))
    width = 0.8 / len(series)
    fig = _figure(7, 4 + _legend_height(series))
    ax = fig.add_subplot()
    positions = np.arange(len(groups))
    for i, name in enumerate(series):
        part = vtab[vtab["series"] == name].set_index("group").reindex(groups)
        ax.bar(positions + i * width, part["mean"], width=width, label=name)
    labels = [
        f"{g}\n({int(vtab[vtab['group'] == g]['tasks'].max())}/{int(vtab[vtab['group'] == g]['total'].max())})"
        for g in groups
    ]
    ax.set_xticks(positions + width * (len(series) - 1) / 2, labels)
    ax.set_ylabel(f"mean {metric} over tasks")
    ax.set_title("VTAB-1k group averages (tasks present / in group)")
    _legend_below(fig, [ax])
    fig.savefig(path, dpi=110)
    return path


def _plot_fewshot_vs_shots(fewshot: pd.DataFrame, metric: str, path: Path) -> Path:
    multi_run = fewshot["checkpoint"].nunique() > 1
    settings = [json.loads(s) for s in fewshot["settings"]]
    fewshot = fewshot.assign(
        shots=[s.get("shots") for s in settings],
        line=[
            (f"{_short_checkpoint(r.checkpoint)} · " if multi_run else "")
            + r.benchmark
            + "".join(f" {k}={v}" for k, v in sorted(s.items()) if k != "shots")
            for r, s in zip(fewshot.itertuples(), settings)
        ],
    ).dropna(subset=["shots"])
    fig = _figure(7, 4.5 + _legend_height(fewshot["line"].unique()))
    ax = fig.add_subplot()
    for name, part in fewshot.groupby("line", sort=True):
        part = part.sort_values("shots")
        ax.errorbar(part["shots"], part["mean"], yerr=part["std"], marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    shots = sorted(fewshot["shots"].unique())
    ax.set_xticks(shots, [str(int(s)) for s in shots])
    ax.set_xlabel("shots per class")
    ax.set_ylabel(f"{metric} (mean ± std over seeds)")
    ax.set_title(f"few-shot linear probe: {metric} vs shots")
    _legend_below(fig, [ax])
    fig.savefig(path, dpi=110)
    return path


def _plot_vs_step(summary: pd.DataFrame, metric: str, path: Path) -> Path:
    """Small multiples: one panel per benchmark, one line per (run, setting)."""
    multi_run = summary["run"].nunique() > 1
    has_steps = summary.groupby(["run", "benchmark", "label"])["step"].transform("nunique") >= 2
    summary = summary[has_steps]
    benchmarks = list(dict.fromkeys(summary["benchmark"]))
    cols = min(3, len(benchmarks))
    rows = -(-len(benchmarks) // cols)
    names = [
        (f"{_short_checkpoint(r)} · " if multi_run else "") + label
        for r, label in zip(summary["run"], summary["label"])
    ]
    summary = summary.assign(series=names)
    colours = _colours(names)  # one legend for every panel: a series has one colour in all of them
    fig = _figure(max(7.0, 4.2 * cols), 3.2 * rows + _legend_height(colours))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, benchmark in zip(axes.flat, benchmarks):
        part = summary[summary["benchmark"] == benchmark]
        for name, line in part.groupby("series", sort=False):
            line = line.sort_values("step")
            ax.errorbar(
                line["step"], line["mean"], yerr=line["std"], marker="o", capsize=3, label=name, color=colours[name]
            )
        ax.set_title(benchmark, fontsize="medium")
        ax.set_xlabel("pre-training step")
        ax.set_ylabel(metric)
    for ax in list(axes.flat)[len(benchmarks) :]:
        ax.set_visible(False)
    _legend_below(fig, list(axes.flat))
    fig.suptitle(f"{metric} (mean ± std over seeds) during pre-training")
    fig.savefig(path, dpi=110)
    return path


# ---------------------------------------------------------------------------------------------
# Small formatting helpers
# ---------------------------------------------------------------------------------------------


def _problem_cells(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["status"] != "ok"].drop_duplicates("cell_id").sort_values(["benchmark", "step", "seed"])


@dataclass(frozen=True)
class ProblemRow:
    """A row of the "cells not finished" table: one failed cell, or all the cells of a benchmark
    whose data is missing (one reason and one command to fix them all: the paper's grid has 96
    cells for each of its benchmarks)."""

    benchmark: str
    step: str
    setting: str
    seed: str
    status: str
    cause: str


def problem_rows(frame: pd.DataFrame) -> list[ProblemRow]:
    """The cells not finished, as the table and report.md show them."""
    rows = []
    problems = _problem_cells(frame)
    for row in problems[problems["status"] != "missing"].itertuples():
        rows.append(
            ProblemRow(
                row.benchmark,
                _step_text(row.step),
                setting_label(row.method, row.settings),
                str(row.seed),
                row.status,
                problem_text(row.status, row.error),
            )
        )
    missing = problems[problems["status"] == "missing"]
    for (benchmark, error), cells in missing.groupby(["benchmark", missing["error"].fillna("")], sort=False):
        if len(cells) == 1:
            (cell,) = cells.itertuples()
            setting, seed, step = setting_label(cell.method, cell.settings), str(cell.seed), _step_text(cell.step)
        else:
            setting, seed, step = _cells_text(cells), _values_text(cells["seed"]), _values_text(cells["step"])
        rows.append(ProblemRow(benchmark, step, setting, seed, "missing", problem_text("missing", error)))
    return sorted(rows, key=lambda row: row.benchmark)


def _cells_text(cells: pd.DataFrame) -> str:
    """e.g. "96 cells: few-shot 1, 5, 10, 25 shots; finetune lr 0.001, 0.003, 0.01, 0.03"."""
    parts = []
    for method, group in cells.groupby("method", sort=True):
        settings = [json.loads(text) for text in group["settings"]]
        if method == "fewshot":
            parts.append(f"few-shot {_values_text(pd.Series([v.get('shots') for v in settings]))} shots")
        elif all("lr" in values for values in settings):
            parts.append(f"{method} lr {_values_text(pd.Series([v['lr'] for v in settings]))}")
        else:
            parts.append(method)
    return f"{len(cells)} cells: " + "; ".join(parts)


def _values_text(values: pd.Series) -> str:
    """The distinct values, in order: "0, 1, 2" ("" where none is recorded)."""
    present = sorted({value for value in values if value is not None and not pd.isna(value)})
    return ", ".join(f"{int(v)}" if float(v).is_integer() else f"{v:g}" for v in present)


def _short_checkpoint(checkpoint: str) -> str:
    parts = str(checkpoint).rstrip("/").split("/")
    return "/".join(parts[-2:]) if len(parts) > 1 else parts[0]


def _step_text(step: Any) -> str:
    return "" if step is None or pd.isna(step) else str(int(step))


def problem_text(status: str, error: Any) -> str:
    """What a table says about a cell that did not finish: a failure's root cause on one line
    (the whole traceback stays in the results table's `error` column), or a missing dataset's
    reason (which holds the command that prepares it)."""
    if status == "failed" and isinstance(error, str) and error.strip():
        failure = describe_failure(error)
        if failure.kind != "Error":  # else a sentence of vitray's own, shown as written
            return failure.one_line(limit=300)
    return _first_lines(error, 3)


def _first_lines(text: Any, n: int) -> str:
    if text is None or (isinstance(text, float) and np.isnan(text)):
        return ""
    return "\n".join(str(text).strip().splitlines()[:n])


def _cell(text: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", "<br>")
