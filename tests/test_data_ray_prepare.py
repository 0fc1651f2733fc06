"""Shard writing fanned out as Ray tasks gives exactly what the serial preparation gives."""

from __future__ import annotations

import pytest
import ray

from vitray.cluster.prepare import prepare_dataset_on_ray
from vitray.data import read_dataset_info


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():  # another module's Ray instance: use it, leave it running
        yield
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_ray_prepare_equals_serial_prepare(local_ray, digits_dataset, tmp_path, capsys):
    dest = tmp_path / "digits"
    info = prepare_dataset_on_ray("builtin:digits", str(dest), samples_per_shard=100)
    assert info == read_dataset_info(str(digits_dataset))
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == {p.name: p.read_bytes() for p in digits_dataset.iterdir()}
    assert "1797/1797" in capsys.readouterr().out  # the progress bar counted every image

    prepare_dataset_on_ray("builtin:digits", str(dest))
    assert "already prepared" in capsys.readouterr().out
