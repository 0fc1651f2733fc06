"""Fine-tuning from a pre-trained checkpoint: the recipe, a fresh zero head for a new number of
classes, position embeddings resampled to a higher resolution (Ti/4: 16 px, a 4x4 grid -> 24 px,
6x6), and a short real fine-tune on one Ray worker that reports its test top-1."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from pretrain_helpers import assert_same_weights, in_process_loop, make_checkpoint, run, straight_and_resumed
from safetensors.torch import load_file

from vitray.cluster.checkpoint_inputs import resolve_checkpoints
from vitray.cluster.finetune import finetune_cell_metrics, finetune_config, run_finetune, training_config
from vitray.common.config import ConfigError
from vitray.evaluation.config import GridConfig
from vitray.evaluation.evaluators import TEST, TEST_TOP1, VAL, VAL_TOP1, Forward
from vitray.evaluation.evaluators.val import ValEvalConfig
from vitray.evaluation.finetune_recipe import FinetuneRecipe
from vitray.evaluation.grid import plan_grid
from vitray.evaluation.methods import CheckpointRef
from vitray.evaluation.methods.finetune import FinetuneGrid, finetune_settings
from vitray.evaluation.suite import get_benchmark
from vitray.models import resample_posemb
from vitray.runfolder.checkpoint_folders import STATE_FILE, latest_complete_checkpoint, read_state
from vitray.runfolder.files import RunFiles
from vitray.trainers.checkpoint.rank_files import mark_complete, write_state

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "vitray.cli"]
TI_WIDTH = 192
THREE_CLASSES = ("zero", "one", "two")


@pytest.fixture(scope="module")
def three_digits(tmp_path_factory) -> str:
    """Another task with another class count: digits 0-2 as a PNG image folder, prepared."""
    from sklearn.datasets import load_digits

    from vitray.data import prepare_dataset

    root = tmp_path_factory.mktemp("three-digits")
    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    for i, (image, label) in enumerate(zip(images, digits.target)):
        if label < len(THREE_CLASSES):
            split = "test" if i % 5 == 0 else "train"
            folder = root / "src" / split / THREE_CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"{i:04d}.png")
    prepare_dataset(f"imagefolder:{root / 'src'}", str(root / "prepared"), samples_per_shard=100)
    return str(root / "prepared")


def _pretrained_ref(pretrained: str) -> CheckpointRef:
    (ref,) = resolve_checkpoints(pretrained)
    return ref


# ---------------------------------------------------------------------------------------------
# The recipe (no Ray)
# ---------------------------------------------------------------------------------------------


def test_recipe_is_the_papers_finetuning_recipe(pretrained, tmp_path):
    ref = _pretrained_ref(pretrained)
    assert ref.step == 8 and ref.img_size == 16 and ref.target_steps == 8
    grid = GridConfig(
        data_root=str(tmp_path / "data"), output=str(tmp_path / "eval"), finetune={"resolution": 24, "steps": 30}
    )
    (job,) = [w for w in plan_grid(grid, [ref]).work if w.method == "finetune"][:1]
    cfg = finetune_config(job, grid)
    train, optim, schedule = cfg.train, cfg.optim, cfg.schedule
    assert (optim.name, optim.momentum, schedule.decay, optim.weight_decay, optim.grad_clip) == (
        "sgd",
        0.9,
        "cosine",
        0.0,
        1.0,
    )
    digits = get_benchmark("digits").finetune
    assert (optim.lr, train.steps, train.batch_size, schedule.warmup_steps) == (
        digits.learning_rates[0],
        30,
        digits.batch_size,
        round(digits.warmup_steps * 30 / digits.steps),  # the protocol's share of warm-up, in fewer steps
    )
    # At the end, the top-1 on the held-out slice and, a second evaluator of the same type, on the test
    # split; whole images, as digits trains on them (resize: BiT's rule, whose evaluation squashes too).
    assert cfg.evals[VAL] == ValEvalConfig(type="val", every=30, resize="whole")
    assert cfg.evals[TEST] == ValEvalConfig(
        type="val", every=30, path=str(tmp_path / "data" / "digits"), split="test", resize="whole"
    )
    assert cfg.init.checkpoint == ref.path and cfg.init.reset_head
    assert cfg.model.name == "Ti/4" and cfg.model.img_size == 24 and cfg.model.representation_size is None
    # No dropout, whatever the pre-training's (big_vision's transfer configs)
    assert (cfg.model.dropout, cfg.model.attn_dropout) == (0.0, 0.0)
    # Trained on the train-minus-validation slice; the run's top-1 is on the held-out slice.
    assert cfg.data.train == cfg.data.val == str(tmp_path / "data" / "digits")
    assert (cfg.data.train_split, cfg.data.val_split) == ("train[:90%]", "train[90%:]")
    assert cfg.run.storage == str(tmp_path / "eval" / "finetune_runs")
    assert job.cell.cell_id in cfg.run.name and cfg.cluster.num_workers == 1


@pytest.mark.parametrize("workers, micro, batch", [(1, 32, 512), (2, 32, 64), (4, 12, 48), (8, 64, 512), (3, 5, 15)])
def test_recipe_validates_for_any_worker_count(workers, micro, batch, tmp_path):
    options = FinetuneGrid(num_workers=workers, micro_batch_size=micro, batch_size=batch)
    settings = finetune_settings(get_benchmark("cifar10"), options)[0]
    recipe = FinetuneRecipe.for_cell(
        get_benchmark("cifar10"),
        settings,
        checkpoint="/ckpt",
        model={"name": "B/16"},
        data_root=str(tmp_path),
        run_name="r",
        run_storage=str(tmp_path),
        options=options,
    )
    cfg = training_config(recipe)
    assert cfg.train.batch_size == batch and cfg.cluster.num_workers == workers
    assert cfg.train.micro_batch_size * workers * cfg.grad_accumulation == batch


@pytest.mark.parametrize(
    "benchmark, grid_settings, expected",
    [
        ("cifar10", {}, ("resmall_crop", True)),  # the benchmark's own
        ("vtab/dsprites_ori", {}, ("resize", False)),
        ("digits", {}, (get_benchmark("digits").finetune.preprocess.crop, False)),
        ("cifar10", {"crop": "inception_crop", "min_crop_area": 0.3, "flip": False}, ("inception_crop", False)),
    ],
)
def test_a_fine_tune_run_crops_and_flips_as_its_benchmark_or_the_grid_says(
    benchmark, grid_settings, expected, tmp_path
):
    options = FinetuneGrid(**grid_settings)
    settings = finetune_settings(get_benchmark(benchmark), options)[0]
    recipe = FinetuneRecipe.for_cell(
        get_benchmark(benchmark),
        settings,
        checkpoint="/ckpt",
        model={"name": "Ti/16"},
        data_root=str(tmp_path),
        run_name="r",
        run_storage=str(tmp_path),
        options=options,
    )
    cfg = training_config(recipe)
    data = cfg.data
    assert (data.crop, data.flip) == expected == (settings["crop"], settings["flip"])
    # Held-out images resized as the crop's family evaluates: big_vision's resize_small(448)|central_crop(384)
    # after its crops, the whole image after BiT's (squares of the squashed image).
    squashes = data.crop in ("resize_crop", "resize")
    assert (cfg.evals[VAL].resize, cfg.evals[VAL].resize_ratio) == (
        ("whole", 256 / 224) if squashes else ("aspect", 448 / 384)
    )
    # The cell's settings name them (its id changes with them); the area only with the inception crop.
    assert ("min_crop_area" in settings) == (data.crop == "inception_crop")
    if grid_settings:
        assert settings["min_crop_area"] == data.min_crop_area == 0.3


def test_recipe_overrides_are_validated_with_clear_errors(tmp_path):
    settings = finetune_settings(get_benchmark("digits"), FinetuneGrid())[0]
    recipe = FinetuneRecipe.for_cell(
        get_benchmark("digits"),
        settings,
        checkpoint="/ckpt",
        model={"name": "Ti/4"},
        data_root=str(tmp_path),
        run_name="r",
        run_storage=str(tmp_path),
    )
    assert training_config(recipe, {"precision.dtype": "bf16"}).precision.dtype == "bf16"
    assert training_config(recipe, ["optim.lr=0.5"]).optim.lr == 0.5
    with pytest.raises(ConfigError, match=r"precision\.dtpye: unknown key; did you mean 'precision\.dtype'"):
        training_config(recipe, {"precision.dtpye": "bf16"})
    with pytest.raises(ConfigError, match=r"optim\.lr.*greater than 0"):
        training_config(recipe, ["optim.lr=-1"])


def _finetune_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "finetune", *args], capture_output=True, text=True, timeout=120)


def test_benchmark_form_builds_the_protocol_recipe(pretrained, digits_dataset, tmp_path):
    root = tmp_path / "prepared"
    root.mkdir()
    (root / "digits").symlink_to(digits_dataset)
    out = _finetune_cli(
        pretrained,
        "--benchmark",
        "digits",
        "--data-root",
        str(root),
        "--lr",
        "0.03",
        "--steps",
        "50",
        "--storage",
        str(tmp_path / "runs"),
        "--set",
        "model.img_size=24",
        "--dry-run",
    )
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["init"] == {"checkpoint": _pretrained_ref(pretrained).path, "reset_head": True}
    assert cfg["optim"]["name"] == "sgd" and cfg["optim"]["lr"] == 0.03 and cfg["train"]["steps"] == 50
    assert cfg["model"]["img_size"] == 24 and cfg["data"]["val"] == str(root / "digits")
    assert (cfg["data"]["train_split"], cfg["data"]["val_split"]) == ("train[:90%]", "train[90%:]")
    assert re.fullmatch(r"digits-lr0\.03-seed0-[0-9a-f]{16}", cfg["run"]["name"])
    # Validated on the held-out slice, it scores the test split in the same run (a second val evaluator).
    assert set(cfg["evals"]) == {VAL, TEST} and cfg["evals"][VAL].get("split") is None
    assert (cfg["evals"][TEST]["path"], cfg["evals"][TEST]["split"]) == (str(root / "digits"), "test")

    # The benchmark's crop and flip, or the ones given.
    assert (cfg["data"]["crop"], cfg["data"]["flip"]) == ("resize", False)
    chosen = _finetune_cli(
        pretrained,
        "-b",
        "digits",
        "--data-root",
        str(root),
        "--crop",
        "resmall_crop",
        "--flip",
        "--storage",
        str(tmp_path / "runs"),
        "--dry-run",
    )
    assert chosen.returncode == 0, chosen.stderr
    chosen_cfg = yaml.safe_load(chosen.stdout)
    assert (chosen_cfg["data"]["crop"], chosen_cfg["data"]["flip"]) == ("resmall_crop", True)
    bad = _finetune_cli(pretrained, "-b", "digits", "--data-root", str(root), "--crop", "center", "--dry-run")
    assert bad.returncode == 2
    assert "--crop 'center': expected one of inception_crop, resmall_crop, resize_crop, resize" in bad.stderr

    missing = _finetune_cli(pretrained, "--benchmark", "cifar10", "--data-root", str(root), "--dry-run")
    assert missing.returncode == 2
    assert f"vitray data prepare cifar10:/path/to/cifar-10-binary.tar.gz {root}/cifar10" in missing.stderr


def test_a_fine_tune_configs_dry_run_checks_and_shows_the_checkpoints_model(pretrained, tmp_path):
    """--dry-run printed the config's model section (ModelConfig's default name, Ti/4, for any
    checkpoint) and passed sizes and heads the run then refused."""
    config = str(Path(__file__).resolve().parent.parent / "configs" / "finetune_digits.yaml")
    shown = _finetune_cli(pretrained, "-c", config, "--set", "model.img_size=24", "--dry-run")
    assert shown.returncode == 0, shown.stderr
    model = yaml.safe_load(shown.stdout)["model"]
    assert (model["name"], model["depth"], model["img_size"]) == ("Ti/4", 2, 24)  # the checkpoint's 2 blocks
    for setting, expected in [
        ("model.img_size=30", "model: img_size 30 is not divisible by the patch size 4 of Ti/4"),
        ("model.head=gap", "holds a model with a token head, but model.head=gap"),
    ]:
        refused = _finetune_cli(pretrained, "-c", config, "--set", setting, "--dry-run")
        assert refused.returncode == 2, refused.stdout
        assert expected in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr


@pytest.mark.parametrize(
    ("section", "warmup"),
    [({}, 20), ({"steps": 20}, 2), ({"steps": 400}, 20), ({"steps": 20, "warmup_steps": 5}, 5), ({"steps": 7}, 1)],
)
def test_fewer_steps_than_the_protocols_keep_its_share_of_warm_up(section, warmup):
    """`--steps 20` on digits kept its 20 warm-up steps: the learning rate rose over the whole run and
    never decayed."""
    from vitray.evaluation.methods.finetune import FinetuneGrid, finetune_settings

    assert get_benchmark("digits").finetune.steps == 200 and get_benchmark("digits").finetune.warmup_steps == 20
    (first, *_) = finetune_settings(get_benchmark("digits"), FinetuneGrid.model_validate(section))
    assert first["warmup_steps"] == warmup


def test_a_stores_options_in_the_overrides_are_no_part_of_a_cells_settings_or_id(tmp_path):
    """`finetune.overrides: {data.storage_options: {key: ..., secret: ...}}` went into every fine-tune
    cell's settings: the credentials stood in the results table, report.md and the console's table,
    and a rotated secret made new cell ids (every fine-tune trained again). Where the data is read from
    is how a run goes, not what it computes; what it computes stays a setting."""
    ids, settings = [], []
    for secret in ("CFGsecretVALUE1", "CFGsecretVALUE2"):
        overrides = {
            "data.storage_options": {"key": "AKIDaudit", "secret": secret, "endpoint_url": "http://store"},
            "data.storage_options.client_kwargs.region_name": "eu",
            "precision.dtype": "bf16",
        }
        _, plan = _grid_plan(tmp_path, ["cifar10"], overrides=overrides)
        ids.append(sorted(job.cell.cell_id for job in plan.work))
        settings.append(plan.work[0].cell.settings_json)
    assert ids[0] == ids[1]
    assert '"precision.dtype":"bf16"' in settings[0].replace(" ", "") and "storage_options" not in settings[0]
    assert "AKIDaudit" not in settings[0] and "CFGsecret" not in settings[0]


def _grid_plan(tmp_path, benchmarks, **finetune):
    grid = GridConfig(
        data_root=str(tmp_path),
        output=str(tmp_path / "eval"),
        benchmarks=benchmarks,
        fewshot={"enabled": False},
        finetune={"seeds": 2, **finetune},
    )
    ref = CheckpointRef("/runs/r/checkpoint_1", 1, {"name": "B/16", "img_size": 224})
    return grid, plan_grid(grid, [ref])


def test_each_lr_trains_on_the_train_slice_and_is_scored_on_the_held_out_slice(tmp_path):
    grid, plan = _grid_plan(tmp_path, ["cifar10"])
    assert len(plan.work) == 4 * 2 and not plan.pending  # 4 lrs x 2 seeds, nothing re-trained
    for job in plan.work:
        assert (job.cell.settings["train_split"], job.cell.settings["val_split"]) == ("train[:98%]", "train[98%:]")
        cfg = finetune_config(job, grid)
        assert (cfg.data.train_split, cfg.data.val_split) == ("train[:98%]", "train[98%:]")
        assert cfg.data.train == cfg.data.val == str(tmp_path / "cifar10")
    # ImageNet-ReaL holds out part of ImageNet's train split; its test split is ReaL's.
    grid, plan = _grid_plan(tmp_path, ["imagenet_real"], learning_rates=[0.01])
    cfg = finetune_config(plan.work[0], grid)
    assert cfg.data.train == cfg.data.val == str(tmp_path / "imagenet") and cfg.data.val_split == "train[99%:]"


def test_vtab_selects_on_800_200_then_retrains_the_chosen_lr_on_1000(tmp_path):
    # The protocol's single lr: nothing to select, the one run is the final run on all 1000 examples.
    grid, plan = _grid_plan(tmp_path, ["vtab/dtd"])
    assert not plan.pending and len(plan.work) == 2
    cfg = finetune_config(plan.work[0], grid)
    settings = plan.work[0].cell.settings
    assert settings["train_split"] == "train[:1000]" and "val_split" not in settings
    assert (cfg.data.train_split, cfg.data.val_split) == ("train[:1000]", "test")
    assert cfg.data.val == str(tmp_path / "vtab_dtd")

    # A sweep: every lr on train[:800] scored on train[800:1000], then per seed a final run.
    grid, plan = _grid_plan(tmp_path, ["vtab/dtd"], learning_rates=[0.003, 0.01, 0.03])
    assert len(plan.work) == 3 * 2 and len(plan.pending) == 2 and len(plan) == 8
    assert {(j.cell.settings["train_split"], j.cell.settings["val_split"]) for j in plan.work} == {
        ("train[:800]", "train[800:1000]")
    }
    final = plan.pending[1]
    assert final.seed == 1 and [c.settings["lr"] for c in final.selection] == [0.003, 0.01, 0.03]
    assert all(c.seed == 1 for c in final.selection)
    job = final.job(0.01)
    # Released once its sweep is scored: the lr with the best validation top-1 (ties: the smaller).
    scores = {c.cell_id: {"val_accuracy": v, "accuracy": 0.5} for c, v in zip(final.selection, [0.2, 0.7, 0.7])}
    assert final.release(scores) == job
    assert job.cell.settings == {
        **{k: v for k, v in final.selection[1].settings.items() if k != "val_split"},
        "train_split": "train[:1000]",
    }
    _, lone = _grid_plan(tmp_path, ["vtab/dtd"], learning_rates=[0.01])
    assert job.cell.cell_id == lone.work[1].cell.cell_id  # the same run as a grid of that lr alone
    assert finetune_config(job, grid).data.train_split == "train[:1000]"
    # The splits can be set per grid, and bad ones fail with the config.
    _, plan = _grid_plan(
        tmp_path, ["digits"], train_split="train[:1000]", val_split="train[1000:]", final_train_split="train"
    )
    assert plan.work[0].cell.settings["val_split"] == "train[1000:]" and plan.pending[0].train_split == "train"
    with pytest.raises(ValueError, match="malformed"):
        FinetuneGrid(val_split="train[1000]")


def test_a_selection_cell_scores_the_held_out_slice_and_the_test_split_in_its_run(tmp_path):
    grid, plan = _grid_plan(tmp_path, ["vtab/dtd"], learning_rates=[0.003, 0.01])
    for job in plan.work:  # selection cells: train[:800], validated on train[800:1000]
        cfg = finetune_config(job, grid)
        assert list(cfg.evals) == [VAL, TEST]
        assert cfg.evals[VAL].dataset(cfg.data) == (str(tmp_path / "vtab_dtd"), "train[800:1000]")
        assert cfg.evals[TEST].dataset(cfg.data) == (str(tmp_path / "vtab_dtd"), "test")
        assert cfg.evals[VAL].every == cfg.evals[TEST].every == cfg.train.steps
        assert cfg.evals[VAL].batch_size == cfg.evals[TEST].batch_size == grid.finetune.eval_batch_size
    final = finetune_config(plan.pending[0].job(0.01), grid)  # validated on the test split: one evaluator
    assert list(final.evals) == [VAL] and final.evals[VAL].dataset(final.data) == (str(tmp_path / "vtab_dtd"), "test")
    # ImageNet-ReaL holds out part of ImageNet's train split; its test evaluator reads ReaL's folder.
    grid, plan = _grid_plan(tmp_path, ["imagenet_real"], learning_rates=[0.01])
    cfg = finetune_config(plan.work[0], grid)
    assert cfg.evals[VAL].dataset(cfg.data) == (str(tmp_path / "imagenet"), "train[99%:]")
    bench = get_benchmark("imagenet_real")
    assert cfg.evals[TEST].dataset(cfg.data) == (str(tmp_path / bench.dataset), bench.test_split)
    # The recipe's shape names the test evaluator only where it has one to name.
    recipe = FinetuneRecipe.for_cell(
        get_benchmark("digits"),
        plan.work[0].cell.settings | {"val_split": "train[90%:]"},
        checkpoint="/ckpt",
        model={"name": "Ti/4"},
        data_root=str(tmp_path),
        run_name="r",
        run_storage=str(tmp_path),
    )
    assert (recipe.test, recipe.test_split) == (str(tmp_path / "digits"), "test")
    with pytest.raises(ValueError, match="name its evaluator"):
        recipe.config(VAL)


def test_the_val_evaluator_scores_the_path_and_split_its_section_names(digits_dataset, single_thread):
    from vitray.common.config import load_config
    from vitray.evaluation.top1 import split_top1
    from vitray.models import create_model
    from vitray.trainers.config import TrainingConfig

    torch.manual_seed(0)
    model = create_model("Ti/4", num_classes=10, img_size=16).eval()
    cfg = load_config(
        TrainingConfig,
        None,
        [
            f"data.train={digits_dataset}",
            "data.val_split=train[:10%]",
            "model.img_size=16",
            "data.num_workers=0",
            f"evals.{VAL}={{type: val, every: 1, batch_size: 64}}",
            f"evals.{TEST}={{type: val, every: 1, batch_size: 64, split: test}}",
            "evals.other={type: val, every: 1, batch_size: 64, path: /nowhere, split: 'train[10%:20%]'}",
        ],
    )
    from vitray.trainers.eval_schedule import build_evaluators

    forward = Forward(device="cpu", dtype=torch.float32, sum_over_ranks=lambda values: values)
    evaluators = {e.name: e for e in build_evaluators(cfg, rank=0, world_size=1)}
    val, test = (evaluators[name](model, forward, rank=0) for name in (VAL, TEST))
    assert val == {VAL_TOP1: pytest.approx(split_top1(model, str(digits_dataset), "train[:10%]", batch_size=64))}
    assert test == {TEST_TOP1: pytest.approx(split_top1(model, str(digits_dataset), "test", batch_size=64))}
    assert cfg.evals["other"].dataset(cfg.data) == ("/nowhere", "train[10%:20%]")
    with pytest.raises(ConfigError, match=r"evals\.test\.split"):
        load_config(
            TrainingConfig, None, [f"data.train={digits_dataset}", "evals.test={type: val, every: 1, split: 'test[1'}"]
        )


def test_the_val_evaluator_says_how_many_images_it_could_not_decode(tmp_path, single_thread):
    """A score of fewer images than the split holds says so: `val/skipped`, the undecodable images
    left out (here one kept at preparation), beside the top-1 of the others; the run's lines show it."""
    import io

    from vitray.common.config import load_config
    from vitray.data import prepare_dataset
    from vitray.evaluation.top1 import split_top1
    from vitray.models import create_model
    from vitray.runfolder.run_report import result_text
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.eval_schedule import build_evaluators

    rng = np.random.default_rng(0)
    for c in range(2):
        (tmp_path / "src" / f"class{c}").mkdir(parents=True)
        for i in range(6):
            png = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(png, format="PNG")
            (tmp_path / "src" / f"class{c}" / f"{i}.png").write_bytes(png.getvalue())
    (tmp_path / "src" / "class1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not a PNG")
    data = str(tmp_path / "data")
    prepare_dataset(f"imagefolder:{tmp_path / 'src'}", data, bad_images="keep")  # stored, for the reader to meet
    torch.manual_seed(0)
    model = create_model("Ti/4", num_classes=2, img_size=16).eval()
    cfg = load_config(
        TrainingConfig,
        None,
        [
            f"data.train={data}",
            "data.val_split=train",
            "model.img_size=16",
            "data.num_workers=0",
            f"evals.{VAL}={{type: val, every: 1, batch_size: 8}}",
        ],
    )
    (val,) = build_evaluators(cfg, rank=0, world_size=1)
    forward = Forward(device="cpu", dtype=torch.float32, sum_over_ranks=lambda values: values)
    for _ in range(2):  # counted per evaluation, not summed over the run's evaluations
        scores = val(model, forward, rank=0)
        assert scores == {VAL_TOP1: pytest.approx(split_top1(model, data, "train")), f"{VAL}/skipped": 1.0}
    assert result_text(f"{VAL}/skipped", 1.0) == "val/skipped 1 (undecodable images, left out of the score)"
    from vitray.runfolder.run_report import evaluations

    record = {"step": 4, VAL_TOP1: 0.5, f"{VAL}/skipped": 1.0, "fewshot/digits_10shot": 0.9}
    assert [key for key, _ in evaluations(record)] == ["fewshot/digits_10shot", VAL_TOP1, f"{VAL}/skipped"]
    assert result_text(VAL_TOP1, 0.5) == "val/top1 0.5000"


