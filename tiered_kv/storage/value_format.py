"""The record stored beside every page: magic, format version, namespace fingerprint, payload
length, an xxh3-64 checksum of the payload, the recency tick, an xxh3-64 of the page's whole key,
and an xxh32 of those fields (so a flipped byte anywhere in the header is caught too). Readers
verify all of it before serving: a store that answers one key with another key's intact value
(a swapped, misfiled or replayed record) is a miss, since the value names the key it was written
under. Version 2 added the key; version 1 records read as damaged (misses)."""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

MAGIC = b"TKVP"
VERSION = 2
# magic, version, flags, fingerprint, payload length, checksum, recency tick, key check
_FIELDS = struct.Struct("<4sHH16sQQQQ")
_CHECK = struct.Struct("<I4x")
HEADER_BYTES = _FIELDS.size + _CHECK.size


class Header(NamedTuple):
    fingerprint: bytes
    length: int
    checksum: int
    tick: int
    key_check: int  # ``key_check`` of the key the value was written under


def key_check(key: bytes | memoryview) -> int:
    """What a record holds of its key: xxh3-64 of the whole key (fingerprint and digest)."""
    return xxhash.xxh3_64_intdigest(bytes(key))


def checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _seal(fields: bytes) -> bytes:
    return fields + _CHECK.pack(xxhash.xxh32_intdigest(fields))


def pack(
    fingerprint: bytes,
    payload: memoryview | bytes,
    tick: int,
    payload_checksum: int | None = None,
    *,
    key: bytes,
) -> bytes:
    """The header for ``payload`` stored under ``key``; ``payload_checksum`` is its
    ``checksum`` if already known."""
    csum = checksum(payload) if payload_checksum is None else payload_checksum
    fields = (MAGIC, VERSION, 0, fingerprint, len(payload), csum, tick, key_check(key))
    return _seal(_FIELDS.pack(*fields))


def with_tick(header: bytes, tick: int) -> bytes:
    """The same header with a new recency tick (the payload checksum is kept, not recomputed)."""
    magic, version, flags, fp, length, csum, _, kc = _FIELDS.unpack(bytes(header[: _FIELDS.size]))
    return _seal(_FIELDS.pack(magic, version, flags, fp, length, csum, tick, kc))


def unpack(header: bytes | memoryview) -> Header | None:
    """The header's fields, or None if it is not an intact header of this format."""
    if len(header) != HEADER_BYTES:
        return None
    raw = bytes(header)
    fields = raw[: _FIELDS.size]
    if raw[_FIELDS.size :] != _CHECK.pack(xxhash.xxh32_intdigest(fields)):  # padding included
        return None
    magic, version, _flags, fp, length, csum, tick, kc = _FIELDS.unpack(fields)
    if magic != MAGIC or version != VERSION:
        return None
    return Header(fp, length, csum, tick, kc)


def describes(header: Header | None, fingerprint: bytes, key: bytes, length: int) -> bool:
    """Whether ``header`` is a record of ``key`` in this namespace for a payload of
    ``length`` bytes (all but the payload's checksum, which a streaming reader checks)."""
    return (
        header is not None
        and header.fingerprint == fingerprint
        and header.length == length
        and header.key_check == key_check(key)
    )


def verify(
    header: Header | None, fingerprint: bytes, payload: memoryview | bytes, *, key: bytes
) -> bool:
    """Whether ``payload`` is exactly what was written under ``key`` (with ``header``) for this
    namespace."""
    return describes(header, fingerprint, key, len(payload)) and header.checksum == checksum(
        payload
    )
