"""The driver's live view of a run: a rich progress bar fed by the run's metrics file."""

from __future__ import annotations

import threading

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from vitray.trainers.evals import VAL_TOP1
from vitray.trainers.run_files import RunFiles


class TrainingProgress:
    """Polls `<run>/vitray/metrics.jsonl` (local or S3) and shows step, loss, images/s and ETA."""

    def __init__(self, run_dir: str, total_steps: int, poll_seconds: float = 2.0):
        self.files = RunFiles(run_dir)
        self.total = total_steps
        self.poll = poll_seconds
        self._stop = threading.Event()
        self._progress = Progress(
            TextColumn("[bold]pretrain"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
        )
        self._task = self._progress.add_task("steps", total=total_steps, status="starting workers...")
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> "TrainingProgress":
        self._progress.start()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._refresh()
        self._progress.stop()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll):
            self._refresh()

    def _refresh(self) -> None:
        try:
            records = self.files.read_metrics()
        except Exception:  # noqa: BLE001 - the display must never take the run down
            return
        if not records:
            return
        last = records[-1]
        status = f"loss {last.get('loss', float('nan')):.4f}  {last.get('images_per_s', 0):.1f} img/s"
        if VAL_TOP1 in last:
            status += f"  val top-1 {last[VAL_TOP1]:.3f}"
        skipped = sum(int(r.get("skipped_samples", 0)) for r in records)
        if skipped:
            status += f"  {skipped} corrupt sample{'s' if skipped != 1 else ''} skipped"
        self._progress.update(self._task, completed=min(last.get("step", 0), self.total), status=status)