def test_preflight_checks_every_split_a_val_evaluator_scores(digits_dataset, tmp_path):
    from vitray.common.config import load_config
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.driver_checks.preflight import PreflightError, check_inputs

    base = [
        f"data.train={digits_dataset}",
        "model.img_size=16",
        f"run.storage={tmp_path}",
        "evals.val={type: val, every: 1}",
        "train.batch_size=64",  # (the paper's 4096 is more than the digits hold)
    ]
    assert check_inputs(load_config(TrainingConfig, None, [*base, "evals.test={type: val, every: 1, split: train}"]))
    with pytest.raises(PreflightError, match=r"evals\.test: .*nowhere does not exist"):
        check_inputs(
            load_config(
                TrainingConfig, None, [*base, f"evals.test={{type: val, every: 1, path: {tmp_path / 'nowhere'}}}"]
            )
        )
    with pytest.raises(PreflightError, match=r"evals\.test=.*validation.*pick one"):
        check_inputs(load_config(TrainingConfig, None, [*base, "evals.test={type: val, every: 1, split: validation}"]))


def _finished_run(tmp_path, grid, job, complete: bool = True, config: dict | None = None, **top1s):
    """A run folder of `job`'s cell that logged `top1s` at its last step and left its checkpoint of
    that step complete, or (`complete=False`) with its files and no completion record (no Ray
    needed to read it)."""
    import json

    cfg = finetune_config(job, grid)
    files = RunFiles(str(Path(cfg.run.storage) / cfg.run.name))
    Path(files.metrics_path).parent.mkdir(parents=True, exist_ok=True)
    Path(files.metrics_path).write_text(json.dumps({"step": cfg.train.steps, "loss": 0.1, **top1s}) + "\n")
    checkpoint = Path(files.run_dir) / "checkpoint_2026-12-01_00-00-00.000000"
    checkpoint.mkdir()
    state = {"step": cfg.train.steps, "world_size": 1, "data": {"epoch": 0}}
    write_state(checkpoint, state if config is None else {**state, "config": config})
    if complete:
        mark_complete(checkpoint, 0, [checkpoint / STATE_FILE])
    return cfg, files


