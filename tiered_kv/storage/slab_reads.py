"""The read path of a slab store: one mapped slot into one host page, verified, and what a failed
verification may delete.

``read_plan`` puts a batch of large pages in the page cache on the I/O threads, any other batch
on one thread in file order (the kernel's readahead then sees one sequential reader).
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

from tiered_kv.storage import value_format
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
    key: bytes,
) -> tuple[bool | None, str | None]:
    """(served, error): True when host page ``page`` now holds the stored bytes; False when
    the record or the bytes failed verification (the host page may hold partial bytes); None
    with the errno's name when the file could not be read."""
    header, slot = entry.header, entry.slot
    if slot is None or not value_format.describes(header, fingerprint, key, slab.page_nbytes):
        return False, None  # unreadable, or another key's record
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


# Pages of 512 KiB and up are read on two threads when in the page cache: into a host pool
# larger than the CPU's caches one thread ran at 0.86-0.88x of two (133.7 vs 118.2 us a page;
# the same run's HiCacheFile 127.1). Smaller ones read faster on one (0.25 MiB: 82 vs 101 us).
PARALLEL_READ_BYTES = 512 << 10


def read_plan(
    slab: SlabFile, jobs: list[tuple[int, Entry]], threads: int
) -> tuple[list[tuple[int, Entry]], int]:
    """The order and thread count of a batch's reads (``(index, entry)`` jobs): pages of at
    least ``PARALLEL_READ_BYTES`` whose slots are in the page cache as given, on ``threads``
    (they copy and hash faster on two: 8.5 vs 7.4 GB/s at 2 MiB); any other batch on one thread
    in file order (two threads reading slots of one file look like random reads to the kernel's
    readahead: cold gets of 8 MiB pages ran at 0.55-0.74x of one thread)."""
    if not jobs:
        return jobs, threads
    slots = sorted((-1 if e.slot is None else e.slot, n) for n, (_, e) in enumerate(jobs))
    if threads <= 1 or slab.page_nbytes < PARALLEL_READ_BYTES:
        return [jobs[n] for _, n in slots], 1
    # the first and the last slot in file order: readahead from the batch before may have
    # brought in the first one, never the last one of a batch that comes from the disk
    if all(slot < 0 or slab.cached(slot) for slot, _ in (slots[0], slots[-1])):
        return jobs, threads
    return [jobs[n] for _, n in slots], 1


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
