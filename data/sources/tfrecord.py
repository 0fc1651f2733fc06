"""TFRecord files and ``tf.train.Example`` records, read without TensorFlow.

A TFRecord file is a sequence of records, each framed as::

    uint64 length (little-endian) | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)

Both checksums are verified: a truncated file or a flipped byte is a :class:`CorruptRecord` naming
the file and the record, never a silently wrong sample. ``tf.train.Example`` (TensorFlow's
``example.proto`` / ``feature.proto``) is parsed with the installed ``protobuf`` runtime from
message descriptors built here in code, so no ``.proto`` compile step and no TensorFlow are needed.
:func:`write_records` and :func:`make_example` write the same format (the tests use them to build
TFDS-shaped folders).

CRC-32C (Castagnoli) is computed by ``google_crc32c`` (a dependency; its C extension uses the
CPU's CRC32 instructions). The table-driven pure-Python loop is only a fallback for an environment
where that package is missing: it runs at a few MB/s, so every record's two checksums would cost
days of CPU on ImageNet-21k's 1.3 TB (BENCHMARKS.md has both rates).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO

_MASK_DELTA = 0xA282EAD8
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")


class CorruptRecord(ValueError):
    """A TFRecord file whose framing or checksums are wrong (truncated or corrupted)."""


# ---------------------------------------------------------------------------------------------
# CRC-32C
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _crc_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


def _crc32c_python(data: bytes) -> int:
    table, crc = _crc_table(), 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _crc32c_c(data: bytes) -> int:
    return google_crc32c.value(bytes(data))


try:
    import google_crc32c
except ImportError:  # imported once: a missing package is not looked for again on every record
    google_crc32c = None

# Which implementation `crc32c` runs, decided at import. The package's own pure-Python fallback
# (when its C extension did not build) is slower than the table loop here, so it is not used.
_crc32c_impl = _crc32c_c if google_crc32c is not None and google_crc32c.implementation == "c" else _crc32c_python


def crc32c(data: bytes) -> int:
    """CRC-32C of ``data`` (``crc32c(b"123456789") == 0xE3069283``)."""
    return _crc32c_impl(data)


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 bits, add a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Framing
# ---------------------------------------------------------------------------------------------


def _read_header(f: BinaryIO, path: str, index: int) -> int | None:
    """The data length of the next record, or None at a clean end of file."""
    header = f.read(_HEADER.size)
    if not header:
        return None
    if len(header) < _HEADER.size:
        raise CorruptRecord(f"{path}: record {index} is truncated (a {len(header)}-byte header; expected 12)")
    length, length_crc = _HEADER.unpack(header)
    if masked_crc32c(header[:8]) != length_crc:
        raise CorruptRecord(f"{path}: record {index} has a bad length checksum (corrupt, or not a TFRecord file)")
    return length


def iter_records(path: str, start: int = 0, stop: int | None = None) -> Iterator[bytes]:
    """The data of records ``[start, stop)`` of the TFRecord file ``path``, checksums verified.

    Records before ``start`` are skipped by their length (their data is neither read nor checked).
    """
    with open(path, "rb") as f:
        index = 0
        while stop is None or index < stop:
            length = _read_header(f, path, index)
            if length is None:
                if stop is not None:
                    raise CorruptRecord(f"{path} ends after {index} records; expected at least {stop}")
                return
            if index < start:
                f.seek(length + _FOOTER.size, 1)
                index += 1
                continue
            data = f.read(length)
            footer = f.read(_FOOTER.size)
            if len(data) < length or len(footer) < _FOOTER.size:
                raise CorruptRecord(f"{path}: record {index} is truncated ({len(data)} of {length} bytes)")
            if masked_crc32c(data) != _FOOTER.unpack(footer)[0]:
                raise CorruptRecord(f"{path}: record {index} has a bad data checksum (the file is corrupt)")
            yield data
            index += 1


def count_records(path: str) -> int:
    """Number of records in ``path`` (headers only: lengths checked, data skipped)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        count = 0
        while (length := _read_header(f, path, count)) is not None:
            end = f.seek(length + _FOOTER.size, 1)
            if end > size:
                raise CorruptRecord(f"{path}: record {count} is truncated (the file ends inside it)")
            count += 1
    return count


def write_records(path: str, records: Sequence[bytes]) -> None:
    """Write ``records`` as a TFRecord file (the framing TensorFlow writes)."""
    with open(path, "wb") as f:
        for data in records:
            length = struct.pack("<Q", len(data))
            f.write(length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data)))


# ---------------------------------------------------------------------------------------------
# tf.train.Example
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _example_class() -> Any:
    """The ``tensorflow.Example`` message class, from descriptors equivalent to TensorFlow's
    ``example.proto`` and ``feature.proto`` (same package, names, field numbers and packing)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="vitray_tf_example.proto", package="tensorflow", syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> descriptor_pb2.DescriptorProto:
        msg = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            field = msg.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = type_name
        return msg

    repeated, optional = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    message("BytesList", ("value", 1, F.TYPE_BYTES, repeated, ""))
    message("FloatList", ("value", 1, F.TYPE_FLOAT, repeated, ""))
    message("Int64List", ("value", 1, F.TYPE_INT64, repeated, ""))
    feature = message(
        "Feature",
        ("bytes_list", 1, F.TYPE_MESSAGE, optional, ".tensorflow.BytesList"),
        ("float_list", 2, F.TYPE_MESSAGE, optional, ".tensorflow.FloatList"),
        ("int64_list", 3, F.TYPE_MESSAGE, optional, ".tensorflow.Int64List"),
    )
    feature.oneof_decl.add(name="kind")
    for field in feature.field:
        field.oneof_index = 0
    features = message("Features", ("feature", 1, F.TYPE_MESSAGE, repeated, ".tensorflow.Features.FeatureEntry"))
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=optional)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=optional, type_name=".tensorflow.Feature")
    message("Example", ("features", 1, F.TYPE_MESSAGE, optional, ".tensorflow.Features"))

    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


FeatureValue = list[bytes] | list[float] | list[int]


def parse_example(data: bytes, where: str = "record") -> dict[str, FeatureValue]:
    """A serialized ``tf.train.Example`` -> ``{feature name: list of values}``."""
    from google.protobuf.message import DecodeError

    example = _example_class()()
    try:
        example.ParseFromString(data)
    except DecodeError as error:
        raise CorruptRecord(f"{where} is not a tf.train.Example: {error}") from None
    parsed: dict[str, FeatureValue] = {}
    for key, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        parsed[key] = list(getattr(feature, kind).value) if kind else []
    return parsed


def make_example(features: Mapping[str, bytes | int | float | Sequence[Any]]) -> bytes:
    """Serialize ``{name: value or list of values}`` (bytes, ints or floats) as a ``tf.train.Example``."""
    example = _example_class()()
    for key, value in features.items():
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        feature = example.features.feature[key]
        if all(isinstance(v, bytes) for v in values) and values:
            feature.bytes_list.value.extend(values)
        elif all(isinstance(v, int) for v in values):
            feature.int64_list.value.extend(values)
        else:
            feature.float_list.value.extend(float(v) for v in values)
    return example.SerializeToString()
