"""The paper's recipes in configs/paper/: every one validates with `--dry-run` (without its data,
checkpoint or cluster being there), its header documents what it reproduces, how to run it (and that
command works), the hardware and the paper's result, its values are the paper's tables, and a
scaled-down variant of each family (tiny model, built-in digits) actually runs."""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from vitray.cli.main import app
from vitray.common.config import load_config
from vitray.evaluation.config import GridConfig
from vitray.runfolder import checkpoint_folders as ckpt
from vitray.runfolder.checkpoint_folders import latest_complete_checkpoint
from vitray.runfolder.files import RunFiles
from vitray.trainers.config import TrainingConfig

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "configs" / "paper"
RECIPES = sorted(PAPER.glob("*.yaml"))
HEADER_KEYS = ("Reproduces:", "Run:", "Hardware:", "Expected:")
WIDTH = {"B": 768, "L": 1024, "H": 1280}


def family(recipe: Path) -> str:
    """pretrain | finetune | grid, from the file name (a recipe of no family fails the tests)."""
    for prefix, kind in (("pretrain_", "pretrain"), ("finetune_", "finetune"), ("vtab1k", "grid"), ("fewshot", "grid")):
        if recipe.name.startswith(prefix):
            return kind
    raise AssertionError(f"{recipe.name}: not a known recipe family (pretrain_*, finetune_*, vtab1k, fewshot)")


def load(recipe: Path):
    return load_config(GridConfig if family(recipe) == "grid" else TrainingConfig, recipe)


def test_every_family_has_recipes():
    kinds = [family(r) for r in RECIPES]
    assert kinds.count("finetune") == 5 and kinds.count("grid") == 2
    names = {r.stem for r in RECIPES}
    assert set(TABLE_3) <= names  # the supervised pre-training recipes (masked patch prediction adds its own)
    for model in ("b16", "l16", "h14"):
        assert {f"pretrain_{model}_i21k", f"pretrain_{model}_jft"} <= names
    assert {"pretrain_b16_imagenet1k", "vtab1k", "fewshot"} <= names
    assert {f"finetune_{d}_384" for d in ("imagenet", "cifar10", "cifar100", "pets", "flowers102")} <= names


# ---------------------------------------------------------------------------------------------
# Dry runs and headers
# ---------------------------------------------------------------------------------------------


def _dry_run(args: list[str]) -> dict:
    result = CliRunner().invoke(app, [*args, "--dry-run"])
    assert result.exit_code == 0, f"vitray {' '.join(args)} --dry-run failed:\n{result.output}"
    return yaml.safe_load(result.stdout)


def _dry_run_args(recipe: Path) -> list[str]:
    kind = family(recipe)
    if kind == "grid":
        return ["evaluate", "s3://bucket/runs/no-such-run", "-c", str(recipe)]
    return [kind, "-c", str(recipe)]


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_validates_with_dry_run_without_its_data(recipe):
    printed = _dry_run(_dry_run_args(recipe))
    cfg = load(recipe)
    assert printed == cfg.model_dump(mode="json")
    # Nothing the recipe points at exists here: --dry-run only validates, it touches no data.
    paths = [cfg.data_root] if isinstance(cfg, GridConfig) else [cfg.data.train, cfg.init.checkpoint]
    assert not any(p and Path(p).exists() for p in paths)


def _header(recipe: Path) -> dict[str, str]:
    """`# Key: text` blocks of the leading comment, continuation lines joined."""
    lines = []
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    blocks: dict[str, str] = {}
    key = None
    for line in lines:
        match = re.match(r"^([A-Z][a-z]+):\s*(.*)$", line)
        if match:
            key = match.group(1)
            blocks[key] = match.group(2)
        elif key is not None:
            blocks[key] += "\n" + line
    return blocks


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_header_says_what_how_where_and_expected(recipe):
    assert recipe.read_text().startswith("# Reproduces:"), "the header comes first"
    header = _header(recipe)
    missing = [k for k in HEADER_KEYS if k[:-1] not in header]
    assert not missing, f"{recipe.name}: header lacks {missing}"
    assert re.search(r"\d\d\.\d", header["Expected"]), "the expected result quotes the paper's numbers"
    assert re.search(r"Table \d|Fig\. \d", header["Reproduces"] + header["Expected"]), "names the paper's table/figure"
    # The documented command is a working command (checked as a dry run).
    command = header["Run"].split("\n")[0]
    continued = header["Run"].split("\n")
    while command.endswith("\\") and len(continued) > 1:
        continued.pop(0)
        command = command[:-1] + " " + continued[0]
    args = shlex.split(command)
    assert args[0] == "vitray" and f"configs/paper/{recipe.name}" in args, command
    args = [str(REPO / a) if a.startswith("configs/") else a for a in args[1:]]
    _dry_run(args)


# ---------------------------------------------------------------------------------------------
# The paper's numbers (appendix B.1 Table 3, B.1.1 Table 4)
# ---------------------------------------------------------------------------------------------

