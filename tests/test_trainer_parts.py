"""The training loop's pieces, and the loop itself in one process (no Ray): schedule, objectives,
weight-decay groups, EMA, and DeepSpeed ZeRO-2 / bf16 / EMA / mixup / label smoothing together."""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vitray.common.config import load_config
from vitray.models import create_model
from vitray.runfolder import checkpoint_folders as ckpt
from vitray.trainers.config import TrainingConfig
from vitray.trainers.context import WorkerContext
from vitray.trainers.step.ema import Ema, WholeWeights
from vitray.trainers.step.objectives import loss_fn, mixup, resolve_objective, targets_from_labels
from vitray.trainers.step.optim import param_groups
from vitray.trainers.step.schedule import lr_multiplier


def test_warmup_then_linear_and_cosine_decay():
    kw = {"total_steps": 100, "warmup_steps": 10}
    # A step ahead of the authors' `step / warmup_steps` (docs/evaluation.md's fidelity table): no
    # first rate of 0, which XLA would compile a step of its own for (tests/test_xla.py counts them)
    assert lr_multiplier(0, decay="linear", **kw) == pytest.approx(0.1)
    assert lr_multiplier(9, decay="linear", **kw) == pytest.approx(1.0)
    assert lr_multiplier(55, decay="linear", **kw) == pytest.approx(0.5)
    assert lr_multiplier(100, decay="linear", **kw) == pytest.approx(0.0)
    assert lr_multiplier(55, decay="cosine", **kw) == pytest.approx(0.5)
    assert lr_multiplier(100, decay="cosine", min_ratio=0.1, **kw) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="linear"):
        lr_multiplier(50, decay="step", **kw)


def test_softmax_with_label_smoothing_matches_torch():
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    ours = loss_fn(logits, targets_from_labels(labels, 5, label_smoothing=0.1), "softmax")
    reference = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.1)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-6)


def test_sigmoid_cross_entropy_sums_classes_for_multi_label():
    logits = torch.zeros(2, 4)
    multi_hot = torch.tensor([[1.0, 0, 1, 0], [0, 0, 0, 1]])
    assert loss_fn(logits, targets_from_labels(multi_hot, 4), "sigmoid").item() == pytest.approx(4 * math.log(2))
    assert resolve_objective("auto", "multi") == "sigmoid"
    with pytest.raises(ValueError, match="multi-label"):
        resolve_objective("softmax", "multi")


def test_mixup_is_seeded_mixes_each_example_with_its_neighbour_and_keeps_targets_normalised():
    """big_vision's pairing (the batch rolled by one): every example is mixed, also the middle one of
    an odd batch (the reversed batch paired it with itself), with a partner of its own."""
    images = torch.randn(5, 3, 8, 8)
    targets = targets_from_labels(torch.tensor([0, 1, 2, 3, 4]), 5)
    a = mixup(images, targets, 0.2, np.random.default_rng([1, 2]))
    b = mixup(images, targets, 0.2, np.random.default_rng([1, 2]))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.allclose(a[1].sum(1), torch.ones(5))
    ratio = float(a[1][0, 0])
    assert 0.5 <= ratio < 1
    for i in range(5):  # example i mixed with example i - 1 (the first with the last)
        expected = torch.zeros(5)
        expected[i], expected[i - 1] = ratio, 1 - ratio
        torch.testing.assert_close(a[1][i], expected)
        torch.testing.assert_close(a[0][i], ratio * images[i] + (1 - ratio) * images[i - 1])


def test_weight_decay_only_on_matrices():
    model = create_model("Ti/4", num_classes=3, img_size=16)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim >= 2 for p in decay["params"])
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert {"pos_embed", "cls_token"} <= skipped and any(n.endswith("bias") for n in skipped)


