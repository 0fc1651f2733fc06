"""The config loader and the CLI's refusal of bad configs, before anything heavy starts."""

from __future__ import annotations

import functools
import json
import operator
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from vitray.common.config import ConfigError, load_config
from vitray.evaluation.config import GridConfig
from vitray.evaluation.evaluators import KINDS, VAL_TOP1, Forward, metric_name
from vitray.evaluation.evaluators import fewshot as fewshot_evaluator
from vitray.evaluation.evaluators import val as val_evaluator
from vitray.evaluation.evaluators.fewshot import FewshotEvalConfig
from vitray.evaluation.evaluators.val import ValEvalConfig
from vitray.storage import absolute
from vitray.trainers.config import MOVED_KEYS, TrainingConfig
from vitray.trainers.eval_schedule import ScheduledEvaluator, build_evaluators

REPO = Path(__file__).resolve().parents[1]
# Run recipes (pre-training and fine-tuning); grid_*.yaml are evaluation grids, checked in test_evaluate.
CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith("grid_"))


def test_yaml_and_overrides_are_typed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"train": {"steps": 7}, "optim": {"lr": 0.5}, "run": {"name": "a"}, "data": {"train": "d"}})
    )
    cfg = load_config(TrainingConfig, path, ["optim.lr=1e-4", "run.name=b", "optim.ema_decay=0.99", "seed=3"])
    assert cfg.train.steps == 7
    assert cfg.optim.lr == pytest.approx(1e-4)
    assert cfg.run.name == "b"
    assert cfg.optim.ema_decay == pytest.approx(0.99)
    assert cfg.seed == 3


def test_a_mapping_set_on_a_section_merges_into_it(tmp_path):
    """`--set 'train={steps: 5}'` changes the steps and keeps the file's other train settings; `{}`
    empties a section, and an evaluator of another type replaces the one there."""
    path = tmp_path / "c.yaml"
    val = {"type": "val", "every": 7, "split": "test"}
    path.write_text(
        yaml.safe_dump(
            {"train": {"steps": 70, "batch_size": 64}, "data": {"train": "d"}, "evals": {"v": val, "w": val}}
        )
    )
    cfg = load_config(TrainingConfig, path, ["train={steps: 5, micro_batch_size: 16}", "evals.v={every: 3}"])
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.micro_batch_size) == (5, 64, 16)
    assert (cfg.evals["v"].every, cfg.evals["v"].split) == (3, "test")
    assert load_config(TrainingConfig, path, ["evals={}"]).evals == {}
    assert list(load_config(TrainingConfig, path, ["evals.v=null"]).evals) == ["w"]  # one of them
    defaults = load_config(TrainingConfig, None, ["data.train=d"]).train
    assert load_config(TrainingConfig, path, ["train=null"]).train == defaults
    fewshot = "evals.w={type: fewshot, every: 5, datasets: {digits: d}}"
    assert load_config(TrainingConfig, path, [fewshot]).evals["w"].type == "fewshot"


def test_typo_suggests_the_closest_key():
    with pytest.raises(ConfigError) as err:
        load_config(TrainingConfig, None, ["train.setps=5"])
    message = str(err.value)
    assert "train.setps" in message and "did you mean 'train.steps'" in message


def test_keys_inside_an_evaluator_and_an_optional_section_are_named_as_written():
    """Pydantic puts an evaluator's `type` in the error's location (`evals.v.val.every`): the
    message names the key as the user wrote it, blames the --set that gave it, and lists the keys
    valid there, as for any other section."""
    with pytest.raises(ConfigError) as bad:
        load_config(TrainingConfig, None, ["data.train=d", "evals.v={type: val, every: 0}"])
    assert str(bad.value).splitlines()[1] == "  evals.v.every: Input should be greater than 0 (got 0)"
    assert "evals.v={type: val, every: 0}" in str(bad.value).splitlines()[0]
    with pytest.raises(ConfigError, match=r"evals.v.evry: unknown key; did you mean 'evals.v.every'\? \(valid here: b"):
        load_config(TrainingConfig, None, ["data.train=d", "evals.v={type: val, evry: 3}"])
    with pytest.raises(ConfigError, match=r"log.wandb.projct: unknown key; did you mean 'log.wandb.project'\?"):
        load_config(TrainingConfig, None, ["data.train=d", "log.wandb={projct: x}"])


