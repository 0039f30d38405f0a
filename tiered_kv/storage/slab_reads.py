"""The read path of a slab store: one mapped slot into one host page, verified, and what a failed
verification may delete.

``deliver`` checks the index record (an intact header of this namespace and page size, an
intact slot record), then reads the slot straight into the host page where the page is a
writable view (``preadv`` in chunks, each hashed as it lands), or into a scratch buffer that
``set_page_bytes`` copies in. A slot can be reused by another process between the index read and
the file read; its bytes then fail the checksum. ``drop_if_unchanged`` deletes such a key only if
the index still holds the very record that was read (same slot, same tick): a key rewritten
since, or already gone, is left alone.
"""

from __future__ import annotations

import errno

import lmdb
import numpy as np

from tiered_kv.storage.contract import PageSource
from tiered_kv.storage.keys import FINGERPRINT_BYTES
from tiered_kv.storage.slab_books import Entry, SlabBooks
from tiered_kv.storage.slab_file import SlabFile


def deliver(
    slab: SlabFile,
    fingerprint: bytes,
    entry: Entry,
    source: PageSource,
    page: int,
    rows: np.ndarray | None,
    zero_copy: bool,
) -> tuple[bool | None, str | None]:
    """(served, error): True when host page ``page`` now holds the stored bytes; False when
    the record or the bytes failed verification (the host page may hold partial bytes); None
    with the errno's name when the file could not be read."""
    header, slot = entry.header, entry.slot
    if (
        header is None
        or slot is None
        or header.fingerprint != fingerprint
        or header.length != slab.page_nbytes
    ):
        return False, None
    if zero_copy:
        dst = rows[page] if rows is not None else source.get_page_bytes(page).numpy()
    else:
        dst = np.empty(slab.page_nbytes, dtype=np.uint8)
    try:
        ok = slab.read_into(slot, dst, header.checksum)
    except OSError as exc:
        return None, errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    if ok and not zero_copy:
        source.set_page_bytes(page, memoryview(dst))
    return ok, None


def drop_if_unchanged(
    txn: lmdb.Transaction, books: SlabBooks, bad: list[tuple[bytes, bytes]]
) -> dict[bytes, list[int]]:
    """Remove each ``(key, raw record)`` whose record is still exactly ``raw``; returns the
    slots freed, per namespace (for the caller to free at the end of the transaction)."""
    freed: dict[bytes, list[int]] = {}
    for key, raw in bad:
        now = books.lookup(txn, key)
        if now is None or now.raw != raw:
            continue
        _, slot = books.remove(txn, key)
        if slot is not None:
            freed.setdefault(key[:FINGERPRINT_BYTES], []).append(slot)
    return freed