def test_a_cell_reads_both_top1s_off_its_run_and_an_old_run_without_the_test_one_is_named(tmp_path):
    grid, plan = _grid_plan(tmp_path, ["vtab/dtd"], learning_rates=[0.003, 0.01])
    selection, other = plan.work[:2]
    _finished_run(tmp_path, grid, selection, **{VAL_TOP1: 0.5, TEST_TOP1: 0.25})
    assert finetune_cell_metrics(selection, grid) == {"val_accuracy": 0.5, "accuracy": 0.25}
    final = plan.pending[0].job(0.01)
    cfg, _ = _finished_run(tmp_path, grid, final, **{VAL_TOP1: 0.75})
    assert finetune_cell_metrics(final, grid) == {"accuracy": 0.75}
    assert run_finetune(cfg).test is None
    # A run made before the test split was scored in the run: nothing is deleted, the message says what to.
    cfg, files = _finished_run(tmp_path, grid, other, **{VAL_TOP1: 0.5})
    with pytest.raises(RuntimeError, match=rf"without {TEST_TOP1}.*Delete the run folder {re.escape(files.run_dir)}"):
        finetune_cell_metrics(other, grid)
    assert Path(files.metrics_path).exists()


def test_a_finished_run_of_other_settings_is_not_reported_for_these(tmp_path):
    """`vitray finetune --set ...` (or a recipe changed since) on the run folder of a finished run:
    its top-1 was computed with other settings, so it is refused in one line naming them; a change of
    how a run goes (its checkpoint interval) still reads the finished run's top-1."""
    from vitray.cluster.finetune import FinishedWithOtherSettings
    from vitray.common.redact import redacted_config

    grid, plan = _grid_plan(tmp_path, ["vtab/dtd"], learning_rates=[0.003, 0.01])
    final = plan.pending[0].job(0.01)
    cfg = finetune_config(final, grid)
    _finished_run(tmp_path, grid, final, config=redacted_config(cfg), **{VAL_TOP1: 0.75})
    assert run_finetune(cfg).top1 == 0.75
    smoothed = cfg.model_copy(update={"train": cfg.train.model_copy(update={"label_smoothing": 0.2})})
    with pytest.raises(
        FinishedWithOtherSettings, match=r"finished with other settings \(train.label_smoothing: 0.0 -> 0.2\)"
    ):
        run_finetune(smoothed)
    rarer = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"every": 7})})
    assert run_finetune(rarer).top1 == 0.75
    # Another pre-trained model under the same run name (`vitray finetune OTHER --name NAME`, the
    # recipe's fixed run.name with --set init.checkpoint=...): its top-1 is not the finished run's.
    other = str(tmp_path / "other-run")
    moved = cfg.model_copy(update={"init": cfg.init.model_copy(update={"checkpoint": other})})
    with pytest.raises(FinishedWithOtherSettings, match=rf"\(init.checkpoint: {re.escape(cfg.init.checkpoint)} -> "):
        run_finetune(moved)


