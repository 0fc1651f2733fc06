"""Masked patch prediction (paper section 4.6 / appendix B.1.2): the corruption's statistics and
determinism, the colour targets on hand-built patches, the model's corruption path, unlabelled
shards, a pre-training run on unlabelled digits whose loss falls, and the transfer of its
checkpoint (few-shot probe and fine-tuning), plus the B/16 recipe's dry run."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from vitray.common.config import ConfigError, load_config
from vitray.data import ShardLoader, prepare_dataset, read_dataset_info, to_model_range
from vitray.models import create_model, load_safetensors, save_npz, save_safetensors
from vitray.runfolder import checkpoint_folders as ckpt
from vitray.trainers.config import TrainingConfig
from vitray.trainers.context import WorkerContext
from vitray.trainers.step.masked_patch import (
    KEEP,
    MASK,
    RANDOM,
    MaskedPatchObjective,
    color_classes,
    draw_corruption,
    num_corrupted,
    patch_targets,
)
from vitray.trainers.step.objectives import build_objective

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "paper" / "pretrain_b16_mpp_jft.yaml"


# -- the corruption ---------------------------------------------------------------------------


def test_corruption_statistics_half_the_patches_then_80_10_10():
    rng = np.random.default_rng(0)
    batch, patches = 8, 196  # B/16 at 224 px
    kinds = []
    for _ in range(150):
        c = draw_corruption(rng, batch, patches, corrupt_rate=0.5, mask_rate=0.8, random_rate=0.1)
        assert c.predict_at.shape == (batch, 98)  # exactly 50% of every image, always the same shape
        for b in range(batch):
            assert len(set(c.predict_at[b].tolist())) == 98 and bool((c.predict_at[b].diff() > 0).all())
        identity = torch.arange(patches).expand(batch, patches)
        corrupted = torch.zeros(batch, patches, dtype=torch.bool)
        corrupted.scatter_(1, c.predict_at, True)
        kind_at = torch.full((batch, patches), -1).scatter_(1, c.predict_at, c.kind)
        # Untouched patches keep their own embedding; [mask] exactly on MASK; another patch exactly on RANDOM.
        assert torch.equal(c.patch_mask, kind_at == MASK)
        assert torch.equal(c.patch_source != identity, kind_at == RANDOM)
        assert not bool((c.patch_mask & ~corrupted).any())
        kinds.append(c.kind.flatten())
        assert int(c.patch_source.min()) >= 0 and int(c.patch_source.max()) < patches  # from the same image
    kinds = torch.cat(kinds)
    fractions = [float((kinds == k).float().mean()) for k in (MASK, RANDOM, KEEP)]
    # 117,600 corrupted patches: the standard error of a 10% share is under 0.1 percentage points.
    assert fractions == pytest.approx([0.8, 0.1, 0.1], abs=0.005)
    assert num_corrupted(49, 0.5) == 25 and num_corrupted(16, 0.15) == 2 and num_corrupted(4, 0.01) == 1


def test_corruption_is_determined_by_the_generator_seed():
    a = draw_corruption(np.random.default_rng([7, 3, 0]), 4, 16)
    b = draw_corruption(np.random.default_rng([7, 3, 0]), 4, 16)
    c = draw_corruption(np.random.default_rng([7, 4, 0]), 4, 16)
    for field in ("patch_source", "patch_mask", "predict_at", "kind"):
        assert torch.equal(getattr(a, field), getattr(b, field))
    assert not torch.equal(a.predict_at, c.predict_at)


# -- the targets ------------------------------------------------------------------------------


def _as_model_input(pixels: np.ndarray) -> torch.Tensor:
    """uint8 (H, W, 3) -> a (1, 3, H, W) batch in [-1, 1], converted as the loader converts."""
    return to_model_range(torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0).contiguous())


def test_mean_color_3bit_classes_of_known_patches():
    pixels = np.zeros((8, 8, 3), dtype=np.uint8)  # 2x2 patches of 4x4 pixels
    pixels[:4, :4] = (255, 0, 128)  # patch 0: levels (7, 0, 4)
    pixels[4:, 4:] = 255  # patch 3: white; patch 1 (top right) stays black
    pixels[:4, 4:6] = (200, 200, 200)  # patch 1 half grey 200, half black: mean 100 per channel, level 3
    pixels[4:, :4] = (31, 32, 224)  # patch 2: levels (0, 1, 7), each just either side of a step
    targets = patch_targets(_as_model_input(pixels), 4, "mean_color", 3)
    assert targets.tolist() == [[7 * 64 + 0 * 8 + 4, 3 * 64 + 3 * 8 + 3, 0 * 64 + 1 * 8 + 7, 511]]
    assert color_classes(torch.tensor([[1.0, 1.0, 1.0]]), 1).tolist() == [7]  # 1 bit: 8 colours


def test_downsized_4x4_targets_of_a_patch_with_known_quadrants():
    pixels = np.zeros((8, 8, 3), dtype=np.uint8)  # one 8x8 patch, 4x4 cells of 2x2 pixels
    pixels[:4, :4] = (255, 0, 0)
    pixels[:4, 4:] = (0, 255, 0)
    pixels[4:, :4] = (0, 0, 255)
    pixels[4:, 4:] = (255, 255, 255)
    targets = patch_targets(_as_model_input(pixels), 8, "downsized_4x4", 3)
    red, green, blue, white = 7 * 64, 7 * 8, 7, 511
    expected = [red, red, green, green] * 2 + [blue, blue, white, white] * 2  # row-major 4x4 cells
    assert targets.shape == (1, 1, 16) and targets[0, 0].tolist() == expected


def test_l2_targets_are_the_patch_colours_in_token_order():
    pixels = np.random.default_rng(0).integers(0, 256, size=(12, 8, 3), dtype=np.uint8)
    targets = patch_targets(_as_model_input(pixels), 4, "patch_l2")  # a 3x2 grid of patches
    assert targets.shape == (1, 6, 3 * 4 * 4)
    colours = torch.from_numpy(pixels).permute(2, 0, 1).float() / 255
    for index in range(6):
        row, col = divmod(index, 2)  # tokens run row-major, as the patch embedding flattens them
        patch = colours[:, 4 * row : 4 * row + 4, 4 * col : 4 * col + 4]
        torch.testing.assert_close(targets[0, index], patch.flatten(), atol=1e-6, rtol=0)


# -- the model --------------------------------------------------------------------------------


def test_model_corruption_hides_masked_patches_and_moves_replaced_ones():
    torch.manual_seed(0)
    model = create_model("Ti/4", num_classes=0, img_size=8, masked_patch_outputs=5).eval()
    torch.nn.init.normal_(model.masked_patch.predictor.weight)  # zero-initialised otherwise
    images = torch.rand(2, 3, 8, 8) * 2 - 1
    identity = torch.arange(4).expand(2, 4)
    everywhere = torch.arange(4).expand(2, 4)
    with torch.no_grad():
        untouched = model(
            images, patch_source=identity, patch_mask=torch.zeros(2, 4, dtype=torch.bool), predict_at=everywhere
        )
        expected = model.masked_patch.predictor(model.forward_features(images)[:, 1:])
        torch.testing.assert_close(untouched, expected)
        # Every patch masked: the predictions no longer depend on the pixels.
        masked = model(
            images, patch_source=identity, patch_mask=torch.ones(2, 4, dtype=torch.bool), predict_at=everywhere
        )
        torch.testing.assert_close(masked[0], masked[1], atol=1e-4, rtol=1e-4)  # batched-matmul rounding
        # Patch 0 of image 0 takes the embedding of its patch 3 = moving those pixels there.
        source = identity.clone()
        source[0, 0] = 3
        moved = images.clone()
        moved[0, :, :4, :4] = images[0, :, 4:, 4:]
        replaced = model(
            images, patch_source=source, patch_mask=torch.zeros(2, 4, dtype=torch.bool), predict_at=everywhere[:, :2]
        )
        torch.testing.assert_close(replaced[0], model.masked_patch.predictor(model.forward_features(moved)[0, 1:3]))
    with pytest.raises(ValueError, match="all of patch_source, patch_mask and predict_at"):
        model(images, patch_source=identity)
    with pytest.raises(ValueError, match="needs a plain ViT"):
        create_model("R26+Ti/16", num_classes=0, img_size=32, masked_patch_outputs=512)


def test_masked_patch_parts_stay_out_of_transfer_and_exports(tmp_path):
    model = create_model("Ti/4", num_classes=0, img_size=8, masked_patch_outputs=512)
    assert model(torch.zeros(1, 3, 8, 8)).shape == (1, 192)  # no classifier: the representation
    save_npz(model, tmp_path / "w.npz")  # no head/*, no [mask]: the original layout
    assert not any(k.startswith(("head", "masked")) for k in np.load(tmp_path / "w.npz").files)
    save_safetensors(model, tmp_path / "w.safetensors")
    plain = create_model("Ti/4", num_classes=3, img_size=8)
    load_safetensors(plain, tmp_path / "w.safetensors", load_head=False)  # pre-training heads ignored
    model.reset_head(3)
    assert model.masked_patch is None and model.masked_patch_outputs is None
    assert model.state_dict().keys() == plain.state_dict().keys()


class _Backend:
    """The parts of a training backend an objective uses, around a bare model."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self.module, self.device, self.dtype = module.to(dtype), torch.device("cpu"), dtype

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@pytest.mark.parametrize("target", ["mean_color", "downsized_4x4", "patch_l2"])
def test_objective_loss_in_bf16_reaches_the_mask_embedding_and_predictor(target):
    torch.manual_seed(0)
    outputs = {"mean_color": 512, "downsized_4x4": 16 * 512, "patch_l2": 48}[target]
    model = create_model("Ti/4", num_classes=0, img_size=8, masked_patch_outputs=outputs)
    torch.nn.init.normal_(model.masked_patch.predictor.weight, std=0.02)  # let gradients reach the encoder
    backend = _Backend(model, torch.bfloat16)
    batch = type("Batch", (), {"images": torch.rand(4, 3, 8, 8) * 2 - 1, "labels": torch.full((4,), -1)})()
    objective = MaskedPatchObjective(target)
    loss = objective.loss(backend, batch, np.random.default_rng(0))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    if target != "patch_l2":  # about ln(512) = 6.24 from a near-zero predictor
        assert loss.item() == pytest.approx(np.log(512), abs=0.3)
    loss.backward()
    assert (
        model.masked_patch.mask_token.grad.abs().sum() > 0 and model.masked_patch.predictor.weight.grad.abs().sum() > 0
    )
    with pytest.raises(ValueError, match="needs 48"):
        MaskedPatchObjective("patch_l2").loss(
            _Backend(create_model("Ti/4", num_classes=0, img_size=8, masked_patch_outputs=512), torch.float32),
            batch,
            np.random.default_rng(0),
        )


