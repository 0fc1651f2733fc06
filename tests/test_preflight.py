"""`vitray pretrain` refuses what cannot run in seconds, before the lease or Ray is touched, in one
line that names the cause and the fix (issue 26): a model that does not build, a dataset that is
missing, empty, not a vitray dataset or made of damaged shards, a split that is not there, a resume
whose checkpoint would not load. A finished run exits at once. Through the CLI (typer's
CliRunner), in-process, so that `ray.is_initialized()` tells whether Ray was started.

Also: a batch of nothing but unreadable samples stops the run naming its shards, and a failure's
root cause is found in Ray Train's report of the workers' tracebacks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import ray
from pretrain_helpers import BASE, in_process_loop, make_checkpoint
from typer.testing import CliRunner

from vitray.cli.main import app
from vitray.common.config import load_config
from vitray.common.failures import describe_failure
from vitray.data.batch import UnreadableData
from vitray.runfolder.files import RunFiles
from vitray.trainers.config import TrainingConfig
from vitray.trainers.driver_checks.preflight import check_inputs, check_resume

PRETRAINED = ["train.steps=8", "checkpoint.every=4"]  # as the `pretrained` fixture ran it


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # rich would wrap the one line at 80 columns otherwise


def _sets(dataset, storage, *extra: str, name: str = "pre") -> list[str]:
    sets = [*BASE, f"data.train={dataset}", f"run.storage={storage}", f"run.name={name}", *extra]
    return [a for s in sets for a in ("--set", s)]


def pretrain(*args: str):
    started = time.monotonic()
    result = CliRunner().invoke(app, ["pretrain", *args])
    assert "Traceback" not in result.output, result.output
    assert not ray.is_initialized(), "Ray was started"
    assert time.monotonic() - started < 30, "a refusal must take seconds"
    return result


def refused(*args: str) -> str:
    result = pretrain(*args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def _damaged_copy(digits_dataset: Path, folder: Path, keep_bytes: int | None) -> Path:
    """The digits dataset with every train shard replaced by as many meaningless bytes (`keep_bytes`
    None: damage of the right size) or cut after its first `keep_bytes` bytes (a valid first tar
    header, then nothing readable)."""
    shutil.copytree(digits_dataset, folder)
    for shard in folder.glob("train-*.tar"):
        data = shard.read_bytes()
        shard.write_bytes(bytes(i % 251 for i in range(len(data))) if keep_bytes is None else data[:keep_bytes])
    return folder


@pytest.mark.parametrize(
    "case, expected",
    [
        ("model.name=Ti/15", ["model: unknown model name 'Ti/15'", "Ti/16"]),
        ("model.img_size=30", ["model: img_size 30 is not divisible by the patch size 4", "28"]),
        ("data.train=MISSING", ["data.train", "does not exist"]),
        ("data.train=EMPTY", ["data.train=", "no dataset.json", "vitray data prepare"]),
        ("data.train=TARS", ["data.train=", "no dataset.json"]),
        ("data.train=DAMAGED", ["data.train:", "train-000000.tar is not a tar archive", "prepare the dataset again"]),
        ("data.train=SHARD", ["data.train=", "train-000000.tar is a file", "holding dataset.json", "e.g. "]),
        ("data.train=LOST", ["data.train=", "1 of the 15 shards the manifest lists are missing (train-000005.tar)"]),
        # a copy cut short (onto a full disk): trained on to the end, exit 0, its samples skipped
        ("data.train=CUT", ["1 of the 15 shards are not of the size the manifest lists (train-000005.tar: ", "verify"]),
        ("data.train_split=validation", ["has no split 'validation'", "['test', 'train']"]),
        # fewer samples than one batch of 32: every worker's loader refused it, Ray started
        (
            "data.train_split=train[:1%]",
            ["split train[:1%] has 14 samples, fewer than one batch (train.batch_size=32)"],
        ),
    ],
)
def test_pretrain_refuses_bad_input_before_ray(case, expected, digits_dataset, tmp_path):
    folders = {
        "MISSING": tmp_path / "nowhere",
        "EMPTY": tmp_path / "empty",
        "TARS": tmp_path / "tars",
        "DAMAGED": tmp_path / "damaged",
    }
    (tmp_path / "empty").mkdir()
    (tmp_path / "tars").mkdir()
    (tmp_path / "tars" / "train-000000.tar").write_bytes(b"\x01" * 2048)
    if case == "data.train=DAMAGED":
        _damaged_copy(digits_dataset, folders["DAMAGED"], keep_bytes=None)
    if case == "data.train=LOST":  # a shard the manifest lists, gone from the storage
        shutil.copytree(digits_dataset, tmp_path / "lost")
        (tmp_path / "lost" / "train-000005.tar").unlink()
    folders["LOST"] = tmp_path / "lost"
    if case == "data.train=CUT":
        shutil.copytree(digits_dataset, tmp_path / "cut")
        shard = tmp_path / "cut" / "train-000005.tar"
        shard.write_bytes(shard.read_bytes()[:4096])
    folders["CUT"] = tmp_path / "cut"
    key, value = case.split("=")
    folders["SHARD"] = digits_dataset / "train-000000.tar"  # a shard of the dataset, not its folder
    value = str(folders.get(value, value))
    line = refused(*_sets(digits_dataset, tmp_path / "runs", f"{key}={value}"))
    for part in expected:
        assert part in line, line
    assert not (tmp_path / "runs").exists(), "a refused run leaves nothing behind (no run folder, no attempt)"


def test_dry_run_checks_the_inputs_too(digits_dataset, tmp_path):
    line = refused(*_sets(digits_dataset, tmp_path / "runs", "model.img_size=30"), "--dry-run")
    assert "not divisible by the patch size" in line


def test_a_resume_that_cannot_load_is_refused_naming_the_keys(pretrained, digits_dataset, tmp_path):
    storage = tmp_path / "storage"
    shutil.copytree(Path(pretrained).parent, storage)
    attempts = len(RunFiles(str(storage / "pre")).read_attempts())
    line = refused(*_sets(digits_dataset, storage, *PRETRAINED, "model.name=S/4", "precision.dtype=bf16"))
    assert "cannot resume with a changed model.name (Ti/4 -> S/4), precision.dtype (fp32 -> bf16)" in line, line
    assert "start a new run (another run.name)" in line
    assert len(RunFiles(str(storage / "pre")).read_attempts()) == attempts, "a refusal records no attempt"


def test_a_resume_in_another_data_stream_is_refused_before_ray(pretrained, digits_dataset, tmp_path):
    """The checkpoint holds a position in its data stream: another seed, shuffle buffer, slot count
    or set of samples failed every worker at its restore, after Ray started (they were listed as
    allowed changes)."""
    storage = tmp_path / "storage"
    shutil.copytree(Path(pretrained).parent, storage)
    more = [*PRETRAINED[1:], "train.steps=12"]
    line = refused(*_sets(digits_dataset, storage, *more, "seed=1", "data.shuffle_buffer=16"))
    assert "cannot resume with a changed seed: 0 -> 1, data.shuffle_buffer: " in line, line
    assert "they decide the order of its data stream" in line and "start a new run (another run.name)" in line
    line = refused(*_sets(digits_dataset, storage, *more, "data.train_split=train[:50%]"))
    assert "was trained on 1,437 samples but data.train=" in line and "split train[:50%] has 718" in line, line


def test_a_finished_run_exits_at_once_saying_so(pretrained, digits_dataset, tmp_path):
    storage = tmp_path / "storage"
    shutil.copytree(Path(pretrained).parent, storage)
    result = pretrain(*_sets(digits_dataset, storage, *PRETRAINED))
    assert result.exit_code == 0, result.output
    assert "pre is finished: its latest checkpoint is at step 8 of train.steps=8" in " ".join(result.output.split())
    assert "raise train.steps" in result.output
    # The same name with settings that compute something else (a sweep's next point) is not this
    # command's result: refused naming them. How the run goes (logging, checkpoints) may differ.
    line = refused(*_sets(digits_dataset, storage, *PRETRAINED, "optim.lr=0.005", "data.flip=true"))
    assert "run pre is finished (step 8, " in line and "with other settings than this command's: " in line, line
    assert "data.flip: False -> True; optim.lr: 0.001 -> 0.005. Give another run.name to train them" in line, line
    assert pretrain(*_sets(digits_dataset, storage, *PRETRAINED, "log.every=1", "checkpoint.keep=3")).exit_code == 0


def test_what_may_change_on_resume_is_allowed_and_said(pretrained, digits_dataset):
    sets = [
        *BASE,
        f"data.train={digits_dataset}",
        f"run.storage={Path(pretrained).parent}",
        "run.name=pre",
        "train.steps=12",
        "checkpoint.every=4",
        "optim.lr=0.002",
        "cluster.num_workers=1",
        "data.num_slots=8",
    ]
    cfg = load_config(TrainingConfig, None, sets)
    plan = check_resume(cfg, pretrained, check_inputs(cfg))
    assert plan.chosen is not None and plan.chosen.step == 8 and not plan.finished
    assert "train.steps: 8 -> 12" in plan.changes and "optim.lr: 0.001 -> 0.002" in plan.changes
    assert "cluster.num_workers: 2 -> 1" in plan.changes


def test_a_batch_of_only_unreadable_samples_stops_the_run_naming_its_shards(process_group, digits_dataset, tmp_path):
    damaged = _damaged_copy(digits_dataset, tmp_path / "cut", keep_bytes=1024)  # one header, then cut short
    loop = in_process_loop(damaged, tmp_path)
    with pytest.raises(UnreadableData) as caught:
        loop.run()
    message = str(caught.value)
    assert "no sample of step 1's batch could be read on rank 0: all 8 were skipped as corrupt" in message
    assert "train-0000" in message and ".tar" in message and "prepare it again" in message


RAY_REPORT = """Training failed due to worker errors:
[Rank 0,1 Error Snippet]:
Traceback (most recent call last):
  File "/work/trainers/loop.py", line 56, in __init__
    self.info = read_dataset_info(cfg.data.train, cfg.data.storage_options)