def test_a_run_that_logged_its_top1_but_never_completed_its_last_checkpoint_is_resumed(tmp_path, monkeypatch):
    """A worker that outlived its Ray node for a moment logged the last step's evaluations and died
    writing that step's checkpoint: the cell is not done (its top-1 belongs to weights in no complete
    checkpoint), so the run is started again, to resume and finish."""
    import vitray.cluster.pretrain

    grid, plan = _grid_plan(tmp_path, ["vtab/dtd"], learning_rates=[0.003, 0.01])
    selection = plan.work[0]
    cfg, files = _finished_run(tmp_path, grid, selection, complete=False, **{VAL_TOP1: 0.5, TEST_TOP1: 0.25})
    started = []

    def resumed(cfg, **kwargs):  # the run as the re-run leaves it: its last checkpoint complete
        started.append(cfg.run.name)
        (checkpoint,) = Path(files.run_dir).glob("checkpoint_*")
        mark_complete(checkpoint, 0, [checkpoint / STATE_FILE])

    monkeypatch.setattr(vitray.cluster.pretrain, "pretrain", resumed)
    assert finetune_cell_metrics(selection, grid) == {"val_accuracy": 0.5, "accuracy": 0.25}
    assert started == [cfg.run.name]
    assert finetune_cell_metrics(selection, grid) == {"val_accuracy": 0.5, "accuracy": 0.25}
    assert started == [cfg.run.name], "a finished run is not started again"


