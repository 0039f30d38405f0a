"""The record stored beside every page: magic, format version, namespace fingerprint, payload
length, an xxh3-64 checksum of the payload, the recency tick, and an xxh32 of those fields (so a
flipped byte anywhere in the header is caught too). Readers verify all of it before serving."""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

MAGIC = b"TKVP"
VERSION = 1
# magic, version, flags, fingerprint, payload length, checksum, recency tick
_FIELDS = struct.Struct("<4sHH16sQQQ")
_CHECK = struct.Struct("<I4x")
HEADER_BYTES = _FIELDS.size + _CHECK.size


class Header(NamedTuple):
    fingerprint: bytes
    length: int
    checksum: int
    tick: int


def checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _seal(fields: bytes) -> bytes:
    return fields + _CHECK.pack(xxhash.xxh32_intdigest(fields))


def pack(
    fingerprint: bytes, payload: memoryview | bytes, tick: int, payload_checksum: int | None = None
) -> bytes:
    """The header for ``payload``; ``payload_checksum`` is its ``checksum`` if already known."""
    csum = checksum(payload) if payload_checksum is None else payload_checksum
    return _seal(_FIELDS.pack(MAGIC, VERSION, 0, fingerprint, len(payload), csum, tick))


def with_tick(header: bytes, tick: int) -> bytes:
    """The same header with a new recency tick (the payload checksum is kept, not recomputed)."""
    magic, version, flags, fp, length, csum, _ = _FIELDS.unpack(bytes(header[: _FIELDS.size]))
    return _seal(_FIELDS.pack(magic, version, flags, fp, length, csum, tick))


def unpack(header: bytes | memoryview) -> Header | None:
    """The header's fields, or None if it is not an intact header of this format."""
    if len(header) != HEADER_BYTES:
        return None
    raw = bytes(header)
    fields = raw[: _FIELDS.size]
    if raw[_FIELDS.size :] != _CHECK.pack(xxhash.xxh32_intdigest(fields)):  # padding included
        return None
    magic, version, _flags, fp, length, csum, tick = _FIELDS.unpack(fields)
    if magic != MAGIC or version != VERSION:
        return None
    return Header(fp, length, csum, tick)


def verify(header: Header | None, fingerprint: bytes, payload: memoryview | bytes) -> bool:
    """Whether ``payload`` is exactly what was written under ``header`` for this namespace."""
    return (
        header is not None
        and header.fingerprint == fingerprint
        and header.length == len(payload)
        and header.checksum == checksum(payload)
    )
