"""`vitray evaluate`: an evaluation grid fanned out over Ray, written to the results table cell by cell.

- Few-shot (and any method of `vitray.evaluation.methods` that runs as Ray tasks): one Ray task
  per unit of work -- a (checkpoint, benchmark) for few-shot, which extracts the features once and
  solves every (shots, seed) cell -- with its section's resource request (`fewshot.num_cpus` / `num_gpus`).
- Fine-tune: every cell is a Ray Train V2 TorchTrainer run (`run_finetune`), named after the cell
  under `<output>/finetune_runs`, so a re-run resumes a half-done run. The driver calls `fit()`
  from a thread pool sized to what the cluster can hold: V2's `fit()` only blocks on its
  controller actor (0 CPUs, pinned to the driver's node; it skips its SIGINT handler off the main
  thread), so threads cost no cluster resources, whereas a Ray task wrapping `fit()` would hold a
  CPU for nothing and could starve the workers it waits for.
- A fine-tune selection cell trains on the train slice; at its last step the run scores the
  held-out slice and the test split (two evaluators of one type), so the cell is its run. Where the
  protocol re-trains the selected learning rate (VTAB-1k), that final run is submitted as soon as
  its seed's sweep is scored.
- The driver alone appends to the results table, each cell as soon as it finishes. A cell that
  fails (an error, or its Ray worker crashed) is tried again up to `retries` times in the same
  invocation, then recorded as failed with its last error while the rest of the grid goes on.
  Finished cells are skipped on a re-run; failed and missing ones are retried. Data that is not prepared
  gives "missing" rows whose message is the `vitray data prepare` command.
"""

from __future__ import annotations

import functools
import math
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import ray
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from vitray import storage
from vitray.cluster.checkpoint_inputs import absolute, checkpoint_ref, resolve_checkpoints
from vitray.cluster.finetune import finetune_cell_metrics
from vitray.cluster.grid_checks import check_grid_storage, check_work
from vitray.cluster.run_attempts import stopping_by_user
from vitray.cluster.runtime import RayLost, check_ray_alive, connect
from vitray.common.failures import describe_failure
from vitray.evaluation.config import GridConfig
from vitray.evaluation.grid import GridPlan, plan_grid
from vitray.evaluation.methods import METHODS, TASK, CheckpointRef, GridWork, PendingWork, finetune
from vitray.evaluation.methods.finetune import FinetuneJob
from vitray.evaluation.results import CellOutcome, ResultsTable, error_text, of_current_data
from vitray.evaluation.suite import data_digest, find_missing
from vitray.runfolder.checkpoint_folders import find_checkpoints, is_checkpoint
from vitray.runfolder.pins import CheckpointPins

# A grid's end merges the results table's parts into one where there are this many (`_compact`).
COMPACT_AT_PARTS = 64


@dataclass
class GridSummary:
    """Counts of one `run_grid` call (cells skipped because an earlier run finished them)."""

    total: int = 0
    skipped: int = 0
    ok: int = 0
    failed: int = 0
    missing: int = 0
    waiting: int = 0  # pending work not started: a cell it waits for did not succeed (a sweep's final run)
    cell_ids: set[str] = field(default_factory=set)  # every cell of this grid (pending work's once released)
    checkpoints: list[str] = field(default_factory=list)
    data: dict[str, str] = field(default_factory=dict)  # benchmark -> digest of its prepared data (if prepared)

    def add(self, outcome: CellOutcome) -> None:
        if outcome.ok:
            self.ok += 1
        else:
            self.failed += 1


