"""The torch-xla backend for real, on PJRT's CPU client: 4 CPU devices stand in for a TPU host.

`make test` runs it beside the other modules with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 set (as this
module also sets them, before torch-xla starts; `make test-xla` runs the `xla` tests alone).
`vitray pretrain --set train.backend=xla` on a local Ray with
one worker (one "host") trains with parameters sharded over the 4 devices, compiles its graphs
once, checkpoints with torch.distributed.checkpoint, resumes exactly after a worker is killed,
resumes on 2 devices from a 4-device checkpoint, and its weights load into the DeepSpeed backend.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Before torch-xla starts its runtime (collection imports this module first). XLA's CPU compiler
# at -O0: these graphs are compiled in every test process and run for a few steps only.
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

from pretrain_helpers import assert_same_weights, final_weights, pretrain_args, run

pytestmark = pytest.mark.xla

STEPS = 24
EVERY = 12
# One Ray worker (one "host") feeding the 4 devices one batch of 32 per step; uncropped digits,
# on which this tiny ViT's loss visibly falls within the run.
XLA = [
    "train.backend=xla",
    "cluster.num_workers=1",
    "train.micro_batch_size=32",
    "schedule.warmup_steps=2",
    "data.min_crop_area=1.0",
]


def _metrics(run_dir: str) -> list[dict]:
    from vitray.runfolder.files import RunFiles

    return RunFiles(run_dir).read_metrics()


@pytest.fixture(scope="module")
def reference(digits_dataset, tmp_path_factory):
    """An uninterrupted XLA run on 4 devices: the yardstick for the resume tests."""
    from vitray.trainers.keys import collect_keys

    root = tmp_path_factory.mktemp("xla-reference")
    keys = root / "keys"
    run(
        pretrain_args(
            str(digits_dataset),
            str(root / "runs"),
            "ref",
            *XLA,
            f"train.steps={STEPS}",
            f"checkpoint.every={EVERY}",
            f"debug.record_sample_keys={keys}",
        )
    )
    run_dir = str(root / "runs" / "ref")
    return {"run_dir": run_dir, "weights": final_weights(run_dir), "keys": collect_keys(keys)}


def test_xla_run_trains_compiles_once_and_checkpoints_with_dcp(reference):
    from vitray.runfolder.checkpoint_folders import find_checkpoints, verify_complete

    metrics = _metrics(reference["run_dir"])
    assert [m["step"] for m in metrics] == list(range(2, STEPS + 1, 2))
    assert all(m["xla/devices"] == 4 for m in metrics)
    first, last = metrics[0]["loss"], metrics[-1]["loss"]
    assert last < first - 0.1, f"loss did not fall: {first} -> {last}"
    # Fixed shapes and one graph cut per step: the graphs of the first step (the optimizer
    # state's creation, the training step with its loss mean) are all it ever compiles.
    compiled = [m["xla/compilations"] for m in metrics]
    assert compiled == [2] * len(metrics), compiled
    keys = reference["keys"]
    assert sorted(keys) == list(range(STEPS)) and all(len(set(k)) == 32 for k in keys.values())

    checkpoints = find_checkpoints(reference["run_dir"])
    assert [c.step for c in checkpoints] == [EVERY, STEPS] and all(c.complete for c in checkpoints)
    folder = Path(checkpoints[-1].path)
    state = verify_complete(folder)
    assert state["backend"] == "xla" and state["world_size"] == 1
    # 24 steps of one batch of 32 over data.num_slots=8, within the first epoch of digits' 1,437 samples
    assert (state["data"]["epoch"], state["data"]["num_slots"], state["data"]["consumed_per_slot"]) == (
        0,
        8,
        STEPS * 32 // 8,
    )
    assert (folder / "xla" / ".metadata").is_file() and list((folder / "xla").glob("*.distcp"))
    listed = (folder / "complete-rank-0000.json").read_text()
    assert "xla/.metadata" in listed  # the DCP shards count for completeness like every other file


def test_parameters_and_optimizer_state_are_sharded_over_the_devices(digits_dataset):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from vitray.common.config import load_config
    from vitray.models import create_model
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.engines.xla.backend import XlaBackend

    cfg = load_config(
        TrainingConfig, None, [f"data.train={digits_dataset}", "model.img_size=16", "train.batch_size=32", *XLA]
    )
    torch.manual_seed(0)
    model = create_model("Ti/4", num_classes=10, img_size=16)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    backend = XlaBackend(cfg, model, world_size=1, restore=None)
    assert str(backend.device).startswith("xla")
    xm.wait_device_ops()  # shards are read from finished tensors
    sharded = 0
    for name, param in backend.module.named_parameters():
        spec = torch_xla._XLAC._get_xla_sharding_spec(param)
        shards = torch_xla._XLAC._get_local_shards([param])[0]
        assert len(shards) == 4, name
        largest = max(range(param.ndim), key=lambda d: param.shape[d]) if param.ndim else None
        if largest is not None and param.shape[largest] >= 4:
            # Each device holds a quarter of the largest dimension, nothing more.
            assert spec.startswith("{devices=["), (name, spec)
            assert shards[0][0].shape[largest] == -(-param.shape[largest] // 4), (name, shards[0][0].shape)
            sharded += 1
        exp_avg = backend.optimizer.state[param]["exp_avg"]  # created up front, in the parameter's sharding
        assert torch_xla._XLAC._get_xla_sharding_spec(exp_avg) == spec, name
    assert sharded == len(list(backend.module.parameters()))
    # The consolidated weights are the model's, assembled from the shards (creating the optimizer
    # state changed nothing).
    assert_same_weights(backend.full_state_dict(), initial)


def _one_step(remat: bool) -> tuple[int, float, dict, dict]:
    """One training step of a Ti/4 with dropout under bf16 autocast on the 4 devices, with or without
    activation checkpointing: (optimization barriers in the step's graph, the loss, the weights
    after it, the weights before it)."""
    import torch
    import torch_xla

    from vitray.common.config import load_config
    from vitray.models import create_model
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.engines.xla.backend import XlaBackend

    sets = [f"model.grad_checkpointing={remat}", "model.dropout=0.1", "precision.dtype=bf16"]
    cfg = load_config(
        TrainingConfig, None, ["data.train=/data", "model.img_size=16", "train.batch_size=32", *XLA, *sets]
    )
    torch.manual_seed(0)
    model = create_model("Ti/4", num_classes=10, img_size=16, dropout=0.1, grad_checkpointing=remat)
    torch.nn.init.normal_(model.head.weight, std=0.1)  # a zero head would stop every block's gradient
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    backend = XlaBackend(cfg, model, world_size=1, restore=None)
    backend.begin_step(7)
    images = torch.randn(32, 3, 16, 16, generator=torch.Generator().manual_seed(1)).to(backend.device)
    labels = (torch.arange(32) % 10).to(backend.device)
    loss = torch.nn.functional.cross_entropy(backend(images), labels)
    backend.backward_step(loss)
    graph = torch_xla._XLAC._get_xla_tensors_hlo(list(backend.module.parameters()))
    backend.end_step()
    return graph.count("opt-barrier"), loss.item(), backend.full_state_dict(), initial


def test_grad_checkpointing_recomputes_each_block_in_the_backward_pass_with_the_same_step():
    """model.grad_checkpointing on XLA: torch-xla's checkpoint (torch's fails on XLA tensors), whose
    recomputation sits behind optimization barriers in the step's graph; with dropout and bf16
    autocast, the step is the one without it, to the bit.

    In a fresh process: torch-xla's device joins autograd's engine only where no backward pass has
    run yet (another module's tests may have trained in this worker process)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        plain_barriers, plain_loss, plain, initial = fresh.submit(_one_step, False).result()
        remat_barriers, remat_loss, recomputed, _ = fresh.submit(_one_step, True).result()
    assert remat_barriers >= plain_barriers + 12, (plain_barriers, remat_barriers)  # Ti's 12 blocks
    assert remat_loss == plain_loss
    assert_same_weights(recomputed, plain)
    assert not torch.equal(plain["blocks.0.mlp.fc1.weight"].cpu(), initial["blocks.0.mlp.fc1.weight"])  # it trained


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_checkpoints_files_are_checksummed_as_written_not_read_back(where, digits_dataset, tmp_path, request):
    """Each DCP file's size and CRC-32C in the completion record are those of the file in storage
    (a local folder; an S3 store, through DCP's fsspec writer), taken as its bytes went out: a
    local save reads back none of what it wrote (this process's read bytes, from /proc/self/io,
    grow by far less than the checkpoint)."""
    import google_crc32c
    from disk_helpers import bytes_read

    from vitray import storage
    from vitray.common.config import load_config
    from vitray.models import create_model
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.engines.xla.backend import XlaBackend

    root = request.getfixturevalue("seaweed_s3").url("runs") if where == "s3" else str(tmp_path)
    cfg = load_config(
        TrainingConfig, None, [f"data.train={digits_dataset}", "model.img_size=16", "train.batch_size=32", *XLA]
    )
    backend = XlaBackend(cfg, create_model("Ti/4", num_classes=10, img_size=16), world_size=1, restore=None)
    backend.save(f"{root}/first").wait()  # (DCP's first use imports its modules: read, not measured)
    before = bytes_read()
    written = backend.save(f"{root}/second").wait()
    read = bytes_read() - before
    fs, folder = storage.filesystem(f"{root}/second")
    stored = sorted(path[len(folder) + 1 :] for path in fs.find(folder))
    assert "xla/.metadata" in stored and any(n.endswith(".distcp") for n in stored), stored
    assert sorted(w.name for w in written) == stored
    for entry in written:
        data = fs.cat_file(f"{folder}/{entry.name}")
        assert (entry.size, entry.crc32c) == (len(data), google_crc32c.value(data)), entry.name
    total = sum(w.size for w in written)
    assert total > 50 * 2**20
    if where == "local":
        assert read < total / 4, (read, total)


def test_the_device_loader_goes_on_after_the_last_batch_handed_over_and_stops_its_threads(digits_dataset):
    """torch-xla's parallel loader reads ahead on threads of its own: a new iterator hands what the
    last one read ahead and never handed over, and closing an iterator stops the threads."""
    import gc
    import itertools
    import threading

    from vitray.common.config import load_config
    from vitray.data import ShardLoader
    from vitray.models import create_model
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.engines.xla.backend import XlaBackend

    cfg = load_config(
        TrainingConfig, None, [f"data.train={digits_dataset}", "model.img_size=16", "train.batch_size=32", *XLA]
    )
    backend = XlaBackend(cfg, create_model("Ti/4", num_classes=10, img_size=16), world_size=1, restore=None)

    def shard_loader():
        args = {"rank": 0, "world_size": 1, "batch_size": 32, "img_size": 16, "train": True, "seed": 3}
        return ShardLoader(str(digits_dataset), "train", num_slots=4, num_workers=0, float_images=False, **args)

    expected = [batch.keys for batch in itertools.islice(shard_loader(), 3)]
    gc.collect()  # that loader's iterator and its threads are gone
    before = set(threading.enumerate())
    loader = backend.device_loader(shard_loader())
    first = iter(loader)
    assert [next(first).keys for _ in range(2)] == expected[:2]
    assert loader.state_dict()["consumed_per_slot"] == 16
    second = iter(loader)  # ends the first (its threads had read ahead)
    batch = next(second)
    assert batch.keys == expected[2] and str(batch.images.device).startswith("xla")
    assert set(threading.enumerate()) - before
    second.close()
    assert not set(threading.enumerate()) - before, "the parallel loader's and the shard loader's threads stop"


def test_killed_worker_resumes_exactly(digits_dataset, reference, tmp_path):
    from vitray.trainers.keys import collect_keys

    keys = tmp_path / "keys"
    run(
        pretrain_args(
            str(digits_dataset),
            str(tmp_path / "runs"),
            "ref",
            *XLA,
            f"train.steps={STEPS}",
            f"checkpoint.every={EVERY}",
            f"debug.record_sample_keys={keys}",
            f"debug.kill_worker_at_step={EVERY + 2}",
            "cluster.max_failures=1",
        )
    )
    run_dir = str(tmp_path / "runs" / "ref")
    assert (Path(run_dir) / "vitray" / "markers" / f"killed-at-step-{EVERY + 2}").exists()
    # Bit for bit: the DCP round trip is exact and every step's graph and inputs are the same.
    assert_same_weights(final_weights(run_dir), reference["weights"])
    assert collect_keys(keys) == reference["keys"]


def test_checkpoint_from_four_devices_resumes_on_two(digits_dataset, reference, tmp_path):
    import torch

    from vitray.runfolder.checkpoint_folders import find_checkpoints
    from vitray.trainers.keys import collect_keys

    run_dir = tmp_path / "runs" / "ref"
    shutil.copytree(reference["run_dir"], run_dir)
    keys = tmp_path / "keys"
    shutil.copytree(Path(reference["run_dir"]).parent.parent / "keys", keys)
    # Cut the final checkpoint short: re-running resumes from the step-EVERY one (4 devices).
    newest = Path(find_checkpoints(str(run_dir))[-1].path) / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])
    run(
        pretrain_args(
            str(digits_dataset),
            str(tmp_path / "runs"),
            "ref",
            *XLA,
            f"train.steps={STEPS}",
            f"checkpoint.every={EVERY}",
            f"debug.record_sample_keys={keys}",
            f"evals.val={{type: val, every: {STEPS}}}",
            f"evals.probe={{type: fewshot, every: {STEPS}, datasets: {{digits: {digits_dataset}}}, shots: [5]}}",
        ),
        env={"CPU_NUM_DEVICES": "2"},
    )
    resumed = [m for m in _metrics(str(run_dir)) if m["step"] > EVERY]
    assert resumed and all(m["xla/devices"] == 2 for m in resumed)
    assert 0.0 <= resumed[-1]["val/top1"] <= 1.0  # validation on the XLA device too
    # and the few-shot probe (its feature pass failed on XLA under torch.inference_mode)
    assert 0.1 < resumed[-1]["probe/digits_5shot"] <= 1.0
    assert collect_keys(keys) == reference["keys"]  # the same samples, whatever the mesh
    # The same computation partitioned in halves instead of quarters: equal up to the order of
    # floating-point sums. Measured here: the first resumed losses within 3e-5 of the 4-device
    # run's (often equal), drifting to ~1e-3 by the end as rounding differences grow; weights
    # within 2e-4. A resume that lost the optimizer state, the schedule or the data position is
    # off by far more (lr-sized weight steps, other samples).
    logged = {m["step"]: m for m in _metrics(reference["run_dir"])}
    assert resumed[0]["loss"] == pytest.approx(logged[resumed[0]["step"]]["loss"], abs=1e-4)
    for m in resumed:
        assert m["loss"] == pytest.approx(logged[m["step"]]["loss"], abs=5e-3), m["step"]
    weights = final_weights(str(run_dir))
    for name, value in reference["weights"].items():
        # The key bias cannot change attention (softmax is shift-invariant), so its gradient is
        # rounding noise, which Adam turns into steps of up to the learning rate.
        loose = name.endswith("attn.qkv.bias")
        torch.testing.assert_close(weights[name], value, rtol=0, atol=5e-3 if loose else 1e-3, msg=name)