# -- configuration ----------------------------------------------------------------------------


def test_config_gives_the_model_its_predictor_only_for_masked_patch_prediction():
    base = ["data.train=/data", "model.name=B/16", "model.img_size=224"]
    sizes = {"mean_color": 512, "downsized_4x4": 16 * 512, "patch_l2": 3 * 16 * 16}
    for target, outputs in sizes.items():
        cfg = load_config(
            TrainingConfig, None, [*base, "train.objective=masked_patch", f"train.masked_patch.target={target}"]
        )
        assert cfg.model.masked_patch_outputs == outputs
    # A fine-tune config that copies a masked-patch checkpoint's model section drops the predictor.
    cfg = load_config(TrainingConfig, None, [*base, "model.masked_patch_outputs=512"])
    assert cfg.model.masked_patch_outputs is None
    for bad, message in [
        ("train.masked_patch.keep_rate=0.2", "must be 1"),
        ("train.mixup_alpha=0.2", "acts on labels"),
        ("model.name=R50+B/16", "needs a plain ViT"),
        ("train.masked_patch.target=rgb", "mean_color"),
        # a pre-logits layer the objective never trains; a predictor larger than the encoder (a typo'd
        # colour depth: 8 bits are 16.7M classes); 4x4 cells of 14-pixel patches
        ("model.representation_size=768", "pre-logits layer that train.objective=masked_patch never trains"),
        ("train.masked_patch.color_bits=8", r"16,777,216 outputs per patch: a predictor of 12,901.7M parameters"),
        ("model.name=B/14", "B/14's 14-pixel patches do not split so"),
    ]:
        with pytest.raises(ConfigError, match=message):
            target = ["train.masked_patch.target=downsized_4x4"] if "14" in bad else []
            load_config(TrainingConfig, None, [*base, "train.objective=masked_patch", *target, bad])
    with pytest.raises(ConfigError, match=r"remove it \(--set evals.val=null"):
        load_config(TrainingConfig, None, [*base, "train.objective=masked_patch", "evals.val={type: val, every: 10}"])
    # with another objective the section would be ignored: a run that trains otherwise, saying nothing
    with pytest.raises(ConfigError, match=r"train.masked_patch.target set, but train.objective=auto: they act only"):
        load_config(TrainingConfig, None, [*base, "train.masked_patch.target=patch_l2"])
    # ... but a full dump (a checkpoint's record, --dry-run's output) holds the section at its defaults
    full = load_config(TrainingConfig, None, base).model_dump(mode="json")
    assert TrainingConfig.model_validate(full).train.objective == "auto"