def run_grid(
    grid: GridConfig,
    checkpoints: Iterable[CheckpointRef],
    *,
    console: Console | None = None,
    show_progress: bool = True,
    verbose: bool = False,
    watched: WatchSummary | None = None,
) -> GridSummary:
    """Evaluates every cell of `grid` x `checkpoints` not finished yet; appends rows as cells finish.
    The summary, counted as cells finish, joins `watched` as soon as the grid is planned: a caller
    stopped part-way (Ctrl-C) still knows what its grid was and what finished."""
    console = console or Console(stderr=True)
    checkpoints = list(checkpoints)
    table = ResultsTable(grid.results_path, storage_options=grid.storage_options)
    data = _data_digests(grid)
    plan = plan_grid(grid, checkpoints, data)
    summary = GridSummary(total=len(plan), checkpoints=[c.path for c in checkpoints], data=data)
    summary.cell_ids.update(c.cell_id for c in plan.cells)
    if watched is not None:
        watched.grids.append(summary)
    scores = _Scores(table.ok_metrics())
    pending = plan.without(scores.finished)
    summary.skipped = len(plan.cells) - len(pending.cells)
    pending = _record_unprepared(pending, grid, table, summary)
    waiting = _Waiting(pending.pending, scores, summary)
    ready = waiting.release()  # what waited for cells an earlier invocation finished
    waiting.take_closed()  # not part of the progress bar's total
    if not pending.cells and not ready and not waiting.work:
        _compact(table, console)
        return summary

    check_work([*pending.work, *ready], grid)  # in seconds, before Ray starts
    connect(grid.cluster.address, verbose=verbose)
    retries = _Retries(grid.retries)
    with (
        CheckpointPins(c.path for c in checkpoints),  # not pruned by a live run while its cells read them
        _progress(console, len(pending.cells) + len(ready) + len(waiting.work), show_progress) as bar,
    ):
        futures: dict[Future, GridWork] = {}
        pool = ThreadPoolExecutor(max_workers=_finetune_slots(grid), thread_name_prefix="finetune")
        runners = _runners(grid, pool, verbose)

        def submit(work: GridWork) -> None:
            futures[runners[work.method](work)] = work

        try:
            for work in [*pending.work, *ready]:
                submit(work)
            while futures:
                done, _ = wait(futures, timeout=1.0, return_when=FIRST_COMPLETED)
                check_ray_alive("the evaluation grid")  # Ray would end this process in silence
                for future in done:
                    work = futures.pop(future)
                    outcomes = _outcomes(future, work)
                    retry = retries.failed_again(work, outcomes)
                    if retry is not None:  # resubmitted; its failed cells are recorded after the last try
                        submit(retry)
                        outcomes = [o for o in outcomes if o.ok]
                    for outcome in outcomes:
                        outcome = retries.annotate(outcome)
                        table.append(outcome.rows())
                        summary.add(outcome)
                        scores.add(outcome)
                        bar.advance(outcome, summary)
                for work in waiting.release():
                    submit(work)
            bar.skip(waiting.take_closed())
        except RayLost:
            # The fine-tune runs see it too: wait for them to end their attempts and release their
            # leases (seconds); Ray's shutdown would wait for the GCS that is gone.
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        except BaseException as error:
            # Ctrl-C (or a results-table error): stop the fine-tunes instead of waiting for them;
            # their runs resume on the next invocation.
            if isinstance(error, KeyboardInterrupt):
                stopping_by_user()  # their attempts end stopped, not failed
            pool.shutdown(wait=False, cancel_futures=True)
            ray.shutdown()
            raise
        pool.shutdown(wait=True)
    _compact(table, console)
    return summary


def _compact(table: ResultsTable, console: Console) -> None:
    """The results table in one part once a grid has appended many (one a finished cell): every
    later read -- the next grid's, the report's, a watcher's after each checkpoint -- lists and
    reads one object, not thousands. Its results are all recorded already: a store that fails
    here costs the merge, not the grid."""
    try:
        table.compact(at_least=COMPACT_AT_PARTS)
    except OSError as error:
        console.print(f"the results table was left in parts (merging them failed: {error})")


def _data_digests(grid: GridConfig) -> dict[str, str]:
    """Benchmark -> the digest of its prepared data, for the grid's benchmarks that are prepared
    (a few small reads each; in parallel, for an object store's latency)."""
    names = [b.name for b in grid.resolved_benchmarks()] if any(grid.section(m).enabled for m in METHODS) else []

    def digest(name: str) -> str | None:
        try:
            return data_digest(name, grid.data_root, storage_options=grid.storage_options)
        except ValueError:  # not a vitray dataset: `_record_unprepared` records why
            return None

    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="data-digest") as pool:
        return {name: d for name, d in zip(names, pool.map(digest, names)) if d is not None}


