"""Bad numbers and bad data in real runs.

`train.nonfinite`: a NaN loss injected for real (`debug.nonfinite_loss_at_steps` multiplies the
last rank's loss by NaN, so the NaN goes through the backward pass, the all-reduce and the
optimizer) is either dropped and counted (`skip`) or stops the run before any checkpoint of it
(`stop`); no checkpoint of non-finite weights is ever written.

In-process runs of the loop (one worker, no Ray) check the policy on each precision; end-to-end
runs (`vitray pretrain`, 2 Ray workers) check that the count survives a kill -9 and the resume is
exact, and that `stop` leaves the latest checkpoint finite.

Damaged shards (an image member overwritten, a shard cut short mid-member) cost only their
samples: skipped and counted (`skipped_samples`) at the same positions on every attempt, so a
killed and resumed run over damaged data ends with the uninterrupted run's weights.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import tarfile

import pytest
import torch
from pretrain_helpers import (
    HELD,
    assert_same_weights,
    final_weights,
    in_process_loop,
    pretrain_args,
    run,
    run_until_mid_checkpoint,
)

from vitray.common.config import ConfigError, load_config
from vitray.data.layout import read_manifest
from vitray.runfolder.checkpoint_folders import latest_complete_checkpoint, read_state
from vitray.runfolder.files import RunFiles
from vitray.runfolder.listing import run_summary
from vitray.trainers.config import TrainingConfig


def _finite(module: torch.nn.Module) -> bool:
    return all(bool(p.isfinite().all()) for p in module.parameters())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_skip_drops_the_poisoned_step_counts_it_and_trains_on(process_group, digits_dataset, tmp_path, dtype):
    loop = in_process_loop(
        digits_dataset,
        tmp_path,
        f"precision.dtype={dtype}",
        "train.nonfinite=skip",
        "debug.nonfinite_loss_at_steps=[2]",
    )
    last = loop.run()
    assert last["nonfinite_steps"] == 1 and loop.backend.skipped_steps() == 1
    assert math.isfinite(last["loss"])  # the mean of the finite losses
    assert _finite(loop.backend.module)


def test_skip_with_nothing_to_skip_counts_nothing(process_group, digits_dataset, tmp_path):
    last = in_process_loop(digits_dataset, tmp_path, "train.nonfinite=skip").run()
    assert last["nonfinite_steps"] == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stop_raises_at_the_log_step_naming_the_steps(process_group, digits_dataset, tmp_path, dtype):
    # bf16 without the overflow check: the NaN reaches the weights, so the run must not save them.
    loop = in_process_loop(digits_dataset, tmp_path, f"precision.dtype={dtype}", "debug.nonfinite_loss_at_steps=[3]")
    assert loop.cfg.train.nonfinite == "stop"  # the default
    with pytest.raises(FloatingPointError, match=r"train.nonfinite=stop: [12] step\(s\) between 1 and 4"):
        loop.run()


def test_stop_checks_a_checkpoint_step_that_does_not_log(process_group, digits_dataset, tmp_path):
    loop = in_process_loop(
        digits_dataset,
        tmp_path,
        "precision.dtype=bf16",
        "debug.nonfinite_loss_at_steps=[1]",
        "checkpoint.every=2",
        "log.every=4",
    )
    with pytest.raises(FloatingPointError, match=r"between 1 and 2"):
        loop.run()
    assert loop.step == 2 and not list((tmp_path / "run").rglob("model.safetensors"))


def test_skip_needs_deepspeed():
    with pytest.raises(ConfigError, match="train.nonfinite=skip needs train.backend=deepspeed"):
        load_config(TrainingConfig, None, ["data.train=x", "train.backend=xla", "train.nonfinite=skip"])


COMMON = ("train.steps=20", "checkpoint.every=10", "log.every=2", "data.min_crop_area=1.0", "cluster.max_failures=0")


@pytest.mark.slow
def test_stop_fails_the_run_and_leaves_the_latest_checkpoint_finite(digits_dataset, tmp_path):
    args = pretrain_args(
        str(digits_dataset), str(tmp_path), "nan", *COMMON, "precision.dtype=bf16", "debug.nonfinite_loss_at_steps=[13]"
    )
    failed = subprocess.run(args, capture_output=True, text=True, timeout=480)
    assert failed.returncode != 0
    text = " ".join((failed.stdout + failed.stderr).split())
    assert "train.nonfinite=stop: 2 step(s) between 13 and 14" in text, text[-3000:]  # 13 on one rank, then 14
    latest = latest_complete_checkpoint(str(tmp_path / "nan"))
    assert latest is not None and latest.step == 10
    assert all(bool(w.isfinite().all()) for w in final_weights(str(tmp_path / "nan")).values())


def _damage(dataset, dest):
    """A copy of `dataset` with the image of every shard's 5th sample overwritten with garbage (same
    length: the tar stays whole) and the 4th shard cut short in the middle of a member: its tail
    zeroed, so that it keeps the size the manifest lists (pre-flight refuses a shard of another size)
    and its reader meets the end of the archive there."""
    shutil.copytree(dataset, dest)
    rows = read_manifest(str(dest), "train")
    for row in rows:
        path = dest / row.name
        with tarfile.open(path) as tar:
            images = [m for m in tar.getmembers() if m.name.rsplit(".", 1)[-1] in ("png", "jpg", "jpeg")]
        member = images[4]
        with open(path, "r+b") as f:
            f.seek(member.offset_data)
            f.write(b"not an image" + bytes(max(0, member.size - 12)))
    cut = dest / rows[3].name
    data = cut.read_bytes()
    kept = len(data) // 2 + 100
    cut.write_bytes(data[:kept] + bytes(len(data) - kept))
    return dest


@pytest.mark.slow
def test_skipped_steps_and_damaged_samples_are_counted_across_a_kill_and_the_resume_is_exact(digits_dataset, tmp_path):
    """One run over damaged shards with NaN losses at steps 3 and 7 (`skip`), and the same run
    killed -- SIGKILL to every process of it -- in the middle of its step-20 checkpoint (its files
    written, not all of its completion records) and re-run: that checkpoint is never taken, the run
    goes on from step 10, the skipped steps' count is restored (DeepSpeed's), the damaged samples
    are skipped at the same steps, and the weights are the uninterrupted run's. (One pair of runs
    for the counts and the kill keeps the suite's time down.)"""
    damaged = str(_damage(digits_dataset, tmp_path / "damaged"))
    poisoned = ("train.nonfinite=skip", "debug.nonfinite_loss_at_steps=[3, 7]")
    reference = tmp_path / "reference"
    run(pretrain_args(damaged, str(reference), "bad", *COMMON, *poisoned))
    metrics = RunFiles(str(reference / "bad")).read_metrics()
    assert metrics[-1]["nonfinite_steps"] == 2 and all(math.isfinite(m["loss"]) for m in metrics)
    assert [m["nonfinite_steps"] for m in metrics if m["step"] in (2, 4, 8)] == [0, 1, 2]
    logged = {m["step"]: m["skipped_samples"] for m in metrics}
    assert sum(logged.values()) > 0, f"the run never met a damaged sample: {logged}"
    # The shards they came from are named over every rank, in the metrics and by `vitray runs`.
    named = {shard.rsplit("/", 1)[-1] for m in metrics for shard in m.get("skipped_shards", ())}
    cut_short = read_manifest(damaged, "train")[3].name
    assert cut_short in named and named <= {row.name for row in read_manifest(damaged, "train")}, named
    status = run_summary(str(reference / "bad")).status
    assert f"{sum(logged.values())} corrupt samples skipped, from " in status and cut_short in status, status

    killed = tmp_path / "killed"
    args = pretrain_args(damaged, str(killed), "bad", *COMMON, *poisoned)
    cut_short = run_until_mid_checkpoint([*args, "--set", HELD], str(killed / "bad"), 10)
    assert read_state(cut_short.path)["step"] == 20 and "never finished writing it" in cut_short.problem
    rerun = run(args)
    said = " ".join(rerun.stderr.split())
    assert "resuming bad from step 10 (" in said and f"skipped newer checkpoint {cut_short.path}: " in said, said
    resumed = RunFiles(str(killed / "bad")).read_metrics()
    assert resumed[-1]["nonfinite_steps"] == 2  # DeepSpeed's count was restored
    assert {m["step"]: m["skipped_samples"] for m in resumed} == logged  # the same samples skipped at the same steps
    assert_same_weights(final_weights(str(killed / "bad")), final_weights(str(reference / "bad")))
    assert all(bool(w.isfinite().all()) for w in final_weights(str(reference / "bad")).values())


