"""The benchmark registry and missing-data messages, the durable results table (local, crash,
S3), and the Markdown / PNG report."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from PIL import Image
from rich.console import Console

from vitray.data.layout import DatasetInfo, SplitInfo, write_dataset_info
from vitray.evaluation.report import print_table, summarize, vtab_group_averages, write_report
from vitray.evaluation.results import Cell, ResultsTable, make_cell_id
from vitray.evaluation.suite import (
    BENCHMARKS,
    MissingDataset,
    benchmarks_in_group,
    find_missing,
    get_benchmark,
    locate,
    locate_train,
    require_prepared,
    with_overrides,
)

# The VTAB-1k tasks and class counts as published (Zhai et al. 2019, Table / TFDS builders).
VTAB_TASKS = {
    "natural": {
        "caltech101": 102,
        "cifar100": 100,
        "dtd": 47,
        "flowers102": 102,
        "pets": 37,
        "sun397": 397,
        "svhn": 10,
    },
    "specialized": {"patch_camelyon": 2, "eurosat": 10, "resisc45": 45, "retinopathy": 5},
    "structured": {
        "clevr_count": 8,
        "clevr_dist": 6,
        "dmlab": 6,
        "dsprites_loc": 16,
        "dsprites_ori": 16,
        "kitti_dist": 4,
        "smallnorb_azimuth": 18,
        "smallnorb_elevation": 9,
    },
}


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def test_vtab_tasks_groups_and_class_counts():
    assert len(benchmarks_in_group("vtab")) == 19
    for group, tasks in VTAB_TASKS.items():
        members = benchmarks_in_group(f"vtab/{group}")
        assert {b.name: b.num_classes for b in members} == {f"vtab/{t}": n for t, n in tasks.items()}
        for b in members:
            assert b.vtab_group == group
            assert (b.finetune.learning_rates, b.finetune.steps, b.finetune.batch_size) == ((0.01,), 2500, 512)
            assert (b.finetune.train_split, b.finetune.val_split, b.finetune.final_train_split) == (
                "train[:800]",
                "train[800:1000]",
                "train[:1000]",
            )


def test_paper_benchmarks_follow_the_paper():
    names = {b.name for b in benchmarks_in_group("paper")}
    assert names == {"imagenet", "imagenet_real", "cifar10", "cifar100", "pets", "flowers102"}
    assert {n: get_benchmark(n).num_classes for n in names} == {
        "imagenet": 1000,
        "imagenet_real": 1000,
        "cifar10": 10,
        "cifar100": 100,
        "pets": 37,
        "flowers102": 102,
    }
    assert get_benchmark("imagenet").finetune.steps == 20_000
    assert get_benchmark("imagenet").finetune.learning_rates == (0.003, 0.01, 0.03, 0.06)  # Table 4
    assert get_benchmark("cifar10").finetune.learning_rates == (0.001, 0.003, 0.01, 0.03)
    assert get_benchmark("pets").finetune.steps == 500
    # Held-out validation: the last 1% (ImageNet), 2% (CIFAR), 10% (Pets, Flowers) of train.
    held_out = {n: (get_benchmark(n).finetune.train_split, get_benchmark(n).finetune.val_split) for n in names}
    assert held_out["imagenet"] == held_out["imagenet_real"] == ("train[:99%]", "train[99%:]")
    assert held_out["cifar10"] == held_out["cifar100"] == ("train[:98%]", "train[98%:]")
    assert held_out["pets"] == held_out["flowers102"] == ("train[:90%]", "train[90%:]")
    assert all(get_benchmark(n).finetune.final_train_split is None for n in names)
    assert get_benchmark("imagenet_real").label_kind == "multi"
    assert get_benchmark("cifar100").fewshot.shots == (1, 5, 10, 25)
    assert get_benchmark("digits").groups == ("demo",)


def _preprocess(name: str) -> tuple[str, float | None, bool]:
    pp = get_benchmark(name).finetune.preprocess
    return pp.crop, pp.min_crop_area if pp.crop == "inception_crop" else None, pp.flip


def test_inception_crop_where_the_authors_take_it():
    # big_vision configs/transfer.py: inception_crop for ImageNet, Pets and Flowers, area from 5%, flip_lr
    for name in ("imagenet", "imagenet_real", "pets", "flowers102"):
        assert _preprocess(name) == ("inception_crop", 0.05, True), name
    assert get_benchmark("pets").finetune.preprocess.describe() == "inception_crop(0.05)|flip_lr"


def test_resmall_crop_for_cifar_as_the_authors_report_it_better():
    for name in ("cifar10", "cifar100"):
        assert _preprocess(name) == ("resmall_crop", None, True), name
    assert get_benchmark("cifar10").finetune.preprocess.describe() == "resmall_crop|flip_lr"


def test_resize_crop_for_vtabs_natural_and_specialized_tasks_and_no_flip_for_svhn():
    # BiT's rule for VTAB: a square resize, a random crop and a flip, unless they change the label
    natural = ("caltech101", "cifar100", "dtd", "flowers102", "pets", "sun397")
    for name in (*natural, "patch_camelyon", "eurosat", "resisc45", "retinopathy"):
        assert _preprocess(f"vtab/{name}") == ("resize_crop", None, True), name
    assert _preprocess("vtab/svhn") == ("resize_crop", None, False)  # digits are not mirror-symmetric


def test_no_crop_where_the_label_is_a_count_distance_or_position_and_no_flip_where_a_mirror_changes_it():
    for name in ("clevr_count", "clevr_dist", "dmlab", "kitti_dist", "smallnorb_elevation"):
        assert _preprocess(f"vtab/{name}") == ("resize", None, True), name
    for name in ("dsprites_loc", "dsprites_ori", "smallnorb_azimuth"):
        assert _preprocess(f"vtab/{name}") == ("resize", None, False), name
    assert _preprocess("digits") == ("resize", None, False)  # 8x8 digits: any crop cuts a stroke
    assert get_benchmark("vtab/dsprites_loc").finetune.preprocess.describe() == "resize"
    # Every benchmark is covered by the four tests above.
    kinds = {b.finetune.preprocess.crop for b in benchmarks_in_group("all")}
    assert kinds == {"inception_crop", "resmall_crop", "resize_crop", "resize"}


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="unknown benchmark 'cifar-10'.*cifar10.*vtab/dtd.*digits"):
        get_benchmark("cifar-10")
    with pytest.raises(ValueError, match="unknown benchmark group 'vtab-natural'.*vtab/natural"):
        benchmarks_in_group("vtab-natural")


def test_locate_paths_local_and_s3():
    assert locate("cifar10", "/data") == "/data/cifar10"
    assert locate("vtab/dtd", "s3://bucket/prepared/") == "s3://bucket/prepared/vtab_dtd"
    assert locate("imagenet_real", "/data") == "/data/imagenet_real"
    assert locate_train("imagenet_real", "/data") == "/data/imagenet"


def _write_dataset_json(folder, splits=("train", "test"), num_classes=10, label_kind="single") -> None:
    """dataset.json through the data layer's own writer (`folder` local Path or s3:// URL)."""
    info = DatasetInfo(
        name=str(folder).rsplit("/", 1)[-1],
        source="test",
        classes=[str(i) for i in range(num_classes)],
        num_classes=num_classes,
        label_kind=label_kind,
        splits={s: SplitInfo(num_samples=10, num_shards=1) for s in splits},
    )
    write_dataset_info(str(folder), info)


