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
    # A private instance: without an address Ray would join another test's `ray start` cluster
    # running on this machine at the same time (the suite runs on two workers).
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_ray_prepare_equals_serial_prepare(local_ray, digits_dataset, tmp_path, capsys):
    dest = tmp_path / "digits"
    info = prepare_dataset_on_ray("builtin:digits", str(dest), samples_per_shard=100)
    assert info == read_dataset_info(str(digits_dataset))
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == {
        p.name: p.read_bytes() for p in digits_dataset.iterdir()
    }
    assert "1797/1797" in capsys.readouterr().out  # the progress bar counted every image

    prepare_dataset_on_ray("builtin:digits", str(dest))
    assert "already prepared" in capsys.readouterr().out


@pytest.mark.slow
def test_ray_prepare_treats_bad_images_like_the_serial_one(local_ray, tmp_path, capsys):
    from test_cli_prepare_refusals import image_folder, with_bad_images

    from vitray.data import BadImagesError, prepare_dataset, read_manifest

    src = image_folder(tmp_path / "src")
    bad = with_bad_images(src)
    with pytest.raises(BadImagesError) as on_ray:
        prepare_dataset_on_ray(f"imagefolder:{src}", str(tmp_path / "ray"), samples_per_shard=3, show_progress=False)
    with pytest.raises(BadImagesError) as serial:
        prepare_dataset(f"imagefolder:{src}", str(tmp_path / "serial"), samples_per_shard=3)
    assert str(on_ray.value) == str(serial.value) and str(bad[0]) in str(on_ray.value)
    assert not (tmp_path / "ray" / "dataset.json").exists()

    for dest, prepare in (("ray", prepare_dataset_on_ray), ("serial", prepare_dataset)):
        capsys.readouterr()
        prepare(f"imagefolder:{src}", str(tmp_path / dest), samples_per_shard=3, bad_images="skip")
        assert "skipped 2 bad images" in capsys.readouterr().out
    assert read_manifest(str(tmp_path / "ray"), "train") == read_manifest(str(tmp_path / "serial"), "train")
