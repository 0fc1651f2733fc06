"""A blocking botocore client for the S3 store an s3fs filesystem reaches, for work spread over
threads.

Why not s3fs's own client: s3fs runs every request of a process on one event-loop thread, which
signs each request -- on plain HTTP SigV4 hashes the whole body -- and sends it. For a checkpoint's
parts that thread is the ceiling: 8 MiB parts kept 10 in flight through it went up at 0.72-0.84x
the rate of boto3's TransferManager, which spreads the same work over 10 threads. The client made
here is built from the same settings s3fs builds its own from (keys, endpoint, `client_kwargs`,
`config_kwargs`, session options; otherwise the standard AWS configuration botocore reads itself),
sends what s3fs would add to each request (`s3_additional_kwargs`, requester-pays), and turns the
store's error answers into the OSErrors s3fs raises, so that `is_transient` and `ride_out` treat
its failures as they treat s3fs's. botocore's clients are safe to share between threads.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

# One client per s3fs filesystem object: building one reads botocore's service model (~0.1 s of
# CPU). Kept by the object's identity: fsspec filesystems compare equal by their options, so a
# filesystem made anew after its environment changed (fsspec's instance cache cleared once
# AWS_ENDPOINT_URL points elsewhere) would otherwise get the old one's client.
_clients: dict[int, tuple[weakref.ref, Any]] = {}
_clients_lock = threading.RLock()  # re-entered when a collection inside `sync_client` drops a filesystem


def is_s3(fs) -> bool:
    """Whether `fs` is an s3fs filesystem (one this module's client can stand in for)."""
    return hasattr(fs, "_call_s3")


def sync_client(fs, *, connections: int) -> Any:
    """The botocore S3 client for `fs` (an s3fs filesystem), with at least `connections` pooled
    HTTP connections."""
    key = id(fs)
    with _clients_lock:
        owner, client = _clients.get(key, (None, None))
        if owner is None or owner() is not fs or client.meta.config.max_pool_connections < connections:
            client = _build(fs, connections)
            _clients[key] = (weakref.ref(fs, lambda _: _forget(key)), client)
        return client


def _forget(key: int) -> None:
    with _clients_lock:
        owner, _ = _clients.get(key, (None, None))
        if owner is not None and owner() is None:
            del _clients[key]


def _build(fs, connections: int) -> Any:
    import botocore.config
    import botocore.session

    client_kwargs = dict(fs.client_kwargs)
    settings = {
        "aws_access_key_id": fs.key,
        "aws_secret_access_key": fs.secret,
        "aws_session_token": fs.token,
        "endpoint_url": fs.endpoint_url,
    }
    settings = {k: v for k, v in settings.items() if v is not None and v != client_kwargs.get(k)}
    client_kwargs.setdefault("use_ssl", fs.use_ssl)
    config = {"connect_timeout": fs.connect_timeout, "read_timeout": fs.read_timeout, **fs.config_kwargs}
    config["max_pool_connections"] = max(connections, config.get("max_pool_connections") or 0)
    if fs.anon:
        from botocore import UNSIGNED

        settings = {k: v for k, v in settings.items() if not k.startswith("aws_")}
        client_kwargs = {k: v for k, v in client_kwargs.items() if not k.startswith("aws_")}
        config["signature_version"] = UNSIGNED
    session = botocore.session.Session(**fs.kwargs)
    return session.create_client("s3", config=botocore.config.Config(**config), **settings, **client_kwargs)


def call(fs, client, method: str, **kwargs) -> dict[str, Any]:
    """`client.<method>(**kwargs)` with what s3fs adds to its requests of that kind; an error answer
    from the store raised as s3fs raises it (an OSError: FileNotFoundError, PermissionError, an
    errno EINVAL for a request the store refuses as invalid, ...)."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    extra = {**fs.s3_additional_kwargs, **fs.req_kw}
    if extra:
        operation = client.meta.service_model.operation_model(client.meta.method_to_api_mapping[method])
        accepted = operation.input_shape.members
        kwargs = {**{k: v for k, v in extra.items() if k in accepted and v is not None}, **kwargs}
    try:
        return getattr(client, method)(**kwargs)
    except ClientError as error:
        raise translate_boto_error(error) from error


def read_range(fs, fs_path: str, start: int, end: int, *, connections: int) -> bytes:
    """Bytes `start` to `end` (exclusive) of the object at `fs_path` on the S3 store `fs` reaches,
    through `sync_client(fs, connections=connections)`: one ranged GET, on the caller's thread."""
    bucket, key, version = fs.split_path(fs_path)
    client = sync_client(fs, connections=connections)
    kwargs = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
    if version:
        kwargs["VersionId"] = version
    return call(fs, client, "get_object", **kwargs)["Body"].read()