def test_missing_dataset_message_is_the_prepare_command(tmp_path):
    missing = find_missing("digits", str(tmp_path))
    assert isinstance(missing, MissingDataset) and missing.path == f"{tmp_path}/digits"
    assert missing.command == f"vitray data prepare builtin:digits {tmp_path}/digits"
    with pytest.raises(MissingDataset, match=re.escape(f"vitray data prepare builtin:digits {tmp_path}/digits")):
        require_prepared("digits", str(tmp_path))
    assert "cifar10:/path/to/cifar-10-binary.tar.gz" in str(find_missing("cifar10", str(tmp_path)))
    assert "pets:/path/to/oxford-iiit-pet" in str(find_missing("pets", str(tmp_path)))

    # A folder that is still being written (shards, no dataset.json yet) is not prepared either.
    (tmp_path / "digits").mkdir()
    (tmp_path / "digits" / "train-000000.tar").write_bytes(b"partial")
    assert "no dataset.json" in str(find_missing("digits", str(tmp_path)))


def test_really_prepared_digits_are_found(digits_dataset):
    """The folder `vitray data prepare builtin:digits` wrote (conftest) passes the check."""
    digits = with_overrides(get_benchmark("digits"), dataset=digits_dataset.name)
    assert find_missing(digits, str(digits_dataset.parent)) is None
    assert require_prepared(digits, str(digits_dataset.parent)) == str(digits_dataset)
    # Wrong benchmark for the folder: caught by the class count.
    cifar100 = with_overrides(get_benchmark("cifar100"), dataset=digits_dataset.name)
    with pytest.raises(ValueError, match="100 classes but the dataset at .* has 10"):
        find_missing(cifar100, str(digits_dataset.parent))


