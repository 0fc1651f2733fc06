"""``parquet:PATH``: Parquet image tables in the Hugging Face ``datasets`` layout.

PATH is a ``.parquet`` file or a folder searched recursively. Each table has an ``image`` struct
column ``{bytes, path}`` (the encoded image) and a ``label`` column: an integer, or a list of
integers for multi-label data. The split is the file name up to its first ``-``
(``train-00000-of-00004.parquet`` -> ``train``, ``test.parquet`` -> ``test``). Class names come
from the ``huggingface`` schema metadata (a ``ClassLabel`` feature) when present, else they are
``"0" .. "K-1"`` with K one more than the largest label.

Rows are read sequentially, in file-name order then row order; the table's order is kept (tables
published on the Hugging Face hub are usually already shuffled). A split sorted by label is said
(:attr:`Source.notes`): its shards would hold a few classes each, and ``train[98%:]`` the last ones.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..layout import check_split_name
from .base import LabelColumnMissing, Sample, SampleChunk, Source, image_ext, split_renames


class ParquetChunk(SampleChunk):
    """Rows ``[start, stop)`` of a split, from the files that hold them: ``(path, its first row in the
    split, its number of rows)``, known when the source was opened (no file's metadata is read again
    to find where a shard's rows are)."""

    def __init__(
        self,
        files: list[tuple[str, int, int]],
        start: int,
        stop: int,
        columns: tuple[str, str | None] = ("image", "label"),
    ) -> None:
        self.files, self.start, self.stop, self.columns = files, start, stop, columns

    def __iter__(self) -> Iterator[Sample]:
        for path, file_start, file_rows in self.files:
            lo, hi = max(self.start - file_start, 0), min(self.stop - file_start, file_rows)
            if lo < hi:
                yield from _read_rows(path, lo, hi, self.columns)


def _read_rows(path: str, lo: int, hi: int, columns: tuple[str, str | None]) -> Iterator[Sample]:
    image_col, label_col = columns  # label_col None: an unlabelled table
    reader = pq.ParquetFile(path)
    first = 0
    for group in range(reader.num_row_groups):
        rows = reader.metadata.row_group(group).num_rows
        if first < hi and first + rows > lo:
            table = reader.read_row_group(group, columns=[c for c in columns if c is not None])
            for row in range(max(lo - first, 0), min(hi - first, rows)):
                image = table.column(image_col)[row].as_py()
                label = table.column(label_col)[row].as_py() if label_col is not None else None
                where = f"{path} row {first + row}"
                if not image or image.get("bytes") is None:
                    raise ValueError(f"{where} has no image bytes (images must be embedded, not referenced by path)")
                if label is None and label_col is not None:
                    raise ValueError(f"{where} has no label")
                data = image["bytes"]
                yield Sample(
                    data,
                    image_ext(data, image.get("path") or ""),
                    tuple(label) if isinstance(label, list) else label,
                    origin=where,
                )
        first += rows


class LabelsOutOfRange(LabelColumnMissing):
    """A split with labels outside the classes: refused, but `unlabelled:` reads the table as it is
    (`reopen`), since it drops the labels."""


class ParquetSource(Source):
    kind = "parquet"
    random_access = False

    def __init__(
        self,
        root: Path,
        classes: list[str],
        multi: bool,
        files: dict[str, list[str]],
        columns: tuple[str, str | None] = ("image", "label"),
        spec: str | None = None,
    ) -> None:
        super().__init__(
            spec or f"{self.kind}:{root}",
            root.stem if root.is_file() else root.name,
            classes,
            "none" if columns[1] is None else "multi" if multi else "single",
        )
        self.files, self.columns = files, columns
        self.rows = {split: [pq.ParquetFile(f).metadata.num_rows for f in paths] for split, paths in files.items()}

    @classmethod
    def open(cls, location: str) -> ParquetSource:
        return cls.from_files(Path(location).expanduser().resolve())

    @classmethod
    def from_files(
        cls,
        root: Path,
        columns: tuple[str, str] = ("image", "label"),
        card_classes: list[str] | None = None,
        spec: str | None = None,
        *,
        labels: bool = True,
        split_options: Sequence[str] = (),
    ) -> ParquetSource:
        """`labels=False` (`unlabelled:`, which drops the labels): a table without the label column is
        read without it, and the labels are not checked against the classes. `split_options` are
        ``FROM:TO`` renames of the splits the file names give (:func:`.base.split_renames`).

        A split whose labels are all -1 (a Hugging Face test split published without its labels,
        as imagenet-1k's) is left out and said so in :attr:`notes`; any other label outside the
        classes refuses the source, naming the split (:class:`LabelsOutOfRange`)."""
        paths = [root] if root.is_file() else sorted(root.rglob("*.parquet"))
        if not paths:
            raise FileNotFoundError(f"{cls.kind} source {root}: no .parquet files there")
        files: dict[str, list[str]] = defaultdict(list)
        folders: dict[str, set[Path]] = defaultdict(set)
        for path in paths:
            split = check_split_name(_split_of(path), str(path))
            files[split].append(str(path))
            folders[split].add(path.parent)
        renames = split_renames(list(split_options), list(files), cls.kind, "SPLIT")
        files = defaultdict(list, {renames.get(split, split): paths for split, paths in files.items()})
        folders = {renames.get(split, split): where for split, where in folders.items()}
        for split, where in folders.items():
            if len(where) > 1:  # Hugging Face's configs: one dataset each, not one split together
                names = ", ".join(sorted(str(w.relative_to(root)) for w in where))
                raise ValueError(
                    f"{cls.kind} source {root}: the files of split {split!r} lie in several folders ({names}), as "
                    "a Hugging Face dataset's configs do; give the folder of one of them"
                )
        schema = pq.read_schema(paths[0])
        image_only = columns[1] not in schema.names and columns[0] in schema.names
        wanted: tuple[str, str | None] = (columns[0], None) if image_only and not labels else columns
        try:
            multi = _check_schema(schema, paths[0], wanted)
        except ValueError as error:
            if image_only:  # `unlabelled:` reads such a table: say so, and let it reopen this one

                def reopen() -> ParquetSource:
                    return cls.from_files(root, columns, card_classes, spec, labels=False, split_options=split_options)

                where = spec or f"{cls.kind}:{root}"
                raise LabelColumnMissing(f"{error} (a table without labels: unlabelled:{where})", reopen) from None
            raise
        for path in paths[1:]:
            if _check_schema(pq.read_schema(path), path, wanted) != multi:
                raise ValueError(f"{path}: label type differs from {paths[0]} (single- vs multi-label)")
        if wanted[1] is None:
            return cls(root, [], False, dict(files), wanted, spec)
        classes = _class_names(schema, columns[1]) or card_classes or _numbered_classes(paths, multi, columns[1])
        if not labels:
            return cls(root, classes, multi, dict(files), columns, spec)
        where = spec or f"{cls.kind}:{root}"

        def without_labels() -> ParquetSource:  # what `unlabelled:` reads: every split, labels not checked
            return cls.from_files(root, columns, card_classes, spec, labels=False, split_options=split_options)

        ranges = {split: _group_ranges(split_paths, columns[1]) for split, split_paths in files.items()}
        # A split's label column, read at most once: for the range check and the order check alike
        labels_of = functools.cache(lambda split: _label_column(files[split], columns[1]))
        try:
            unlabelled = _unlabelled_splits(files, ranges, labels_of, multi, len(classes))
        except ValueError as error:
            raise LabelsOutOfRange(f"{where}: {error}", without_labels) from None
        if len(unlabelled) == len(files):
            raise LabelsOutOfRange(
                f"{where}: every label of the splits {sorted(files)} is -1 (no labels published): to pre-train "
                f"on the images without labels, prepare unlabelled:{where}",
                without_labels,
            )
        source = cls(root, classes, multi, {s: p for s, p in files.items() if s not in unlabelled}, columns, spec)
        for split, count in unlabelled.items():
            source.notes.append(
                f"leaving out split {split!r} ({count} rows): every label is -1, an unlabelled test split as Hugging "
                f"Face publishes them (unlabelled:{where} keeps it, without any labels)"
            )
        for split in [] if multi else sorted(source.files):
            if _sorted_by_label(ranges[split], lambda split=split: labels_of(split)):
                source.notes.append(
                    f"warning: split {split!r} of {where} is sorted by label: each shard will hold a few classes, "
                    f"and a held-out slice such as {split}[98%:] only the last ones; shuffle the table before "
                    "preparing it"
                )
        if unlabelled:  # `unlabelled:` keeps every split
            source.reopen_unlabelled = without_labels
        return source

    def split_sizes(self) -> dict[str, int]:
        return {split: sum(rows) for split, rows in self.rows.items()}

    def sample_nbytes(self, split: str) -> np.ndarray:
        # Estimated per row group from the stored size of the image bytes column: reading the
        # images only to measure them would double the work of preparing.
        sizes = []
        for path in self.files[split]:
            meta = pq.ParquetFile(path).metadata
            for group in range(meta.num_row_groups):
                rg = meta.row_group(group)
                column = next(
                    rg.column(c)
                    for c in range(rg.num_columns)
                    if rg.column(c).path_in_schema == f"{self.columns[0]}.bytes"
                )
                sizes.append(np.full(rg.num_rows, column.total_uncompressed_size // max(rg.num_rows, 1)))
        return np.concatenate(sizes).astype(np.int64) if sizes else np.zeros(0, np.int64)

    def chunk(self, split: str, indices: Sequence[int]) -> ParquetChunk:
        start, stop = int(indices[0]), int(indices[-1]) + 1
        if stop - start != len(indices) or any(int(b) - int(a) != 1 for a, b in itertools.pairwise(indices)):
            raise ValueError("parquet sources read contiguous ascending index ranges only")
        files, first = [], 0
        for path, rows in zip(self.files[split], self.rows[split], strict=True):
            if first < stop and first + rows > start:  # only the files that hold some of the rows
                files.append((path, first, rows))
            first += rows
        return ParquetChunk(files, start, stop, self.columns)


def _split_of(path: Path) -> str:
    """A file's split: its name's first word (`train-00000-of-00002.parquet`), or where that is a
    number (`0000.parquet`, Hugging Face's converted layout `CONFIG/SPLIT/0000.parquet`) its folder's name."""
    word = path.name.split(".")[0].split("-")[0]
    return path.parent.name if word.isdigit() else word


def _check_schema(schema: pa.Schema, path: Path, columns: tuple[str, str | None] = ("image", "label")) -> bool:
    """Validate the Hugging Face image layout; True when labels are lists (multi-label). A label
    column of None: the image column alone (an unlabelled table)."""
    names = schema.names
    image_col, label_col = columns
    if image_col not in names or (label_col is not None and label_col not in names):
        wanted = f"{image_col!r} (struct of bytes, path)" + (f" and {label_col!r}" if label_col is not None else "")
        raise ValueError(f"{path}: expected columns {wanted}; found {names}")
    image = schema.field(image_col).type
    if not pa.types.is_struct(image) or image.get_field_index("bytes") < 0:
        raise ValueError(f"{path}: column {image_col!r} must be a struct with a 'bytes' field, not {image}")
    if label_col is None:
        return False
    label = schema.field(label_col).type
    if pa.types.is_integer(label):
        return False
    if (pa.types.is_list(label) or pa.types.is_large_list(label)) and pa.types.is_integer(label.value_type):
        return True
    raise ValueError(f"{path}: column {label_col!r} must be an integer or a list of integers, not {label}")


def _class_names(schema: pa.Schema, label_col: str = "label") -> list[str] | None:
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta:
        return None
    feature: Any = json.loads(meta).get("info", {}).get("features", {}).get(label_col, {})
    if feature.get("_type") in ("Sequence", "List", "LargeList"):
        feature = feature.get("feature", {})
    names = feature.get("names") if feature.get("_type") == "ClassLabel" else None
    return [str(n) for n in names] if names else None


def _unlabelled_splits(
    files: dict[str, list[str]],
    ranges: dict[str, list[tuple[int, int]] | None],
    labels_of: Callable[[str], pa.ChunkedArray],
    multi: bool,
    num_classes: int,
) -> dict[str, int]:
    """The splits whose every label is -1, with their row counts; raises ValueError for a split with
    other labels outside ``0 .. num_classes - 1``, naming it. The column statistics answer for most
    tables without reading a row; a split whose statistics are missing or out of range is read (its
    label column only)."""
    unlabelled = {}
    for split, paths in files.items():
        groups = ranges[split]
        if groups is not None and all(lo >= 0 and hi < num_classes for lo, hi in groups):
            continue
        labels = labels_of(split)
        rows = len(labels)
        values = pc.list_flatten(labels) if multi else labels
        outside = pc.or_(pc.less(values, 0), pc.greater_equal(values, num_classes))
        if multi:  # rows that hold a label outside
            parents = pc.filter(pc.list_parent_indices(labels), outside)
            bad_rows = len(pc.unique(parents))
        else:
            bad_rows = pc.sum(outside).as_py() or 0
        if not bad_rows:
            continue
        if not multi and bad_rows == rows and pc.all(pc.equal(labels, -1)).as_py():
            unlabelled[split] = rows
            continue
        first = pc.filter(values, outside)[0].as_py()
        raise ValueError(
            f"split {split!r} has {bad_rows} of {rows} rows with labels outside the classes "
            f"0..{num_classes - 1} (e.g. {first}): fix the labels, or move the split's files "
            f"({Path(paths[0]).name} ...) out of the source"
        )
    return unlabelled


def _group_ranges(paths: list[str], label_col: str) -> list[tuple[int, int]] | None:
    """(min, max) of the label column (a list's elements, for multi-label) in each non-empty row group
    of ``paths``, in order, from the files' statistics; None where a row group has none."""
    ranges = []
    for path in paths:
        meta = pq.ParquetFile(path).metadata
        for group in range(meta.num_row_groups):
            rg = meta.row_group(group)
            if rg.num_rows == 0:
                continue
            column = next(
                (
                    rg.column(c)
                    for c in range(rg.num_columns)
                    if rg.column(c).path_in_schema == label_col
                    or rg.column(c).path_in_schema.startswith(f"{label_col}.list.")
                ),
                None,
            )
            stats = column.statistics if column is not None else None
            if stats is None or not stats.has_min_max or stats.null_count:
                return None
            ranges.append((int(stats.min), int(stats.max)))
    return ranges


def _label_column(paths: list[str], label_col: str) -> pa.ChunkedArray:
    """A split's labels, its files' label column alone."""
    return pa.chunked_array(
        [pq.read_table(path, columns=[label_col]).column(label_col).combine_chunks() for path in paths]
    )


def _sorted_by_label(ranges: list[tuple[int, int]] | None, labels_of: Callable[[], pa.ChunkedArray]) -> bool:
    """Whether a single-label split's rows come in label order (two labels or more, never decreasing):
    from the row groups' statistics where there are several, else from the label column itself."""
    if ranges is not None and len(ranges) > 1:
        in_order = all(ranges[i][1] <= ranges[i + 1][0] for i in range(len(ranges) - 1))
        return in_order and ranges[0][0] < ranges[-1][1]
    labels = labels_of().to_numpy(zero_copy_only=False)
    return len(labels) > 1 and labels[0] < labels[-1] and bool(np.all(np.diff(labels) >= 0))


def _numbered_classes(paths: list[Path], multi: bool, label_col: str = "label") -> list[str]:
    largest = -1
    for path in paths:
        labels = pq.read_table(path, columns=[label_col]).column(label_col)
        if multi:
            labels = pc.list_flatten(labels)
        if len(labels):
            largest = max(largest, pc.max(labels).as_py() or 0)
    return [str(i) for i in range(largest + 1)]