def test_a_fine_tune_starting_anew_beside_an_earlier_run_of_its_cell_names_it(tmp_path, monkeypatch, capsys):
    """The same benchmark, learning rate and seed under another id (other settings, or the id an
    older vitray gave the cell): a re-run after an upgrade trained again without a word. It says which
    run is beside it, what wrote it, and how its settings differ; nothing is said when none is there."""
    import shutil

    import vitray.cluster.pretrain
    from vitray.common.redact import redacted_config

    grid, plan = _grid_plan(tmp_path, ["vtab/dtd"], learning_rates=[0.003, 0.01])
    final = plan.pending[0].job(0.01)
    cfg = finetune_config(final, grid)
    monkeypatch.setattr(vitray.cluster.pretrain, "pretrain", lambda cfg, **kwargs: None)
    with pytest.raises(RuntimeError, match="ended without"):  # (pretrain does nothing here)
        run_finetune(cfg)
    assert "note:" not in capsys.readouterr().err
    older = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"warmup_steps": 12})})
    _, files = _finished_run(tmp_path, grid, final, config=redacted_config(older), **{VAL_TOP1: 0.75})
    earlier = files.run_dir[: -len("0123456789abcdef")] + "02fdcea0f9d5c388"  # the id an older vitray gave it
    shutil.move(files.run_dir, earlier)
    with pytest.raises(RuntimeError, match="ended without"):
        run_finetune(cfg)
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert line.startswith(f"note: {Path(earlier).name} beside this fine-tune is the same benchmark, learning rate")
    assert f"schedule.warmup_steps: 12 -> {cfg.schedule.warmup_steps}" in line and cfg.run.name in line
    assert "written by an earlier vitray" in line  # its trainer state does not say which