def _fp16_or_skip(loop_args) -> None:
    """DeepSpeed trains fp16 on a CPU only where oneDNN has fp16 kernels (this machine's and CI's do)."""
    try:
        return in_process_loop(*loop_args)
    except (RuntimeError, ValueError) as error:
        if "fp16 is not supported" in str(error):
            pytest.skip(f"DeepSpeed refuses fp16 on this CPU: {error}")
        raise


def test_fp16_loss_scale_overflows_are_no_fault_of_the_run(process_group, digits_dataset, tmp_path):
    """fp16's dynamic loss scale is found by dropping the steps whose scaled gradients overflow (a
    real fp16 run's first steps): under the default train.nonfinite=stop every such run stopped at
    its first log step. They are counted apart (`loss_scale_skips`) and the run trains on; a NaN loss
    still stops it."""
    loop = _fp16_or_skip((digits_dataset, tmp_path / "a", "precision.dtype=fp16", "train.steps=12", "log.every=4"))
    assert loop.cfg.train.nonfinite == "stop"  # the default
    loop.backend.engine.optimizer.loss_scaler.cur_scale = 2.0**24  # overflows until halved to 2^16
    last = loop.run()
    assert last["loss_scale_skips"] >= 8 and last["loss_scale"] <= 2.0**16 and last["nonfinite_steps"] == 0
    assert math.isfinite(last["loss"]) and _finite(loop.backend.module)
    poisoned = _fp16_or_skip(
        (digits_dataset, tmp_path / "b", "precision.dtype=fp16", "debug.nonfinite_loss_at_steps=[3]")
    )
    with pytest.raises(FloatingPointError, match=r"train.nonfinite=stop: 1 step\(s\) between 1 and 4"):
        poisoned.run()