def test_typo_in_section_name():
    with pytest.raises(ConfigError, match=r"did you mean 'train'"):
        load_config(TrainingConfig, None, ["trian.steps=5"])


def test_bad_value_names_key_value_and_what_is_allowed():
    with pytest.raises(ConfigError) as err:
        load_config(TrainingConfig, None, ["precision.dtype=fp4"])
    message = str(err.value)
    assert "precision.dtype" in message and "'fp4'" in message
    assert "fp32" in message and "bf16" in message and "fp8" in message


def test_wrong_type():
    with pytest.raises(ConfigError, match=r"train\.steps.*'many'"):
        load_config(TrainingConfig, None, ["train.steps=many"])


def test_batch_must_divide_into_micro_batches_and_workers():
    with pytest.raises(ConfigError, match=r"train.batch_size=100 must be a multiple"):
        load_config(
            TrainingConfig,
            None,
            ["data.train=d", "train.batch_size=100", "train.micro_batch_size=16", "cluster.num_workers=2"],
        )


@pytest.mark.parametrize(
    "overrides, slots",
    [
        (["cluster.num_workers=4", "data.num_workers=2", "train.micro_batch_size=8"], 8),  # a slot per loader worker
        (["cluster.num_workers=2", "data.num_workers=0", "train.micro_batch_size=8"], 2),  # decoding in the rank
        (["cluster.num_workers=2", "data.num_workers=6", "train.micro_batch_size=8"], 4),  # 2 of 6 divide the batch
        (["cluster.num_workers=2", "data.num_workers=6", "train.micro_batch_size=8", "data.num_slots=16"], 16),
    ],
)
def test_data_slots_default_to_one_per_loader_worker(overrides, slots):
    cfg = load_config(TrainingConfig, None, ["data.train=d", "train.batch_size=64", *overrides])
    assert cfg.new_run_num_slots() == slots


@pytest.mark.parametrize(
    "overrides, workers, slots",
    [
        ([], 1, 2),  # a CPU run: its step needs the cores; one slot per rank's worker
        (["cluster.cpus_per_worker=8"], 1, 2),
        # all CPUs but the trainer's that divide the micro batch (32): a slot each, no slot shared
        (["cluster.gpus_per_worker=1", "cluster.cpus_per_worker=16"], 8, 16),
        (["cluster.gpus_per_worker=1", "cluster.cpus_per_worker=8.5"], 4, 8),  # whole CPUs: 7, of which 4 divide
        (
            [
                "cluster.gpus_per_worker=1",
                "cluster.cpus_per_worker=16",
                "train.micro_batch_size=24",
                "train.batch_size=96",
            ],
            12,
            24,
        ),
        (["cluster.gpus_per_worker=1", "cluster.cpus_per_worker=9"], 8, 16),  # 8 divide the micro batch: a slot each
        (["cluster.gpus_per_worker=1", "cluster.cpus_per_worker=1"], 1, 2),  # at least one
        (["cluster.gpus_per_worker=1", "cluster.cpus_per_worker=16", "data.num_workers=3"], 3, 2),  # as set
        (["cluster.gpus_per_worker=1", "cluster.cpus_per_worker=16", "data.num_workers=0"], 0, 2),
    ],
)
def test_loader_workers_default_to_the_cpus_ray_gives_a_worker(overrides, workers, slots):
    cfg = load_config(TrainingConfig, None, ["data.train=d", "train.batch_size=64", *overrides])
    assert cfg.data.num_workers == workers
    assert cfg.new_run_num_slots() == slots
    # Recorded: the run's config (what workers and checkpoints get) names the number it resolved to.
    assert cfg.model_dump(mode="json")["data"]["num_workers"] == workers
    assert TrainingConfig.model_validate(cfg.model_dump(mode="json")).data.num_workers == workers


