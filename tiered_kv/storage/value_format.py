"""The record stored beside every page: magic, format version, namespace fingerprint, payload
length and an xxh3-64 checksum of the payload. Readers verify all of it before serving a page."""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

MAGIC = b"TKVP"
VERSION = 1
# magic, version, flags, fingerprint, payload length, checksum, recency tick
_HEADER = struct.Struct("<4sHH16sQQQ")
HEADER_BYTES = _HEADER.size


class Header(NamedTuple):
    fingerprint: bytes
    length: int
    checksum: int
    tick: int


def checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def pack(fingerprint: bytes, payload: memoryview | bytes, tick: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, 0, fingerprint, len(payload), checksum(payload), tick)


def with_tick(header: bytes, tick: int) -> bytes:
    """The same header with a new recency tick (the checksum is kept, not recomputed)."""
    magic, version, flags, fp, length, csum, _ = _HEADER.unpack(header)
    return _HEADER.pack(magic, version, flags, fp, length, csum, tick)


def unpack(header: bytes | memoryview) -> Header | None:
    """The header's fields, or None if it is not a header of this format."""
    if len(header) != HEADER_BYTES:
        return None
    magic, version, _flags, fp, length, csum, tick = _HEADER.unpack(header)
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
