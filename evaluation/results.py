"""The evaluation grid's results table, written durably one finished cell at a time.

A *cell* is one unit of the grid: (checkpoint, benchmark, method, settings, seed) on the benchmark's
data as prepared (its digest, `data`). Its identity hashes to a stable `cell_id`, so a re-run of the
same grid on the same data can skip finished cells, and data prepared again is evaluated again. A finished
cell becomes one or more rows (one per metric) with its status:

- "ok": the metric values;
- "failed": the error text (retried on the next run);
- "missing": the benchmark's data was not prepared (the error holds the prepare command).

Storage: a folder (local or s3://, through `vitray.storage`) of parquet *part files*, one per
`append`, each written whole before it becomes visible (local: temp name + rename; S3: an object
only appears once its upload completes). Concurrent writers never collide (unique part names), a crash loses at most the
cell being written, and pyarrow reads the parts back as one table.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import time
import traceback
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from vitray import storage

Status = Literal["ok", "failed", "missing"]
# A method's name (`vitray.evaluation.methods.METHODS`; the table takes any method's rows alike).
METHOD_NAME = re.compile(r"[a-z][a-z0-9_]*")
STATUSES: tuple[str, ...] = ("ok", "failed", "missing")
PART_PREFIX = "part-"
MAX_ERROR_CHARS = 4000

SCHEMA = pa.schema(
    [
        pa.field("cell_id", pa.string(), nullable=False),
        pa.field("checkpoint", pa.string(), nullable=False),
        pa.field("step", pa.int64()),
        pa.field("benchmark", pa.string(), nullable=False),
        pa.field("method", pa.string(), nullable=False),
        pa.field("settings", pa.string(), nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
        pa.field("data", pa.string()),  # the digest of the benchmark's prepared data (none: not known)
        pa.field("metric", pa.string()),
        pa.field("value", pa.float64()),
        pa.field("seconds", pa.float64()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("finished_at", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)
COLUMNS: tuple[str, ...] = tuple(SCHEMA.names)


def canonical_settings(settings: Mapping[str, Any]) -> str:
    """Settings as canonical JSON (sorted keys, no spaces) so equal settings hash equally."""
    if not isinstance(settings, Mapping):
        raise TypeError(f"settings must be a mapping such as {{'shots': 10}}, got {type(settings).__name__}")
    try:
        return json.dumps(dict(settings), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"settings must be JSON-serialisable numbers/strings/lists: {err}") from None


def make_cell_id(
    checkpoint: str, benchmark: str, method: str, settings: Mapping[str, Any] | str, seed: int, data: str = ""
) -> str:
    """Stable 16-hex-digit id of a grid cell (sha256 of its identity, independent of the step; the
    data's digest is part of it where it is known)."""
    settings_json = settings if isinstance(settings, str) else canonical_settings(settings)
    parts: list[Any] = [checkpoint, benchmark, method, settings_json, int(seed)]
    identity = json.dumps([*parts, data] if data else parts, separators=(",", ":"))
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Cell:
    """One grid cell; builds its result rows."""

    checkpoint: str
    benchmark: str
    method: str  # its method's NAME (vitray.evaluation.methods)
    settings: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    step: int | None = None
    data: str = ""  # the digest of the benchmark's prepared data (`vitray.evaluation.suite.data_digest`)

    def __post_init__(self) -> None:
        if not _is_method_name(self.method):
            raise ValueError(f"method must be a method name (lowercase letters, digits, _), got {self.method!r}")
        canonical_settings(self.settings)  # fail at construction, not at write time

    @property
    def settings_json(self) -> str:
        return canonical_settings(self.settings)

    @property
    def cell_id(self) -> str:
        return make_cell_id(self.checkpoint, self.benchmark, self.method, self.settings_json, self.seed, self.data)

    def ok(self, metrics: Mapping[str, float], seconds: float) -> list[dict[str, Any]]:
        """Rows of a finished cell, one per metric (e.g. {"accuracy": 0.91})."""
        if not metrics:
            raise ValueError(f"cell {self.cell_id}: an ok result needs at least one metric")
        return [self._row("ok", metric, float(value), seconds, None) for metric, value in metrics.items()]

    def failed(self, error: str | BaseException, seconds: float) -> list[dict[str, Any]]:
        """The row of a cell that raised; it will be retried by the next run."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return [self._row("failed", None, None, seconds, text)]

    def missing(self, reason: str) -> list[dict[str, Any]]:
        """The row of a cell whose dataset is not prepared (`reason` says how to prepare it)."""
        return [self._row("missing", None, None, 0.0, reason)]

    def _row(self, status: Status, metric: str | None, value: float | None, seconds: float, error: str | None):
        return {
            "cell_id": self.cell_id,
            "checkpoint": self.checkpoint,
            "step": self.step,
            "benchmark": self.benchmark,
            "method": self.method,
            "settings": self.settings_json,
            "seed": int(self.seed),
            "data": self.data or None,
            "metric": metric,
            "value": value,
            "seconds": float(seconds),
            "status": status,
            "error": error,
        }


@dataclass(frozen=True)
class CellOutcome:
    """What became of one cell: metrics when it succeeded, else the error text."""

    cell: Cell
    metrics: Mapping[str, float] | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    def rows(self) -> list[dict[str, Any]]:
        """The cell's rows for :class:`ResultsTable`."""
        if self.error is not None:
            return self.cell.failed(self.error, self.seconds)
        return self.cell.ok(dict(self.metrics or {}), self.seconds)


def error_text(error: BaseException, limit: int = 12) -> str:
    """`Type: message` and the innermost frames of the traceback: enough to act on, small to store."""
    frames = traceback.format_exception(type(error), error, error.__traceback__)
    tail = "".join(frames[-limit:]).strip()
    return f"{type(error).__name__}: {error}\n{tail}"


class ResultsTable:
    """A durable, append-only results table at `path` (a local folder or s3://bucket/prefix).

    `append(rows)` writes one part file per call; `to_table()` reads all parts back; a re-opened
    table after a crash holds every cell whose append returned.
    """

    def __init__(self, path: str, *, storage_options: dict[str, Any] | None = None):
        self.path = str(path).rstrip("/")
        self.storage_options = storage_options
        self.fs, self._root = storage.filesystem(self.path, storage_options)

    def __repr__(self) -> str:
        return f"ResultsTable({self.path!r})"

    def append(self, rows: Iterable[Mapping[str, Any]]) -> str | None:
        """Durably adds rows (all of one or more finished cells); returns the part file written."""
        table = _rows_to_table(list(rows))
        if table.num_rows == 0:
            return None
        name = f"{PART_PREFIX}{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.parquet"
        part = storage.join(self.path, name)
        # Readers list only part-*.parquet: the part is invisible until it is complete (local:
        # hidden temp file + rename; object stores: one upload, size-checked, with retries).
        with storage.atomic_write(part, self.storage_options) as sink:
            pq.write_table(table, sink)
        return part

    def part_files(self) -> list[str]:
        """The committed part files (local paths or URLs, like `path`), oldest first."""
        # Other processes append too: never trust a cached listing (s3fs caches directory listings).
        self.fs.invalidate_cache(self._root)
        try:
            names = self.fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return []
        parts = sorted(_basename(n) for n in names)
        return [storage.join(self.path, p) for p in parts if p.startswith(PART_PREFIX) and p.endswith(".parquet")]

    def _read_all(self, attempts: int = 3) -> pa.Table:
        for attempt in range(attempts):
            try:
                return self._read_parts(self.part_files())
            except FileNotFoundError:
                # A concurrent compact() replaced parts after we listed them: list again.
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _read_parts(self, parts: list[str]) -> pa.Table:
        # Fetched concurrently: a grid appends a part per finished cell, and one request after the
        # other took 9 s for 2,000 parts on a local S3 store (minutes on a remote one).
        found = storage.read_all(parts, self.storage_options)
        gone = [part for part in parts if part not in found]
        if gone:
            raise FileNotFoundError(f"{gone[0]} was listed and is gone")
        tables = [pq.read_table(io.BytesIO(found[part]), schema=SCHEMA) for part in parts]
        return pa.concat_tables(tables) if tables else SCHEMA.empty_table()

    def to_table(self, *, latest: bool = True) -> pa.Table:
        """Every row as a pyarrow Table (schema :data:`SCHEMA`).

        With `latest` (default) each cell keeps only its deciding attempt: its most recent "ok"
        attempt if it ever succeeded, else its most recent attempt. Rows are ordered by
        finish time. Duplicate rows (e.g. seen twice during :meth:`compact`) are dropped.
        """
        frame = self._read_all().to_pandas()
        if frame.empty:
            return SCHEMA.empty_table()
        frame = frame.drop_duplicates(subset=["cell_id", "finished_at", "metric", "status"])
        if latest:
            frame = _deciding_attempts(frame)
        frame = frame.sort_values(["finished_at", "cell_id", "metric"], kind="stable", na_position="first")
        table = pa.Table.from_pandas(frame.reset_index(drop=True), schema=SCHEMA, preserve_index=False)
        return table.replace_schema_metadata(None)

    def to_pandas(self, *, latest: bool = True):
        """:meth:`to_table` as a pandas DataFrame."""
        return self.to_table(latest=latest).to_pandas()

    def ok_metrics(self) -> dict[str, dict[str, float]]:
        """cell id -> metric -> value of every cell that succeeded (its deciding attempt)."""
        metrics: dict[str, dict[str, float]] = {}
        for row in self.to_table(latest=True).to_pylist():
            if row["status"] == "ok":
                metrics.setdefault(row["cell_id"], {})[row["metric"]] = float(row["value"])
        return metrics

    def finished_cell_ids(self) -> set[str]:
        """Ids of cells that succeeded; failed and missing cells are not finished (they are retried)."""
        return set(self.ok_metrics())

    def compact(self, at_least: int = 2) -> str | None:
        """Merges all part files into one (fewer objects to list and read on S3 for large grids),
        where there are `at_least` parts; returns the merged part.

        Safe while others append: the merged part is committed before the old ones are deleted,
        and rows seen twice in between are dropped by :meth:`to_table`.
        """
        parts = self.part_files()
        if len(parts) < max(at_least, 2):
            return None
        merged = self.append(self._read_parts(parts).to_pylist())
        # The merged part is committed: deleting the originals now never loses a row.
        for part in parts:
            storage.remove(part, self.storage_options)
        return merged


CELL_KEY = ("checkpoint", "benchmark", "method", "settings", "seed")  # a cell but for its data


def of_current_data(table: pa.Table, data: Mapping[str, str]) -> tuple[pa.Table, dict[str, tuple[int, int]]]:
    """`table` without the successes of superseded data, and per benchmark the number of cells left
    out: (those of data prepared before, those an earlier vitray evaluated without recording their
    data). For a benchmark in `data` (its name -> the digest of its data as prepared now) only the
    results of that data are kept; for any other, each cell's (:data:`CELL_KEY`) results of the data
    it was last evaluated on. Rows that are not successes stay: a failure is no result of its data."""
    frame = table.to_pandas()
    if frame.empty:
        return table, {}
    digest = frame["data"].fillna("")
    current = frame["benchmark"].map(dict(data))
    ok = frame["status"] == "ok"
    # Each cell's latest success says which data it was last evaluated on (a failure since says nothing)
    latest = (
        digest[ok]
        .groupby([frame.loc[ok, c] for c in CELL_KEY])
        .transform(lambda cell: cell.loc[frame.loc[cell.index, "finished_at"].idxmax()])
        .reindex(frame.index)
    )
    keep = ~ok | current.isna() & (digest == latest) | (digest == current)
    dropped = frame[~keep].drop_duplicates("cell_id")
    unrecorded = dropped["data"].fillna("") == ""
    before, older = dropped[~unrecorded]["benchmark"].value_counts(), dropped[unrecorded]["benchmark"].value_counts()
    return table.filter(pa.array(keep.to_numpy(dtype=bool), type=pa.bool_())), {
        str(k): (int(before.get(k, 0)), int(older.get(k, 0))) for k in sorted({*before.index, *older.index})
    }


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _rows_to_table(rows: list[Mapping[str, Any]]) -> pa.Table:
    now = time.time_ns() // 1000
    clean = []
    for i, row in enumerate(rows):
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise ValueError(f"row {i} has unknown columns {sorted(unknown)}; valid: {', '.join(COLUMNS)}")
        full = {name: row.get(name) for name in COLUMNS}
        if full["finished_at"] is None:
            full["finished_at"] = now
        _check_row(full, i)
        if full["error"] is not None and len(full["error"]) > MAX_ERROR_CHARS:
            full["error"] = shorten_error(full["error"])
        clean.append(full)
    return pa.Table.from_pylist(clean, schema=SCHEMA)


def shorten_error(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to about ``limit`` characters in the middle: its start says what failed, its
    end holds the root cause (a traceback's last line, what tables and reports show)."""
    if len(text) <= limit:
        return text
    head, tail = limit // 4, limit - limit // 4 - 40
    return f"{text[:head]}\n... ({len(text) - head - tail} characters cut) ...\n{text[-tail:]}"


def _is_method_name(method: object) -> bool:
    return isinstance(method, str) and METHOD_NAME.fullmatch(method) is not None


def _check_row(row: dict[str, Any], i: int) -> None:
    for name in ("cell_id", "checkpoint", "benchmark", "method", "settings", "seed", "status"):
        if row[name] is None:
            raise ValueError(f"row {i}: column {name!r} is required")
    if not _is_method_name(row["method"]):
        raise ValueError(f"row {i}: method must be a method name (lowercase letters, digits, _), got {row['method']!r}")
    if row["status"] not in STATUSES:
        raise ValueError(f"row {i}: status must be one of {', '.join(STATUSES)}, got {row['status']!r}")
    if row["status"] == "ok":
        value = row["value"]
        if row["metric"] is None or value is None or not math.isfinite(float(value)):
            raise ValueError(f"row {i}: an ok row needs a metric name and a finite value, got {row['value']!r}")
    elif not row["error"]:
        raise ValueError(f"row {i}: a {row['status']} row needs an error text saying why")


def _deciding_attempts(frame):
    """Keeps, per cell, the rows of its latest ok attempt, or of its latest attempt if none is ok."""
    if frame.empty:
        return frame
    is_ok = frame["status"] == "ok"
    ok_cells = set(frame.loc[is_ok, "cell_id"])
    candidates = frame[is_ok | ~frame["cell_id"].isin(ok_cells)]
    last = candidates.groupby("cell_id")["finished_at"].transform("max")
    return candidates[candidates["finished_at"] == last]