def test_ema_tracks_weights():
    model = torch.nn.Linear(2, 2)
    ema = Ema(WholeWeights(model), decay=0.5)
    start = ema.state_dict()["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update()
    assert torch.allclose(ema.state_dict()["weight"], start + 0.5)


class _MixedWeights(torch.nn.Module):
    """fp32 and bf16 parameters side by side, and an integer buffer (what a bf16 ZeRO rank holds)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(7, 5))
        self.b = torch.nn.Parameter(torch.randn(300).bfloat16())
        self.c = torch.nn.Parameter(torch.randn(4, 4).half())
        self.register_buffer("steps", torch.tensor(3))


@pytest.mark.parametrize("chunk", [1 << 26, 200])  # one cast chunk, or one per bf16/fp16 tensor
def test_ema_foreach_update_gives_the_per_tensor_values(monkeypatch, chunk):
    import vitray.trainers.step.ema as ema_module

    monkeypatch.setattr(ema_module, "CAST_CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    model, decay = _MixedWeights(), 0.9
    ema = Ema(WholeWeights(model), decay=decay)
    # The formula before foreach: one lerp per tensor on an fp32 copy, integers copied.
    reference = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    for step in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model.steps += 1
        ema.update()
        for key, value in model.state_dict().items():
            if value.is_floating_point():
                reference[key].lerp_(value.float(), 1.0 - decay)
            else:
                reference[key].copy_(value)
        for key in reference:
            assert torch.equal(ema.shadow[key], reference[key]), (step, key)
    assert ema.shadow["steps"].item() == 8
    assert not torch.equal(ema.shadow["b"], model.b.float())  # averaged, not copied


def test_loop_in_process_with_zero2_bf16_ema_mixup(process_group, digits_dataset, tmp_path):
    from vitray.trainers.loop import TrainingLoop

    cfg = load_config(
        TrainingConfig,
        None,
        [
            f"data.train={digits_dataset}",
            "model.img_size=16",
            "train.steps=4",
            "train.batch_size=16",
            "train.micro_batch_size=8",
            "schedule.warmup_steps=1",
            "log.every=2",
            "checkpoint.every=4",
            "train.zero_stage=2",
            "precision.dtype=bf16",
            "optim.ema_decay=0.9",
            "train.mixup_alpha=0.2",
            "train.label_smoothing=0.1",
            "cluster.num_workers=1",
            "data.num_workers=0",
            f"run.storage={tmp_path}",
        ],
    )
    reports = []
    ctx = WorkerContext(rank=0, world_size=1, run_dir=str(tmp_path / "run"), report=lambda m, d: reports.append((m, d)))
    loop = TrainingLoop(cfg, ctx)
    assert loop.accum == 2 and loop.backend.dtype == torch.bfloat16
    assert loop.ema is not None  # evaluators score the EMA weights (tests/test_fidelity.py)
    last = loop.run()
    # The last of 3 decay steps trains at a third of optim.lr (the decay reaches 0 at train.steps)
    assert math.isfinite(last["loss"]) and last["lr"] == pytest.approx(cfg.optim.lr / 3)
    # Only the checkpoint is reported (log step 2 is not: under Ray Train a report is a barrier
    # across the ranks that stalls the step), with its step's metrics.
    saved = [d for _, d in reports]
    assert len(saved) == 1 and reports[0][0]["step"] == 4 and "loss" in reports[0][0], reports
    state = ckpt.verify_complete(saved[0])
    assert state["step"] == 4 and state["world_size"] == 1
    ema, weights = load_file(str(Path(saved[0]) / ckpt.EMA_FILE)), load_file(str(Path(saved[0]) / ckpt.MODEL_FILE))
    assert ema.keys() == weights.keys()
    assert any(not torch.equal(ema[k], weights[k]) for k in weights)
    # data.num_slots unset: one slot per loader worker (no workers here: one for the rank) ...
    assert cfg.data.num_slots is None and state["data"]["num_slots"] == 1
    # The checkpoint loads back (ZeRO-2 bf16 optimizer states through weights_only loading), ...
    more_workers = cfg.model_copy(update={"data": cfg.data.model_copy(update={"num_workers": 2})})
    assert more_workers.new_run_num_slots() == 2
    resumed = TrainingLoop(
        more_workers,
        WorkerContext(rank=0, world_size=1, run_dir=ctx.run_dir, report=ctx.report, resume_from=str(saved[0])),
    )
    assert resumed.step == 4
    # ... with the slots the run started with, not those a new run of this config would take.
    assert resumed.loader.state_dict()["num_slots"] == 1
    # model.safetensors holds the fp32 master weights (not the bf16 ones upcast): the module's bf16
    # weights are them rounded, and the resumed run's master weights are them exactly.
    assert any(not torch.equal(v, v.bfloat16().float()) for v in weights.values())
    live = resumed.backend.module.state_dict()
    assert all(torch.equal(live[k], weights[k].bfloat16()) for k in weights)
    master = resumed.backend.full_state_dict()
    assert all(torch.equal(master[k], weights[k]) for k in weights)


def test_background_checkpoint_writes_the_state_as_it_was_when_saved(tmp_path):
    from vitray.trainers.engines.deepspeed.checkpoint_engine import DEEPSPEED_SAVE_ROOT, BackgroundCheckpointEngine

    engine = BackgroundCheckpointEngine()
    weights = torch.arange(6, dtype=torch.float32)
    view = weights[2:4]  # a view must be written compactly, not with its whole storage
    scale = _Scale(2.0)  # a plain object DeepSpeed pickles (its loss scaler, fragment addresses)
    state = {"module": {"w": weights, "v": view}, "step": 7, "groups": [{"lr": 0.1}], "shape": weights.shape}
    state["scaler"] = scale
    # DeepSpeed names its files under a folder that is never made; each goes into the checkpoint's folder.
    folder = tmp_path / "checkpoint"
    engine.begin(str(folder))
    engine.makedirs(str(DEEPSPEED_SAVE_ROOT / "deepspeed"), exist_ok=True)
    engine.save(state, str(DEEPSPEED_SAVE_ROOT / "deepspeed" / "state.pt"))
    weights.add_(100.0)  # training goes on while the file is written
    state["groups"][0]["lr"] = 0.0
    scale.value = 0.5
    # Nothing is written until the whole snapshot is taken (the writer would hold the GIL the
    # training thread needs between its copies).
    assert not folder.exists()
    pending = engine.pending()
    pending.wait()
    assert pending.done()
    assert not DEEPSPEED_SAVE_ROOT.exists()
    with torch.serialization.safe_globals([_Scale]):
        loaded = engine.load(str(folder / "deepspeed" / "state.pt"))
    assert torch.equal(loaded["module"]["w"], torch.arange(6, dtype=torch.float32))
    assert torch.equal(loaded["module"]["v"], torch.tensor([2.0, 3.0]))
    assert loaded["module"]["v"].untyped_storage().nbytes() == 2 * 4
    assert loaded["step"] == 7 and loaded["groups"] == [{"lr": 0.1}] and loaded["shape"] == (6,)
    assert loaded["scaler"] == _Scale(2.0)


@dataclasses.dataclass
class _Scale:
    value: float


def test_host_buffers_reserved_ahead_serve_the_first_snapshot_and_are_kept_for_the_next():
    """The first checkpoint's snapshot takes buffers reserved (allocated and touched) ahead of it,
    also for a tensor a few elements smaller (a ZeRO partition saved without its padding), allocates
    only what nothing reserved fits, and the next snapshot copies into the same buffers; each starts
    on a page of memory."""
    from vitray.trainers.checkpoint.host_buffers import HostBuffers

    buffers = HostBuffers()
    master, moment = torch.randn(10, 10), torch.randn(64, dtype=torch.bfloat16)
    buffers.reserve([master, moment, torch.zeros(10_000)])  # (the last one fits nothing below)
    # An empty tensor (ZeRO-3's module states) comes first and must not take the master's buffer.
    state = {"empty": torch.zeros(0), "master": master, "moments": [moment[:62]], "counts": torch.arange(7)}
    first = buffers.snapshot(state)
    buffers.release_reserve()
    assert buffers.allocated_in_snapshots == 7 * 8  # only `counts`: int64, which nothing reserved fits
    assert torch.equal(first["master"], master) and torch.equal(first["moments"][0], moment[:62])
    assert first["moments"][0].shape == (62,)
    # Every buffer's storage starts on a page: a checkpoint file writes it from there (DirectFile).
    assert all(first[k].untyped_storage().data_ptr() % 4096 == 0 for k in ("master", "counts"))
    assert first["moments"][0].untyped_storage().data_ptr() % 4096 == 0
    master.add_(1.0)
    second = buffers.snapshot(state)
    assert torch.equal(second["master"], master) and buffers.allocated_in_snapshots == 7 * 8
    assert second["master"].data_ptr() == first["master"].data_ptr()
    assert second["moments"][0].data_ptr() == first["moments"][0].data_ptr()


def test_checkpoint_loading_refuses_pickled_code(tmp_path):
    from vitray.trainers.engines.deepspeed.checkpoint_engine import BackgroundCheckpointEngine

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        BackgroundCheckpointEngine().load(str(tmp_path / "evil.pt"))


def test_the_shared_memory_all_reduce_is_off_without_probing_every_op_builder():
    """DeepSpeed's shared-memory all-reduce extension is never built (its build lock outlives a
    killed worker), and marking it off does not probe all of DeepSpeed's op builders, which the
    first read of `deepspeed.ops.__compatible_ops__` does (~0.15 s of CPU in every worker)."""
    script = (
        "import deepspeed.ops.op_builder.builder as builder; probed = []; real = builder.probe_is_compatible; "
        "builder.probe_is_compatible = lambda b: probed.append(b) or real(b); "
        "from vitray.trainers.engines.deepspeed.backend import _without_shared_memory_comm_op; "
        "_without_shared_memory_comm_op(); "
        "from deepspeed.comm.torch import build_shm_op; "
        "print('result', build_shm_op() is None, len(probed)); "
        "import deepspeed.ops; deepspeed.ops.__compatible_ops__; "
        "print('result', build_shm_op() is None, len(probed))"
    )
    assert _results_in_a_fresh_process(script) == [["True", "0"], ["True", "0"]]


def _results_in_a_fresh_process(script: str) -> list[list[str]]:
    """The words after `result` of each line `script` prints, run in a new Python process (imports
    and DeepSpeed's module state fresh); not DeepSpeed's own log lines."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("result ")]


def test_the_deepspeed_backend_imports_deepspeed_without_mlflow_or_inductor():
    """DeepSpeed's autotuner imports mlflow when installed, and its ZeRO engines import its Muon
    optimizer, which compiles three functions and so imports torch's inductor (~1 + ~1.5 s in every
    worker's start-up); vitray keeps both out of those imports only: mlflow stays importable and
    torch.compile compiles as before afterwards."""
    script = (
        "import sys, torch; import vitray.trainers.engines.deepspeed.backend; "
        "from deepspeed.autotuning import autotuner; "
        "print('result', 'mlflow' in sys.modules, autotuner.has_mlflow); "
        # What deepspeed.initialize with ZeRO and every ZeRO reduction import:
        "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam; "
        "from deepspeed.runtime.zero.muon.original_muon import muon_update; "
        "print('result', 'torch._inductor.compile_fx' in sys.modules, callable(muon_update)); "
        "import mlflow; print('result', mlflow.__name__); "
        "square = lambda x: x * x; compiled = torch.compile(square); "
        "print('result', compiled is not square, 'torch._inductor.compile_fx' in sys.modules)"
    )
    said = _results_in_a_fresh_process(script)
    assert said == [["False", "False"], ["False", "True"], ["mlflow"], ["True", "True"]]


def test_the_metrics_writer_imports_tensorboard_without_boto3(tmp_path):
    """TensorBoard's file layer imports boto3 for s3:// paths (~0.3 CPU-s of rank 0's start-up);
    the writer's events go to a local folder, so vitray keeps boto3 out of that import only: the
    events are written, and boto3 imports as before afterwards."""
    script = (
        "import sys; from pathlib import Path; from vitray.trainers.metrics import MetricsWriter; "
        f"writer = MetricsWriter(Path({str(tmp_path)!r})); writer.write(1, {{'loss': 2.5}}); writer.close(); "
        "from tensorboard.compat.tensorflow_stub.io import gfile; "
        "print('result', 'boto3' in sys.modules, gfile.S3_ENABLED); "
        f"print('result', len(list(Path({str(tmp_path)!r}, 'tensorboard').glob('events.out.tfevents.*')))); "
        "import boto3; print('result', boto3.__name__)"
    )
    assert _results_in_a_fresh_process(script) == [["False", "False"], ["1"], ["boto3"]]


def test_a_runs_evaluation_starts_workers_only_for_a_share_that_repays_them(digits_dataset):
    """The val evaluator reads a rank's share of fewer than 512 samples per worker in its own
    process: no forkserver importing torch for the 180 samples of digits' test split."""
    from vitray.data.eval_loader import worker_count

    assert [worker_count(n, 4) for n in (0, 511, 512, 1535, 1536, 100_000)] == [0, 0, 1, 2, 3, 4]
    assert worker_count(100_000, 0) == 0

    def val(split: str, rank: int = 0, world_size: int = 1, num_workers: int = 2):
        from vitray.trainers.eval_schedule import build_evaluators

        cfg = load_config(
            TrainingConfig,
            None,
            [
                f"data.train={digits_dataset}",
                f"data.num_workers={num_workers}",
                f"evals.val={{type: val, every: 4, split: {split}}}",
            ],
        )
        (scheduled,) = build_evaluators(cfg, rank, world_size)
        return scheduled.evaluator

    assert not val("test").uses_worker_processes()  # 360 samples
    assert val("train", 1, 2).uses_worker_processes()  # 718 of 1,437
    assert not val("train", 0, 3).uses_worker_processes()  # 479
    assert not val("train", num_workers=0).uses_worker_processes()
    evaluator = val("train")
    assert evaluator.loader().num_workers == 2  # 1,437: two workers (at most data.num_workers)
    assert evaluator.loader() is evaluator.loader()  # the split is listed once, not at every evaluation