def test_supervised_objectives_refuse_unlabelled_data_before_ray(unlabelled_digits, tmp_path):
    from vitray.trainers.driver_checks.preflight import PreflightError, check_inputs

    for objective in ("auto", "softmax", "sigmoid"):
        sets = [f"data.train={unlabelled_digits}", f"run.storage={tmp_path}", f"train.objective={objective}"]
        cfg = load_config(TrainingConfig, None, sets)
        with pytest.raises(ValueError, match="needs labelled data.*train.objective=masked_patch"):
            build_objective(cfg.train, "none", 0)
        with pytest.raises(PreflightError, match="data.train: train.objective=.* needs labelled data"):
            check_inputs(cfg)
    cfg = load_config(TrainingConfig, None, ["data.train=/data", "train.objective=masked_patch"])
    assert isinstance(build_objective(cfg.train, "none", 0), MaskedPatchObjective)


# -- unlabelled shards ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def unlabelled_digits(tmp_path_factory) -> str:
    dest = tmp_path_factory.mktemp("unlabelled-digits")
    prepare_dataset("unlabelled:builtin:digits", str(dest), samples_per_shard=500)
    return str(dest)


def test_unlabelled_shards_hold_images_only_and_read_as_label_minus_one(unlabelled_digits, tmp_path):
    info = read_dataset_info(unlabelled_digits)
    assert (info.label_kind, info.num_classes, info.classes) == ("none", 0, [])
    assert info.source == "unlabelled:builtin:digits" and info.splits["train"].num_samples == 1437
    with tarfile.open(Path(unlabelled_digits) / "train-000000.tar") as tar:
        assert {name.rsplit(".", 1)[1] for name in tar.getnames()} == {"png"}
    loader = ShardLoader(
        unlabelled_digits,
        "train",
        rank=0,
        world_size=1,
        batch_size=8,
        img_size=8,
        train=True,
        seed=0,
        num_slots=2,
        num_workers=0,
    )
    batch = next(iter(loader))
    assert batch.images.shape == (8, 3, 8, 8) and batch.labels.tolist() == [-1] * 8
    # A folder of images without class folders is unlabelled by itself.
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(3):
        Image.new("RGB", (4, 4), (i, 0, 0)).save(folder / f"{i}.png")
    info = prepare_dataset(f"imagefolder:{folder}", str(tmp_path / "out"))
    assert (info.label_kind, info.num_classes, info.splits["train"].num_samples) == ("none", 0, 3)
    (folder / "cats").mkdir()
    Image.new("RGB", (4, 4)).save(folder / "cats" / "a.png")
    assert prepare_dataset(f"imagefolder:{folder}", str(tmp_path / "out2")).label_kind == "single"