def _record_unprepared(plan: GridPlan, grid: GridConfig, table: ResultsTable, summary: GridSummary) -> GridPlan:
    """Writes "missing" (or, for a mismatching dataset, "failed") rows for benchmarks whose data
    cannot be read, and returns the plan without them."""
    for name in dict.fromkeys(c.benchmark for c in plan.cells):
        try:
            missing = find_missing(name, grid.data_root, storage_options=grid.storage_options)
            problem = None if missing is None else str(missing)
        except ValueError as error:  # prepared, but not this benchmark's data (class count, label kind)
            missing, problem = None, f"ValueError: {error}"
        if problem is None:
            continue
        cells = plan.for_benchmark(name).cells
        if missing is not None:
            table.append([row for cell in cells for row in cell.missing(problem)])
            summary.missing += len(cells)
        else:
            table.append([row for cell in cells for row in cell.failed(problem, 0.0)])
            summary.failed += len(cells)
        plan = plan.without_benchmark(name)
    return plan


class _Retries:
    """Re-runs failed work up to `retries` more times in this invocation (a crashed Ray worker,
    a flaky read) -- not a failure that would come again (a bad input, a refused config: its
    `describe_failure(...).repeats`); a cell that still fails is recorded as failed, saying how
    often it was tried, and the rest of the grid goes on."""

    def __init__(self, retries: int):
        self.retries = retries
        self.tries: dict[str, int] = {}  # cell_id -> attempts so far

    def failed_again(self, work: GridWork, outcomes: list[CellOutcome]) -> GridWork | None:
        """The work to submit again (only its failed cells), or None when it succeeded or is out of tries."""
        failed = [o.cell for o in outcomes if not o.ok and not describe_failure(o.error).repeats]
        for cell in (o.cell for o in outcomes):
            self.tries[cell.cell_id] = self.tries.get(cell.cell_id, 0) + 1
        again = [c for c in failed if self.tries[c.cell_id] <= self.retries]
        return work.with_cells(tuple(again)) if again else None

    def annotate(self, outcome: CellOutcome) -> CellOutcome:
        tries = self.tries.get(outcome.cell.cell_id, 1)
        if outcome.ok or tries <= 1:
            return outcome
        return replace(
            outcome, error=f"failed {tries} times (grid retries={self.retries}); last error: {outcome.error}"
        )


def _runners(grid: GridConfig, pool: ThreadPoolExecutor, verbose: bool) -> dict[str, Callable[[GridWork], Future]]:
    """Grid method -> how one unit of its work starts, as a future of its cells' outcomes: the
    units of a method that runs as Ray tasks (few-shot) each in a task of its own; fine-tune runs
    from the driver's thread pool (their `fit()` only waits on Ray Train's controller)."""
    runners = {
        name: functools.partial(_submit_task, grid=grid) for name, method in METHODS.items() if method.RUNS_AS == TASK
    }
    runners[finetune.NAME] = lambda job: pool.submit(_finetune_cell, job, grid, verbose)
    return runners


def _submit_task(work: GridWork, grid: GridConfig) -> Future:
    """`work` in a Ray task that calls its method's `run`, with the resources its grid section asks for."""
    method, section = METHODS[work.method], grid.section(work.method)
    task = _remote(method.run).options(
        name=f"vitray-{work.method}", num_cpus=section.num_cpus, num_gpus=section.num_gpus
    )
    return task.remote(work, section, grid.inputs).future()


@functools.cache
def _remote(run: Callable) -> Any:
    return ray.remote(run)


def _finetune_cell(job: FinetuneJob, grid: GridConfig, verbose: bool) -> CellOutcome:
    started = time.perf_counter()
    try:
        metrics = finetune_cell_metrics(job, grid, verbose=verbose)
    except RayLost:
        raise  # not the cell's failure: the grid stops (`run_grid`)
    except Exception as error:
        return CellOutcome(job.cell, error=error_text(error), seconds=time.perf_counter() - started)
    return CellOutcome(job.cell, metrics=metrics, seconds=time.perf_counter() - started)