def test_skip_under_zero_0_in_fp32_is_refused_before_the_run():
    """DeepSpeed's plain optimizer (ZeRO-0, fp32) checks nothing: the NaN step was applied, the run
    trained on NaN weights and failed at its checkpoint, spending its restarts on the same failure."""
    with pytest.raises(ConfigError, match=r"train.nonfinite=skip with train.zero_stage=0 and precision.dtype=fp32"):
        load_config(
            TrainingConfig,
            None,
            ["data.train=x", "train.zero_stage=0", "precision.dtype=fp32", "train.nonfinite=skip"],
        )
    load_config(
        TrainingConfig, None, ["data.train=x", "train.zero_stage=0", "precision.dtype=bf16", "train.nonfinite=skip"]
    )


@pytest.mark.parametrize("stage", [0, 1])
def test_the_logged_lr_and_grad_norm_are_those_of_the_logged_step(process_group, digits_dataset, tmp_path, stage):
    """`lr` was the next step's (the last record showed min_lr, a rate no step trained at), and ZeRO-0
    in fp32 logged a NaN `grad_norm` (DeepSpeed's plain optimizer keeps none)."""
    from vitray.trainers.step.schedule import lr_multiplier

    steps = 4
    loop = in_process_loop(
        digits_dataset,
        tmp_path,
        f"train.zero_stage={stage}",
        "precision.dtype=fp32",
        "optim.grad_clip=1e-6",
        f"train.steps={steps}",
        "log.every=4",
        "schedule.warmup_steps=1",
        "schedule.decay=linear",
    )
    last = loop.run()
    rate = lr_multiplier(steps - 1, total_steps=steps, warmup_steps=1, decay="linear")  # the last step, 0-based
    assert last["lr"] == pytest.approx(loop.cfg.optim.lr * rate) and rate > 0
    assert math.isfinite(last["grad_norm"]) and last["grad_norm"] > 1e-3  # before clipping (to 1e-6)