def test_prepared_but_wrong_data_is_reported(tmp_path):
    _write_dataset_json(tmp_path / "digits", splits=("train",))
    assert "has no split 'test' (it has: train)" in str(find_missing("digits", str(tmp_path)))
    _write_dataset_json(tmp_path / "cifar10", num_classes=100)
    with pytest.raises(ValueError, match="10 classes but the dataset at .* has 100"):
        find_missing("cifar10", str(tmp_path))
    # ImageNet-ReaL reads its train split from the ImageNet folder: that one is checked too.
    _write_dataset_json(tmp_path / "imagenet_real", splits=("val",), num_classes=1000)
    with pytest.raises(ValueError, match="needs multi-label test data"):
        find_missing("imagenet_real", str(tmp_path))
    _write_dataset_json(tmp_path / "imagenet_real", splits=("val",), num_classes=1000, label_kind="multi")
    missing = find_missing("imagenet_real", str(tmp_path))
    assert missing.command == (
        f"vitray data prepare 'tfds:/path/to/tensorflow_datasets/imagenet2012/5.1.0?split=validation:val' {tmp_path}/imagenet"
    )  # quoted: the source has a `?`
    _write_dataset_json(tmp_path / "imagenet", splits=("train", "val"), num_classes=1000)
    assert find_missing("imagenet_real", str(tmp_path)) is None


# ---------------------------------------------------------------------------------------------
# Results table
# ---------------------------------------------------------------------------------------------


def test_cell_id_is_stable_and_order_independent():
    a = Cell("runs/r1/checkpoint_000100", "digits", "fewshot", {"shots": 10, "l2": 1024.0}, seed=0, step=100)
    b = Cell("runs/r1/checkpoint_000100", "digits", "fewshot", {"l2": 1024.0, "shots": 10}, seed=0, step=None)
    assert a.cell_id == b.cell_id == make_cell_id(a.checkpoint, "digits", "fewshot", {"shots": 10, "l2": 1024.0}, 0)
    assert a.cell_id != Cell(a.checkpoint, "digits", "fewshot", a.settings, seed=1).cell_id
    assert a.cell_id != Cell(a.checkpoint, "digits", "finetune", a.settings, seed=0).cell_id
    # The documented scheme, spelled out: changing it would make every existing table re-run its grid.
    identity = '["runs/r1/checkpoint_000100","digits","fewshot","{\\"l2\\":1024.0,\\"shots\\":10}",0]'
    assert a.cell_id == hashlib.sha256(identity.encode()).hexdigest()[:16]
    with pytest.raises(
        ValueError, match=r"method must be a method name \(lowercase letters, digits, _\), got 'Linear probe'"
    ):
        Cell("c", "digits", "Linear probe", {})


def test_data_prepared_again_is_evaluated_again_and_reported_alone(digits_dataset, tmp_path):
    """The digest of a benchmark's prepared data is part of its cells: a grid's finished cells of the
    data as it was are not taken for data prepared again (another order, other shards), and the
    report shows the new data's results, saying how many of the old it leaves out."""
    import io
    import shutil

    from vitray.cluster.evaluate import report_grid, reported_results, run_grid
    from vitray.data import dataset_digest, prepare_dataset
    from vitray.evaluation.config import GridConfig
    from vitray.evaluation.grid import plan_grid
    from vitray.evaluation.methods import CheckpointRef
    from vitray.evaluation.suite import data_digest

    root = tmp_path / "data"
    shutil.copytree(digits_dataset, root / "digits")
    before = data_digest("digits", str(root))
    assert before == dataset_digest(str(digits_dataset))  # a copy holds the same data
    grid = GridConfig(
        data_root=str(root),
        output=str(tmp_path / "eval"),
        benchmarks=["digits"],
        fewshot={"shots": [5], "seeds": 2},
        finetune={"enabled": False},
    )
    ref = CheckpointRef(str(tmp_path / "checkpoint_000010"), 10, {"name": "Ti/16", "img_size": 32})
    table = ResultsTable(grid.results_path)
    legacy = Cell(ref.path, "digits", "fewshot", {"shots": 1, "l2_reg": 1024, "img_size": 32}, 0, 10)  # no digest
    table.append(legacy.ok({"accuracy": 0.25}, 1.0))
    old = plan_grid(grid, [ref], {"digits": before}).cells
    for cell in old:
        table.append(cell.ok({"accuracy": 0.5}, 1.0))
    summary = run_grid(grid, [ref], show_progress=False)  # all finished: no Ray to start
    assert (summary.skipped, summary.ok, summary.data) == (2, 0, {"digits": before})
    assert summary.cell_ids == {c.cell_id for c in old}

    shutil.rmtree(root / "digits")
    prepare_dataset("builtin:digits", str(root / "digits"), samples_per_shard=300)  # same images, other shards
    after = data_digest("digits", str(root))
    assert after not in (before, None) and data_digest("cifar10", str(root)) is None
    new = plan_grid(grid, [ref], {"digits": after}).cells
    assert not {c.cell_id for c in new} & summary.cell_ids  # not finished: run again
    for cell in new:
        table.append(cell.ok({"accuracy": 0.75}, 1.0))
    summary = run_grid(grid, [ref], show_progress=False)
    assert (summary.skipped, summary.data) == (2, {"digits": after})

    reported = reported_results(grid, summary.cell_ids, summary.data)
    assert reported["value"].to_pylist() == [0.75, 0.75] and set(reported["data"].to_pylist()) == {after}
    # Where the data as it is now is not known, each cell's latest data (the legacy cell has no other)
    assert sorted(reported_results(grid)["value"].to_pylist()) == [0.25, 0.75, 0.75]
    out = io.StringIO()
    report_grid(grid, Console(file=out, width=400), cells=summary.cell_ids, data=summary.data)
    said = out.getvalue()
    assert (
        f"digits: 2 cell(s) evaluated on its data as prepared before are not reported (their rows stay in {grid.results_path})"
        in said
    )
    # The legacy cell's data is not known at all: not "prepared before", which it may not have been
    assert (
        "digits: 1 cell(s) evaluated by an earlier vitray, which did not record the data they ran on, are not "
        f"reported (their rows stay in {grid.results_path})" in said
    )