# -- pre-training and transfer in one process -------------------------------------------------


def _run_loop(overrides: list[str], run_dir: Path) -> tuple[list[str], list[dict]]:
    """(the checkpoint folders the loop handed over, the metrics it logged)."""
    from vitray.runfolder.files import RunFiles
    from vitray.trainers.loop import TrainingLoop

    cfg = load_config(TrainingConfig, None, overrides)
    saved: list[str] = []
    ctx = WorkerContext(rank=0, world_size=1, run_dir=str(run_dir), report=lambda m, d: saved.append(str(d)))
    TrainingLoop(cfg, ctx).run()
    return saved, RunFiles(str(run_dir)).read_metrics()


@pytest.fixture(scope="module")
def mpp_checkpoint(
    process_group, unlabelled_digits, digits_dataset, tmp_path_factory, single_thread
) -> tuple[str, list[dict]]:
    """20 steps of masked patch prediction (mean colour, 3 bits) of a Ti/4 of 2 blocks at 16 px on unlabelled
    digits, ZeRO-2 with 2 accumulated micro-batches; (final checkpoint, reported metrics)."""
    storage = tmp_path_factory.mktemp("mpp")
    saved, metrics = _run_loop(
        [
            f"data.train={unlabelled_digits}",
            "model.img_size=16",
            "model.depth=2",
            "train.objective=masked_patch",
            "train.steps=20",
            "train.batch_size=32",
            "train.micro_batch_size=16",
            "optim.lr=0.002",
            "schedule.warmup_steps=4",
            "schedule.decay=cosine",
            "log.every=4",
            "checkpoint.every=20",
            f"evals.probe={{type: fewshot, every: 20, datasets: {{digits: {digits_dataset}}}}}",
            "train.zero_stage=2",
            "precision.dtype=fp32",
            "cluster.num_workers=1",
            "data.num_workers=0",
            "data.min_crop_area=0.5",
            "data.flip=false",
            f"run.storage={storage}",
        ],
        storage / "run",
    )
    assert len(saved) == 1
    return saved[0], metrics