FileNotFoundError: no dataset.json at /data/x: not prepared or still being written
"""


def test_a_failure_is_reduced_to_its_root_cause_with_advice_that_fits():
    cause = describe_failure(RAY_REPORT)
    assert cause.one_line() == "FileNotFoundError: no dataset.json at /data/x: not prepared or still being written"
    assert not cause.transient and cause.advice().startswith("fix the cause")
    lost = describe_failure(
        "...\nray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task."
    )
    assert lost.kind == "ActorDiedError" and lost.transient and cause.advice() != lost.advice()
    try:
        raise RuntimeError("checkpoint upload failed") from ConnectionResetError("connection reset by peer")
    except RuntimeError as error:
        assert describe_failure(error).one_line() == "ConnectionResetError: connection reset by peer"


def test_evaluate_refuses_a_resolution_the_patch_does_not_divide_before_ray(pretrained, digits_dataset, tmp_path):
    root = tmp_path / "prepared"
    root.mkdir()
    (root / "digits").symlink_to(digits_dataset)
    started = time.monotonic()
    grid = Path(__file__).resolve().parents[1] / "configs" / "grid_digits.yaml"
    result = CliRunner().invoke(
        app,
        [
            "evaluate",
            pretrained,
            "-c",
            str(grid),
            "--data-root",
            str(root),
            "--output",
            str(tmp_path / "eval"),
            "--set",
            "finetune.resolution=30",
        ],
    )
    assert result.exit_code == 2, result.output
    assert not ray.is_initialized() and time.monotonic() - started < 30
    assert "Traceback" not in result.output
    message = " ".join(result.output.split())
    assert (
        "fine-tune cells of" in message
        and "at 30 px: model: img_size 30 is not divisible by the patch size 4" in message
    )


CHAINED = """[Rank 0 Error Snippet]:
Traceback (most recent call last):
  File "/x/checkpointer.py", line 120, in save
    write()
