"""The config loader and the CLI's refusal of bad configs, before anything heavy starts."""

from __future__ import annotations

import functools
import operator
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from vitray.common.config import ConfigError, load_config
from vitray.trainers.config import PretrainConfig

REPO = Path(__file__).resolve().parents[1]
# Run recipes (pre-training and fine-tuning); grid_*.yaml are evaluation grids, checked in test_evaluate.
CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith("grid_"))


def test_yaml_and_overrides_are_typed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"steps": 7, "lr": 0.5}, "run": {"name": "a"}, "data": {"train": "d"}}))
    cfg = load_config(PretrainConfig, path, ["train.lr=1e-4", "run.name=b", "train.ema_decay=0.99", "seed=3"])
    assert cfg.train.steps == 7
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.run.name == "b"
    assert cfg.train.ema_decay == pytest.approx(0.99)
    assert cfg.seed == 3


def test_typo_suggests_the_closest_key():
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, None, ["train.setps=5"])
    message = str(err.value)
    assert "train.setps" in message and "did you mean 'train.steps'" in message


def test_typo_in_section_name():
    with pytest.raises(ConfigError, match=r"did you mean 'train'"):
        load_config(PretrainConfig, None, ["trian.steps=5"])


def test_bad_value_names_key_value_and_what_is_allowed():
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, None, ["train.precision=fp8"])
    message = str(err.value)
    assert "train.precision" in message and "'fp8'" in message
    assert "fp32" in message and "bf16" in message


def test_wrong_type():
    with pytest.raises(ConfigError, match=r"train\.steps.*'many'"):
        load_config(PretrainConfig, None, ["train.steps=many"])


def test_batch_must_divide_into_micro_batches_and_workers():
    with pytest.raises(ConfigError, match=r"train.batch_size=100 must be a multiple"):
        load_config(
            PretrainConfig,
            None,
            ["data.train=d", "train.batch_size=100", "train.micro_batch_size=16", "cluster.num_workers=2"],
        )


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(PretrainConfig, None, ["train.steps"])
    with pytest.raises(ConfigError, match="is a value"):
        load_config(PretrainConfig, None, ["seed=1", "seed.x=1"])


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_validate(path):
    cfg = load_config(PretrainConfig, path)
    assert type(cfg) is PretrainConfig
    resolved = cfg.model_dump(mode="json")
    for key, value in leaves(yaml.safe_load(path.read_text())):  # each value set is the value the run gets
        assert functools.reduce(operator.getitem, key, resolved) == value, ".".join(key)


def leaves(tree: dict, prefix: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _vitray(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vitray.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_dry_run_prints_resolved_config():
    out = _vitray("pretrain", "-c", str(REPO / "configs" / "demo.yaml"), "--set", "train.steps=3", "--dry-run")
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["train"]["steps"] == 3
    assert resolved["model"]["name"] == "Ti/4"
    assert resolved == load_config(PretrainConfig, REPO / "configs" / "demo.yaml", ["train.steps=3"]).model_dump(mode="json")


def test_cli_bad_config_fails_fast_without_ray():
    started = time.monotonic()
    out = _vitray("pretrain", "--set", "cluster.num_workrs=2")
    assert out.returncode == 2
    assert "did you mean 'cluster.num_workers'" in out.stderr
    assert "ray" not in out.stderr.lower().replace("vitray", "")
    assert time.monotonic() - started < 60


def test_missing_dataset_is_named():
    with pytest.raises(ConfigError, match=r"data: Field required"):
        load_config(PretrainConfig, None, [])


def test_backend_choices_and_their_rules():
    assert load_config(PretrainConfig, None, ["data.train=d", "train.backend=xla"]).train.backend == "xla"
    with pytest.raises(ConfigError, match=r"train.backend.*'deepspeed' or 'xla'"):
        load_config(PretrainConfig, None, ["data.train=d", "train.backend=tpu"])
    with pytest.raises(ConfigError, match=r"fp16 is for GPUs"):
        load_config(PretrainConfig, None, ["data.train=d", "train.backend=xla", "train.precision=fp16"])
    with pytest.raises(ConfigError, match=r"cluster.tpu=v4-32 needs train.backend=xla"):
        load_config(PretrainConfig, None, ["data.train=d", "cluster.tpu=v4-32", "cluster.gpus_per_worker=0"])
