"""vitray.storage: one way to reach local and object-storage paths -- fsspec, with bounded retries.

Every part of vitray opens dataset, checkpoint and report paths through this package, so that a
path is either a local folder or a URL such as ``s3://bucket/prefix`` and nothing else needs to
know which::

    from vitray import storage

    storage.check_reachable("s3://bucket/runs")                  # one quick probe, one-line error
    storage.write_bytes_atomic(storage.join("s3://bucket/runs", "x.json"), b"{}")
    data = storage.read_bytes("s3://bucket/runs/x.json")         # retried on transient errors

The modules: :mod:`.files` (the filesystem for a path, reading, atomic writes, uploads, listing;
where the S3 endpoint and credentials come from), :mod:`.retries` (which errors are transient, the
backoff, riding out a storage outage during a run), :mod:`.shard_cache` (whole remote shards in a
node-local folder), :mod:`.direct_file` (a large local file written once, past the page cache, and
fsynced), :mod:`.upload_stream` (an S3 object written as a stream of parts), :mod:`.s3_client` (a blocking
botocore client for the store an s3fs filesystem reaches, for requests spread over threads),
:mod:`.reachable` (the quick probe a command makes before expensive work starts). Constants stay in their modules,
read and patched there (``storage.retries.RETRY_ATTEMPTS``, ``storage.shard_cache.CACHE_PART_BYTES``):
a copy here would not be the value the functions use.

This package imports nothing else from vitray (`common` is the only one it may) and never imports ray.
"""

from .direct_file import DirectFile
from .files import (
    absolute,
    atomic_write,
    exists,
    file_sizes,
    filesystem,
    fsync_folder,
    holds_files,
    is_local_file,
    is_remote,
    join,
    list_names,
    open_file,
    publish_file,
    publish_folder,
    read_all,
    read_bytes,
    read_range,
    remove,
    remove_all,
    upload_file,
    write_bytes_atomic,
)
from .reachable import StorageUnreachable, check_reachable, check_remote_reachable
from .retries import backoff_delay, gave_up, is_transient, polled, ride_out, set_outage_budget, with_retries
from .shard_cache import ShardCache
from .upload_stream import UploadStream

__all__ = [
    "DirectFile",
    "ShardCache",
    "StorageUnreachable",
    "UploadStream",
    "absolute",
    "atomic_write",
    "backoff_delay",
    "check_reachable",
    "check_remote_reachable",
    "exists",
    "file_sizes",
    "filesystem",
    "fsync_folder",
    "gave_up",
    "holds_files",
    "is_local_file",
    "is_remote",
    "is_transient",
    "join",
    "list_names",
    "open_file",
    "polled",
    "publish_file",
    "publish_folder",
    "read_all",
    "read_bytes",
    "read_range",
    "remove",
    "remove_all",
    "ride_out",
    "set_outage_budget",
    "upload_file",
    "with_retries",
    "write_bytes_atomic",
]