class _Scores:
    """Finished cells and their metrics: the results table's at the start, plus every outcome since;
    and the cells that failed in this invocation."""

    def __init__(self, metrics: dict[str, dict[str, float]]):
        self.metrics = metrics  # cell_id -> metric -> value, of finished cells
        self.failed: set[str] = set()

    @property
    def finished(self) -> set[str]:
        return set(self.metrics)

    def add(self, outcome: CellOutcome) -> None:
        cell_id = outcome.cell.cell_id
        if outcome.ok:
            self.metrics[cell_id] = {k: float(v) for k, v in (outcome.metrics or {}).items()}
            self.failed.discard(cell_id)
        else:
            self.failed.add(cell_id)


class _Waiting:
    """Pending work (VTAB-1k: the selected lr re-trained on train[:1000]) waiting for its cells.

    :meth:`release` turns every pending unit whose cells are all finished into its work -- or into
    a skipped cell when an earlier invocation finished that work -- and gives up on those with a
    cell that failed in this invocation (a later one retries the cell, then runs the work)."""

    def __init__(self, pending: tuple[PendingWork, ...], scores: _Scores, summary: GridSummary):
        self.work, self.scores, self.summary = list(pending), scores, summary
        self._closed = 0  # given up or found finished: no work for the progress bar

    def release(self) -> list[GridWork]:
        ready, still = [], []
        for pending in self.work:
            ids = [c.cell_id for c in pending.waits_for]
            if all(i in self.scores.metrics for i in ids):
                work = pending.release(self.scores.metrics)
                self.summary.cell_ids.update(c.cell_id for c in work.cells)
                if all(c.cell_id in self.scores.metrics for c in work.cells):
                    self.summary.skipped += 1
                    self._closed += 1
                else:
                    ready.append(work)
            elif any(i in self.scores.failed for i in ids):
                self.summary.waiting += 1
                self._closed += 1
            else:
                still.append(pending)
        self.work = still
        return ready

    def take_closed(self) -> int:
        """Pending work closed without being run since the last call."""
        closed, self._closed = self._closed, 0
        return closed


def _outcomes(future: Future, work: GridWork) -> list[CellOutcome]:
    try:
        result = future.result()
    except RayLost:
        raise
    except Exception as error:
        return [CellOutcome(cell, error=error_text(error)) for cell in work.cells]
    return result if isinstance(result, list) else [result]


def _finetune_slots(grid: GridConfig) -> int:
    """Fine-tune runs the cluster can hold at once (or `finetune.max_concurrent`)."""
    settings = grid.finetune
    if settings.max_concurrent:
        return settings.max_concurrent
    resources = ray.cluster_resources()
    if settings.gpus_per_worker > 0:
        fits = resources.get("GPU", 0) / (settings.gpus_per_worker * settings.num_workers)
    else:
        fits = resources.get("CPU", 0) / ((settings.cpus_per_worker or 1.0) * settings.num_workers)  # CPU runs: 1
    return max(1, math.floor(fits))