@pytest.mark.parametrize("backend", ["deepspeed", "xla"])
def test_the_stop_message_offers_skip_only_where_the_engine_can_skip(backend):
    """The xla backend refuses train.nonfinite=skip (and fp16): its stop message offered both."""
    from types import SimpleNamespace

    from vitray.trainers.loop import TrainingLoop

    cfg = load_config(TrainingConfig, None, ["data.train=x", f"train.backend={backend}"])
    with pytest.raises(FloatingPointError) as stopped:
        TrainingLoop._apply_nonfinite_policy(SimpleNamespace(cfg=cfg, step=4), 1, 2)
    message = str(stopped.value)
    assert "between 3 and 4" in message and "fp16" not in message
    assert ("train.nonfinite=skip" in message) == (backend == "deepspeed")


def test_a_resumed_fp16_run_counts_no_loss_scale_drop_as_a_nonfinite_step(process_group, digits_dataset, tmp_path):
    """The run-long count went on from DeepSpeed's checkpointed dropped steps: in fp16 the loss
    scaler's, so a resumed run reported 8 non-finite steps that never happened."""
    from pathlib import Path

    saved = []
    extra = ("precision.dtype=fp16", "train.steps=16", "log.every=4", "checkpoint.every=8")
    straight = _fp16_or_skip((digits_dataset, tmp_path / "a", *extra))
    straight.ctx.report = lambda metrics, folder: saved.append(folder)
    straight.checkpointer.report = straight.ctx.report
    straight.backend.engine.optimizer.loss_scaler.cur_scale = 2.0**24  # drops until halved to 2^16
    last = straight.run()
    resumed = in_process_loop(digits_dataset, tmp_path / "b", *extra, restore_dir=Path(saved[0]))
    assert resumed.step == 8
    again = resumed.run()
    assert last["loss_scale_skips"] >= 8 and last["nonfinite_steps"] == again["nonfinite_steps"] == 0


def test_a_non_finite_stop_is_not_restarted(monkeypatch):
    """A step is a function of the seed and the checkpoint: a new worker group from the latest
    checkpoint meets the same NaN, so the stop (and fp16's exhausted loss scale) spends no restart."""
    from vitray.cluster import train_worker as worker
    from vitray.common.failures import RestartCannotFix

    def poisoned(loop_config):
        raise FloatingPointError("train.nonfinite=stop: 1 step(s) between 3 and 4 had a non-finite loss")

    monkeypatch.setattr(worker, "_train", poisoned)
    with pytest.raises(RestartCannotFix, match="between 3 and 4"):
        worker.train_worker({})


def test_fp16_gradients_that_overflow_at_every_scale_stop_with_vitrays_words(process_group, digits_dataset, tmp_path):
    """A finite loss whose gradients are not finite at any scale: DeepSpeed halves the loss scale to
    its minimum and raised its bare `Exception` (restarted, to meet it again); the scaler's drops no
    longer count as non-finite steps, so this is said here instead."""
    loop = _fp16_or_skip((digits_dataset, tmp_path, "precision.dtype=fp16", "train.steps=60", "log.every=30"))
    loop.backend.module.head.weight.register_hook(lambda grad: grad * float("inf"))
    with pytest.raises(FloatingPointError, match=r"fp16's loss scale fell to its minimum .* Train in bf16"):
        loop.run()