def test_masked_patch_pretraining_loss_falls(mpp_checkpoint):
    folder, metrics = mpp_checkpoint
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert not any("val/top1" in m for m in metrics)  # an evaluator runs, but there is no classifier
    assert len(losses) == 5 and all(np.isfinite(losses))
    # Starts near the uniform distribution over 512 colours (ln 512 = 6.24) and must fall well below.
    assert losses[0] > 4.0 and losses[-1] < losses[0] - 2.0 and losses[-1] < 2.5, losses
    state = ckpt.verify_complete(folder)
    assert state["label_kind"] == "none" and state["num_classes"] == 0
    assert state["model"]["masked_patch_outputs"] == 512


# Two steps from `init.checkpoint` in one process, checkpointed at the end.
TWO_STEPS = (
    "model.img_size=16",
    "train.steps=2",
    "train.batch_size=16",
    "train.micro_batch_size=16",
    "schedule.warmup_steps=1",
    "checkpoint.every=2",
    "cluster.num_workers=1",
    "data.num_workers=0",
)


def test_masked_patch_checkpoint_transfers_to_fewshot_and_finetuning(
    mpp_checkpoint, digits_dataset, process_group, tmp_path
):
    from vitray.evaluation.evaluators.fewshot import fewshot_accuracies

    folder, _ = mpp_checkpoint
    model, _state = ckpt.load_model(folder)  # strict: the [mask] embedding and predictor load too
    assert model.num_classes == 0 and model.masked_patch_outputs == 512
    scores = dict(fewshot_accuracies(model.eval(), {"digits": str(digits_dataset)}, shots=(10,)))
    assert scores["digits_10shot"] > 0.3  # chance is 0.1
    model.reset_head(10)
    assert model(torch.zeros(2, 3, 16, 16)).shape == (2, 10) and model.masked_patch is None
    # Fine-tuning on labelled digits from the checkpoint: a plain ViT with a 10-class head comes out.
    saved, _ = _run_loop(
        [
            f"data.train={digits_dataset}",
            f"init.checkpoint={folder}",
            "optim.name=sgd",
            *TWO_STEPS,
            f"run.storage={tmp_path}",
        ],
        tmp_path / "finetune",
    )
    tuned, tuned_state = ckpt.load_model(saved[0])
    assert tuned.num_classes == 10 and tuned.masked_patch is None
    assert tuned_state["model"]["masked_patch_outputs"] is None
    assert not any(key.startswith("masked_patch.") for key in tuned.state_dict())