# recipe -> (lr, weight decay, dropout, epochs, decay, grad clip)   [Table 3]
TABLE_3 = {
    "pretrain_b16_i21k": (1e-3, 0.03, 0.1, 90, "linear", 0.0),
    "pretrain_l16_i21k": (1e-3, 0.03, 0.1, 90, "linear", 0.0),
    "pretrain_h14_i21k": (1e-3, 0.03, 0.1, 90, "linear", 0.0),  # no H row in Table 3: the L row
    "pretrain_b16_jft": (8e-4, 0.1, 0.0, 7, "linear", 0.0),
    "pretrain_l16_jft": (4e-4, 0.1, 0.0, 14, "linear", 0.0),
    "pretrain_h14_jft": (3e-4, 0.1, 0.0, 14, "linear", 0.0),
    "pretrain_b16_imagenet1k": (3e-3, 0.3, 0.1, 300, "cosine", 1.0),
}
IMAGES = {"i21k": 14.2e6, "jft": 303e6, "imagenet1k": 1_281_167}
# dataset -> (steps, lr sweep)   [Table 4]
TABLE_4 = {
    "imagenet": (20_000, (0.003, 0.01, 0.03, 0.06)),
    "cifar10": (10_000, (0.001, 0.003, 0.01, 0.03)),
    "cifar100": (10_000, (0.001, 0.003, 0.01, 0.03)),
    "pets": (500, (0.001, 0.003, 0.01, 0.03)),
    "flowers102": (500, (0.001, 0.003, 0.01, 0.03)),
}


@pytest.mark.parametrize("name", sorted(TABLE_3))
def test_pretraining_recipes_are_table_3(name):
    cfg = load(PAPER / f"{name}.yaml")
    lr, wd, dropout, epochs, decay, clip = TABLE_3[name]
    t = cfg.train
    o, s = cfg.optim, cfg.schedule
    assert (o.name, o.b1, o.b2, t.batch_size, s.warmup_steps) == ("adamw", 0.9, 0.999, 4096, 10_000)
    assert (o.lr, o.weight_decay, cfg.model.dropout, s.decay, o.grad_clip) == (lr, wd, dropout, decay, clip)
    assert cfg.model.img_size == 224 and cfg.model.head == "token" and cfg.model.attn_dropout == 0.0
    size, patch = cfg.model.name.split("/")
    assert cfg.model.representation_size == WIDTH[size] and name.split("_")[1] == f"{size.lower()}{patch}"
    dataset = name.split("_")[2]
    assert t.steps == pytest.approx(epochs * IMAGES[dataset] / 4096, rel=0.01)
    assert t.objective == ("softmax" if dataset == "imagenet1k" else "sigmoid")
    assert t.batch_size == t.micro_batch_size * cfg.cluster.num_workers  # no accumulation on the intended GPUs


@pytest.mark.parametrize("dataset", sorted(TABLE_4))
def test_finetuning_recipes_are_table_4(dataset):
    cfg = load(PAPER / f"finetune_{dataset}_384.yaml")
    steps, sweep = TABLE_4[dataset]
    t = cfg.train
    o, s = cfg.optim, cfg.schedule
    assert (o.name, o.momentum, t.batch_size, o.weight_decay, o.grad_clip, s.decay) == (
        "sgd",
        0.9,
        512,
        0.0,
        1.0,
        "cosine",
    )
    assert t.steps == steps and o.lr in sweep and cfg.evals["val"].every == steps
    assert cfg.model.img_size == 384 and cfg.init.reset_head and cfg.init.checkpoint
    assert cfg.data.train.endswith(f"/{dataset}") and cfg.data.val_path.endswith(f"/{dataset}")


def test_grid_recipes_follow_the_protocols():
    vtab = load(PAPER / "vtab1k.yaml")
    assert vtab.benchmarks == ["vtab"] and not vtab.fewshot.enabled
    assert (vtab.finetune.learning_rates, vtab.finetune.steps, vtab.finetune.batch_size, vtab.finetune.resolution) == (
        [0.01],
        2500,
        512,
        384,
    )
    assert len(vtab.resolved_benchmarks()) == 19
    fewshot = load(PAPER / "fewshot.yaml")
    assert fewshot.benchmarks == ["paper"] and not fewshot.finetune.enabled
    assert (fewshot.fewshot.shots, fewshot.fewshot.seeds, fewshot.fewshot.l2_reg) == ([1, 5, 10, 25], 3, 1024)


# ---------------------------------------------------------------------------------------------
# Scaled-down variants that actually run (one per family)
# ---------------------------------------------------------------------------------------------

SMALL_TRAIN = [
    "train.steps=4",
    "train.batch_size=16",
    "train.micro_batch_size=16",
    "schedule.warmup_steps=1",
    "checkpoint.every=4",
    "checkpoint.keep=1",
    "evals.val={type: val, every: 4, batch_size: 128}",
    "log.every=2",
    "precision.dtype=fp32",
    "cluster.num_workers=1",
    "cluster.cpus_per_worker=1",
    "cluster.gpus_per_worker=0",
    "cluster.max_failures=0",
    "data.num_slots=8",
    "data.num_workers=0",
    "data.shuffle_buffer=64",
    "data.min_crop_area=0.5",
    "data.flip=false",
    "data.val_split=test",
]
SMALL_MODEL = ["model.name=Ti/4", "model.depth=2", "model.img_size=16", "model.representation_size=32"]


