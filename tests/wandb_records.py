"""Reading what W&B wrote in offline mode (`run-<id>.wandb`), without its servers: the file is
LevelDB's log format (32 KiB blocks of records with a 7-byte header: CRC-32C, length, kind) after
W&B's own 7-byte header, each record a `wandb_internal_pb2.Record`. wandb 0.2x's Python reader of
it is gone from the package; this is the few lines the tests need.

W&B's service process writes the file on its own time: `run.finish()` can return before the last
records are on disk (seen once in a CI-like run: a record cut short). The readers below wait, up
to `WAIT_S`, for the run's `exit` record, the last one W&B writes."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
FILE_HEADER = 7  # b":W&B" + magic (2 bytes) + version
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
WAIT_S = 30.0


def finished_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """The records of a finished run's log, once W&B has written its `exit` record."""
    deadline = time.monotonic() + WAIT_S
    while True:
        records = read_records(path)
        if any(record.WhichOneof("record_type") == "exit" for record in records):
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {WAIT_S} s"
        time.sleep(0.1)


def read_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """The whole records in the log so far (a record still being written is left out)."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B log"
    records, pending, offset = [], b"", FILE_HEADER
    while offset + 7 <= len(data):
        room = BLOCK - offset % BLOCK
        if room < 7:  # the block's tail is padding
            offset += room
            continue
        length, kind = struct.unpack("<HB", data[offset + 4 : offset + 7])
        payload = data[offset + 7 : offset + 7 + length]
        if len(payload) < length:
            break  # still being written
        offset += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def history(path: Path) -> list[dict]:
    """The logged rows, each {"_step": ..., metric: value}."""
    rows = []
    for record in finished_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def config(path: Path) -> dict:
    """The run's config: what the run record carried, with later config updates on top."""
    values = {}
    for record in finished_records(path):
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        values.update({item.key: json.loads(item.value_json) for item in updates})
    return values