def test_masked_patch_prediction_starts_from_a_classifiers_weights_or_goes_on_from_its_own(
    mpp_checkpoint, unlabelled_digits, digits_dataset, process_group, tmp_path
):
    from pretrain_helpers import make_checkpoint

    from vitray.trainers.driver_checks.preflight import check_inputs

    def pretrain(data: str, init: str, name: str, *extra: str):
        sets = [
            f"data.train={data}",
            f"init.checkpoint={init}",
            "train.objective=masked_patch",
            *TWO_STEPS,
            f"run.storage={tmp_path}",
            *extra,
        ]
        check_inputs(load_config(TrainingConfig, None, sets))  # the pre-flight builds what the loop will
        (saved,), _ = _run_loop(sets, tmp_path / name)
        return ckpt.load_model(saved)

    # A supervised checkpoint with a pre-logits layer and a 10-class head, on unlabelled data: the
    # classifier goes, the predictor is new (zero), the encoder is the checkpoint's.
    classifier = make_checkpoint(tmp_path / "classifier", depth=2, representation_size=32)
    model, state = pretrain(unlabelled_digits, str(tmp_path / "classifier"), "from-classifier")
    assert (state["num_classes"], model.num_classes, model.pre_logits, model.masked_patch_outputs) == (0, 0, None, 512)
    assert torch.allclose(model.cls_token, classifier.cls_token, atol=0.01)

    # An MPP checkpoint goes on with its own predictor (init.reset_head=false) or a fresh one (the
    # default), on labelled data too (its zero head of 10 classes, as a run from scratch has it).
    folder, _ = mpp_checkpoint
    trained = ckpt.load_model(folder)[0].masked_patch.predictor.weight
    for reset, kept in ((False, True), (True, False)):
        model, state = pretrain(digits_dataset, folder, f"go-on-{reset}", f"init.reset_head={reset}")
        assert state["num_classes"] == 10 and state["model"]["masked_patch_outputs"] == 512
        # 2 steps of Adam move a zero predictor by about 2 x lr; the trained one is 20 steps away from zero
        assert (model.masked_patch.predictor.weight.norm() > trained.norm() / 2) == kept


def test_inspect_captions_the_validation_images_of_unlabelled_data_by_their_keys(unlabelled_digits):
    from vitray.evaluation.checkpoint_inspection import validation_images

    state = {"config": {"data": {"train": unlabelled_digits, "val_split": "train"}}}
    images, captions = validation_images(state, 16, 4)
    assert images.shape == (4, 3, 16, 16) and len(captions) == 4
    assert all(caption.startswith("train_") and "·" not in caption for caption in captions), captions


def _run_xla_loop(overrides: list[str], run_dir: str) -> tuple[list[str], list[dict]]:
    """`_run_loop` on torch-xla's 4 CPU devices, in a process of its own (see below)."""
    import torch.distributed as dist
    from conftest import init_one_rank_group

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", "4")
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
    init_one_rank_group()
    try:
        return _run_loop(overrides, Path(run_dir))
    finally:
        dist.destroy_process_group()