OSError: [Errno 28] No space left on device

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/x/checkpointer.py", line 199, in _raise_if_disk_full
    raise CheckpointDiskFull(
vitray.trainers.checkpoint.checkpointer.CheckpointDiskFull: [Errno 28] rank 0 could not write the checkpoint
of step 20 (No space left on device). Free space in /s or point checkpoint.staging_dir at a larger disk
"""


def test_the_cause_is_the_exception_raised_last_whatever_its_class_is_called():
    cause = describe_failure(CHAINED)
    assert cause.kind == "CheckpointDiskFull"  # not the OSError it was raised from
    assert cause.message.endswith("Free space in /s or point checkpoint.staging_dir at a larger disk")
    assert "checkpoint of step 20" in cause.one_line() and len(cause.one_line(limit=40)) == 40


def test_the_cause_is_found_past_rays_truncation_of_a_workers_traceback():
    """Ray Train cuts a long worker traceback ("... (Output truncated ...) ...", then the fragment of a
    line it cut): `vitray runs` and a grid's failed cells showed Ray's wrapper line and the traceback's
    first frames, not the CheckpointDiskFull; and a grid tried a full disk three times."""
    text = (
        "Training failed due to worker errors:\n[Rank 0 Error Snippet]:\nTraceback (most recent call last):\n"
        '  File "/x/concurrent/futures/_base.py", line 456, in result\n    return self.__get_result()\n'
        "... (Output truncated. See individual worker logs for full details) ...\nointDiskFull(\n"
        "vitray.trainers.checkpoint.checkpointer.CheckpointDiskFull: [Errno 28] rank 0 could not write the checkpoint"
    )
    cause = describe_failure(text)
    assert cause.one_line() == "CheckpointDiskFull: [Errno 28] rank 0 could not write the checkpoint"
    assert cause.repeats and not cause.transient


def test_an_initial_checkpoint_of_another_architecture_is_refused(pretrained, digits_dataset, tmp_path):
    sets = _sets(digits_dataset, tmp_path / "runs", f"init.checkpoint={pretrained}", "model.name=S/4", name="ft")
    line = refused(*sets)
    assert f"init.checkpoint {pretrained} holds a Ti/4, but model.name=S/4" in line, line
    assert "set model.name=Ti/4 or leave it out" in line
    assert not (tmp_path / "runs").exists(), "a refused run leaves nothing behind"
    # The same name with another number of blocks is another architecture too.
    sets = _sets(digits_dataset, tmp_path / "runs", f"init.checkpoint={pretrained}", "model.depth=3", name="ft")
    line = refused(*sets)
    assert f"init.checkpoint {pretrained} holds a Ti/4 of 2 blocks, but model.depth=3" in line, line
    assert "set model.depth=2 or leave it out" in line
    # The head and the pre-logits layer are the checkpoint's too: they were ignored and recorded as set.
    sets = _sets(digits_dataset, tmp_path / "runs", f"init.checkpoint={pretrained}", "model.head=gap", name="ft")
    line = refused(*sets)
    assert f"init.checkpoint {pretrained} holds a model with a token head, but model.head=gap" in line, line
    assert "set model.head=token or leave it out" in line
    sets = _sets(
        digits_dataset, tmp_path / "runs", f"init.checkpoint={pretrained}", "model.representation_size=64", name="ft"
    )
    line = refused(*sets)
    assert (
        "model.representation_size=64 with init.checkpoint: a fine-tune's fresh head (init.reset_head=true) drops"
        in (line)
    )
    sets = _sets(
        digits_dataset,
        tmp_path / "runs",
        f"init.checkpoint={pretrained}",
        "init.reset_head=false",
        "model.representation_size=64",
        name="ft",
    )
    line = refused(*sets)
    assert f"init.checkpoint {pretrained} holds no pre-logits layer, but model.representation_size=64" in line, line
    # The same name, or none, trains on (resolution and head are the run's own).
    cfg = load_config(
        TrainingConfig,
        None,
        [*BASE, f"data.train={digits_dataset}", f"init.checkpoint={pretrained}", "model.img_size=24"],
    )
    assert check_inputs(cfg).num_classes == 10


def test_a_checkpoint_of_its_variants_own_depth_fine_tunes_from_the_benchmarks_recipe(digits_dataset, tmp_path):
    """A model pre-trained without model.depth (the demo's Ti/4: the variant's 12 blocks) keeps
    depth None in its checkpoint; the fine-tune recipe copies that model section, and the depth it
    passes on is no claim against the checkpoint's blocks."""
    from vitray.cluster.finetune import benchmark_config

    make_checkpoint(tmp_path / "run" / "checkpoint_2026-01-01_00-00-00.000001")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "digits").symlink_to(digits_dataset)
    cfg = benchmark_config(str(tmp_path / "run"), "digits", str(tmp_path / "data"), storage=str(tmp_path / "runs"))
    assert "depth" in cfg.model.model_fields_set and cfg.model.depth is None, cfg.model
    assert cfg.model.blocks == 12
    assert check_inputs(cfg).num_classes == 10


