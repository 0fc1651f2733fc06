"""What a run that ended prints last: its numbers, where its files are, and what to do with it.

Read from the run folder alone (the metrics file and the latest complete checkpoint), so that what
`vitray pretrain` prints at its end is what the run recorded: the final loss, the last evaluation
results, the mean throughput (and MFU where the run measured it), the checkpoint, the metrics and
TensorBoard folders, and the commands that export or evaluate it.
"""

from __future__ import annotations

import datetime
import shlex
from typing import Any

from vitray.runfolder.checkpoint_folders import latest_complete_checkpoint
from vitray.runfolder.files import RunFiles
from vitray.runfolder.listing import skipped_data, skipped_data_line
from vitray.runfolder.timm_folder import HYBRIDS


def run_report(run_dir: str, *, total_steps: int, wall_s: float) -> list[str]:
    """The lines that end a run's output (`wall_s`: this command's own time)."""
    files = RunFiles(run_dir)
    records = files.read_metrics()
    lines = []
    trained = [r for r in records if "loss" in r]
    if trained:
        last = trained[-1]
        speed = [float(r["images_per_s"]) for r in trained if "images_per_s" in r]
        text = f"step {last['step']} of {total_steps} in {_duration(wall_s)}: final loss {last['loss']:.4f}"
        if speed:
            text += f", {sum(speed) / len(speed):.1f} img/s on average"
        mfu = [float(r["mfu"]) for r in trained if "mfu" in r]
        if mfu:
            text += f", MFU {sum(mfu) / len(mfu):.1%}"
        lines.append(text)
    evaluated = [r for r in records if evaluations(r)]
    if evaluated:
        last = evaluated[-1]
        results = ", ".join(result_text(key, value) for key, value in evaluations(last))
        lines.append(f"evaluations at step {last['step']}: {results}")
    skipped, shards = skipped_data(records)
    if skipped:
        lines.append(
            f"data:        {skipped_data_line(skipped, shards)} (`vitray data verify` finds a shard damaged since "
            "it was written; where it finds none, the images are damaged in the source)"
        )
    checkpoint = latest_complete_checkpoint(run_dir)
    lines.append(f"checkpoint:  {checkpoint.path} (step {checkpoint.step})" if checkpoint else "checkpoint:  none")
    lines.append(f"metrics:     {files.metrics_path}")
    lines.append(f"TensorBoard: tensorboard --logdir {shlex.quote(files.root + '/tensorboard')}")
    if checkpoint is not None:
        quoted = shlex.quote(run_dir)
        lines.append(f"export:      {_export_command(run_dir, (checkpoint.state or {}).get('model') or {})}")
        lines.append(f"evaluate:    vitray evaluate {quoted} -c GRID.yaml --data-root PREPARED_DATA")
    return lines


def _export_command(run_dir: str, model: dict[str, Any]) -> str:
    """The export to suggest: to timm, where timm can build the model (`timm_folder.timm_config`
    refuses a pre-logits layer and a ResNet timm lacks), else safetensors, saying why."""
    name, leaf = str(model.get("name", "")), shlex.quote(_leaf(run_dir))
    if model.get("representation_size"):
        why = "timm's ViT has no pre-logits layer; fine-tuning drops it"
    elif "+" in name and name not in HYBRIDS:
        why = f"timm has no hybrid with the ResNet of {name}"
    else:
        return f"vitray export {shlex.quote(run_dir)} --format timm --out {leaf}-timm"
    return f"vitray export {shlex.quote(run_dir)} --format safetensors --out {leaf}.safetensors ({why})"


# Named like an evaluator's numbers, but an engine's own figures about the step (the xla backend's
# graph compilations): kept in the metrics, not shown as results.
ENGINE_NAMESPACES = ("xla/",)


# An evaluator's count of the images it could not decode and left out of its score (`val/skipped`),
# recorded only where there were any: shown as a count, not as a score.
EVAL_SKIPPED = "skipped"


def result_text(key: str, value: float, digits: int = 4) -> str:
    """One evaluation result as the run's lines show it: "val/top1 0.7830"."""
    if key.endswith("/" + EVAL_SKIPPED):
        return f"{key} {int(value)} (undecodable images, left out of the score)"
    return f"{key} {value:.{digits}f}"


def evaluations(record: dict[str, Any]) -> list[tuple[str, float]]:
    """The evaluators' numbers in a metrics record (named `evaluator/metric`), by evaluator, each
    one's count of skipped images after its scores."""
    return sorted(
        (
            (key, float(value))
            for key, value in record.items()
            if "/" in key
            and not key.startswith(ENGINE_NAMESPACES)
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
        ),
        key=lambda item: (item[0].rsplit("/", 1)[0], item[0].endswith("/" + EVAL_SKIPPED), item[0]),
    )


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def _leaf(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]