def _sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _run_vitray(*args: str):
    from pretrain_helpers import run, vitray_cmd

    return run(vitray_cmd(*args))


def _finished_state(run_dir: Path, steps: int) -> dict:
    latest = latest_complete_checkpoint(str(run_dir))
    assert latest is not None and latest.step == steps, f"no checkpoint at step {steps} in {run_dir}"
    metrics = RunFiles(str(run_dir)).read_metrics()
    assert all(math.isfinite(m["loss"]) for m in metrics if "loss" in m)
    assert any("val/top1" in m and m["step"] == steps for m in metrics)
    return ckpt.read_state(latest.path)


@pytest.mark.slow
def test_scaled_down_pretraining_recipe_runs(digits_dataset, tmp_path):
    """The JFT-style recipe, scaled down: its sigmoid cross-entropy, linear decay, Table 3's lr and
    weight decay and no dropout are what the run recorded. (The other pre-training recipes differ
    from it only in values that Table 3's test checks and the other end-to-end runs train with:
    softmax, cosine decay, dropout, gradient clipping.)"""
    recipe = "pretrain_b16_jft"
    kept = {
        "train.objective": "sigmoid",
        "schedule.decay": "linear",
        "optim.lr": 8e-4,
        "optim.weight_decay": 0.1,
        "model.dropout": 0.0,
    }
    _run_vitray(
        "pretrain",
        "-c",
        str(PAPER / f"{recipe}.yaml"),
        *_sets(*SMALL_MODEL, *SMALL_TRAIN, f"data.train={digits_dataset}", f"run.storage={tmp_path}", "run.name=small"),
    )
    state = _finished_state(tmp_path / "small", 4)
    config = state["config"]
    for dotted, value in kept.items():
        section, key = dotted.split(".")
        assert config[section][key] == value, dotted
    assert (state["model"]["name"], state["model"]["depth"]) == ("Ti/4", 2)


@pytest.mark.slow
def test_scaled_down_finetuning_recipe_runs(pretrained, digits_dataset, tmp_path):
    out = _run_vitray(
        "finetune",
        "-c",
        str(PAPER / "finetune_cifar10_384.yaml"),
        *_sets(
            *SMALL_TRAIN,
            f"init.checkpoint={pretrained}",
            "model.img_size=24",
            f"data.train={digits_dataset}",
            f"data.val={digits_dataset}",
            f"run.storage={tmp_path}",
            "run.name=small-ft",
        ),
    )
    assert re.search(r"top-1 \(.*split test\): [01]\.\d{4}", out.stdout), out.stdout
    state = _finished_state(tmp_path / "small-ft", 4)
    assert (state["model"]["name"], state["model"]["depth"]) == ("Ti/4", 2)  # from the checkpoint
    assert state["model"]["img_size"] == 24  # resampled
    assert state["model"]["representation_size"] is None  # the pre-logits went with the head
    optim, schedule = state["config"]["optim"], state["config"]["schedule"]
    assert (optim["name"], optim["momentum"], optim["weight_decay"], schedule["decay"]) == ("sgd", 0.9, 0.0, "cosine")


@pytest.fixture(scope="module")
def data_root(digits_dataset, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    (root / "digits").symlink_to(digits_dataset)
    return root


def _results(output: Path):
    from vitray.evaluation.results import ResultsTable

    return ResultsTable(str(output / "results")).to_pandas()


@pytest.mark.slow
def test_scaled_down_fewshot_recipe_runs(pretrained, data_root, tmp_path):
    """The grid family's run: the few-shot recipe, scaled down. (vtab1k.yaml, the other grid recipe,
    is the fine-tune method with one learning rate: its values are checked above and a grid's
    fine-tunes, with the lr selection and the final run, are `tests/test_evaluate.py`'s.)"""
    _run_vitray(
        "evaluate",
        pretrained,
        "-c",
        str(PAPER / "fewshot.yaml"),
        "--no-progress",
        *_sets(
            "benchmarks=[digits]",
            f"data_root={data_root}",
            f"output={tmp_path}",
            "fewshot.shots=[1, 5]",
            "fewshot.seeds=1",
            "fewshot.num_gpus=0",
            "fewshot.num_cpus=1",
            "fewshot.data_workers=0",
            "fewshot.batch_size=128",
        ),
    )
    results = _results(tmp_path)
    assert set(results["method"]) == {"fewshot"} and set(results["status"]) == {"ok"}
    assert sorted(results.drop_duplicates("cell_id")["settings"].map(lambda s: yaml.safe_load(s)["shots"])) == [1, 5]
    assert results["value"].between(0, 1).all()