def test_a_cell_whose_run_another_grid_trains_waits_for_it_and_reads_its_result(tmp_path, monkeypatch, capsys):
    """Two grids into one output: the second's cell met the first's run lease, was tried three times
    within seconds and reported failed (exit 1) while the other finished it. It waits for the run to
    end and reads its top-1; a Ctrl-C of the grid ends the wait at once."""
    import threading
    import time

    import vitray.cluster.pretrain
    from vitray.cluster import run_attempts
    from vitray.runfolder.lease import RunLease, RunLeaseHeld

    grid, plan = _grid_plan(tmp_path, ["vtab/dtd"], learning_rates=[0.003, 0.01])
    final = plan.pending[0].job(0.01)
    cfg = finetune_config(final, grid)
    folder = str(Path(cfg.run.storage) / cfg.run.name)

    def pretrain(cfg, **kwargs):  # what the real one does first: take the run's lease
        RunLease(folder, timeout_s=60).acquire()

    monkeypatch.setattr(vitray.cluster.pretrain, "pretrain", pretrain)
    other_grid = RunLease(folder, timeout_s=60)
    other_grid.acquire()
    got: list = []
    cell = threading.Thread(target=lambda: got.append(finetune_cell_metrics(final, grid, poll_s=0.1)))
    cell.start()
    time.sleep(1.0)
    assert cell.is_alive() and not got
    _finished_run(tmp_path, grid, final, **{VAL_TOP1: 0.75})  # what the other grid's run leaves
    other_grid.release()
    cell.join(timeout=10)
    assert got == [{"accuracy": 0.75}]
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "trains this fine-tune now" in line]
    assert line == (
        f"{cfg.run.name}: {other_grid.record.describe()} trains this fine-tune now; waiting for it to end, to read "
        "its result"
    )
    # A Ctrl-C of the grid while a cell waits: the wait ends at once, as the cell's error.
    monkeypatch.setattr(run_attempts, "_STOPPED_BY_USER", threading.Event())
    run_attempts.stopping_by_user()
    monkeypatch.setattr(
        "vitray.cluster.finetune.run_finetune", lambda cfg, **kw: (_ for _ in ()).throw(RunLeaseHeld("held"))
    )
    started = time.monotonic()
    with pytest.raises(RunLeaseHeld):
        finetune_cell_metrics(final, grid, poll_s=60)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    "raised, code, said",
    [
        ("sigterm", 75, "stopped on a pre-emption notice (SIGTERM to the driver); latest complete checkpoint: "),
        ("ctrl-c", 130, "stopped by user; latest complete checkpoint: "),
        ("lease", 2, "error: run RUN is already running: another driver holds it"),
    ],
)
def test_a_stopped_or_refused_fine_tune_exits_as_pretrain_does(raised, code, said, tmp_path, monkeypatch):
    """`vitray finetune` stopped by SIGTERM once its workers checkpointed said "fine-tuning failed:
    Preempted", exit 1, and a run another driver holds was a failure too: exit 75 (130 for Ctrl-C)
    with where a re-run resumes, and a refusal (exit 2), as `vitray pretrain`."""
    from typer.testing import CliRunner

    import vitray.cluster.finetune
    from vitray.cli.main import app
    from vitray.cluster.pretrain import Preempted
    from vitray.runfolder.lease import RunLeaseHeld

    def run(cfg, **kwargs):
        if raised == "lease":
            raise RunLeaseHeld("run RUN is already running: another driver holds it")
        raise Preempted(None, "SIGTERM to the driver", by_user=raised == "ctrl-c")

    monkeypatch.setattr(vitray.cluster.finetune, "run_finetune", run)
    args = [
        "finetune",
        str(tmp_path / "ckpt"),
        "-c",
        str(Path(__file__).parents[1] / "configs" / "finetune_digits.yaml"),
    ]
    result = CliRunner().invoke(app, [*args, "--set", f"run.storage={tmp_path / 'runs'}"], env={"COLUMNS": "300"})
    assert result.exit_code == code, result.output
    assert said in result.output and "Traceback" not in result.output and "failed" not in result.output