def _cell(seed: int, shots: int = 10, benchmark: str = "digits") -> Cell:
    return Cell("runs/r1/checkpoint_000100", benchmark, "fewshot", {"shots": shots}, seed=seed, step=100)


def test_append_reopen_and_retry_semantics(tmp_path):
    table = ResultsTable(str(tmp_path / "results"))
    table.append(_cell(0).ok({"accuracy": 0.8, "l2_reg": 1024.0}, seconds=1.5))
    table.append(_cell(1).failed(RuntimeError("worker died"), seconds=0.2))
    table.append(_cell(2).missing("no dataset.json at /data/digits"))

    reopened = ResultsTable(str(tmp_path / "results"))
    assert reopened.finished_cell_ids() == {_cell(0).cell_id}
    rows = reopened.to_table().to_pylist()
    assert len(rows) == 4
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["metric"]: r["value"] for r in ok} == {"accuracy": 0.8, "l2_reg": 1024.0}
    assert ok[0]["settings"] == '{"shots":10}' and ok[0]["seconds"] == 1.5 and ok[0]["step"] == 100
    failed = next(r for r in rows if r["status"] == "failed")
    assert failed["error"] == "RuntimeError: worker died" and failed["value"] is None

    # The failed cell is retried and succeeds: it is finished, and the deciding attempt is the ok one.
    reopened.append(_cell(1).ok({"accuracy": 0.7}, seconds=1.0))
    assert reopened.finished_cell_ids() == {_cell(0).cell_id, _cell(1).cell_id}
    latest = [r for r in reopened.to_table().to_pylist() if r["cell_id"] == _cell(1).cell_id]
    assert [(r["status"], r["value"]) for r in latest] == [("ok", 0.7)]
    history = [r["status"] for r in reopened.to_table(latest=False).to_pylist() if r["cell_id"] == _cell(1).cell_id]
    assert history == ["failed", "ok"]


