"""ZeRO stages end to end with 2 CPU workers: training, the val evaluator, the few-shot probe and
the EMA, checkpoints, a killed worker's restart and a resume onto another number of workers, at
ZeRO-3. ZeRO-1 is `tests/test_pretrain.py`'s recipe; ZeRO-2 runs in process in
`tests/test_trainer_parts.py` and `tests/test_step_overhead.py` (it partitions what ZeRO-1 does,
and the gradients); ZeRO-0 and ZeRO-3 in bf16 run in process here (one rank: the evaluators, the
EMA and the consolidated fp32 master weights of each stage's optimizer).

ZeRO-3 is the stage where these used to hang or break: its forward pass gathers each layer's
weights from every rank, so a probe on rank 0 alone waits forever, ranks with different numbers
of validation batches wait on each other, and the EMA of a partitioned (empty) parameter fails.
ZeRO-0 has nothing of this kind across ranks (every rank holds everything; its gradients are
all-reduced as ZeRO-1's are), so its two-worker run was one the suite could do without.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from pretrain_helpers import assert_same_weights, in_process_loop, pretrain_args, run
from safetensors.torch import load_file

from vitray import storage
from vitray.runfolder import derived_weights
from vitray.runfolder.checkpoint_folders import find_checkpoints, latest_complete_checkpoint, verify_complete
from vitray.runfolder.files import RunFiles

pytestmark = pytest.mark.slow

# Evaluations (val + probe) and checkpoints every 4 steps: a restart at step 6 goes back to step 4.
# The resume on one worker goes on from step 8 of 12: from step 4, Adam's young moments magnify the
# rounding differences of one worker's gradient sums to the size of a lost state (measured 1.2e-4).
STEPS = 12
EVERY = 4
# Validation on the first 359 test samples in batches of 179: rank 0 scores 179 samples in one
# batch, rank 1 180 in two, so under ZeRO-3 rank 0 makes a padding forward call.
VAL_SPLIT, VAL_BATCH = "test[:359]", 179


def _args(
    digits_dataset,
    storage: Path,
    stage: int,
    dtype: str,
    *extra: str,
    steps: int = STEPS,
    evals: bool = True,
    evals_every: int = EVERY,
) -> list[str]:
    """The run's command; `evals=False` leaves out the val evaluator and the probe (a resume may
    drop them: they do not change the training)."""
    evaluations = (
        f"evals.val={{type: val, every: {evals_every}, batch_size: {VAL_BATCH}}}",
        f"data.val_split={VAL_SPLIT}",
        f"evals.probe={{type: fewshot, every: {evals_every}, datasets: {{digits: {digits_dataset}}}, batch_size: 64}}",
    )
    return pretrain_args(
        str(digits_dataset),
        str(storage),
        "run",
        f"train.steps={steps}",
        f"checkpoint.every={EVERY}",
        "checkpoint.keep=3",
        "data.min_crop_area=1.0",
        f"train.zero_stage={stage}",
        f"precision.dtype={dtype}",
        "optim.ema_decay=0.9",
        *(evaluations if evals else ()),
        *extra,
    )


def _final(run_dir: Path) -> tuple[dict, dict]:
    latest = Path(latest_complete_checkpoint(str(run_dir)).path)
    return load_file(str(latest / "model.safetensors")), load_file(str(latest / "ema.safetensors"))


def _evals(run_dir: Path) -> dict[int, dict[str, float]]:
    metrics = RunFiles(str(run_dir)).read_metrics()
    return {
        m["step"]: {k: v for k, v in m.items() if k.startswith(("val/", "probe/"))}
        for m in metrics
        if any(k.startswith(("val/", "probe/")) for k in m)
    }


def _check_reference(
    run_dir: Path, dtype: str, steps: int = STEPS, evals_every: int = EVERY
) -> tuple[dict, dict, dict]:
    weights, ema = _final(run_dir)
    evals = _evals(run_dir)
    # The val evaluator and the probe ran at every evaluation step, on the EMA weights.
    assert sorted(evals) == list(range(evals_every, steps + 1, evals_every))
    assert all({"val/top1", "probe/digits_10shot"} <= set(e) for e in evals.values()), evals
    assert ema.keys() == weights.keys() and any(not torch.equal(ema[k], weights[k]) for k in weights)
    if dtype == "bf16":  # the consolidated weights are the fp32 master ones, not bf16 upcast
        assert any(not torch.equal(v, v.bfloat16().float()) for v in weights.values())
    return weights, ema, evals


@pytest.mark.parametrize("stage", [0, 3])
def test_zero_stage_in_process_trains_evaluates_probes_and_keeps_the_ema_in_bf16(
    stage, process_group, digits_dataset, tmp_path
):
    """One rank, in this process: the val evaluator and the probe every 2 steps on the EMA weights,
    and a checkpoint whose consolidated weights are the fp32 master ones (at ZeRO-3 gathered from
    the optimizer's partition), not the bf16 module weights upcast."""
    loop = in_process_loop(
        digits_dataset,
        tmp_path,
        f"train.zero_stage={stage}",
        "optim.ema_decay=0.9",
        "checkpoint.every=4",
        "log.every=2",
        f"evals.val={{type: val, every: 2, batch_size: {VAL_BATCH}}}",
        f"data.val_split={VAL_SPLIT}",
        f"evals.probe={{type: fewshot, every: 2, datasets: {{digits: {digits_dataset}}}, batch_size: 64}}",
    )
    loop.run()
    _check_reference(tmp_path / "run", "bf16", steps=4, evals_every=2)


@pytest.mark.parametrize("remat_policy", ["nothing_saveable", "dots_saveable"])
def test_zero3_checkpointed_blocks_get_the_gradients_of_plain_ones(process_group, remat_policy):
    """DeepSpeed's ZeRO-3 engine, left to its defaults, replaces `torch.nn.functional.linear` for
    the whole process with its own, which adds the bias in place to the product it has just made.
    Under remat_policy=dots_saveable that product is the output the block keeps, so the recompute
    in the backward pass added the bias a second time: every gradient was wrong (up to 9e-3 on a
    Ti/4). vitray keeps torch's linear; a ZeRO-3 engine's gradients equal those of the same model
    without checkpointing, in fp32."""
    import deepspeed
    import torch.nn.functional as F

    from vitray.common.config import load_config
    from vitray.models import create_model_from_config
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.engines.deepspeed.backend import DeepSpeedBackend

    linear = F.linear
    settings = ["data.train=/unused", "model.name=Ti/16", "model.img_size=32", "train.zero_stage=3"]
    settings += ["precision.dtype=fp32", "train.batch_size=2", "train.micro_batch_size=2", "cluster.num_workers=1"]
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([1, 3])
    gradients = []
    for checkpointed in (False, True):
        extra = [f"model.grad_checkpointing={checkpointed}", f"model.remat_policy={remat_policy}"]
        cfg = load_config(TrainingConfig, None, settings + extra)
        torch.manual_seed(0)
        model = create_model_from_config(cfg.model, 10)
        for parameter in model.parameters():  # (a zero head would hide the blocks' gradients)
            torch.nn.init.normal_(parameter, std=0.1)
        if checkpointed:
            backend = DeepSpeedBackend(cfg, model, 1, None)
            backend.engine.backward(F.cross_entropy(backend(images), labels))
            named = backend.module.named_parameters()
            gradients.append({name: deepspeed.utils.safe_get_full_grad(p) for name, p in named})
        else:
            F.cross_entropy(model(images), labels).backward()
            gradients.append({name: p.grad for name, p in model.named_parameters()})
    plain, zero3 = gradients
    assert plain.keys() == zero3.keys() and all(g.abs().sum() > 0 for g in plain.values())
    for name in plain:
        torch.testing.assert_close(zero3[name], plain[name], msg=lambda m, name=name: f"{name}: {m}")
    assert F.linear is linear, "the ZeRO-3 engine replaced torch.nn.functional.linear"


def test_zero3_restarts_exactly_and_resumes_on_one_worker(digits_dataset, tmp_path):
    """ZeRO-3's state is partitioned over the ranks: a killed worker's restart loads every rank's
    partition back, and a resume on one worker needs DeepSpeed's universal conversion, which
    re-partitions the weights and the optimizer state. fp32, so that the one-worker resume can be
    told from one that lost Adam's moments (bf16's rounding would be of that size). The reference
    evaluates every 4 steps on both ranks (rounds between training steps; rank 0 with a padding
    batch); the restarted run at its last step only: what the restart must give again are that
    step's numbers, and a ZeRO-3 round costs more CPU than 4 steps."""
    reference = tmp_path / "reference"
    run(_args(digits_dataset, reference, 3, "fp32"))
    weights, ema, evals = _check_reference(reference / "run", "fp32")
    # Only the last checkpoint carries model.safetensors (checkpoint.model_weights=last): the others'
    # weights are derived from the two ranks' ZeRO-3 shards, as they are from the last one's.
    checkpoints = find_checkpoints(str(reference / "run"))
    with_weights = [(c.step, (Path(c.path) / "model.safetensors").exists()) for c in checkpoints]
    assert with_weights == [(4, False), (8, False), (12, True)], with_weights
    last = checkpoints[-1].path
    shards = derived_weights.derive(
        last, storage.filesystem(last)[0], verify_complete(last), read=lambda name: (Path(last) / name).read_bytes()
    )
    assert_same_weights(shards, weights)

    # A worker killed mid-run: Ray Train restarts the group from the step-4 checkpoint, and the run
    # ends with the same weights, EMA and last evaluations as the uninterrupted one.
    restarted = tmp_path / "restarted"
    run(
        _args(
            digits_dataset,
            restarted,
            3,
            "fp32",
            "debug.kill_worker_at_step=6",
            "cluster.max_failures=1",
            evals_every=STEPS,
        )
    )
    assert (restarted / "run" / "vitray" / "markers" / "killed-at-step-6").exists()
    again_weights, again_ema = _final(restarted / "run")
    assert_same_weights(again_weights, weights)
    assert_same_weights(again_ema, ema)
    assert _evals(restarted / "run") == {STEPS: evals[STEPS]}

    # The reference with its last checkpoint left unfinished by rank 1: it goes on from step 8 on
    # one worker (the same global batch of 32 in one micro-batch). Without the evaluations: what is
    # checked of it is its weights, and a ZeRO-3 evaluation round (val and probe) costs more CPU
    # than its 4 steps.
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    last = Path(find_checkpoints(str(resumed / "run"))[-1].path)
    assert verify_complete(last)["step"] == STEPS
    (last / "complete-rank-0001.json").unlink()
    one_worker = ("cluster.num_workers=1", "train.micro_batch_size=32")
    out = run(_args(digits_dataset, resumed, 3, "fp32", *one_worker, evals=False))
    # Converted once, by the driver, into the step-8 checkpoint (its record written last).
    assert "written by 2 workers; converting it once for 1" in out.stderr, out.stderr[-3000:]
    step8 = next(Path(c.path) for c in find_checkpoints(str(resumed / "run")) if c.step == STEPS - EVERY)
    assert (step8 / "deepspeed" / "state_universal" / "complete.json").is_file()
    state = verify_complete(latest_complete_checkpoint(str(resumed / "run")).path)
    assert state["step"] == STEPS and state["world_size"] == 1
    resumed_weights, resumed_ema = _final(resumed / "run")
    # Not bit-equal: one worker sums the gradients in another order. Restored Adam moments keep the
    # difference at rounding level; moments lost on resume would move the weights by about the
    # learning rate (4e-4 .. 1e-4 over these 4 steps) in every parameter.
    worst = max(float((resumed_weights[k] - weights[k]).abs().max()) for k in weights)
    assert worst < 2e-5, worst
    worst_ema = max(float((resumed_ema[k] - ema[k]).abs().max()) for k in ema)
    assert worst_ema < 2e-5, worst_ema