GPU_RUN = ["data.train=d", "train.batch_size=256", "train.micro_batch_size=256", "cluster.num_workers=1"]


@pytest.mark.parametrize(
    "overrides, nodes, cpus, workers, slots",
    [
        # one 16-core node with one GPU (the H100 box): 15 CPUs, 14 spare, 8 of them divide 256
        (["cluster.gpus_per_worker=1"], [{"CPU": 16.0, "GPU": 1.0}], 15, 8, 8),
        # 8 GPUs on 96 cores: 95 / 8 = 11.9 -> 11; the CPU-only head node does not count
        (["cluster.gpus_per_worker=1"], [{"CPU": 4.0}, {"CPU": 96.0, "GPU": 8.0}], 11, 8, 8),
        (["cluster.gpus_per_worker=2"], [{"CPU": 96.0, "GPU": 8.0}], 23, 16, 16),  # two GPUs' share
        (["cluster.gpus_per_worker=1"], [{"CPU": 96.0, "GPU": 8.0}, {"CPU": 16.0, "GPU": 4.0}], 3, 2, 2),  # smallest
        (["cluster.gpus_per_worker=1"], [{"CPU": 8.0}], 1, 1, 1),  # no GPU node yet (an autoscaler adds it): 1
        (
            ["cluster.gpus_per_worker=1", "data.num_workers=3"],
            [{"CPU": 16.0, "GPU": 1.0}],
            15,
            3,
            1,
        ),  # as set; 1 slot: 3 does not divide 256
        (["cluster.gpus_per_worker=1", "cluster.cpus_per_worker=4"], [{"CPU": 16.0, "GPU": 1.0}], 4, 2, 2),  # as set
    ],
)
def test_gpu_workers_get_their_nodes_cpus_once_ray_is_up(overrides, nodes, cpus, workers, slots):
    """An accelerator run's unset cluster.cpus_per_worker comes from the cluster's nodes, once Ray is up
    (the driver may be a CPU-only head node); Ray's default of 1 CPU left a 16-core, one-GPU node
    reading with one loader worker."""
    cfg = load_config(TrainingConfig, None, [*GPU_RUN, *overrides])
    if "cluster.cpus_per_worker=4" not in overrides:
        assert cfg.cluster.cpus_per_worker is None
        assert cfg.data.num_workers == (3 if "data.num_workers=3" in overrides else None)
    resolved = cfg.with_worker_cpus(nodes)
    assert (resolved.cluster.cpus_per_worker, resolved.data.num_workers) == (cpus, workers)
    assert resolved.new_run_num_slots() == slots
    assert resolved.with_worker_cpus([{"CPU": 2.0, "GPU": 1.0}]) is resolved  # resolved once


@pytest.mark.parametrize(
    "overrides",
    [
        ["data.train=d", "train.steps=50"],  # a CPU run
        [*GPU_RUN, "train.steps=50", "cluster.gpus_per_worker=1"],  # resolved once Ray is up, below
        ["data.train=d", "train.backend=xla", "cluster.tpu=v4-8", "train.batch_size=64", "train.steps=50"],
        ["data.train=d", "train.objective=masked_patch", "train.steps=50", "evals={}"],
        ["data.train=d", "train.steps=50000", "schedule.warmup_steps=20000", "cluster.num_workers=4"],
    ],
)
def test_the_config_the_workers_get_validates_back_to_the_drivers(overrides):
    """A run shorter than the default warm-up (the paper's 10k steps, clamped to the run when left
    unset) is refused only when the warm-up was asked for. The workers rebuild the config from what
    the driver sends them: that must not turn the default into a request (every run under 10k
    steps that left it unset failed in its workers with the refusal), nor change anything else."""
    cfg = load_config(TrainingConfig, None, overrides)
    for config in (cfg, cfg.with_worker_cpus([{"CPU": 16.0, "GPU": 1.0, "TPU": 4.0}])):
        again = TrainingConfig.model_validate(config.settings())
        assert again == config and again.model_dump() == config.model_dump()
        assert TrainingConfig.model_validate(json.loads(json.dumps(config.settings()))) == config  # as Ray sends it