def test_a_crash_mid_append_loses_nothing_finished(tmp_path):
    """A writer process is SIGKILLed in the middle of writing its third cell."""
    path = tmp_path / "results"
    script = textwrap.dedent(f"""
        import os, signal
        import pyarrow.parquet as pq
        from vitray.evaluation.results import Cell, ResultsTable

        def cell(seed):
            return Cell("runs/r1/checkpoint_000100", "digits", "fewshot", {{"shots": 10}}, seed=seed, step=100)

        table = ResultsTable({str(path)!r})
        table.append(cell(0).ok({{"accuracy": 0.8}}, 1.0))
        table.append(cell(1).failed("boom", 1.0))

        def die_half_way(tbl, sink, **kwargs):
            sink.write(b"PAR1" + b"\\0" * 100)  # a parquet file's first bytes, then the process dies
            sink.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        pq.write_table = die_half_way
        table.append(cell(2).ok({{"accuracy": 0.9}}, 1.0))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == -9, result.stderr
    assert list(path.glob(".*.tmp")), "the half-written part was left behind under its temp name"

    table = ResultsTable(str(path))
    assert table.finished_cell_ids() == {_cell(0).cell_id}
    assert sorted(r["status"] for r in table.to_table().to_pylist()) == ["failed", "ok"]
    table.append(_cell(2).ok({"accuracy": 0.9}, 1.0))  # the re-run finishes the grid
    assert table.finished_cell_ids() == {_cell(0).cell_id, _cell(2).cell_id}


def test_concurrent_appends_and_compaction(tmp_path):
    table = ResultsTable(str(tmp_path / "results"))

    def writer(first: int) -> None:
        for seed in range(first, first + 10):
            ResultsTable(str(tmp_path / "results")).append(_cell(seed).ok({"accuracy": seed / 100}, 0.1))

    threads = [threading.Thread(target=writer, args=(i * 10,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(table.part_files()) == 40
    before = sorted((r["cell_id"], r["value"]) for r in table.to_table().to_pylist())
    assert len(before) == 40 and table.finished_cell_ids() == {_cell(s).cell_id for s in range(40)}

    table.compact()
    assert len(table.part_files()) == 1
    assert sorted((r["cell_id"], r["value"]) for r in table.to_table().to_pylist()) == before


def test_invalid_rows_are_rejected(tmp_path):
    table = ResultsTable(str(tmp_path / "results"))
    row = _cell(0).ok({"accuracy": 0.5}, 1.0)[0]
    with pytest.raises(ValueError, match="unknown columns \\['acc'\\]"):
        table.append([{**row, "acc": 1}])
    with pytest.raises(ValueError, match="status must be one of ok, failed, missing"):
        table.append([{**row, "status": "done"}])
    with pytest.raises(ValueError, match="finite value"):
        table.append([{**row, "value": float("nan")}])
    with pytest.raises(ValueError, match="error text"):
        table.append([{**row, "status": "failed", "value": None, "metric": None}])
    assert table.part_files() == [] and table.to_table().num_rows == 0


def test_results_table_and_dataset_check_on_s3(seaweed_s3):
    table = ResultsTable(seaweed_s3.url("eval", "results"))
    table.append(_cell(0).ok({"accuracy": 0.8}, 1.0))
    table.append(_cell(1).failed("boom", 1.0))
    reopened = ResultsTable(seaweed_s3.url("eval", "results"))
    assert reopened.part_files()[0].startswith(seaweed_s3.url("eval", "results", "part-"))
    assert reopened.finished_cell_ids() == {_cell(0).cell_id}
    assert reopened.to_table().num_rows == 2
    reopened.compact()
    assert len(reopened.part_files()) == 1 and reopened.finished_cell_ids() == {_cell(0).cell_id}

    root = seaweed_s3.url("prepared")
    missing = find_missing("digits", root)
    assert missing.command == f"vitray data prepare builtin:digits {root}/digits"
    _write_dataset_json(f"{root}/digits")
    assert find_missing("digits", root) is None


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


@pytest.fixture()
def grid_table(tmp_path):
    """Two checkpoints of one run x digits + 3 VTAB tasks x shots 1/5/10 x 3 seeds, plus one failure."""
    rng = np.random.default_rng(0)
    table = ResultsTable(str(tmp_path / "results"))
    for step in (100, 200):
        checkpoint = f"runs/r1/checkpoint_{step:06d}"
        for benchmark in ("digits", "vtab/dtd", "vtab/eurosat", "vtab/dmlab"):
            for shots in (1, 5, 10):
                rows = []
                for seed in range(3):
                    cell = Cell(checkpoint, benchmark, "fewshot", {"shots": shots, "l2": 1024}, seed, step)
                    rows += cell.ok({"accuracy": float(rng.uniform(0.1, 0.9))}, 0.5)
                table.append(rows)
    table.append(
        Cell("runs/r1/checkpoint_000200", "cifar10", "finetune", {"lr": 0.01}, 0, 200).failed(
            "CUDA out of memory | retry with a smaller batch", 3.0
        )
    )
    return table


def _markdown_rows(text: str, header_start: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def test_report_numbers_equal_the_table(grid_table, tmp_path):
    files = write_report(grid_table, tmp_path / "report")
    text = files.markdown.read_text()

    # Independent aggregation of the raw rows: mean and population std over seeds.
    raw = {}
    for r in grid_table.to_table().to_pylist():
        if r["status"] == "ok":
            key = (r["checkpoint"], r["benchmark"], json.loads(r["settings"])["shots"])
            raw.setdefault(key, []).append(r["value"])
    rows = _markdown_rows(text, "| checkpoint | step | benchmark |")
    assert len(rows) == len(raw) == 24
    for checkpoint, step, benchmark, setting, metric, mean, std, seeds, _lr in rows:
        values = raw[(checkpoint, benchmark, int(setting.split("-shot")[0]))]
        assert (metric, int(seeds), int(step)) == ("accuracy", 3, int(checkpoint[-6:]))
        assert float(mean) == pytest.approx(np.mean(values), abs=5e-5)
        assert float(std) == pytest.approx(np.std(values), abs=5e-5)

    groups = _markdown_rows(text, "| checkpoint | step | setting | metric | group |")
    for checkpoint, _, setting, _, group, mean, tasks in groups:
        shots = int(setting.split("-shot")[0])
        members = {
            "natural": ["vtab/dtd"],
            "specialized": ["vtab/eurosat"],
            "structured": ["vtab/dmlab"],
            "all": ["vtab/dtd", "vtab/eurosat", "vtab/dmlab"],
        }[group]
        expected = np.mean([np.mean(raw[(checkpoint, b, shots)]) for b in members])
        assert float(mean) == pytest.approx(expected, abs=5e-5)
        assert tasks == {"natural": "1/7", "specialized": "1/4", "structured": "1/8", "all": "3/19"}[group]
    assert len(groups) == 2 * 3 * 4

    assert "CUDA out of memory \\| retry" in text  # the failed cell, escaped for the table
    assert "1 failed" in text and "72 cells ok" in text


def test_report_plots_are_real_figures(grid_table, tmp_path):
    files = write_report(grid_table, tmp_path / "report")
    assert set(files.plots) == {"accuracy_per_benchmark", "vtab_groups", "fewshot_vs_shots", "accuracy_vs_step"}
    text = files.markdown.read_text()
    for name, path in files.plots.items():
        assert path.parent == files.markdown.parent and f"]({path.name})" in text
        with Image.open(path) as image:
            assert image.format == "PNG" and image.width > 300 and image.height > 200
            pixels = np.asarray(image.convert("L"))
        assert pixels.std() > 10, f"{name} looks blank"

    # Different numbers draw a different figure.
    other = ResultsTable(str(tmp_path / "other"))
    flipped = []
    for row in grid_table.to_table().to_pylist():
        if row["status"] == "ok":
            row["value"] = 1.0 - row["value"]
        flipped.append(row)
    other.append(flipped)
    changed = write_report(other, tmp_path / "other_report")
    for name in files.plots:
        assert files.plots[name].read_bytes() != changed.plots[name].read_bytes(), name


def test_report_only_draws_what_the_data_supports(tmp_path):
    table = ResultsTable(str(tmp_path / "results"))
    for seed in range(2):
        table.append(
            Cell("runs/r2/checkpoint_000050", "cifar10", "finetune", {"lr": 0.01}, seed, 50).ok(
                {"accuracy": 0.9 + seed / 100}, 10.0
            )
        )
    files = write_report(table, tmp_path / "report")
    assert set(files.plots) == {"accuracy_per_benchmark"}
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["accuracy_per_benchmark.png", "report.md"]
    rows = _markdown_rows(files.markdown.read_text(), "| checkpoint | step | benchmark |")
    # Cells from before held-out selection (no splits in their settings) are runs of their own.
    assert rows == [
        ["runs/r2/checkpoint_000050", "50", "cifar10", "finetune lr=0.01", "accuracy", "0.9050", "0.0050", "2", "0.01"]
    ]
    assert "VTAB" not in files.markdown.read_text()

    empty = write_report(ResultsTable(str(tmp_path / "none")), tmp_path / "empty")
    assert empty.plots == {} and "no finished cells" in empty.markdown.read_text()


def test_print_table_shows_means_and_failures(grid_table):
    console = Console(record=True, width=200)
    print_table(grid_table, console=console)
    text = console.export_text()
    summary = summarize(grid_table)
    first = summary.iloc[0]
    assert f"{first['mean']:.4f}" in text and "vtab/eurosat" in text and "10-shot" in text
    assert "CUDA out of memory" in text and "failed" in text


def test_vtab_group_averages_mark_incomplete_groups(grid_table):
    averages = vtab_group_averages(summarize(grid_table, "accuracy"))
    natural = averages[(averages["group"] == "natural") & (averages["step"] == 200)]
    assert set(natural["tasks"]) == {1} and set(natural["total"]) == {7}
    assert set(averages["group"]) == {"natural", "specialized", "structured", "all"}


def test_a_vtab_group_averages_every_task_whatever_its_crop_and_flip(tmp_path):
    """Each VTAB task trains with its own crop and flip (BiT's rules), which are in its setting label:
    grouped by that label, one checkpoint's 19 tasks made four partial averages and no whole one."""
    from vitray.evaluation.methods.finetune import FinetuneGrid, finetune_settings

    table = ResultsTable(str(tmp_path / "results"))
    for name, benchmark in BENCHMARKS.items():
        if benchmark.vtab_group:
            for settings in finetune_settings(benchmark, FinetuneGrid()):
                table.append(
                    Cell("runs/r/checkpoint_000100", name, "finetune", settings, 0, 100).ok({"accuracy": 0.5}, 1.0)
                )
    averages = vtab_group_averages(summarize(table, "accuracy"))
    assert sorted(zip(averages["group"], averages["tasks"], averages["total"])) == [
        ("all", 19, 19),
        ("natural", 7, 7),
        ("specialized", 4, 4),
        ("structured", 8, 8),
    ]
    assert "pp=" not in averages["label"].iloc[0]


# ---------------------------------------------------------------------------------------------
# Fine-tuning: the learning rate selected on the held-out split
# ---------------------------------------------------------------------------------------------


def test_select_lr_takes_the_best_val_and_the_smaller_lr_on_ties():
    from vitray.evaluation.methods.finetune import select_lr

    assert select_lr({0.03: 0.5, 0.01: 0.7, 0.1: 0.6}) == 0.01
    assert select_lr({0.03: 0.7, 0.01: 0.7, 0.001: 0.2}) == 0.01
    with pytest.raises(ValueError, match="no learning rate"):
        select_lr({})


def test_finetune_reports_the_test_top1_of_the_lr_best_on_val(tmp_path):
    from vitray.evaluation.report import fine_tune_sweeps

    rng = np.random.default_rng(1)
    table = ResultsTable(str(tmp_path / "results"))
    checkpoint, lrs = "runs/r3/checkpoint_000100", (0.003, 0.01, 0.03)
    common = {"steps": 100, "batch_size": 64, "warmup_steps": 10, "resolution": 32}
    held_out = {"train_split": "train[:90%]", "val_split": "train[90%:]"}
    expected, scores = [], {}
    for seed in range(3):
        for lr in lrs:
            val, test = float(rng.uniform()), float(rng.uniform())
            scores[seed, lr] = (val, test)
            cell = Cell(checkpoint, "digits", "finetune", {"lr": lr, **common, **held_out}, seed, 100)
            table.append(cell.ok({"val_accuracy": val, "accuracy": test}, 1.0))
        best = max(lrs, key=lambda lr: scores[seed, lr][0])
        expected.append((best, scores[seed, best][1]))
    # VTAB-1k: a sweep on train[:800] / train[800:1000], then the selected lr re-trained on train[:1000].
    vtab = {"train_split": "train[:800]", "val_split": "train[800:1000]"}
    for lr, val in ((0.01, 0.8), (0.03, 0.6)):
        table.append(
            Cell(checkpoint, "vtab/dtd", "finetune", {"lr": lr, **common, **vtab}, 0, 100).ok(
                {"val_accuracy": val, "accuracy": 0.5}, 1.0
            )
        )
    table.append(
        Cell(checkpoint, "vtab/dtd", "finetune", {"lr": 0.01, **common, "train_split": "train[:1000]"}, 0, 100).ok(
            {"accuracy": 0.625}, 1.0
        )
    )

    summary = summarize(table).set_index("benchmark")
    digits = summary.loc["digits"]
    assert digits["mean"] == pytest.approx(np.mean([t for _, t in expected]))
    assert digits["std"] == pytest.approx(np.std([t for _, t in expected])) and digits["seeds"] == 3
    assert digits["lr"] == "/".join(f"{lr:g}" for lr in sorted({lr for lr, _ in expected}))
    assert digits["label"].startswith("finetune lr of 0.003/0.01/0.03 best on train[90%:], trained on train[:90%]")
    dtd = summary.loc["vtab/dtd"]
    assert (dtd["mean"], dtd["lr"], dtd["seeds"]) == (0.625, "0.01", 1) and "re-trained on train[:1000]" in dtd["label"]

    sweeps = fine_tune_sweeps(table)
    digit_sweep = sweeps[sweeps["benchmark"] == "digits"].set_index("lr")
    for lr in lrs:
        assert digit_sweep.loc[lr, "val"] == pytest.approx(np.mean([scores[s, lr][0] for s in range(3)]))
        assert digit_sweep.loc[lr, "test"] == pytest.approx(np.mean([scores[s, lr][1] for s in range(3)]))
        assert digit_sweep.loc[lr, "selected"] == sum(best == lr for best, _ in expected)

    text = write_report(table, tmp_path / "report").markdown.read_text()
    assert "## Fine-tuning: every learning rate" in text and "the held-out validation split" in text
    (row,) = [r for r in _markdown_rows(text, "| checkpoint | step | benchmark |") if r[2] == "vtab/dtd"]
    assert row[5:] == ["0.6250", "0.0000", "1", "0.01"]
    console = Console(record=True, width=250)
    print_table(table, console=console)
    printed = console.export_text()
    assert "train[800:1000]" in printed and "every learning rate" in printed and "0.6250" in printed


def test_each_row_says_how_its_number_was_made(tmp_path):
    """Fine-tune rows name their crop, flip, resolution, steps and lr; few-shot rows their resize and
    crop. The cells are the grid's own (`plan_grid`), so the settings are what a run records."""
    from vitray.evaluation.config import GridConfig
    from vitray.evaluation.grid import plan_grid
    from vitray.evaluation.methods import CheckpointRef

    grid = GridConfig(
        data_root=str(tmp_path),
        output=str(tmp_path / "eval"),
        benchmarks=["cifar10", "vtab/dsprites_loc"],
        fewshot={"shots": [10], "seeds": 1},
        finetune={"learning_rates": [0.01], "steps": 100, "resolution": 64},
    )
    plan = plan_grid(grid, [CheckpointRef("runs/r/checkpoint_000010", 10, {"name": "Ti/16", "img_size": 32})])
    table = ResultsTable(str(tmp_path / "results"))
    for cell in plan.cells:
        metrics = {"accuracy": 0.5} if cell.method == "fewshot" else {"val_accuracy": 0.6, "accuracy": 0.5}
        table.append(cell.ok(metrics, 1.0))
    labels = summarize(table).set_index(["benchmark", "method"])["label"]
    cifar, dsprites = labels["cifar10", "finetune"], labels["vtab/dsprites_loc", "finetune"]
    for part in ("lr of 0.01", "resolution=64", "steps=100", "pp=resmall_crop|flip_lr"):
        assert part in cifar, cifar
    assert dsprites.endswith("pp=resize") and "flip" not in dsprites and "steps=100" in dsprites
    assert labels["cifar10", "fewshot"] == "10-shot img_size=32 l2_reg=1024.0 pp=resize(37)|central_crop(32)"
    text = write_report(table, tmp_path / "report").markdown.read_text()
    assert "pp=resmall_crop\\|flip_lr" in text  # escaped in its Markdown cell

    # The grid's config overrides change what its fine-tune runs compute: other cells (and so other
    # runs), not the finished ones found again, and the label says them.
    overridden = grid.model_copy(
        update={
            "finetune": grid.finetune.model_copy(
                update={"overrides": {"train.label_smoothing": 0.1, "checkpoint.keep": 1, "cluster.max_failures": 2}}
            )
        }
    )
    ref = CheckpointRef("runs/r/checkpoint_000010", 10, {"name": "Ti/16", "img_size": 32})
    before = {c.cell_id for c in plan.cells if c.method == "finetune"}
    after = [c for c in plan_grid(overridden, [ref]).cells if c.method == "finetune"]
    assert len(after) == len(before) and not before & {c.cell_id for c in after}
    assert {c.cell_id for c in plan.cells if c.method == "fewshot"} <= {
        c.cell_id for c in plan_grid(overridden, [ref]).cells
    }
    other = ResultsTable(str(tmp_path / "other"))
    for cell in after:
        other.append(cell.ok({"val_accuracy": 0.6, "accuracy": 0.5}, 1.0))
    (label,) = summarize(other).query("benchmark == 'cifar10'")["label"]
    assert "train.label_smoothing=0.1" in label and "keep" not in label and "max_failures" not in label, label


def test_the_raw_pixel_reference_is_fitted_on_the_prepared_splits(digits_dataset):
    """The demo's context row: a linear classifier on the 8x8 pixels of the prepared digits, fitted
    here; what a ViT's numbers are held against."""
    from vitray.evaluation.reference import in_context, pixel_linear_top1

    reference = pixel_linear_top1(str(digits_dataset), img_size=8)
    assert 0.9 < reference.top1 <= 1.0  # digits are nearly linearly separable in their pixels
    # The splits are the ones asked for: fitted on the 360 test images, it is scored on train[:300].
    swapped = pixel_linear_top1(str(digits_dataset), train_split="test", test_split="train[:300]", img_size=8)
    assert (swapped.train_split, swapped.test_split) == ("test", "train[:300]") and swapped.top1 != reference.top1
    section = in_context([("fine-tuned pp=inception_crop(0.5)|x", 0.85), ("10-shot", 0.7)], reference)
    rows = _markdown_rows(section, "| model |")
    assert [r[0] for r in rows] == [f"reference: {reference.name}", "fine-tuned pp=inception_crop(0.5)\\|x", "10-shot"]
    assert rows[0][1] == f"{reference.top1:.4f}" and rows[1][1] == "0.8500"


def test_an_unset_fewshot_l2_reg_is_the_benchmarks_protocols():
    """ "Unset keys take the benchmark's protocol": the grid's l2_reg defaulted to the constant 2^10, so a
    benchmark's own protocol value was never read."""
    from dataclasses import replace

    from vitray.evaluation.methods.fewshot import FewShotGrid, fewshot_settings

    own = with_overrides(get_benchmark("digits"), fewshot=replace(get_benchmark("digits").fewshot, l2_reg=8.0))
    assert {s["l2_reg"] for s in fewshot_settings(own, FewShotGrid(), 16)} == {8.0}
    assert {s["l2_reg"] for s in fewshot_settings(own, FewShotGrid(l2_reg="select"), 16)} == {"select"}
    assert {s["l2_reg"] for s in fewshot_settings(get_benchmark("digits"), FewShotGrid(), 16)} == {1024.0}
