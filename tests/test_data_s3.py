"""Preparing to and reading from S3 (a moto server on 127.0.0.1), through data/storage.py."""

from __future__ import annotations

import itertools

import boto3
import pytest
import torch

from vitray.data import EvalLoader, ShardLoader, prepare_dataset, read_dataset_info, read_manifest, storage


def test_s3_round_trip_matches_local(moto_server, digits_dataset):
    dest = moto_server.url("datasets", "digits")
    info = prepare_dataset("builtin:digits", dest, samples_per_shard=100)
    assert info == read_dataset_info(str(digits_dataset))

    # The objects are the local shards, byte for byte, and the manifest agrees.
    s3 = boto3.client("s3", endpoint_url=moto_server.endpoint_url)
    listed = s3.list_objects_v2(Bucket=moto_server.bucket, Prefix="datasets/digits/")["Contents"]
    assert {o["Key"].rsplit("/", 1)[1] for o in listed} == {p.name for p in digits_dataset.iterdir()}
    for row in read_manifest(dest, "test"):
        body = s3.get_object(Bucket=moto_server.bucket, Key=f"datasets/digits/{row.name}")["Body"].read()
        assert body == (digits_dataset / row.name).read_bytes()

    # Training batches from S3 (two worker processes) equal those from local disk.
    def batches(path, workers):
        data_loader = ShardLoader(str(path), "train", rank=0, world_size=1, batch_size=16, img_size=8, train=True,
                                  seed=0, num_workers=workers, shuffle_buffer=64)  # fmt: skip
        return list(itertools.islice(data_loader, 5))

    remote, local = batches(dest, 2), batches(digits_dataset, 0)
    assert [b.keys for b in remote] == [b.keys for b in local]
    assert all(torch.equal(r.images, lo.images) for r, lo in zip(remote, local))

    evaluated = [k for b in EvalLoader(dest, "test", batch_size=100, img_size=8, num_workers=0) for k in b.keys]
    assert len(evaluated) == 360

    # Already prepared: nothing is rewritten.
    assert prepare_dataset("builtin:digits", dest, samples_per_shard=7) == info


def test_s3_errors_name_the_path(moto_server):
    with pytest.raises(FileNotFoundError, match="not prepared or still being written"):
        read_dataset_info(moto_server.url("nothing-here"))
    dest = moto_server.url("partial")
    storage.write_bytes_atomic(storage.join(dest, "train-000000.tar"), b"x")
    with pytest.raises(FileNotFoundError, match=f"no dataset.json at {dest}"):
        ShardLoader(dest, "train", rank=0, world_size=1, batch_size=8, img_size=8, train=True, seed=0)


def test_explicit_storage_options_reach_the_store(moto_server, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    path = moto_server.url("explicit", "blob.bin")
    storage.write_bytes_atomic(path, b"payload", moto_server.storage_options)
    assert storage.read_bytes(path, moto_server.storage_options) == b"payload"
    assert storage.exists(path, moto_server.storage_options)
