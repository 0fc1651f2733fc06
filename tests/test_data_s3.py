"""Preparing to and reading from S3 (SeaweedFS on 127.0.0.1), through vitray.storage (storage/)."""

from __future__ import annotations

import itertools

import boto3
import pytest
import torch

from vitray import storage
from vitray.data import EvalLoader, ShardLoader, prepare_dataset, read_dataset_info, read_manifest


def test_s3_round_trip_matches_local(seaweed_s3, digits_dataset):
    dest = seaweed_s3.url("datasets", "digits")
    info = prepare_dataset("builtin:digits", dest, samples_per_shard=100)
    assert info == read_dataset_info(str(digits_dataset))

    # The objects are the local shards, byte for byte, and the manifest agrees.
    s3 = boto3.client("s3", endpoint_url=seaweed_s3.endpoint_url)
    listed = s3.list_objects_v2(Bucket=seaweed_s3.bucket, Prefix="datasets/digits/")["Contents"]
    assert {o["Key"].rsplit("/", 1)[1] for o in listed} == {p.name for p in digits_dataset.iterdir()}
    for row in read_manifest(dest, "test"):
        body = s3.get_object(Bucket=seaweed_s3.bucket, Key=f"datasets/digits/{row.name}")["Body"].read()
        assert body == (digits_dataset / row.name).read_bytes()

    # Training batches from S3 (two worker processes) equal those from local disk.
    def batches(path, workers):
        data_loader = ShardLoader(
            str(path),
            "train",
            rank=0,
            world_size=1,
            batch_size=16,
            img_size=8,
            train=True,
            seed=0,
            num_workers=workers,
            shuffle_buffer=64,
        )
        return list(itertools.islice(data_loader, 5))

    remote, local = batches(dest, 2), batches(digits_dataset, 0)
    assert [b.keys for b in remote] == [b.keys for b in local]
    assert all(torch.equal(r.images, lo.images) for r, lo in zip(remote, local))

    evaluated = [k for b in EvalLoader(dest, "test", batch_size=100, img_size=8, num_workers=0) for k in b.keys]
    assert len(evaluated) == 360

    # Already prepared: nothing is rewritten.
    assert prepare_dataset("builtin:digits", dest, samples_per_shard=7) == info


def test_s3_errors_name_the_path(seaweed_s3):
    with pytest.raises(FileNotFoundError, match="not prepared or still being written"):
        read_dataset_info(seaweed_s3.url("nothing-here"))
    dest = seaweed_s3.url("partial")
    storage.write_bytes_atomic(storage.join(dest, "train-000000.tar"), b"x")
    with pytest.raises(FileNotFoundError, match=f"no dataset.json at {dest}"):
        ShardLoader(dest, "train", rank=0, world_size=1, batch_size=8, img_size=8, train=True, seed=0)


def test_explicit_storage_options_reach_the_store(seaweed_s3, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    path = seaweed_s3.url("explicit", "blob.bin")
    storage.write_bytes_atomic(path, b"payload", seaweed_s3.storage_options)
    assert storage.read_bytes(path, seaweed_s3.storage_options) == b"payload"
    assert storage.exists(path, seaweed_s3.storage_options)


def test_shard_cache_fetches_whole_shards_in_parallel_ranges_and_stays_bounded(
    seaweed_s3, digits_dataset, tmp_path, monkeypatch
):
    dest = seaweed_s3.url("datasets", "digits")
    prepare_dataset("builtin:digits", dest, samples_per_shard=100)
    rows = read_manifest(dest, "train")
    largest = max(r.bytes for r in rows)
    monkeypatch.setattr(storage.shard_cache, "CACHE_PART_BYTES", 4096)  # many ranges per shard, several groups of them
    cache_dir = tmp_path / "cache"

    def batches(path, workers, steps, **kwargs):
        data_loader = ShardLoader(
            str(path),
            "train",
            rank=0,
            world_size=1,
            batch_size=16,
            img_size=8,
            train=True,
            seed=0,
            num_workers=workers,
            shuffle_buffer=64,
            **kwargs,
        )
        return list(itertools.islice(data_loader, steps))

    # Bounded to about two and a half shards: the slots' shards come and go, the folder never holds more.
    bound_gb = 2.5 * largest / 2**30
    cached = batches(dest, 2, 30, shard_cache=str(cache_dir), shard_cache_gb=bound_gb)
    local = batches(digits_dataset, 0, 30)
    assert [b.keys for b in cached] == [b.keys for b in local]
    assert all(torch.equal(c.images, lo.images) for c, lo in zip(cached, local))
    files = list(cache_dir.iterdir())
    assert files and all(not f.name.startswith(".") for f in files)  # no partial copy left behind
    assert sum(f.stat().st_size for f in files) <= bound_gb * 2**30  # the 8 slots read 10+ shards: some were evicted
    assert len(files) <= bound_gb * 2**30 // min(r.bytes for r in rows) < len(rows)

    # What the cache holds is the object, byte for byte; with the bucket emptied, reads are served
    # from the cache alone (environment variables configure it too).
    s3 = boto3.client("s3", endpoint_url=seaweed_s3.endpoint_url)
    cache = storage.ShardCache(str(cache_dir), 2**30)
    for row in rows[:3]:
        url = storage.join(dest, row.name)
        with cache.open(url) as f:
            assert f.read() == (digits_dataset / row.name).read_bytes()
    monkeypatch.setenv("VITRAY_SHARD_CACHE", str(cache_dir))
    monkeypatch.setenv("VITRAY_SHARD_CACHE_GB", "1")
    whole = batches(dest, 0, 8)  # caches every shard these batches read
    for row in rows:
        s3.delete_object(Bucket=seaweed_s3.bucket, Key=f"datasets/digits/{row.name}")
    assert [b.keys for b in batches(dest, 0, 8)] == [b.keys for b in whole]


def test_s3_slowdown_and_server_errors_are_retried():
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    for code in ("SlowDown", "ServiceUnavailable", "InternalError", "503"):
        error = translate_boto_error(ClientError({"Error": {"Code": code, "Message": "slow"}}, "GetObject"))
        assert storage.is_transient(error), code
    # A missing object, a refusal, and a request the store refuses as invalid (a multipart part
    # under S3's 5 MiB least, as SeaweedFS answers it): the same request fails again.
    for code in ("NoSuchKey", "AccessDenied", "EntityTooSmall", "InvalidArgument", "400", "NotImplemented"):
        error = translate_boto_error(ClientError({"Error": {"Code": code, "Message": "no"}}, "GetObject"))
        assert not storage.is_transient(error), code


def test_the_command_line_prepares_into_a_new_prefix(seaweed_s3, monkeypatch):
    """`vitray data prepare SRC s3://...` as docs/deploy.md shows it: its write probe (an object put
    and removed) leaves SeaweedFS a folder entry for the prefix, which was listed as a file named
    like the folder and refused as someone else's ("is not empty and is not a vitray dataset")."""
    from typer.testing import CliRunner

    from vitray.cli.main import app

    monkeypatch.setenv("COLUMNS", "1000")
    dest = seaweed_s3.url("data", "digits")
    result = CliRunner().invoke(app, ["data", "prepare", "builtin:digits", dest, "--serial"])
    assert result.exit_code == 0, result.output
    assert read_dataset_info(dest).splits["train"].num_samples == 1437
    assert storage.list_names(dest) == sorted(storage.list_names(dest))  # (a listing, no error)
    assert "dataset.json" in storage.list_names(dest) and "digits" not in storage.list_names(dest)