class _progress:
    """A rich progress bar over the pending cells; `advance(outcome, summary)` moves it. Where the
    console is not a terminal (a log, `ray job logs`) a bar is never redrawn: each finished cell is a
    line there instead (`cell 3/40 ok: digits fewshot shots=5 seed 1: accuracy 0.7500`)."""

    def __init__(self, console: Console, total: int, enabled: bool):
        self.enabled = enabled
        self.console = console
        self.lines = not console.is_terminal
        self.total, self.done = total, 0
        self.bar = Progress(
            TextColumn("[bold]evaluate"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.task = self.bar.add_task("cells", total=total, status="starting...")

    def __enter__(self) -> _progress:
        if self.enabled and not self.lines:
            self.bar.start()
        return self

    def advance(self, outcome: CellOutcome, summary: GridSummary) -> None:
        self.done += 1
        status = f"ok {summary.ok}  failed {summary.failed}  last: {outcome.cell.benchmark} {outcome.cell.method}"
        self.bar.update(self.task, advance=1, status=status)
        if self.enabled and self.lines:
            self.console.print(
                _cell_line(outcome, self.done, self.total), markup=False, highlight=False, soft_wrap=True
            )

    def skip(self, count: int) -> None:
        """Counts final runs that needed no run (finished earlier, or their sweep failed)."""
        self.done += count
        self.bar.update(self.task, advance=count)

    def __exit__(self, *exc) -> None:
        if self.enabled and not self.lines:
            self.bar.stop()


def _cell_line(outcome: CellOutcome, done: int, total: int) -> str:
    from vitray.evaluation.report import setting_label  # (pandas: only where lines are printed)

    cell = outcome.cell
    what = f"{cell.benchmark} {setting_label(cell.method, dict(cell.settings))} seed {cell.seed}"
    if outcome.ok:
        result = ", ".join(f"{name} {value:.4f}" for name, value in sorted((outcome.metrics or {}).items()))
    else:
        result = (outcome.error or "").splitlines()[0][:200]
    return f"cell {done}/{total} {'ok' if outcome.ok else 'failed'}: {what}: {result}"


def reported_results(grid: GridConfig, cells: set[str] | None = None, data: dict[str, str] | None = None) -> pa.Table:
    """The results table as reported: every cell that succeeded (the output folder's results
    accumulate: other checkpoints, earlier grids) on the data as it is now (`data`: this grid's
    benchmarks' digests; a benchmark's results of data prepared again since are left out,
    :func:`~vitray.evaluation.results.of_current_data`), and the failed and missing ones of `cells`
    (this invocation's grid; all when None) -- a failure of a cell no longer planned is no problem
    of this grid, and a later one would never clear it."""
    return _reported(grid, cells, data)[0]


def _reported(
    grid: GridConfig, cells: set[str] | None, data: dict[str, str] | None
) -> tuple[pa.Table, dict[str, tuple[int, int]]]:
    """:func:`reported_results`, and per benchmark the cells of data prepared before left out of it."""
    everything = ResultsTable(grid.results_path, storage_options=grid.storage_options).to_table()
    table, left_out = of_current_data(everything, data or {})
    if cells is None:
        return table, left_out
    keep = [
        status == "ok" or cell_id in cells
        for status, cell_id in zip(table["status"].to_pylist(), table["cell_id"].to_pylist())
    ]
    return table.filter(pa.array(keep, type=pa.bool_())), left_out


def report_grid(
    grid: GridConfig,
    console: Console | None = None,
    *,
    show: bool = True,
    cells: set[str] | None = None,
    data: dict[str, str] | None = None,
) -> str:
    """Writes `<output>/report` (Markdown + PNG plots, uploaded when the output is remote) from the
    results table (:func:`reported_results` of `cells` and `data`), printing the table first when
    `show`; returns the path of report.md."""
    from vitray.evaluation.report import print_table, write_report

    table, left_out = _reported(grid, cells, data)
    if show:
        console = console or Console()
        print_table(table, console=console)
        for benchmark, (before, older) in sorted(left_out.items()):
            for count, which in (
                (before, "evaluated on its data as prepared before"),
                (older, "evaluated by an earlier vitray, which did not record the data they ran on,"),
            ):
                if count:
                    console.print(
                        f"{benchmark}: {count} cell(s) {which} are not reported (their rows stay in {grid.results_path})"
                    )
    if not storage.is_remote(grid.report_path):
        return str(write_report(table, grid.report_path).markdown)
    with tempfile.TemporaryDirectory() as local:
        write_report(table, local)
        storage.publish_folder(local, grid.report_path, grid.storage_options)
    return storage.join(grid.report_path, "report.md")


# ---------------------------------------------------------------------------------------------
# Watching a run that is still training
# ---------------------------------------------------------------------------------------------


@dataclass
class WatchSummary:
    grids: list[GridSummary] = field(default_factory=list)
    finished: bool = False  # the run reached its last step and that checkpoint was evaluated

    @property
    def cell_ids(self) -> set[str]:
        """Every cell of its grids."""
        return {cell_id for summary in self.grids for cell_id in summary.cell_ids}

    @property
    def data(self) -> dict[str, str]:
        """Benchmark -> the digest of its data, as its latest grid found it."""
        return {name: digest for summary in self.grids for name, digest in summary.data.items()}


def watch_run(
    run_path: str,
    grid: GridConfig,
    *,
    poll_seconds: float = 60.0,
    timeout_seconds: float = 24 * 3600.0,
    console: Console | None = None,
    show_progress: bool = True,
    verbose: bool = False,
    on_grid: Callable[[WatchSummary], None] | None = None,
    watched: WatchSummary | None = None,
) -> WatchSummary:
    """Evaluates each new complete checkpoint of a run as it appears, until the run's final
    checkpoint (step == its train.steps) is evaluated or `timeout_seconds` pass. `on_grid` is
    called with what was watched so far after each batch of checkpoints (e.g. to refresh the report)."""
    console = console or Console(stderr=True)
    run_path = absolute(run_path)
    if is_checkpoint(run_path):
        raise ValueError(f"--watch follows a run folder; {run_path} is a checkpoint (drop --watch to evaluate it)")
    if not storage.exists(run_path):
        console.print(f"waiting for {run_path} to appear (the run has not written anything yet)")
    done: set[str] = set()
    watched = watched if watched is not None else WatchSummary()
    deadline = time.monotonic() + timeout_seconds
    while True:
        new = [c for c in find_checkpoints(run_path, leaving_out=done) if c.complete]
        refs = []
        for info in new:
            try:
                refs.append(checkpoint_ref(info))
            except Exception as error:
                console.print(f"skipping {info.path}: {error}")
            done.add(info.path)
        if refs:
            console.print(f"evaluating {len(refs)} new checkpoint(s): steps {', '.join(str(r.step) for r in refs)}")
            run_grid(grid, refs, console=console, show_progress=show_progress, verbose=verbose, watched=watched)
            if on_grid is not None:
                on_grid(watched)
            if any(r.target_steps is not None and r.step is not None and r.step >= r.target_steps for r in refs):
                watched.finished = True
                return watched
        if time.monotonic() + poll_seconds > deadline:
            return watched
        time.sleep(poll_seconds)


def evaluate_checkpoint(
    checkpoint: str,
    grid: GridConfig,
    *,
    all_checkpoints: bool = False,
    watch: bool = False,
    poll_seconds: float = 60.0,
    timeout_seconds: float = 24 * 3600.0,
    console: Console | None = None,
    show_progress: bool = True,
    verbose: bool = False,
) -> WatchSummary:
    """What `vitray evaluate` runs: the grid on CHECKPOINT (a checkpoint, or a run folder's newest
    complete checkpoint, or every one with ``all_checkpoints``), or with ``watch`` on each new
    checkpoint of a run still training, the report brought up to date after each. ``finished`` is
    True unless a watch stopped at its time-out before the run's last step."""
    check_grid_storage(checkpoint, grid, watch=watch)
    watched = WatchSummary()
    try:
        if watch:
            return watch_run(
                checkpoint,
                grid,
                poll_seconds=poll_seconds,
                timeout_seconds=timeout_seconds,
                console=console,
                show_progress=show_progress,
                verbose=verbose,
                on_grid=lambda watched: report_grid(grid, show=False, cells=watched.cell_ids, data=watched.data),
                watched=watched,
            )
        refs = resolve_checkpoints(checkpoint, all_checkpoints=all_checkpoints)
        run_grid(grid, refs, console=console, show_progress=show_progress, verbose=verbose, watched=watched)
    except KeyboardInterrupt:
        # What finished before the stop is in the results; the report shows it too.
        if any(summary.ok for summary in watched.grids):
            report = report_grid(grid, show=False, cells=watched.cell_ids, data=watched.data)
            (console or Console(stderr=True)).print(f"report:  {report} (the cells finished before the stop)")
        raise
    watched.finished = True
    return watched


__all__ = ["GridSummary", "WatchSummary", "evaluate_checkpoint", "report_grid", "run_grid", "watch_run"]
