"""Pre-training on a local Ray instance with 2 CPU workers and DeepSpeed: learning, checkpoints,
exact resume after a pre-emption, re-sharding onto 1 worker. (A worker killed mid-run is
`tests/test_faults_pretrain.py`'s and, under ZeRO-3, `tests/test_zero_stages.py`'s.)"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from pretrain_helpers import (
    HELD,
    REFERENCE,
    REFERENCE_STEPS,
    assert_same_weights,
    final_weights,
    pretrain_args,
    run,
    run_until_ray_dies,
)

from vitray.runfolder.checkpoint_folders import (
    CHECKPOINT_FORMAT,
    IncompleteCheckpointError,
    find_checkpoints,
    latest_complete_checkpoint,
    resolve_checkpoint,
    verify_complete,
    vitray_version,
)
from vitray.runfolder.files import RunFiles
from vitray.runfolder.lease import read_lease
from vitray.trainers.checkpoint.rank_files import write_state
from vitray.trainers.keys import collect_keys

pytestmark = pytest.mark.slow

# The shared reference run's recipe (`reference_run`): 30 steps, a checkpoint every 10.
STEPS = REFERENCE_STEPS
EVERY = 10
# Uncropped digits: with crops of half the image, 24 steps of this tiny ViT hardly move the loss
# from chance (ln 10): it fell by 0.12 with one torch build and rose with another.
WHOLE_DIGITS = "data.min_crop_area=1.0"
assert WHOLE_DIGITS in REFERENCE


@pytest.fixture(scope="module")
def reference(reference_run):
    """An uninterrupted 2-worker run: the yardstick for every resume test (shared with the fault
    tests of test_faults_pretrain, test_drain and test_multinode)."""
    return reference_run


def test_run_trains_and_loss_falls(reference):
    metrics = RunFiles(reference["run_dir"]).read_metrics()
    assert [m["step"] for m in metrics] == list(range(2, STEPS + 1, 2))
    first, last = metrics[0]["loss"], metrics[-1]["loss"]
    assert last < first - 0.1, f"loss did not fall: {first} -> {last}"
    assert 0.0 <= metrics[-1]["val/top1"] <= 1.0  # on the train split (the demo checks the held-out level)
    assert 0.1 < metrics[-1]["fewshot/digits_10shot"] <= 1.0  # the periodic probe; even random features beat chance
    for key in ("lr", "grad_norm", "images_per_s", "tflops_per_worker", "data_wait_fraction", "skipped_samples"):
        assert key in metrics[-1]
    # Every step trained on one global batch of distinct samples.
    keys = reference["keys"]
    assert sorted(keys) == list(range(STEPS))
    assert all(len(k) == 32 and len(set(k)) == 32 for k in keys.values())
    assert Path(reference["run_dir"], "vitray", "tensorboard").is_dir()


def test_checkpoints_are_complete_and_kept(reference):
    checkpoints = find_checkpoints(reference["run_dir"])
    assert all(c.complete for c in checkpoints)
    assert [c.step for c in checkpoints] == [STEPS - EVERY, STEPS]  # checkpoint.keep=2
    state = verify_complete(checkpoints[-1].path)
    assert state["step"] == STEPS and state["world_size"] == 2
    # What wrote it: the checkpoint layout and vitray's version (a later vitray can tell, and refuse).
    assert state["checkpoint_format"] == CHECKPOINT_FORMAT and state["vitray_version"] == vitray_version() != ""


def test_a_checkpoint_of_a_newer_layout_is_refused_by_name_not_read(digits_dataset, reference, tmp_path):
    """A run resumed, or a checkpoint read, by an older vitray than wrote it: refused in one line
    naming both versions and the fix, before Ray starts; never a resume that misreads it or goes back
    to an older checkpoint."""
    import json
    import shutil
    import subprocess

    run_dir = tmp_path / "runs" / "ref"
    shutil.copytree(reference["run_dir"], run_dir)
    newest = Path(find_checkpoints(str(run_dir))[-1].path)
    state = json.loads((newest / "trainer_state.json").read_text())
    newer = write_state(newest, {**state, "checkpoint_format": 2, "vitray_version": "9.0"})
    for record in newest.glob("complete-rank-*.json"):  # a whole checkpoint of that layout: its records agree
        listing = json.loads(record.read_text())
        if newer.name in listing:
            record.write_text(
                json.dumps({**listing, newer.name: {"size": newer.size, "crc32c": f"{newer.crc32c:08x}"}})
            )
    assert verify_complete(newest)["checkpoint_format"] == 2
    args = pretrain_args(str(digits_dataset), str(tmp_path / "runs"), "ref", f"train.steps={STEPS + 2}")
    refused = subprocess.run(args, capture_output=True, text=True, timeout=300)
    lines = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "run ref cannot resume here" in lines[0] and "vitray 9.0 wrote it in checkpoint format 2" in lines[0]
    assert "upgrade vitray" in lines[0] and "Traceback" not in refused.stderr
    with pytest.raises(IncompleteCheckpointError, match="checkpoint format 2.*upgrade vitray"):
        resolve_checkpoint(str(run_dir))


def test_ray_gone_under_a_run_is_said_and_the_rerun_resumes_exactly(digits_dataset, reference, tmp_path):
    storage = str(tmp_path / "runs")
    keys = tmp_path / "keys"
    args = pretrain_args(
        str(digits_dataset),
        storage,
        "ref",
        f"train.steps={STEPS}",
        f"checkpoint.every={EVERY}",
        WHOLE_DIGITS,
        f"evals.val={{type: val, every: {STEPS}}}",
        f"debug.record_sample_keys={keys}",
    )
    staging = tmp_path / "staging"
    args += ["--set", f"checkpoint.staging_dir={staging}"]
    # Ray's head killed under the run (held: a step a quarter second); the driver says so in one line
    # and exits 1, its attempt recorded as failed and the lease released; the re-run does not wait.
    run_dir = str(tmp_path / "runs" / "ref")
    gone = run_until_ray_dies([*args, "--set", HELD], run_dir, min_step=EVERY)
    said = " ".join(gone.stderr.split())
    assert gone.returncode == 1, gone.stdout[-2000:] + gone.stderr[-4000:]
    assert "error: Ray went away under the run ref: the Ray GCS at " in said and "start the same command again" in said
    assert "Traceback" not in gone.stderr and "Failed to connect to GCS" not in gone.stderr
    (attempt,) = RunFiles(run_dir).read_attempts()
    assert attempt["status"] == "failed" and "RayLost" in attempt["error"]
    assert read_lease(RunFiles(run_dir).lease_path) is None
    run(args)  # the same command again
    assert_same_weights(final_weights(str(tmp_path / "runs" / "ref")), reference["weights"])
    assert collect_keys(keys) == reference["keys"]
    # Written once: the ranks wrote straight into the run folder; nothing was staged on the node.
    # (A resume's restore folder leaves only its lock file there.)
    assert not staging.exists() or [p.name for p in staging.rglob("*") if p.is_file()] in (
        [],
        [f"vitray-restore-{os.getuid()}.lock"],
    )


def test_resume_on_one_worker_from_two_worker_checkpoint(digits_dataset, reference, tmp_path):
    import shutil

    # The reference run as a kill during its last upload leaves it: the newest checkpoint's weights
    # cut short (which `test_half_written_checkpoint_is_never_taken` takes apart). The re-run must
    # not take it. (A kill's own resume is test_stop_and_rerun_resumes_exactly's.)
    run_dir = tmp_path / "runs" / "ref"
    shutil.copytree(reference["run_dir"], run_dir)
    weights = Path(find_checkpoints(str(run_dir))[-1].path) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    keys = tmp_path / "keys"
    out = run(
        pretrain_args(
            str(digits_dataset),
            str(tmp_path / "runs"),
            "ref",
            f"train.steps={STEPS}",
            f"checkpoint.every={EVERY}",
            WHOLE_DIGITS,
            f"debug.record_sample_keys={keys}",
            "cluster.num_workers=1",
            "train.micro_batch_size=32",
        )
    )
    assert f"resuming ref from step {STEPS - EVERY} (" in " ".join(out.stderr.split())
    state = verify_complete(latest_complete_checkpoint(str(run_dir)).path)
    assert state["step"] == STEPS and state["world_size"] == 1
    # The global batches are the same samples whatever the number of workers.
    resumed = {step: k for step, k in reference["keys"].items() if step >= STEPS - EVERY}  # keys count from 0
    assert collect_keys(keys) == resumed
    metrics = RunFiles(str(run_dir)).read_metrics()
    assert [m["step"] for m in metrics] == list(range(2, STEPS + 1, 2))
    # It went on from the reference's state, not from fresh weights and a fresh schedule: the same
    # learning rates, and losses and weights equal up to the order of one worker's sums (measured:
    # losses within 2e-7, weights within 2.2e-5; a resume that loaded nothing is off by 0.2 in the
    # loss and by lr-sized steps in every weight).
    logged = {m["step"]: m for m in RunFiles(reference["run_dir"]).read_metrics()}
    resumed = [m for m in metrics if m["step"] > STEPS - EVERY]
    assert resumed and all(m["lr"] == logged[m["step"]]["lr"] for m in resumed)
    for m in resumed:
        assert m["loss"] == pytest.approx(logged[m["step"]]["loss"], abs=1e-4), m["step"]
    weights = final_weights(str(run_dir))
    for name, value in reference["weights"].items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=2e-4, msg=name)


def test_half_written_checkpoint_is_never_taken(reference, tmp_path):
    import shutil

    run_dir = tmp_path / "runs" / "ref"
    shutil.copytree(reference["run_dir"], run_dir)
    newest = Path(find_checkpoints(str(run_dir))[-1].path)
    weights = newest / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])  # an upload cut short
    with pytest.raises(IncompleteCheckpointError, match="model.safetensors"):
        verify_complete(newest)
    latest = latest_complete_checkpoint(str(run_dir))
    assert latest is not None and latest.step == STEPS - EVERY
    weights.write_bytes(whole)
    assert verify_complete(newest)["step"] == STEPS
    (newest / "complete-rank-0001.json").unlink()  # rank 1 died before finishing its part
    with pytest.raises(IncompleteCheckpointError, match="rank 1"):
        verify_complete(newest)
    latest = latest_complete_checkpoint(str(run_dir))
    assert latest is not None and latest.step == STEPS - EVERY
    # A re-run of a run whose newest checkpoint is cut short: test_resume_on_one_worker_from_two_worker_checkpoint.


def test_more_workers_than_the_local_instance_has_fails_at_once(digits_dataset, tmp_path):
    """Ray Train would retry placing them forever, in silence: the local instance never grows."""
    import os
    import subprocess
    import time

    cpus = os.cpu_count()
    args = pretrain_args(
        str(digits_dataset),
        str(tmp_path),
        "too-big",
        "train.steps=2",
        "schedule.warmup_steps=1",
        f"cluster.num_workers={2 * cpus}",
        f"data.num_slots={2 * cpus}",
        f"train.batch_size={32 * cpus}",
    )
    started = time.monotonic()
    out = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    message = " ".join(out.stderr.split())
    found = re.search(
        rf"needs {2 * cpus} CPU \(cluster.cpus_per_worker x {2 * cpus} workers\) but it has (\d+)", message
    )
    assert found and int(found[1]) < 2 * cpus, message
    assert "cluster.address" in message
    assert time.monotonic() - started < 120
    assert not (tmp_path / "too-big").exists() or not find_checkpoints(str(tmp_path / "too-big"))
    # Refused before an attempt began: nothing for `vitray runs` to list as a failed attempt.
    assert RunFiles(str(tmp_path / "too-big")).read_attempts() == []


def test_the_log_of_a_run_follows_it_and_ends_with_its_numbers_and_what_to_do_next(reference):
    """Its output is a pipe (a log, `ray job logs`): a line per log step, then the run's summary."""
    lines = reference["stdout"].splitlines()
    progress = [line for line in lines if re.match(r"step \d+/30  loss \d", line)]
    steps = [int(re.match(r"step (\d+)/", line).group(1)) for line in progress]
    assert steps == list(range(2, 31, 2)), reference["stdout"][-3000:]  # log.every=2: each record once
    assert all("img/s  data wait " in line for line in progress)
    assert "eta 0:" in progress[1] and "val/top1 0." in progress[-1] and "fewshot/digits_10shot 0." in progress[-1]
    text = reference["stderr"]  # the command's own messages
    assert "run folder:" in text, text[-3000:]
    assert re.search(r"step 30 of 30 in 0:\d\d:\d\d: final loss \d+\.\d{4}, \d+\.\d img/s on average", text), text
    assert re.search(r"evaluations at step 30: fewshot/digits_10shot 0\.\d{4}, val/top1 0\.\d{4}", text), text
    assert f"checkpoint:  {reference['run_dir']}/checkpoint_" in text and "(step 30)" in text
    assert f"TensorBoard: tensorboard --logdir {reference['run_dir']}/vitray/tensorboard" in text
    assert f"export:      vitray export {reference['run_dir']} --format timm" in text