# ---------------------------------------------------------------------------------------------
# A real fine-tune on Ray
# ---------------------------------------------------------------------------------------------


def test_finetune_resets_head_resamples_posemb_and_reports_top1(pretrained, three_digits, tmp_path):
    steps = 6
    sets = [
        f"init.checkpoint={pretrained}",
        f"data.train={three_digits}",
        f"run.storage={tmp_path}",
        "run.name=three",
        f"train.steps={steps}",
        "train.batch_size=16",
        "train.micro_batch_size=16",
        "schedule.warmup_steps=2",
        "log.every=1",
        "checkpoint.every=3",
        f"evals.val.every={steps}",
        "data.shuffle_buffer=64",
        "model.img_size=24",
    ]
    # As JSON for scripts, while it trains: stdout holds the JSON alone (no progress lines).
    command = [*CLI, "finetune", "-c", str(REPO / "configs" / "finetune_digits.yaml")]
    out = run([*command, *[a for s in sets for a in ("--set", s)], "--format", "json"])
    said = json.loads(out.stdout)
    run_dir = str(tmp_path / "three")
    assert said["run"] == run_dir and said["step"] == steps and said["top1"]["split"] == "test"
    metrics = RunFiles(run_dir).read_metrics()
    assert said["top1"]["top1"] == pytest.approx(metrics[-1]["val/top1"], abs=1e-4)
    assert 0.0 <= metrics[-1]["val/top1"] <= 1.0 and metrics[-1]["step"] == steps
    # The same command again: the finished run's top-1 (its recorded config is this one: no change
    # named), not trained again.
    again = run([*command, *[a for s in sets for a in ("--set", s)]])
    printed = re.search(r"top-1 \(.* split test\): ([0-9.]+)", again.stdout)
    assert printed and float(printed.group(1)) == pytest.approx(said["top1"]["top1"], abs=1e-4), again.stdout
    assert RunFiles(run_dir).read_metrics() == metrics
    # A zero-initialised head gives uniform logits: the first step's loss is exactly ln(3).
    assert metrics[0]["step"] == 1 and metrics[0]["loss"] == pytest.approx(math.log(3), abs=1e-5)

    checkpoint = latest_complete_checkpoint(run_dir)
    state = read_state(checkpoint.path)
    assert (state["step"], state["world_size"], state["num_classes"]) == (steps, 1, 3)
    assert state["model"]["img_size"] == 24 and state["model"]["name"] == "Ti/4"
    tuned = load_file(str(Path(checkpoint.path) / "model.safetensors"))
    before = load_file(str(Path(_pretrained_ref(pretrained).path) / "model.safetensors"))
    assert tuned["head.weight"].shape == (3, TI_WIDTH) and before["head.weight"].shape == (10, TI_WIDTH)
    assert before["pos_embed"].shape == (1, 1 + 4 * 4, TI_WIDTH)
    assert tuned["pos_embed"].shape == (1, 1 + 6 * 6, TI_WIDTH)
    # The 6x6 embeddings start from the pre-trained 4x4 ones, bilinearly resampled; six small SGD
    # steps move them far less than the distance to a fresh initialisation.
    resampled = resample_posemb(before["pos_embed"], 6)
    fresh = torch.empty_like(resampled).normal_(std=0.02, generator=torch.Generator().manual_seed(0))
    moved = (tuned["pos_embed"] - resampled).norm()
    assert moved < 0.2 * (fresh - resampled).norm(), float(moved)
    assert (tuned["pos_embed"][:, 0] - before["pos_embed"][:, 0]).norm() < 0.2 * before["pos_embed"][:, 0].norm() + 0.05


