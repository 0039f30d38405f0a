"""Moving page bytes between LMDB's map and host pages, verified: the chunked copy-then-hash of
a read, and the checksums a write computes ahead on the I/O threads."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import xxhash

from tiered_kv.storage import value_format
from tiered_kv.storage.contract import PageSource

CHUNK = 256 << 10  # copy-then-hash chunk: small enough to still be in cache when hashed


def deliver(
    fingerprint: bytes,
    header: value_format.Header | None,
    payload: memoryview | bytes,
    source: PageSource,
    page: int,
    dst: np.ndarray | None,
    key: bytes,
) -> bool:
    """Copy a stored page into host page ``page`` (one copy, straight from LMDB's map) and
    verify it. Where the host page is a writable view (``dst``), the copy goes in cache-sized
    chunks and each chunk is hashed right after it lands, from cache, instead of in a second
    pass over memory. On failure the host page may hold partial bytes (reported a miss). A
    record written under another key than ``key`` fails too."""
    if not value_format.describes(header, fingerprint, key, len(payload)):
        return False
    if dst is None:
        if not value_format.verify(header, fingerprint, payload, key=key):
            return False
        source.set_page_bytes(page, payload)
        return True
    src = np.frombuffer(payload, dtype=np.uint8)
    hasher = xxhash.xxh3_64()
    for start in range(0, src.size, CHUNK):
        part = dst[start : start + CHUNK]
        part[:] = src[start : start + CHUNK]
        hasher.update(part)
    return hasher.intdigest() == header.checksum


class ChecksumsAhead:
    """Checksums of a batch's pages, computed ahead on the I/O threads (``start`` takes their
    ordered (index, checksum) results) while the writing thread inserts earlier pages; a page
    whose checksum has not arrived is hashed by the caller."""

    def __init__(self) -> None:
        self._sums: dict[int, int] = {}
        self._pending: Iterator[tuple[int, int]] = iter(())

    def start(self, pending: Iterator[tuple[int, int]]) -> None:
        self._pending = pending

    def of(self, i: int, view: memoryview) -> int:
        while i not in self._sums:
            j, value = next(self._pending, (i, None))
            self._sums[j] = value_format.checksum(view) if value is None else value
        return self._sums[i]