def test_exported_weights_give_the_same_logits_on_deepspeed(reference, process_group, digits_dataset, tmp_path):
    import torch

    from vitray.common.config import load_config
    from vitray.data import EvalLoader
    from vitray.models import create_model, load_safetensors
    from vitray.runfolder.checkpoint_folders import load_checkpoint
    from vitray.runfolder.export import export
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.engines.deepspeed.backend import DeepSpeedBackend
    from vitray.trainers.engines.xla.backend import XlaBackend

    out = tmp_path / "vit.safetensors"
    export(reference["run_dir"], "safetensors", str(out))
    images = next(
        iter(EvalLoader(str(digits_dataset), "test", rank=0, world_size=1, batch_size=32, img_size=16))
    ).images

    common = [
        f"data.train={digits_dataset}",
        "model.img_size=16",
        "train.batch_size=32",
        "train.micro_batch_size=32",
        "cluster.num_workers=1",
    ]
    model = create_model("Ti/4", num_classes=10, img_size=16, depth=2)  # the run's (pretrain_helpers.BASE)
    load_safetensors(model, out)
    ds = DeepSpeedBackend(load_config(TrainingConfig, None, common), model, world_size=1, restore=None)
    ds.module.eval()
    with torch.no_grad():
        on_deepspeed = ds(images).float()

    trained, _ = load_checkpoint(reference["run_dir"])
    xla = XlaBackend(
        load_config(TrainingConfig, None, [*common, "train.backend=xla"]), trained, world_size=1, restore=None
    )
    xla.module.eval()
    with torch.no_grad():
        on_xla = xla(images.to(xla.device)).float().cpu()
    torch.testing.assert_close(on_deepspeed, on_xla, rtol=1e-4, atol=1e-4)
    assert on_xla.argmax(1).tolist() == on_deepspeed.argmax(1).tolist()