def test_a_resumed_fine_tune_does_not_read_its_init_checkpoints_weights(process_group, digits_dataset, tmp_path):
    """The run's own checkpoint replaces every weight on a resume: `init.checkpoint`'s weights are not
    read again (a download per rank from object storage at every resume), only its architecture, and
    the resumed run ends with the weights of the run that went straight through."""
    init = tmp_path / "pre" / "checkpoint_2026-01-01_00-00-00.000001"
    make_checkpoint(init, depth=2, representation_size=8)  # a pre-trained head and pre-logits, reset
    extra = (f"init.checkpoint={init}", "train.steps=6", "checkpoint.every=3", "log.every=3", "model.img_size=24")
    weights_file = init / "model.safetensors"

    def unreadable_init_weights():
        weights_file.write_bytes(b"\xff" * weights_file.stat().st_size)  # complete by its size; a read fails

    straight, resumed = straight_and_resumed(digits_dataset, tmp_path, *extra, between=unreadable_init_weights)
    assert_same_weights(resumed, straight)


def test_a_fine_tune_trains_with_its_own_dropout_and_checkpointing_not_the_checkpoints(
    process_group, digits_dataset, tmp_path
):
    """Dropout and activation checkpointing say how a model trains, not what its weights are: a run
    from `init.checkpoint` takes them from its own config (they were the pre-training's, whatever the
    fine-tune config said, and its record then claimed the config's)."""
    from torch import nn

    checkpoint = tmp_path / "pre" / "checkpoint_2026-01-01_00-00-00.000001"
    make_checkpoint(checkpoint, depth=2, dropout=0.1, attn_dropout=0.1)
    loop = in_process_loop(
        digits_dataset,
        tmp_path / "tuned",
        f"init.checkpoint={checkpoint}",
        "model.dropout=0.0",
        "model.grad_checkpointing=true",
        "model.remat_policy=dots_saveable",
    )
    model = loop.backend.module
    assert [m.p for m in model.modules() if isinstance(m, nn.Dropout)] == [0.0] * (1 + 2 * 2)  # embeddings, 2 a block
    assert [block.attn.attn_dropout for block in model.blocks] == [0.0, 0.0]
    assert (model.grad_checkpointing, model.remat_policy) == (True, "dots_saveable")
    assert model.depth == 2


def test_the_val_evaluator_resizes_as_its_section_says(digits_dataset):
    """big_vision's resize_small(R)|central_crop(S) at the section's R / S (256 / 224 by default), or
    the whole image squashed (`resize: whole`): the images its loader gives are those."""
    from vitray.common.config import load_config
    from vitray.data import EvalLoader
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.eval_schedule import build_evaluators

    sections = {
        "plain": "{type: val, every: 1, batch_size: 64}",
        "transfer": "{type: val, every: 1, batch_size: 64, resize_ratio: 1.1667}",
        "whole": "{type: val, every: 1, batch_size: 64, resize: whole}",
    }
    cfg = load_config(
        TrainingConfig,
        None,
        [f"data.train={digits_dataset}", "model.img_size=24", *[f"evals.{k}={v}" for k, v in sections.items()]],
    )
    first = {e.name: next(iter(e.evaluator.loader())).images for e in build_evaluators(cfg, rank=0, world_size=1)}
    for name, resize in (("plain", {}), ("transfer", {"resize_ratio": 448 / 384}), ("whole", {"resize": "whole"})):
        expected = next(iter(EvalLoader(str(digits_dataset), "test", batch_size=64, img_size=24, **resize))).images
        assert torch.equal(first[name], expected), name
    assert not torch.equal(first["plain"], first["transfer"]) and not torch.equal(first["plain"], first["whole"])
    with pytest.raises(ConfigError, match=r"evals\.val\.resize"):
        load_config(
            TrainingConfig, None, [f"data.train={digits_dataset}", "evals.val={type: val, every: 1, resize: crop}"]
        )


def test_a_grids_warm_up_longer_than_its_fine_tunes_is_refused():
    """The grid clipped it to the run (the whole run warm-up, never decaying); pre-training refuses it."""
    digits = get_benchmark("digits")
    with pytest.raises(
        ValueError, match=r"finetune.warmup_steps=10 is longer than the fine-tune \(finetune.steps: 4\)"
    ):
        finetune_settings(digits, FinetuneGrid(steps=4, warmup_steps=10))
    protocol = digits.finetune.steps
    with pytest.raises(ValueError, match=rf"\(digits's protocol steps: {protocol}\).* at most {protocol}$"):
        finetune_settings(digits, FinetuneGrid(warmup_steps=protocol + 1))
    assert finetune_settings(digits, FinetuneGrid(steps=4, warmup_steps=4))[0]["warmup_steps"] == 4


def test_a_stop_that_comes_after_the_last_step_says_the_run_had_finished(tmp_path, monkeypatch):
    """A Ctrl-C after the workers' last step (its checkpoint written) said "re-run the same command to
    resume", while `vitray runs` showed the run finished."""
    from pretrain_helpers import make_checkpoint
    from typer.testing import CliRunner

    import vitray.cluster.pretrain
    from vitray.cli.main import app
    from vitray.cluster.pretrain import Preempted

    def run(cfg, **kwargs):
        make_checkpoint(tmp_path / "runs" / cfg.run.name / "checkpoint_2026-01-01_00-00-00.000001")  # at step 4
        raise Preempted(None, "Ctrl-C", by_user=True)

    monkeypatch.setattr(vitray.cluster.pretrain, "pretrain", run)
    demo = str(Path(__file__).parents[1] / "configs" / "demo.yaml")
    for steps, said in ((4, "; the run had finished: nothing to resume"), (5, "; re-run the same command to resume")):
        sets = [f"run.storage={tmp_path / 'runs'}", f"run.name=at{steps}", f"train.steps={steps}"]
        args = ["pretrain", "-c", demo, *(a for s in [*sets, "schedule.warmup_steps=1"] for a in ("--set", s))]
        result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
        assert result.exit_code == 130 and "latest complete checkpoint: step 4 (" in result.output, result.output
        assert said in result.output, result.output