@pytest.mark.xla
def test_masked_patch_pretraining_on_the_xla_backend(unlabelled_digits, tmp_path):
    """The same objective through torch-xla SPMD (4 CPU devices): fixed shapes, so the graphs of
    the first step are all it compiles, and the loss falls as under DeepSpeed.

    In a fresh process: torch-xla's device joins autograd's engine only where no backward pass has
    run yet, and the other tests of this module train in the test process."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    overrides = [
        f"data.train={unlabelled_digits}",
        "model.img_size=16",
        "model.depth=2",
        "train.objective=masked_patch",
        "train.backend=xla",
        "precision.dtype=bf16",
        "train.steps=6",
        "train.batch_size=64",
        "train.micro_batch_size=32",
        "optim.lr=0.003",
        "schedule.warmup_steps=2",
        "schedule.decay=cosine",
        "log.every=2",
        "checkpoint.every=6",
        "cluster.num_workers=1",
        "data.num_workers=0",
        "data.min_crop_area=0.5",
        "data.flip=false",
        f"run.storage={tmp_path}",
    ]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        saved, metrics = fresh.submit(_run_xla_loop, overrides, str(tmp_path / "run")).result()
    logged = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in logged] == [2, 4, 6]
    assert logged[-1]["loss"] < logged[0]["loss"] - 2.0, logged
    assert len({m["xla/compilations"] for m in logged}) == 1  # no recompilation after the first step
    model, state = ckpt.load_model(saved[-1])
    assert state["backend"] == "xla" and model.masked_patch_outputs == 512


# -- the paper's recipe -----------------------------------------------------------------------


def test_b16_recipe_dry_run():
    from typer.testing import CliRunner

    from vitray.cli.main import app

    result = CliRunner().invoke(app, ["pretrain", "-c", str(RECIPE), "--dry-run"])
    assert result.exit_code == 0, result.output
    cfg = load_config(TrainingConfig, RECIPE, [])
    assert yaml.safe_load(result.stdout) == cfg.model_dump(mode="json")
    train, optim, schedule, masked = cfg.train, cfg.optim, cfg.schedule, cfg.train.masked_patch
    assert (cfg.model.name, cfg.model.img_size, cfg.model.masked_patch_outputs) == ("B/16", 224, 512)
    assert (train.objective, train.steps, train.batch_size, optim.lr) == ("masked_patch", 1_000_000, 4096, 2e-4)
    assert (schedule.warmup_steps, schedule.decay, optim.name) == (10_000, "cosine", "adamw")
    assert (masked.corrupt_rate, masked.mask_rate, masked.random_rate, masked.keep_rate) == (0.5, 0.8, 0.1, 0.1)
    assert (masked.target, masked.color_bits) == ("mean_color", 3)
    assert RECIPE.read_text().startswith("# Reproduces:") and "79.9 %" in RECIPE.read_text()


def test_each_prediction_is_scored_against_its_own_patchs_target():
    """A predictor that outputs each corrupted patch's own mean-colour class (computed here from the
    pixels, independently of the objective) has a near-zero loss; scored against another image's or
    another patch's targets (a pairing bug the end-to-end loss curve does not show) it would not."""
    torch.manual_seed(0)
    pixels = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)  # 4 images of 2x2 patches of 4x4

    def own_classes(images: torch.Tensor) -> torch.Tensor:  # (B, 4): r*64 + g*8 + b of each patch's mean
        means = images.float().reshape(4, 3, 2, 4, 2, 4).mean(dim=(3, 5)).flatten(2).transpose(1, 2)  # (B, 4, 3)
        levels = (means / 255 * 8).floor().clamp(0, 7).long()
        return levels[..., 0] * 64 + levels[..., 1] * 8 + levels[..., 2]

    class Oracle(torch.nn.Module):
        patch_size, grid_size, masked_patch_outputs = 4, 2, 512

        def forward(self, images, patch_source, patch_mask, predict_at):
            classes = own_classes(pixels).gather(1, predict_at)  # the true patches at the predicted positions
            return torch.nn.functional.one_hot(classes, 512).float() * 50.0

    backend = _Backend(Oracle(), torch.float32)
    batch = type("Batch", (), {"images": pixels, "labels": torch.full((4,), -1)})()
    loss = MaskedPatchObjective("mean_color").loss(backend, batch, np.random.default_rng(0))
    assert loss.item() < 1e-6
    assert len(set(own_classes(pixels).flatten().tolist())) > 8  # targets that differ, so a mix-up would show