def test_an_online_wandb_run_without_an_api_key_is_refused_before_ray_starts(digits_dataset, monkeypatch, tmp_path):
    """wandb.init would fail in the worker, after Ray and the workers started; offline needs no key."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # none there yet
    sets = _sets(digits_dataset, tmp_path / "runs", "log.wandb={project: p}")
    line = refused(*sets)
    assert line == (
        "error: log.wandb: no W&B API key here: set WANDB_API_KEY (or run `wandb login`), or set log.wandb.mode=offline"
    )
    assert not (tmp_path / "runs").exists()

    def checked(*extra: str) -> int:
        cfg = load_config(TrainingConfig, None, [*BASE, f"data.train={digits_dataset}", *extra])
        return check_inputs(cfg).num_classes

    assert checked("log.wandb={mode: offline}") == 10
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    (tmp_path / "netrc").chmod(0o600)
    assert checked("log.wandb={project: p}") == 10  # what `wandb login` writes
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert checked("log.wandb={project: p}") == 10


def test_a_fewshot_evaluator_asking_more_shots_than_its_data_holds_is_refused(digits_dataset, tmp_path):
    """The probe would fail at the run's first evaluation, which may be hours in."""
    fewshot = f"evals.fs={{type: fewshot, every: 10, datasets: {{digits: '{digits_dataset}'}}, shots: [5, 500]}}"
    line = refused(*_sets(digits_dataset, tmp_path / "runs", fewshot))
    assert line == (
        "error: evals.fs.shots: 500 shots of each of the 10 classes of digits need 5,000 samples in its train split, "
        "which has 1,437; lower evals.fs.shots"
    )
    cfg = load_config(TrainingConfig, None, [*BASE, f"data.train={digits_dataset}", fewshot.replace("500", "100")])
    assert check_inputs(cfg).num_classes == 10


