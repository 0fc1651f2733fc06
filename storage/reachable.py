"""Is a storage path usable, asked once and quickly, before anything expensive starts?

The S3 clients vitray reads and writes through retry every request for tens of seconds and end
in a long traceback (``NoCredentialsError`` at the bottom of ~100 lines). A command that is about
to start Ray, or to write shards for minutes, first asks :func:`check_reachable`: one request,
a few seconds at most, and a :class:`StorageUnreachable` whose message is one line naming the
cause and the fix. Callers find it as ``storage.check_reachable`` (:mod:`vitray.storage`).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from typing import Any

import fsspec

__all__ = ["StorageUnreachable", "check_path_form", "check_reachable", "check_remote_reachable"]

# One probe, not the usual retry loop: a refused or silent endpoint is reported in seconds.
CONNECT_TIMEOUT_S = 3
READ_TIMEOUT_S = 5

# S3 error codes by what a person has to do about them.
_NO_BUCKET = {"NoSuchBucket"}
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
}
_DENIED = {"AccessDenied", "AllAccessDisabled", "AccountProblem", "403", "Forbidden"}
# A store that is busy, not a path that is wrong: S3 throttles a hot prefix with SlowDown (503) and
# has the odd InternalError; the probe asks again, after these pauses, before it says so.
_BUSY = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling", "ThrottlingException"}
BUSY_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)


class StorageUnreachable(ValueError):
    """A storage path that cannot be used as it stands. ``cause`` is one of ``no-credentials``,
    ``bad-credentials``, ``credentials-in-url``, ``unsupported`` (not a local path nor an s3:// URL),
    ``no-bucket``, ``access-denied``, ``read-only``, ``unreachable``, ``missing``; the
    message is one line naming the path, the cause and the fix. A ValueError, so the command
    line's handlers of bad input report it like any other bad argument (exit 2, no traceback)."""

    def __init__(self, message: str, *, cause: str, url: str) -> None:
        super().__init__(message)
        self.cause, self.url = cause, url


# A URL's scheme; the schemes a person may have meant by a mistyped one (`s3:/bucket`, `S3://`).
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):(/*)")
_S3_SCHEMES = ("s3", "s3a")
_LOCAL_SCHEMES = ("file", "local")
# https://BUCKET.s3.REGION.amazonaws.com/KEY, https://s3.REGION.amazonaws.com/BUCKET/KEY
_S3_WEB_URL = re.compile(r"https?://(?:(?P<bucket>[^/.]+)\.)?s3[.-][^/]*amazonaws\.com/(?P<rest>.*)")


def check_path_form(path: str) -> None:
    """A local path or an ``s3://`` URL, or :class:`StorageUnreachable` (a ValueError) saying what
    was meant: ``s3:/bucket`` (one slash) named a local folder ``s3:`` in the working directory, and
    data or checkpoints meant for the store stayed on this machine; ``S3://``, ``gs://`` (no gcsfs
    here) or an S3 bucket's ``https://`` address failed later, inside the filesystem library, as a
    crash (protocol not known, a DNS error after minutes of retries). Another filesystem fsspec has
    here is left to it. Credentials in an ``s3://`` URL are refused too."""
    text = str(path)
    found = _SCHEME.match(text)
    if found is None:
        return
    scheme, slashes, rest = found[1], found[2], text[found.end() :]
    if slashes != "//":  # `s3:/bucket`, `s3:bucket`: a local name unless a store was meant
        if scheme.lower() in (*_S3_SCHEMES, "gs", "gcs", "http", "https"):
            raise StorageUnreachable(
                f"{text}: a URL's scheme is followed by '://'; as written it names a local folder {scheme}: here. "
                f"Write s3://{rest.lstrip('/')} for the store",
                cause="unsupported",
                url=text,
            )
        return
    if scheme in _S3_SCHEMES:
        refuse_credentials_in_url(scheme, rest)
        return
    if scheme in _LOCAL_SCHEMES:
        return
    from vitray.common.redact import redact_text

    shown = redact_text(text)
    web = _S3_WEB_URL.match(text)
    if scheme.lower() in _S3_SCHEMES:
        meant = f"write {scheme.lower()}:// in lower case: {scheme.lower()}://{rest}"
    elif web is not None:
        meant = f"an S3 bucket's web address: write it s3://{web['bucket'] + '/' if web['bucket'] else ''}{web['rest']}"
    elif scheme.lower() in ("http", "https"):  # fsspec reads a web server, but lists and writes nothing there
        meant = (
            "vitray reads and writes local paths and s3:// URLs (AWS S3, or an S3-compatible store, its endpoint in "
            "AWS_ENDPOINT_URL); a web server is no place a dataset, run or output can be listed or written"
        )
    elif _filesystem_here(scheme):  # another filesystem fsspec has here (one a deployment registered)
        return
    else:
        meant = (
            "vitray reads and writes local paths and s3:// URLs (AWS S3, or an S3-compatible store such as "
            f"MinIO, Ceph, SeaweedFS or Google Cloud Storage's S3 API, its endpoint in AWS_ENDPOINT_URL); "
            f"no filesystem for {scheme}:// is installed here"
        )
    raise StorageUnreachable(f"{shown}: {meant}", cause="unsupported", url=shown)


def _filesystem_here(scheme: str) -> bool:
    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError):
        return False
    return True


def refuse_credentials_in_url(protocol: str | None, rest: str) -> None:
    """``s3://KEY:SECRET@bucket/...`` (`rest`: the URL after its protocol): s3fs would take
    ``KEY:SECRET@bucket`` for the bucket's name (and the store's error quotes it, the secret
    included), and a path is printed and recorded where a credential must not be: refused, naming
    the path with its credentials masked."""
    if protocol not in ("s3", "s3a") or "@" not in rest.split("/", 1)[0]:
        return
    masked = f"{protocol}://***@{rest.split('@', 1)[1]}"
    raise StorageUnreachable(
        f"{masked}: vitray takes no credentials in an {protocol}:// URL (paths are printed and recorded): give "
        "them in the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) or in storage_options, "
        f"and the path as {protocol}://BUCKET/PREFIX",
        cause="credentials-in-url",
        url=masked,
    )


def check_reachable(
    url: str, *, must_exist: bool = False, writable: bool = False, storage_options: dict[str, Any] | None = None
) -> None:
    """Raise :class:`StorageUnreachable` unless ``url`` can be used: for ``s3://`` the credentials
    at hand, the bucket and read access are checked with one listing of at most one key; with
    ``must_exist`` something must be stored at ``url``; with ``writable`` an empty object is written
    under it and removed again (credentials that may read but not write, or not delete, pass a
    listing and failed at the first write: a run's lease, a preparation's first shard). For a local
    path its parent folder must exist (or the path itself, with ``must_exist``). Other protocols are
    not probed."""
    url = str(url)
    check_path_form(url)
    protocol, rest = fsspec.core.split_protocol(url)
    if protocol in (None, "file", "local"):
        _check_local(rest if protocol else url, must_exist=must_exist)
    elif protocol in ("s3", "s3a"):
        _check_s3(url, rest, must_exist=must_exist, writable=writable, options=dict(storage_options or {}))


def check_remote_reachable(
    url: str, *, must_exist: bool = False, writable: bool = False, storage_options: dict[str, Any] | None = None
) -> None:
    """:func:`check_reachable` for a remote ``url`` (a wrong key, endpoint or bucket: one line, before
    any work); a local path is left to where it is opened, which says what is wrong with it."""
    if fsspec.core.split_protocol(str(url))[0] not in (None, "file", "local"):
        check_reachable(url, must_exist=must_exist, writable=writable, storage_options=storage_options)


def _check_local(path: str, *, must_exist: bool) -> None:
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path):
        return
    if must_exist:
        raise StorageUnreachable(
            f"{path} does not exist: check the path (a typo, or a disk not mounted?)", cause="missing", url=path
        )
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        what = "is not a folder" if os.path.exists(parent) else "does not exist"
        raise StorageUnreachable(
            f"the parent folder of {path} {what}: check the path or create {parent} first", cause="missing", url=path
        )


def _check_s3(url: str, rest: str, *, must_exist: bool, writable: bool, options: dict[str, Any]) -> None:
    import botocore.exceptions as bex

    bucket, _, key = rest.partition("/")
    key = key.strip("/")
    if not bucket:
        raise StorageUnreachable(f"{url} names no bucket: write s3://BUCKET/PREFIX", cause="no-bucket", url=url)
    client = _s3_client(options)
    endpoint = client.meta.endpoint_url
    try:
        found = _while_busy(lambda: _stored_under(client, bucket, key, must_exist=must_exist))
        if writable:
            _write_and_remove(client, bucket, key, url)
    except (bex.NoCredentialsError, bex.PartialCredentialsError, bex.CredentialRetrievalError) as error:
        raise StorageUnreachable(
            f"no credentials for {url} ({type(error).__name__}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "or AWS_PROFILE, or run where an instance role provides them",
            cause="no-credentials",
            url=url,
        ) from None
    except (
        bex.EndpointConnectionError,
        bex.ConnectTimeoutError,
        bex.ReadTimeoutError,
        bex.ConnectionClosedError,
        bex.HTTPClientError,
    ) as error:
        raise StorageUnreachable(
            f"cannot reach the S3 endpoint {endpoint} for {url} ({type(error).__name__}, "
            f"{CONNECT_TIMEOUT_S} s time-out): check AWS_ENDPOINT_URL (or storage_options' endpoint_url) "
            "and the network",
            cause="unreachable",
            url=url,
        ) from None
    except bex.ClientError as error:
        raise _client_error(error, url, bucket, endpoint, given_credentials=_given_credentials(options)) from None
    if must_exist and not found:
        raise StorageUnreachable(
            f"nothing is stored at {url}: check the prefix (bucket {bucket} exists)", cause="missing", url=url
        )


def _write_and_remove(client: Any, bucket: str, key: str, url: str) -> None:
    """An empty object written under ``key`` and removed: what writing there needs, asked before the work."""
    import botocore.exceptions as bex

    probe = f"{key}/.vitray-write-check-{uuid.uuid4().hex}" if key else f".vitray-write-check-{uuid.uuid4().hex}"
    for action, call in (
        ("PutObject", lambda: client.put_object(Bucket=bucket, Key=probe, Body=b"")),
        ("DeleteObject", lambda: client.delete_object(Bucket=bucket, Key=probe)),
    ):
        try:
            _while_busy(call)
        except bex.ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", ""))
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code not in _DENIED and status != 403:
                raise
            left = f" (an empty s3://{bucket}/{probe} is left there)" if action == "DeleteObject" else ""
            raise StorageUnreachable(
                f"the credentials at hand may read {url} but not write there ({code or status} on {action}){left}: "
                "use credentials allowed s3:PutObject and s3:DeleteObject under it",
                cause="read-only",
                url=url,
            ) from None


def _stored_under(client: Any, bucket: str, key: str, *, must_exist: bool) -> bool:
    found = client.list_objects_v2(Bucket=bucket, Prefix=f"{key}/" if key else "", MaxKeys=1)["KeyCount"]
    if must_exist and not found and key:
        found = _object_exists(client, bucket, key)
    return bool(found)


def _while_busy(call: Any) -> Any:
    """`call()`, asked again while the store answers that it is busy (:func:`_busy`)."""
    import botocore.exceptions as bex

    for delay in (*BUSY_RETRY_DELAYS_S, None):
        try:
            return call()
        except bex.ClientError as error:
            if delay is None or not _busy(error):
                raise
            time.sleep(delay)


def _busy(error: Any) -> bool:
    """A ClientError of a store that is busy or failing (`_BUSY`, or any 5xx), not of a wrong path."""
    code = str(error.response.get("Error", {}).get("Code", ""))
    return code in _BUSY or (error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0) >= 500


def _object_exists(client: Any, bucket: str, key: str) -> bool:
    import botocore.exceptions as bex

    try:
        client.head_object(Bucket=bucket, Key=key)
    except bex.ClientError as error:
        if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return True


def _given_credentials(options: dict[str, Any]) -> bool:
    """Whether `options` (storage_options) carry credentials of their own, which the client uses
    before the environment's: a rejection is theirs."""
    kwargs = options.get("client_kwargs") or {}
    return any(options.get(name) for name in ("key", "secret", "token", "profile")) or any(
        kwargs.get(name) for name in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
    )


def _client_error(
    error: Any, url: str, bucket: str, endpoint: str, *, given_credentials: bool = False
) -> StorageUnreachable:
    details = error.response.get("Error", {})
    code = str(details.get("Code", ""))
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in _NO_BUCKET:
        return StorageUnreachable(
            f"no such bucket {bucket!r} at {endpoint} (for {url}): create it or fix the URL", cause="no-bucket", url=url
        )
    if code == "404" and status == 404:  # S3's answer to a HEAD (no body) -- and any web server's
        return StorageUnreachable(
            f"no such bucket {bucket!r} at {endpoint} (for {url}): create it or fix the URL, or the endpoint "
            "(AWS_ENDPOINT_URL) if it is not an S3 API",
            cause="no-bucket",
            url=url,
        )
    if code in _BAD_CREDENTIALS:
        whose = (
            "the key / secret / token (or profile) of the storage_options given for it: they are used, not the "
            "environment's"
            if given_credentials
            else "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN (or AWS_PROFILE)"
        )
        return StorageUnreachable(
            f"the S3 credentials were rejected for {url} ({code}): check {whose}",
            cause="bad-credentials",
            url=url,
        )
    if code in _DENIED or status == 403:
        return StorageUnreachable(
            f"access denied to {url} ({code or status}): the credentials at hand may not list "
            f"s3://{bucket}; use credentials allowed s3:ListBucket and s3:GetObject there",
            cause="access-denied",
            url=url,
        )
    message = " ".join(str(details.get("Message", "")).split())
    if _busy(error):
        return StorageUnreachable(
            f"the S3 store at {endpoint} answered {url} with {code or status} ({message}) "
            f"{len(BUSY_RETRY_DELAYS_S) + 1} times in a row: it is busy or failing; retry later, or check the store",
            cause="unreachable",
            url=url,
        )
    return StorageUnreachable(
        f"S3 refused {url} ({code or status}: {message}): check the URL and the credentials",
        cause="access-denied",
        url=url,
    )


def _s3_client(options: dict[str, Any]) -> Any:
    """A botocore client built from the same settings s3fs would use (environment, profile, and
    the s3fs-style ``storage_options``: key, secret, token, anon, endpoint_url, client_kwargs,
    config_kwargs, profile), with short time-outs and no retries."""
    import botocore
    import botocore.config
    import botocore.session

    client_kwargs = dict(options.get("client_kwargs") or {})
    if options.get("endpoint_url"):
        client_kwargs.setdefault("endpoint_url", options["endpoint_url"])
    for option, argument in (
        ("key", "aws_access_key_id"),
        ("secret", "aws_secret_access_key"),
        ("token", "aws_session_token"),
    ):
        if options.get(option):
            client_kwargs.setdefault(argument, options[option])
    config = {k: v for k, v in dict(options.get("config_kwargs") or {}).items() if k not in ("retries",)}
    config.update(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S, retries={"total_max_attempts": 1})
    if options.get("anon"):
        config["signature_version"] = botocore.UNSIGNED
    session = botocore.session.Session(profile=options.get("profile"))
    # Credentials from an instance role are looked up at most once, briefly (botocore's defaults
    # are a 1 s time-out and one attempt; set here so that a user's config cannot stretch them).
    session.set_config_variable("metadata_service_timeout", 1)
    session.set_config_variable("metadata_service_num_attempts", 1)
    return session.create_client("s3", config=botocore.config.Config(**config), **client_kwargs)
