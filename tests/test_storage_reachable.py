"""check_reachable: one quick probe of a storage path, one line naming the cause and the fix.

Against a real S3 store (SeaweedFS) on 127.0.0.1 (tests/conftest.py): no credentials, a missing bucket, a
closed port, a prefix with nothing under it; and local paths. Each case must answer in seconds.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest

from vitray.storage import StorageUnreachable, check_reachable, write_bytes_atomic

# A refusal must come from the one probe, not from a retry loop.
FAST_S = 8.0


def _refusal(url: str, **kwargs) -> StorageUnreachable:
    start = time.monotonic()
    with pytest.raises(StorageUnreachable) as caught:
        check_reachable(url, **kwargs)
    assert time.monotonic() - start < FAST_S
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    return caught.value


def test_storage_unreachable_is_a_value_error() -> None:
    # The CLI's `except ValueError` handlers report bad input with exit 2 and no traceback.
    assert issubclass(StorageUnreachable, ValueError)


def test_reachable_bucket_and_existing_prefix_pass(seaweed_s3) -> None:
    check_reachable(seaweed_s3.url("new", "prefix"))  # nothing there yet: fine for a destination
    write_bytes_atomic(seaweed_s3.url("data", "dataset.json"), b"{}")
    check_reachable(seaweed_s3.url("data"), must_exist=True)
    check_reachable(seaweed_s3.url("data", "dataset.json"), must_exist=True)  # an object, not a prefix
    check_reachable(seaweed_s3.url("new"), storage_options=seaweed_s3.storage_options)


def test_missing_prefix_when_it_must_exist(seaweed_s3) -> None:
    error = _refusal(seaweed_s3.url("nothing-here"), must_exist=True)
    assert error.cause == "missing" and "nothing-here" in str(error)


def test_no_credentials(seaweed_s3, monkeypatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role lookup (169.254.169.254)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    error = _refusal(seaweed_s3.url("runs"))
    assert error.cause == "no-credentials"
    assert "no credentials" in str(error) and "AWS_ACCESS_KEY_ID" in str(error)


def test_missing_bucket(seaweed_s3) -> None:
    error = _refusal("s3://no-such-bucket-vitray/runs")
    assert error.cause == "no-bucket"
    assert "no-such-bucket-vitray" in str(error) and "create it" in str(error)


def test_unreachable_endpoint(seaweed_s3, monkeypatch) -> None:
    with socket.socket() as s:  # a port nothing listens on once this socket is closed
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    error = _refusal(seaweed_s3.url("runs"))
    assert error.cause == "unreachable"
    assert closed in str(error) and "AWS_ENDPOINT_URL" in str(error)


def test_local_paths(tmp_path: Path) -> None:
    check_reachable(str(tmp_path / "new"))  # a destination to be made inside an existing folder
    check_reachable(str(tmp_path), must_exist=True)
    check_reachable(f"file://{tmp_path}", must_exist=True)
    error = _refusal(str(tmp_path / "absent"), must_exist=True)
    assert error.cause == "missing" and "absent does not exist" in str(error)
    error = _refusal(str(tmp_path / "no-parent" / "dest"))
    assert "parent folder" in str(error) and "no-parent" in str(error)


def test_a_busy_store_is_asked_again_before_it_is_said_to_be_busy(seaweed_s3, monkeypatch) -> None:
    """S3 throttles with SlowDown (503): the probe took it for a refused path ("check the URL and the
    credentials") and a run was refused on one busy answer. It asks again; a store busy every time
    is said to be busy, not wrong."""
    from s3_proxy import FlakyS3Proxy

    from vitray.storage import reachable

    monkeypatch.setattr(reachable, "BUSY_RETRY_DELAYS_S", (0.01, 0.01, 0.01))
    busy = FlakyS3Proxy(seaweed_s3.endpoint_url, rate=1.0, faults=("slowdown",)).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", busy.url)
        error = _refusal(seaweed_s3.url("runs"))
        assert busy.requests and sum(busy.injected.values()) == 4  # the first answer and three more
        assert error.cause == "unreachable" and "answered" in str(error) and "SlowDown" in str(error)
        assert "4 times in a row: it is busy or failing" in str(error) and "credentials" not in str(error)
        busy.rate = 0.5  # now and then busy: the probe gets through
        check_reachable(seaweed_s3.url("runs"))
    finally:
        busy.stop()


def test_an_endpoint_that_is_not_an_s3_api_is_named_as_a_possible_cause(seaweed_s3, monkeypatch, tmp_path) -> None:
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))  # 404 for all
    handler.log_message = lambda *args: None
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        web = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("AWS_ENDPOINT_URL", web)
        try:
            error = _refusal(seaweed_s3.url("runs"))
        finally:
            server.shutdown()
    assert web in str(error) and "AWS_ENDPOINT_URL) if it is not an S3 API" in str(error), str(error)


def test_credentials_that_may_read_but_not_write_are_refused_where_writing_is_asked(
    seaweed_s3, seaweed_store, monkeypatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed_store.read_only_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed_store.read_only_secret)
    check_reachable(seaweed_s3.url("runs"))  # reading and listing: allowed
    error = _refusal(seaweed_s3.url("runs"), writable=True)
    assert error.cause == "read-only"
    assert f"may read {seaweed_s3.url('runs')} but not write there" in str(error) and "s3:PutObject" in str(error)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed_store.access_key)  # these write, and the check leaves nothing
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed_store.secret_key)
    check_reachable(seaweed_s3.url("runs"), writable=True)
    assert "Contents" not in seaweed_store.client().list_objects_v2(Bucket=seaweed_s3.bucket)


def test_credentials_in_an_s3_url_are_refused_and_never_said(tmp_path: Path) -> None:
    """`s3://KEY:SECRET@bucket/...`: s3fs took `KEY:SECRET@bucket` for a bucket's name and the store's
    error quoted it, secret and all, on the console and in the traceback file. Refused (the probe,
    and any other opening of the path), the credentials masked, and through the command line in one line."""
    from typer.testing import CliRunner

    from vitray import storage
    from vitray.cli.main import app

    url = "s3://AKIDaudit:SECRETvalue9@vit/runs"
    refused = _refusal(url)
    assert refused.cause == "credentials-in-url" and refused.url == "s3://***@vit/runs"
    with pytest.raises(StorageUnreachable, match=r"^s3://\*\*\*@vit/runs/x: vitray takes no credentials"):
        storage.filesystem(f"{url}/x")
    assert storage.filesystem("s3://vit/runs/user@example")[1] == "vit/runs/user@example"  # an @ in a key is a name
    for command in (["runs", url], ["data", "verify", url]):
        result = CliRunner().invoke(app, command)
        said = result.stdout + (result.stderr or "")
        assert result.exit_code == 2 and "SECRETvalue9" not in said and "AKIDaudit" not in said, said
        assert said.startswith("error: s3://***@vit/runs: vitray takes no credentials in an s3:// URL"), said


def test_rejected_credentials_are_named_where_they_were_given(seaweed_s3, monkeypatch) -> None:
    """A wrong secret in `storage_options`, the environment's keys good: the refusal named the
    environment's variables, which were not used (the options' credentials come first)."""
    given = {**seaweed_s3.storage_options, "secret": "not-the-secret"}
    error = _refusal(seaweed_s3.url("runs"), storage_options=given)
    assert error.cause == "bad-credentials" and "storage_options given for it" in str(error)
    assert "AWS_SECRET_ACCESS_KEY" not in str(error)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    error = _refusal(seaweed_s3.url("runs"))
    assert error.cause == "bad-credentials" and "AWS_SECRET_ACCESS_KEY" in str(error)


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("s3:/bucket/x", "s3:/bucket/x: a URL's scheme is followed by '://'; as written it names a local folder s3: "),
        ("s3:bucket/x", "Write s3://bucket/x for the store"),
        ("S3://bkt/runs", "S3://bkt/runs: write s3:// in lower case: s3://bkt/runs"),
        ("gs://bkt/x", "gs://bkt/x: vitray reads and writes local paths and s3:// URLs"),
        ("https://bkt.s3.eu-west-1.amazonaws.com/runs", "an S3 bucket's web address: write it s3://bkt/runs"),
        ("abfs://me:hunter22@store/x", "abfs://me:***@store/x: vitray reads and writes local paths"),
    ],
)
def test_a_path_that_is_no_local_path_nor_an_s3_url_is_refused_saying_what_was_meant(path, said, tmp_path) -> None:
    """`s3:/bucket` (one slash) named a local folder `s3:`: data and checkpoints meant for the store
    stayed on this machine, exit 0; `S3://`, `gs://`, `https://` failed inside fsspec as crashes."""
    from vitray import storage
    from vitray.common.config import ConfigError, load_config
    from vitray.trainers.config import TrainingConfig

    for check in (storage.absolute, storage.filesystem, check_reachable):
        with pytest.raises(StorageUnreachable) as refused:
            check(path)
        assert (
            said in str(refused.value) and refused.value.cause == "unsupported" and "hunter22" not in str(refused.value)
        )
    with pytest.raises(ConfigError, match=re.escape(said)):  # a config's path, before anything runs
        load_config(TrainingConfig, None, [f"data.train={tmp_path}", f"run.storage={path}"])
    for fine in ("s3://bucket/x", f"file://{tmp_path}", str(tmp_path / "a:b"), "relative/folder"):
        storage.absolute(fine)
