"""The progress of a pass over a dataset's shards (`vitray data prepare`, `vitray data verify`).

On a terminal: rich's bar, with the count, the rate, the time spent and the time left. Without one
(a log file, CI, `| tee`) a bar has no screen to redraw: rich printed it once, cut at 80 columns
("25000/25… images"), and nothing after it. There the progress is a plain line every
:attr:`ShardProgress.line_every_s` seconds and one at the end, never cut, as `vitray pretrain`
writes its steps into a log (runfolder/progress.py).
"""

from __future__ import annotations

import datetime
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class ShardProgress:
    """``with ShardProgress("preparing digits", total=1797) as bar: ... bar.advance(n)``: ``total``
    units (``unit``: "images", "shards") of work, on the console's stream (stderr, where the command
    line's messages go); nothing at all when ``show`` is false."""

    # Without a terminal: a line at most this often (and one when the pass is over).
    line_every_s = 30.0

    def __init__(
        self, title: str, total: int, *, unit: str = "images", show: bool = True, console: Console | None = None
    ):
        self.title, self.total, self.unit, self.show = title, total, unit, show
        self.done = 0
        self._console = console or Console(stderr=True, soft_wrap=True)
        self.lines = not self._console.is_terminal
        self._started = self._said_at = time.monotonic()
        self._progress: Progress | None = None

    def __enter__(self) -> ShardProgress:
        self._started = self._said_at = time.monotonic()
        if self.show and not self.lines:
            self._progress = Progress(
                TextColumn(f"[bold]{self.title}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(f"{self.unit}  {{task.fields[rate]:>7.0f}} {self.unit}/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self._console,
            )
            self._progress.start()
            self._bar = self._progress.add_task(self.unit, total=self.total, rate=0.0)
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, amount: int) -> None:
        """``amount`` more units done."""
        self.done += amount
        now = time.monotonic()
        rate = self.done / (now - self._started) if now > self._started else 0.0
        if self._progress is not None:
            self._progress.update(self._bar, advance=amount, rate=rate)
        elif self.show and self.lines and (self.done >= self.total or now - self._said_at >= self.line_every_s):
            self._console.print(self.line(now), markup=False, highlight=False, soft_wrap=True)
            self._said_at = now

    def line(self, now: float) -> str:
        """ "preparing digits: 900/1,797 images (50%)  850 images/s  0:00:01 spent  eta 0:00:01"."""
        spent = now - self._started
        rate = self.done / spent if spent > 0 else 0.0
        share = self.done / self.total if self.total else 1.0
        text = f"{self.title}: {self.done:,}/{self.total:,} {self.unit} ({share:.0%})  {rate:,.0f} {self.unit}/s"
        text += f"  {datetime.timedelta(seconds=round(spent))} spent"
        if self.done < self.total and rate > 0:
            text += f"  eta {datetime.timedelta(seconds=round((self.total - self.done) / rate))}"
        return text