def test_a_run_storage_that_cannot_be_made_or_written_is_refused(digits_dataset, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    line = refused(*_sets(digits_dataset, tmp_path / "a-file" / "runs"))
    assert f"run.storage={tmp_path / 'a-file' / 'runs'}: {tmp_path / 'a-file'} is a file, not a folder" in line
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.access(locked, os.W_OK):  # root ignores permissions: a read-only bind mount stands in
        mount = subprocess.run(["mount", "--bind", "-o", "ro", str(locked), str(locked)], capture_output=True)
        if mount.returncode != 0:
            pytest.skip(f"no way to make a folder this user cannot write: {mount.stderr.decode().strip()}")
    try:
        line = refused(*_sets(digits_dataset, locked / "runs"))
        assert f"{locked} cannot be written (" in line, line
        assert "Read-only file system" in line or "Permission denied" in line, line
    finally:
        subprocess.run(["umount", str(locked)], capture_output=True)
    # A folder that permissions allow (root's, here) in a file system that makes none: refused too.
    line = refused(*_sets(digits_dataset, "/proc/vitray-runs"))
    assert "run.storage=/proc/vitray-runs: /proc cannot be written (" in line, line


def test_keys_added_to_vitray_since_a_checkpoint_are_not_reported_as_changes(digits_dataset):
    """A checkpoint's config written before a key existed lacks it: on resume it was listed as
    changed from None to its default (`evals.val.resize: None -> aspect`)."""
    from vitray.common.redact import redacted_config
    from vitray.trainers.driver_checks.preflight import _with_todays_defaults, config_changes

    cfg = load_config(TrainingConfig, None, [*BASE, f"data.train={digits_dataset}", "evals.val={type: val, every: 4}"])
    recorded = redacted_config(cfg)
    del recorded["data"]["decode"], recorded["evals"]["val"]["resize"]  # as an older vitray wrote it
    assert config_changes(recorded, redacted_config(cfg))[1] == [
        "data.decode: None -> auto",
        "evals.val.resize: None -> aspect",
    ]
    assert config_changes(_with_todays_defaults(recorded), redacted_config(cfg)) == ([], [])


def test_the_data_storage_options_are_the_datas_and_the_run_folder_is_checked_as_it_is_written(
    digits_dataset, seaweed_s3
):
    """data.storage_options (another store's endpoint, for the data) were used to probe run.storage,
    which the run then wrote with the environment's credentials: a run whose run folder was fine was
    refused, and one whose run folder could not be written passed the probe."""
    cfg = load_config(
        TrainingConfig,
        None,
        [
            *BASE,
            f"data.train={digits_dataset}",
            f"run.storage={seaweed_s3.url('runs')}",
            "data.storage_options={endpoint_url: 'http://127.0.0.1:9'}",  # nothing answers there
        ],
    )
    assert check_inputs(cfg).num_classes == 10


def _relabelled_copy(digits_dataset: Path, folder: Path, classes: list[str]) -> Path:
    """The digits dataset whose dataset.json names other classes: what pre-flight reads of a dataset."""
    import json

    shutil.copytree(digits_dataset, folder)
    info = json.loads((folder / "dataset.json").read_text())
    (folder / "dataset.json").write_text(json.dumps({**info, "classes": classes, "num_classes": len(classes)}))
    return folder


def test_a_validation_set_of_other_labels_is_refused_and_one_of_other_names_said(digits_dataset, tmp_path, capsys):
    """data.val (or an evaluator's path) of another number of classes gave `val/top1 0.000` without a
    word, after Ray started; the same number under other names is said (one dataset prepared from
    two sources names its classes two ways), not refused."""
    three = _relabelled_copy(digits_dataset, tmp_path / "three", ["cat", "dog", "eel"])
    line = refused(*_sets(digits_dataset, tmp_path / "runs", f"data.val={three}", "evals.val={type: val, every: 4}"))
    assert line.startswith(f"error: data.val={three} has 3 classes (single-label), data.train={digits_dataset} 10 ")
    assert "its top-1 would score other labels" in line, line
    named = _relabelled_copy(digits_dataset, tmp_path / "named", [f"digit {i}" for i in range(10)])
    sets = [*BASE, f"data.train={digits_dataset}", f"data.val={named}", "evals.val={type: val, every: 4}"]
    check_inputs(load_config(TrainingConfig, None, sets))
    assert f"note: data.val={named} names its classes otherwise than data.train (class 0: 'digit 0' against '0')" in (
        capsys.readouterr().err
    )


def test_a_kept_head_of_another_number_of_classes_is_refused(pretrained, digits_dataset, tmp_path):
    """init.reset_head=false on data of other classes: the loop gave the run a fresh head without a word."""
    three = _relabelled_copy(digits_dataset, tmp_path / "three", ["cat", "dog", "eel"])
    sets = _sets(three, tmp_path / "runs", f"init.checkpoint={pretrained}", "init.reset_head=false", name="ft")
    line = refused(*sets)
    assert (
        f"init.reset_head=false keeps the head of init.checkpoint {pretrained}, of 10 classes, but data.train=" in line
    )
    assert "has 3: set init.reset_head=true for a fresh head" in line, line


def test_a_resume_on_workers_that_cannot_share_its_data_slots_is_refused_before_ray(
    pretrained, digits_dataset, tmp_path
):
    """A run resumed on a number of workers its recorded data.num_slots does not divide: Ray started,
    the checkpoint was converted for the new world size, then every worker failed, advising a
    num_slots the resume refuses."""
    storage = tmp_path / "storage"
    shutil.copytree(Path(pretrained).parent, storage)
    more = [*PRETRAINED[1:], "train.steps=12", "cluster.num_workers=3", "train.batch_size=48", "data.num_slots=null"]
    line = refused(*_sets(digits_dataset, storage, *more))
    assert "reads its data in 8 slots (data.num_slots, as recorded), which cluster.num_workers=3 cannot share" in line
    assert "resume it on a number of workers among [1, 2, 4, 8]" in line, line


def test_a_run_shorter_than_the_default_warm_up_is_told_it_never_decays(digits_dataset, capsys):
    """A 5,000-step run that never named schedule.warmup_steps warmed up for the whole run (the
    default, 10,000, clipped to it) and trained its last steps at the peak, without a word."""
    from vitray.cluster.pretrain import _say_warmup_default

    base = [b for b in BASE if not b.startswith("schedule.warmup_steps")] + [f"data.train={digits_dataset}"]
    for extra, said in (
        (["train.steps=5000"], True),
        (["train.steps=5000", "schedule.warmup_steps=500"], False),
        (["train.steps=20000"], False),
    ):
        _say_warmup_default(load_config(TrainingConfig, None, [*base, *extra]))
        err = capsys.readouterr().err
        assert ("note: schedule.warmup_steps is unset, and its default (10,000 steps" in err) is said, (extra, err)
    assert "spans the whole run (train.steps=5,000): the learning rate rises until the last step" in (
        _say_warmup_default(load_config(TrainingConfig, None, [*base, "train.steps=5000"])) or capsys.readouterr().err
    )


def test_a_new_run_with_data_num_slots_unset_is_told_the_number_its_sample_order_depends_on(digits_dataset, capsys):
    """Unset, data.num_slots is workers x loader workers: 1 worker and 2 gave other samples at every
    step, without a word (the README's "a pure function of the seed" held for a set number only)."""
    from vitray.cluster.pretrain import _say_num_slots_default

    base = [*BASE, f"data.train={digits_dataset}", "data.num_workers=2", "train.micro_batch_size=8"]
    for extra, said in (
        (["data.num_slots=null", "cluster.num_workers=2"], "data.num_slots is unset: 4 (2 workers x 2 loader slots)"),
        (["data.num_slots=null", "cluster.num_workers=1"], "data.num_slots is unset: 2 (1 worker x 2 loader slots)"),
        (["data.num_slots=8", "cluster.num_workers=2"], None),
    ):
        _say_num_slots_default(load_config(TrainingConfig, None, [*base, *extra]))
        err = capsys.readouterr().err
        assert (said in err and "Set data.num_slots" in err) if said else err == "", (extra, err)


def test_a_worker_killed_without_an_error_is_said_so_with_the_memory_advice():
    """A worker the OOM killer took: ~1,500 characters of Ray's account, and advice that re-running helps
    (it fails the same way): cut, said, with what to lower."""
    account = "A worker health check failed. Worker info: Worker( actor=Actor(RayTrainWorker, a1)" + " x" * 800
    cause = describe_failure(f"ray.train.WorkerHealthCheckFailedError: {account}")
    assert cause.kind == "WorkerHealthCheckFailedError" and len(cause.one_line()) < 400
    assert "a worker process was killed without an error of its own (out of memory, or stopped" in cause.message
    assert "lower train.micro_batch_size (accumulation keeps train.batch_size)" in cause.advice()


def test_a_validation_slice_the_run_trains_on_is_refused(digits_dataset, tmp_path, capsys):
    """Its top-1 was reported as held out, exit 0, of samples the run trained on."""
    runs, val = tmp_path / "runs", "evals.val={type: val, every: 2}"  # (data.val_split is its split)
    line = refused(*_sets(digits_dataset, runs, "data.train_split=train[:90%]", "data.val_split=train[80%:]", val))
    assert line == (
        "error: data.val_split=train[80%:] and data.train_split=train[:90%] share 143 samples ([1150:1293] of "
        "train's 1,437): its top-1 would be measured on samples the run trains on. Hold out a slice the training "
        "slice leaves out, e.g. data.train_split=train[:98%] with data.val_split=train[98%:]"
    )
    # An evaluator's own split, inside the whole split trained on (the held-out slice set, train_split not)
    line = refused(*_sets(digits_dataset, runs, "evals.held={type: val, every: 2, split: 'train[98%:]'}"))
    assert line.startswith("error: evals.held.split=train[98%:] and data.train_split=train share 29 samples")

    # Held out, and the very split trained on (a look at the fit): taken, the latter with a note.
    def checked(*sets: str) -> str:
        check_inputs(
            load_config(TrainingConfig, None, [*BASE, f"data.train={digits_dataset}", f"run.storage={runs}", *sets])
        )
        return " ".join(capsys.readouterr().err.split())

    assert "note" not in checked("data.train_split=train[:98%]", "data.val_split=train[98%:]", val)
    assert (
        "vitray: note: evals.fit.split=train is the split the run trains on (data.train_split=train): its top-1 is a "
        "training accuracy, not a held-out one" in checked("evals.fit={type: val, every: 2, split: train}")
    )
    assert not runs.exists()


def test_a_grids_validation_slice_its_fine_tunes_train_on_is_refused(pretrained, digits_dataset, tmp_path):
    """The learning rate was selected on training samples."""
    root = tmp_path / "prepared"
    root.mkdir()
    (root / "digits").symlink_to(digits_dataset)
    grid = Path(__file__).resolve().parents[1] / "configs" / "grid_digits.yaml"
    args = ["evaluate", pretrained, "-c", str(grid), "--data-root", str(root), "--output", str(tmp_path / "eval")]
    sets = ["--set", "finetune.train_split=train[:90%]", "--set", "finetune.val_split=train[50%:]"]
    result = CliRunner().invoke(app, [*args, *sets])
    assert result.exit_code == 2 and not ray.is_initialized(), result.output
    assert "error: finetune.val_split=train[50%:] and finetune.train_split=train[:90%] share 575 samples" in " ".join(
        result.output.split()
    )


def test_a_run_folder_that_is_or_is_inside_a_prepared_dataset_is_refused(digits_dataset, tmp_path):
    """Its checkpoints and records were written among the shards."""
    digits_dataset = Path(shutil.copytree(digits_dataset, tmp_path / "digits"))  # (were it taken, not the shared one)
    before = sorted(p.name for p in digits_dataset.iterdir())
    sets = [*BASE, f"data.train={digits_dataset}"]
    inside = refused(*[a for s in [*sets, f"run.storage={digits_dataset}", "run.name=r"] for a in ("--set", s)])
    assert inside == (
        f"error: run.storage: the run folder {digits_dataset / 'r'} would be inside the prepared dataset "
        f"{digits_dataset} (it holds dataset.json): give the runs a folder of their own (run.storage)"
    )
    named = [f"run.storage={digits_dataset.parent}", f"run.name={digits_dataset.name}"]
    line = refused(*[a for s in [*sets, *named] for a in ("--set", s)])
    assert line.startswith(f"error: run.name: the run folder {digits_dataset} would be the prepared dataset ")
    assert sorted(p.name for p in digits_dataset.iterdir()) == before
