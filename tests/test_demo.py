"""`vitray demo` (what `make demo` runs) end to end, shortened: prepare -> pretrain -> evaluate ->
report -> inspect on the built-in digits, as a user runs it (a subprocess with its own embedded Ray).
The model keeps its variant's depth (Ti/4's 12 blocks, depth unset, as the demo's config has it),
so the grid fine-tunes a checkpoint whose recorded depth is None."""

from __future__ import annotations

import pyarrow.parquet as pq
from pretrain_helpers import run, vitray_cmd

from vitray.runfolder.checkpoint_folders import latest_complete_checkpoint

SHORT = [
    "--set",
    "train.steps=12",
    "--set",
    "schedule.warmup_steps=3",
    "--grid-set",
    "fewshot.shots=[1, 5]",
    "--grid-set",
    "fewshot.seeds=1",
    "--grid-set",
    "finetune.steps=8",
    "--grid-set",
    "finetune.warmup_steps=2",
]


def test_the_demo_pretrains_evaluates_every_cell_and_reports(tmp_path):
    out = tmp_path / "demo-output"
    result = run(vitray_cmd("demo", "--out", str(out), *SHORT), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    run_dir = out / "runs" / "demo"
    checkpoint = latest_complete_checkpoint(str(run_dir))
    assert checkpoint is not None and checkpoint.step == 12
    assert checkpoint.state["model"]["name"] == "Ti/4" and checkpoint.state["model"]["depth"] is None

    # Every cell of the grid finished: the few-shot probes (2 shots x 1 seed) and the fine-tune.
    rows = pq.read_table(out / "eval" / "results").to_pandas()
    assert set(rows["status"]) == {"ok"}, rows[["method", "status", "error"]].to_string()
    assert sorted(set(rows["method"])) == ["fewshot", "finetune"]
    assert len(set(rows.loc[rows["method"] == "fewshot", "cell_id"])) == 2
    # Its numbers are in the results the demo prints, whole lines whatever the console's width.
    lines = result.stdout.splitlines()
    finetuned = [line for line in lines if line.startswith("finetune lr of 0.03") and "steps=8" in line]
    assert len(finetuned) == 1, result.stdout[-3000:]
    assert 0.0 <= float(finetuned[0].rsplit(": ", 1)[1]) <= 1.0
    assert any(line.startswith("report/plots: ") and line.endswith("report.md") for line in lines)
    assert (out / "eval" / "report" / "report.md").read_text().count("fine") > 0
    assert any((out / "eval" / "report" / "inspection").glob("*.png"))

    # The demo again into the same output with another model: refused before Ray starts and before
    # the data step (it started Ray, said the data was prepared, then pretrain refused, 22 s in).
    import subprocess
    import time

    started = time.monotonic()
    command = vitray_cmd("demo", "--out", str(out), *SHORT, "--set", "model.depth=2")
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2, again.stdout[-3000:] + again.stderr[-3000:]
    assert "cannot resume with a changed model.depth (None -> 2)" in again.stderr, again.stderr[-3000:]
    assert "for the demo: give another --out" in again.stderr and "1/4 prepare" not in again.stdout + again.stderr
    assert time.monotonic() - started < 60
