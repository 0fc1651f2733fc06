"""storage.s3_client on a real S3 store (SeaweedFS): the blocking botocore client that a checkpoint's
parts and ranges go through is the one of the filesystem at hand, sends what s3fs would add to a
request, and raises the store's answers as s3fs does."""

from __future__ import annotations

import pytest

from vitray import storage
from vitray.storage import s3_client


def test_a_filesystem_made_anew_after_the_endpoint_moved_gets_a_client_of_its_own(seaweed_s3, monkeypatch):
    """fsspec filesystems compare equal by their options: one made after AWS_ENDPOINT_URL changed
    (the instance cache cleared) equals the old one, and must not get the old one's client."""
    import s3fs

    first, _ = storage.filesystem(seaweed_s3.url("runs"))
    client = s3_client.sync_client(first, connections=10)
    assert s3_client.sync_client(first, connections=10) is client  # built once per filesystem
    assert client.meta.endpoint_url == seaweed_s3.endpoint_url
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        second, _ = storage.filesystem(seaweed_s3.url("runs"))
        assert second == first and second is not first
        assert s3_client.sync_client(second, connections=10).meta.endpoint_url == "http://127.0.0.1:9"
        assert s3_client.sync_client(second, connections=20).meta.config.max_pool_connections == 20
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_requests_carry_s3fs_extra_arguments_and_errors_come_as_s3fs_raises_them(seaweed_s3):
    """`s3_additional_kwargs` go with the requests that take them (and not with those that do
    not); a missing object is FileNotFoundError, an upload that does not exist an OSError that is not
    taken for an outage."""
    import s3fs

    fs = s3fs.S3FileSystem(s3_additional_kwargs={"Metadata": {"written-by": "vitray"}})
    client = s3_client.sync_client(fs, connections=10)
    bucket = seaweed_s3.bucket
    s3_client.call(fs, client, "put_object", Bucket=bucket, Key="meta.bin", Body=b"0123456789")
    assert client.head_object(Bucket=bucket, Key="meta.bin")["Metadata"] == {"written-by": "vitray"}
    # get_object takes no Metadata: left out, not refused
    assert storage.read_range(fs, f"{bucket}/meta.bin", 2, 6, threads=4) == b"2345"
    with pytest.raises(FileNotFoundError):
        storage.read_range(fs, f"{bucket}/missing.bin", 0, 4, threads=4)
    with pytest.raises(OSError) as refused:
        s3_client.call(fs, client, "complete_multipart_upload", Bucket=bucket, Key="meta.bin", UploadId="no-such")
    assert not storage.is_transient(refused.value)  # an answer, not an outage: not ridden out


def test_an_upload_killed_midway_leaves_a_staging_file_the_next_process_removes(seaweed_s3, tmp_path):
    """A shard or checkpoint file bound for S3 is staged in the temp folder; kill -9 leaves it there
    (hundreds of MB each), and the next process that uploads removes it."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    write = (
        "import sys, time; from vitray import storage\n"
        "with storage.atomic_write(sys.argv[1]) as f:\n"
        "    f.write(b'x' * 2**20); f.flush(); print('staged', flush=True)\n"
        "    time.sleep(60 if sys.argv[2] == 'hold' else 0)\n"
    )
    held = subprocess.Popen(
        [sys.executable, "-c", write, seaweed_s3.url("held.bin"), "hold"], env=env, stdout=subprocess.PIPE, text=True
    )
    assert held.stdout.readline().strip() == "staged"
    os.kill(held.pid, signal.SIGKILL)
    held.wait()
    (orphan,) = [p for p in tmp_path.iterdir() if p.name.startswith(f"vitray-upload-{held.pid}-")]
    assert orphan.stat().st_size == 2**20
    mine = tmp_path / f"vitray-upload-{os.getpid()}-running"  # a running process's: kept
    mine.write_bytes(b"")
    done = subprocess.run([sys.executable, "-c", write, seaweed_s3.url("next.bin"), "go"], env=env, timeout=120)
    assert done.returncode == 0
    assert storage.read_bytes(seaweed_s3.url("next.bin")) == b"x" * 2**20
    assert sorted(p.name for p in tmp_path.iterdir()) == [mine.name]