@pytest.mark.parametrize(
    ("name", "chips", "hosts", "topology", "accelerator"),
    [
        ("v4-8", 4, 1, "2x2x1", "TPU-V4"),
        ("v4-32", 16, 4, "2x2x4", "TPU-V4"),
        ("v4-128", 64, 16, "4x4x4", "TPU-V4"),
        ("v5p-16", 8, 2, "2x2x2", "TPU-V5P"),
        ("v5e-8", 8, 1, "2x4", "TPU-V5LITEPOD"),
        ("v5litepod-16", 16, 4, "4x4", "TPU-V5LITEPOD"),
        ("v6e-16", 16, 4, "4x4", "TPU-V6E"),
        ("v6e-256", 256, 64, "16x16", "TPU-V6E"),
    ],
)
def test_tpu_slice_names(name, chips, hosts, topology, accelerator):
    from vitray.trainers.driver_checks.tpu_slices import tpu_slice

    tpu = tpu_slice(name)
    assert (tpu.chips, tpu.hosts, tpu.topology, tpu.accelerator_type) == (chips, hosts, topology, accelerator)


def test_tpu_slice_becomes_ray_trains_tpu_scaling_config():
    from vitray.cluster.torch_trainer import scaling_config
    from vitray.common.config import ConfigError, load_config
    from vitray.trainers.config import TrainingConfig

    cfg = load_config(
        TrainingConfig,
        None,
        [
            "data.train=/data",
            "train.backend=xla",
            "cluster.tpu=v4-32",
            "train.batch_size=128",
            "cluster.cpus_per_worker=8",
        ],
    )
    assert cfg.cluster.num_workers == 4  # one worker per host, from the slice
    scaling = scaling_config(cfg)
    assert (scaling.use_tpu, scaling.num_workers, scaling.topology, scaling.accelerator_type) == (
        True,
        4,
        "2x2x4",
        "TPU-V4",
    )
    assert scaling.resources_per_worker == {"CPU": 8.0, "TPU": 4}
    wrong = {
        "cluster.num_workers=2": "v4-32 has 4 host",
        "cluster.tpu=v4-30": "power-of-two number of chips",
        "cluster.tpu_topology=4x4": "expected 3 dimensions",
        "train.backend=deepspeed": "needs train.backend=xla",
        "precision.dtype=fp16": "bf16",
        # Refused with the config, not ignored (compile, attention) or met by the workers (the rest)
        "train.micro_batch_size=2": "does not split over the 4 chips of a v4-32 host: give a multiple of 4",
        "train.compile=true": "XLA compiles the whole step itself",
        "train.check_grad_overflow=true": "DeepSpeed's check before each step; train.backend=xla does not skip",
        "train.attention=flash": "names a CUDA attention kernel; XLA compiles its own",
        "cluster.resources_per_worker={TPU: 4}": "TPU chips are reserved by cluster.tpu",
    }
    for override, message in wrong.items():
        with pytest.raises(ConfigError, match=message):
            load_config(
                TrainingConfig,
                None,
                ["data.train=/data", "train.backend=xla", "cluster.tpu=v4-32", "train.batch_size=128", override],
            )
    # torch-xla's checkpoint recomputes whole blocks: no selective policy
    with pytest.raises(ConfigError, match="XLA tensors: train.backend=xla recomputes whole blocks"):
        load_config(
            TrainingConfig,
            None,
            [
                "data.train=/data",
                "train.backend=xla",
                "model.grad_checkpointing=true",
                "model.remat_policy=dots_saveable",
            ],
        )
    # Several workers are a slice's hosts: without cluster.tpu each would train a copy of its own
    # (and `ray up`'s TPU hosts take cluster.tpu too: a TPU resource alone fails in Ray Train)
    for sets, message in [
        (["cluster.num_workers=2"], "several workers are the hosts of one TPU slice, which cluster.tpu names"),
        (["cluster.num_workers=1", "cluster.resources_per_worker={TPU: 4}"], "TPU chips are reserved by cluster.tpu"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(TrainingConfig, None, ["data.train=/data", "train.backend=xla", *sets])