def test_local_paths_are_read_against_the_drivers_working_directory(tmp_path, monkeypatch):
    """Ray's workers run in working directories of their own: a relative path in the config (or the
    default run.storage ./runs) is made absolute where the config is read, and travels so to them;
    URLs stay as given."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        TrainingConfig,
        None,
        [
            "data.train=data/digits",
            "data.val=s3://bucket/val",
            "init.checkpoint=~/runs/ref",
            "evals.held={type: val, every: 2, path: held}",
            "evals.few={type: fewshot, every: 2, datasets: {digits: data/digits, cifar: s3://b/cifar}}",
            "checkpoint.staging_dir=scratch",
            "log.wandb={mode: offline, dir: wandb-files}",
            "log.mlflow={tracking_uri: mlruns}",
        ],
    )
    here = str(tmp_path)
    assert cfg.log.mlflow.tracking_uri == f"{here}/mlruns"
    assert (cfg.checkpoint.staging_dir, cfg.log.wandb.dir) == (f"{here}/scratch", f"{here}/wandb-files")
    assert (cfg.data.train, cfg.data.val, cfg.run.storage) == (f"{here}/data/digits", "s3://bucket/val", f"{here}/runs")
    assert cfg.init.checkpoint == str(Path("~/runs/ref").expanduser())
    assert cfg.evals["held"].path == f"{here}/held"
    assert cfg.evals["few"].datasets == {"digits": f"{here}/data/digits", "cifar": "s3://b/cifar"}
    monkeypatch.chdir(REPO)  # a worker's own working directory
    assert TrainingConfig.model_validate(cfg.settings()) == cfg
    grid = load_config(GridConfig, None, ["data_root=bench"])
    assert (grid.data_root, grid.output) == (f"{REPO}/bench", f"{REPO}/eval-output")


def test_mlflow_stores_on_local_disk_are_read_against_the_drivers_working_directory(tmp_path, monkeypatch):
    from vitray.trainers.trackers import MlflowSettings

    monkeypatch.chdir(tmp_path)
    here = str(tmp_path)
    given_and_sent = {
        "mlruns": f"{here}/mlruns",
        "file:mlruns": f"file:{here}/mlruns",
        "sqlite:///mlflow.db": f"sqlite:///{here}/mlflow.db",
        "sqlite:////srv/mlflow.db": "sqlite:////srv/mlflow.db",
        "file:///srv/mlruns": "file:///srv/mlruns",
        "/srv/mlruns": "/srv/mlruns",
        "http://127.0.0.1:5000": "http://127.0.0.1:5000",
        "databricks": "databricks",
        "postgresql://u@db/mlflow": "postgresql://u@db/mlflow",
    }
    for given, sent in given_and_sent.items():
        assert MlflowSettings(tracking_uri=given).tracking_uri == sent, given
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert MlflowSettings().tracking_uri == f"{here}/mlruns"  # unset: the folder mlruns here


def test_a_cpu_run_gets_one_cpu_per_worker_without_ray():
    cfg = load_config(TrainingConfig, None, ["data.train=d", "train.batch_size=64"])
    assert (cfg.cluster.cpus_per_worker, cfg.data.num_workers) == (1, 1)
    assert cfg.with_worker_cpus([{"CPU": 64.0}]) is cfg


def test_an_unresolved_gpu_run_checks_its_slots_once_resolved():
    cfg = load_config(
        TrainingConfig, None, [*GPU_RUN, "cluster.gpus_per_worker=1", "train.micro_batch_size=6", "train.batch_size=6"]
    )
    with pytest.raises(ValueError, match="resolved once Ray is up"):
        cfg.new_run_num_slots()
    assert cfg.with_worker_cpus([{"CPU": 16.0, "GPU": 1.0}]).new_run_num_slots() == 6  # 14 spare: 6 divide 6


def test_loader_workers_default_on_a_tpu_slice():
    cfg = load_config(
        TrainingConfig,
        None,
        ["data.train=d", "train.backend=xla", "cluster.tpu=v4-8", "cluster.cpus_per_worker=96", "train.batch_size=64"],
    )
    assert cfg.data.num_workers == 32  # of the host's 95 spare CPUs, as many as divide its micro batch (32)


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(TrainingConfig, None, ["train.steps"])
    with pytest.raises(ConfigError, match="is a value"):
        load_config(TrainingConfig, None, ["seed=1", "seed.x=1"])


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_validate(path):
    cfg = load_config(TrainingConfig, path)
    assert type(cfg) is TrainingConfig
    resolved = cfg.model_dump(mode="json")
    for key, value in leaves(yaml.safe_load(path.read_text())):  # each value set is the value the run gets
        got = functools.reduce(operator.getitem, key, resolved)
        # (a local path as read against the working directory: demo-output/runs -> /cwd/demo-output/runs)
        assert got == value or (isinstance(value, str) and got == absolute(value) != value), ".".join(key)


def leaves(tree: dict, prefix: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _vitray(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vitray.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_dry_run_prints_resolved_config():
    out = _vitray(
        "pretrain",
        "-c",
        str(REPO / "configs" / "demo.yaml"),
        "--set",
        "train.steps=3",
        "--set",
        "schedule.warmup_steps=1",
        "--dry-run",
    )
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["train"]["steps"] == 3
    assert resolved["model"]["name"] == "Ti/4"
    assert resolved == load_config(
        TrainingConfig, REPO / "configs" / "demo.yaml", ["train.steps=3", "schedule.warmup_steps=1"]
    ).model_dump(mode="json")


def test_cli_bad_config_fails_fast_without_ray():
    started = time.monotonic()
    out = _vitray("pretrain", "--set", "cluster.num_workrs=2")
    assert out.returncode == 2
    assert "did you mean 'cluster.num_workers'" in out.stderr
    assert "ray" not in out.stderr.lower().replace("vitray", "")
    assert time.monotonic() - started < 60


def test_missing_dataset_is_named():
    with pytest.raises(ConfigError, match=r"^no config given: pass -c FILE.yaml \(see configs/.*it must set data$"):
        load_config(TrainingConfig, None, [])


def test_backend_choices_and_their_rules():
    assert load_config(TrainingConfig, None, ["data.train=d", "train.backend=xla"]).train.backend == "xla"
    with pytest.raises(ConfigError, match=r"train.backend.*'deepspeed' or 'xla'"):
        load_config(TrainingConfig, None, ["data.train=d", "train.backend=tpu"])
    with pytest.raises(ConfigError, match=r"fp16 is for GPUs"):
        load_config(TrainingConfig, None, ["data.train=d", "train.backend=xla", "precision.dtype=fp16"])
    with pytest.raises(ConfigError, match=r"cluster.tpu=v4-32 needs train.backend=xla"):
        load_config(TrainingConfig, None, ["data.train=d", "cluster.tpu=v4-32", "cluster.gpus_per_worker=0"])


# -- the sections split by concern: old keys refused with the new one ---------------------------


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_an_old_key_is_refused_naming_the_new_one(old, tmp_path):
    hint = MOVED_KEYS[old]
    new = hint.split()[2]  # "moved to optim.lr" / "moved to evals.<name>.every (...)" / "... an evaluator ..."
    if new.startswith(("optim.", "schedule.", "precision.", "checkpoint.", "log.")):
        section, key = new.split(".")
        assert key in TrainingConfig.model_fields[section].annotation.model_fields, new  # the hint names a real key
    for source in ("set", "yaml"):
        section, key = old.split(".")
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump({"data": {"train": "d"}, section: {key: 1} if source == "yaml" else {}}))
        with pytest.raises(ConfigError) as err:
            load_config(TrainingConfig, path, [f"{old}=1"] if source == "set" else [])
        assert f"  {old}: {hint}" in str(err.value).splitlines()


def test_moved_key_hints_say_where_and_show_evals():
    with pytest.raises(ConfigError) as err:
        load_config(TrainingConfig, None, ["data.train=d", "train.lr=0.1", "train.eval_every=100", "train.steps=5"])
    lines = str(err.value).splitlines()
    assert lines[1:] == [
        "  train.lr: moved to optim.lr",
        "  train.eval_every: moved to evals.<name>.every (e.g. evals: {val: {type: val, every: 100, batch_size: 256}})",
    ]
    example = lines[2].split("e.g. ", 1)[1].rstrip(")")
    cfg = load_config(TrainingConfig, None, ["data.train=d", example.replace(": ", "=", 1)])
    assert cfg.evals == {"val": ValEvalConfig(type="val", every=100, batch_size=256)}


# -- evaluators by name ---------------------------------------------------------------------------


def test_evals_are_typed_by_name_and_type():
    cfg = load_config(
        TrainingConfig,
        None,
        [
            "data.train=d",
            "evals.val={type: val, every: 10}",
            "evals.probe={type: fewshot, every: 50, datasets: {digits: /d}, shots: [1, 5], seeds: 2}",
        ],
    )
    assert list(cfg.evals) == ["val", "probe"]
    assert cfg.evals["val"] == ValEvalConfig(type="val", every=10, batch_size=256)
    assert cfg.evals["probe"] == FewshotEvalConfig(
        type="fewshot", every=50, datasets={"digits": "/d"}, shots=[1, 5], seeds=2, batch_size=256
    )
    evaluators = build_evaluators(cfg, rank=0, world_size=1)
    assert [(type(e.evaluator), e.name, e.config.every) for e in evaluators] == [
        (val_evaluator.Evaluator, "val", 10),
        (fewshot_evaluator.Evaluator, "probe", 50),
    ]
    assert load_config(TrainingConfig, None, ["data.train=d"]).evals == {}


@pytest.mark.parametrize(
    "bad, expected",
    [
        ("evals.val={type: top5, every: 10}", r"evals\.val: Input tag 'top5'.*expected tags: 'val', 'fewshot'"),
        ("evals.val={type: val}", r"evals\.val\.every: Field required"),
        ("evals.val={type: val, every: 0}", r"evals\.val\.every: Input should be greater than 0"),
        ("evals.val={type: val, every: 5, shots: [1]}", r"evals\.val\.shots: unknown key"),
        ("evals.probe={type: fewshot, every: 5, datasets: {}}", r"evals\.probe\.datasets: .*at least 1"),
        ("evals.probe={type: fewshot, every: 5, datasets: {d: /d}, shots: [0]}", r"must be positive"),
        ("evals={a/b: {type: val, every: 5}}", r"evaluator name 'a/b' must start with"),
    ],
)
def test_bad_evals_are_refused(bad, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(TrainingConfig, None, ["data.train=d", bad])


def test_masked_patch_refuses_a_val_evaluator():
    base = ["data.train=d", "train.objective=masked_patch"]
    with pytest.raises(
        ConfigError, match=r"evals\.val \(type val\) scores a classifier, but train\.objective=masked_patch"
    ):
        load_config(TrainingConfig, None, [*base, "evals.val={type: val, every: 10}"])
    assert load_config(TrainingConfig, None, [*base, "evals.probe={type: fewshot, every: 10, datasets: {d: /d}}"])


def test_every_evaluator_module_is_a_registered_kind_with_its_config_and_evaluator():
    """A kind is one module of vitray/evaluation/evaluators/ and its line in KINDS: the config's
    union, the reference docs and the loop take them from there."""
    import typing

    from vitray.evaluation import evaluators

    folder = Path(evaluators.__file__).parent
    assert sorted(p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "base")) == sorted(KINDS)
    for kind, module in KINDS.items():
        assert kind == module.KIND and typing.get_args(module.Config.model_fields["type"].annotation) == (kind,)
        assert all(callable(getattr(module.Evaluator, m)) for m in ("run", "uses_worker_processes"))
    union = typing.get_args(typing.get_args(TrainingConfig.model_fields["evals"].annotation)[1])[0]
    assert set(typing.get_args(union)) == {module.Config for module in KINDS.values()}


def test_every_grid_method_module_is_registered_with_its_section_plan_and_runner():
    """A grid method is one module of vitray/evaluation/methods/ and its line in METHODS: the grid
    config's sections, the plan, the reference docs and the grid's runners take them from there."""
    from concurrent.futures import ThreadPoolExecutor

    from vitray.cluster.evaluate import _runners
    from vitray.evaluation import methods
    from vitray.evaluation.config import GridConfig
    from vitray.evaluation.methods import METHODS, TASK, TRAINING_RUN, MethodSection, TaskSection

    folder = Path(methods.__file__).parent
    assert sorted(p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "base")) == sorted(METHODS)
    for name, module in METHODS.items():
        assert name == module.NAME and issubclass(module.Config, MethodSection) and callable(module.plan)
        assert GridConfig.model_fields[name].annotation is module.Config
        assert module.RUNS_AS in (TASK, TRAINING_RUN)
        if module.RUNS_AS == TASK:  # a Ray task per unit of work, asking for its section's resources
            assert issubclass(module.Config, TaskSection) and callable(module.run)
    with ThreadPoolExecutor(1) as pool:
        assert set(_runners(GridConfig(data_root="/d"), pool, verbose=False)) == set(METHODS)


def test_evaluator_metric_names_are_made_in_one_place():
    assert metric_name("val", "top1") == VAL_TOP1 == "val/top1"

    class Constant:
        rank0_only = False

        def run(self, module, forward):
            yield from {"a": 1.0, "b_10shot": 0.5}.items()

    ev = ScheduledEvaluator("probe", ValEvalConfig(type="val", every=4), Constant())
    assert ev(None, Forward(None, None, None), rank=0) == {"probe/a": 1.0, "probe/b_10shot": 0.5}
    assert [s for s in range(1, 11) if ev.due(s, last_step=10)] == [4, 8, 10]


def test_a_rank_0_evaluator_runs_on_the_other_ranks_only_when_the_forward_is_a_collective():
    ran_on = []

    class RankZero:
        rank0_only = True

        def run(self, module, forward):
            ran_on.append(module)
            yield "acc", 1.0

    ev = ScheduledEvaluator("probe", FewshotEvalConfig(type="fewshot", every=1, datasets={"d": "/d"}), RankZero())
    alone, collective = Forward(None, None, None), Forward(None, None, None, collective_forward=True)
    assert ev("rank 1", alone, rank=1) == {} and ran_on == []  # rank 1 goes on training
    assert ev("rank 1", collective, rank=1) == {} and ran_on == ["rank 1"]  # it joins rank 0's forward calls
    assert ev("rank 0", collective, rank=0) == {"probe/acc": 1.0}  # rank 0 alone reports


def test_the_docs_recipe_paths_work_outside_a_checkout(tmp_path, monkeypatch):
    """`-c configs/paper/pretrain_b16_i21k.yaml` as the docs write it, from a folder with no
    `configs/` (vitray installed from a wheel): the recipe installed with vitray. A file of that name
    here wins; a mistyped recipe is refused naming the recipes of its folder."""
    monkeypatch.chdir(tmp_path)
    packaged = load_config(TrainingConfig, "configs/paper/pretrain_b16_i21k.yaml")
    assert packaged == load_config(TrainingConfig, REPO / "configs" / "paper" / "pretrain_b16_i21k.yaml")
    assert load_config(GridConfig, "configs/grid_digits.yaml").benchmarks
    (tmp_path / "configs" / "paper").mkdir(parents=True)
    (tmp_path / "configs" / "paper" / "pretrain_b16_i21k.yaml").write_text("seed: 7\ndata: {train: /d}\n")
    assert load_config(TrainingConfig, "configs/paper/pretrain_b16_i21k.yaml").seed == 7
    with pytest.raises(ConfigError) as refused:
        load_config(TrainingConfig, "configs/paper/pretrain_b16_i21.yaml")
    assert str(refused.value).startswith("config file configs/paper/pretrain_b16_i21.yaml does not exist; ")
    assert "vitray's recipes in configs/paper/: fewshot.yaml, " in str(refused.value)
    assert "pretrain_b16_i21k.yaml" in str(refused.value)
    with pytest.raises(ConfigError, match=r"^config file elsewhere/run.yaml does not exist$"):
        load_config(TrainingConfig, "elsewhere/run.yaml")


@pytest.mark.parametrize(
    "override, message",
    [
        # .inf passes every ge/gt bound: each of these trained nothing, NaN'd every loss or failed in
        # the workers after Ray started (a restart spent on an error that recurs).
        ("optim.eps=.inf", "optim.eps: Input should be a finite number"),
        ("train.mixup_alpha=.inf", "train.mixup_alpha: Input should be a finite number"),
        ("optim.lr=.inf", "optim.lr: Input should be a finite number"),
        ("evals={val: {type: val, every: 2, resize_ratio: .inf}}", "evals.val.resize_ratio: Input should be a finite"),
        ("data.resize_ratio=.nan", "data.resize_ratio: Input should be a finite number"),
        ("run.preemption_grace_s=.inf", "run.preemption_grace_s: Input should be a finite number"),
        ("seed=99999999999999999999", "seed: Input should be less than or equal to 9223372036854775807"),
        ("run.storage=", "run.storage: is empty: give a local folder or an s3:// URL"),
        ("cluster.resources_per_worker={foo: -1}", "cluster.resources_per_worker.foo: Input should be greater than or"),
        ("run.storage=http://host/runs", "run.storage: http://host/runs: vitray reads and writes local paths"),
    ],
)
def test_values_no_run_can_use_are_refused_with_the_config(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(TrainingConfig, None, ["data.train=/data", override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("fewshot.l2_reg=.inf", 'fewshot.l2_reg: must be a positive number or "select", got inf'),
        ("fewshot.l2_reg=Select", "fewshot.l2_reg: must be a positive number or \"select\", got 'Select'"),
        ("finetune.learning_rates=[.nan]", "finetune.learning_rates.0: Input should be a finite number"),
        ("output=' '", "output: is empty"),
    ],
)
def test_grid_values_no_cell_can_use_are_refused_in_one_line_each(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        load_config(GridConfig, None, ["data_root=/data", override])
    assert len(str(refused.value).splitlines()) == 2  # the header and one line: not one per union branch


def test_a_whole_number_l2_given_as_text_is_taken():
    grid = load_config(GridConfig, None, ["data_root=/data", "fewshot.l2_reg=1e3"])
    assert grid.fewshot.l2_reg == 1000.0


@pytest.mark.parametrize("name", ["''", "a/b"])
def test_a_fewshot_dataset_name_that_makes_no_metric_name_is_refused(name):
    with pytest.raises(ConfigError, match=r"dataset name .* must start with a letter or digit .*names the probe's"):
        load_config(
            TrainingConfig,
            None,
            ["data.train=/data", f"evals.fs={{type: fewshot, every: 2, datasets: {{{name}: /d}}}}"],
        )
