"""SlabStorage: LMDB keeps the index, the page bytes live in one preallocated file per namespace.

The store directory holds an LMDB environment (``data.mdb``: the databases of ``slab_books``)
and ``slabs/<namespace fingerprint hex>.slab``, one ``slab_file.SlabFile`` per namespace
(``slab_env`` opens them). A write transaction hands out slots (``slab_alloc``), writes the pages
into them with ``pwritev`` straight from the host pages (hashing each chunk), fsyncs the file
when ``durable``, and only then maps the keys to the slots and commits. A slot freed by a
transaction is reused only by a later one. So a crash loses at most the pages of the transaction
in flight and never leaves a mapped slot half-written; and every read checks the record, then
``preadv``-s the slot into the host page and verifies its checksum (``slab_reads``): a reader
that raced a reuse of the slot gets a checksum miss, never another page's bytes.

The budget covers the slots' disk blocks, ``ENTRY_COST`` per page and ``FREE_COST`` per free-slot
record, plus the LMDB files (``BASE_COST``); the oldest pages of any namespace are evicted to
stay under it, and other namespaces' free slots give their blocks back. A full disk is a failed
``fallocate``: counted, never a signal; the set evicts, commits, and its next transaction writes
into the freed slots. That commit needs no new disk blocks (``slab_env``'s index reserve); a
transaction that still fails for want of space is retried with half its pages (``_store_all``),
and a free slot that lost its blocks becomes a hole instead of failing every set. Several
processes may share the directory (allocation happens inside LMDB's write lock); a store used
after ``fork`` reopens everything in the child.
Reads refresh recency as ``LMDBStorage``'s do (in memory, written with the next write).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import lmdb

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage import lmdb_env, map_file, value_format
from tiered_kv.storage.booked_store import BookedStorage
from tiered_kv.storage.contract import PageSource, StorageStats, page_rows
from tiered_kv.storage.io_threads import check_io_threads, shared_map
from tiered_kv.storage.keys import FINGERPRINT_BYTES, StorageNamespace
from tiered_kv.storage.slab_alloc import SlabAllocator
from tiered_kv.storage.slab_books import ENTRY_COST, Entry
from tiered_kv.storage.slab_env import INDEX_RESERVE, Pending, SlabEnv, count_os_error
from tiered_kv.storage.slab_file import slot_bytes_for
from tiered_kv.storage.slab_reads import deliver, drop_if_unchanged, read_plan

INDEX_BASE = 256 << 10  # the index's fixed part: meta and root pages, LMDB's own free list
BASE_COST = map_file.LOCK_BYTES + INDEX_BASE + INDEX_RESERVE
_FLUSH_EVERY = 256
_SET_TRANSACTIONS = 3  # a set at the budget writes into what its previous transaction evicted
UNCAP_FREE = 4 * INDEX_RESERVE  # free bytes on the file system that end a full disk's small sets


def _free_bytes(path: Path) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def min_budget(page_nbytes: int) -> int:
    """The smallest budget that holds four pages of ``page_nbytes``."""
    return BASE_COST + 4 * (slot_bytes_for(page_nbytes) + ENTRY_COST)


class SlabStorage(BookedStorage):
    """``path``: the store directory; ``budget_bytes``: the most disk it may use (index, slabs
    and lock file together). ``durable``: fsync the slab before each commit, and the commit;
    ``io_threads``: threads that write or read and hash pages at once; ``hugepages`` is accepted
    for ``LMDBStorage``'s signature and has no effect (nothing is memory-mapped)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        namespace: StorageNamespace,
        page_nbytes: int,
        *,
        budget_bytes: int,
        durable: bool = False,
        hugepages: bool = False,
        io_threads: int | None = None,
    ) -> None:
        super().__init__(namespace, page_nbytes)
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
            raise InvalidArgumentError(f"budget_bytes={budget_bytes!r} must be an int")
        if budget_bytes < min_budget(page_nbytes):
            raise InvalidArgumentError(
                f"budget_bytes={budget_bytes} is too small for pages of {page_nbytes} bytes; "
                f"give at least {min_budget(page_nbytes)}"
            )
        self.path = Path(path)
        self.budget_bytes = budget_bytes
        self._durable = bool(durable)
        self._io_threads = check_io_threads(io_threads)
        self._stats = StorageStats(budget_bytes=budget_bytes)
        self._touched: dict[bytes, Entry] = {}  # read since the last write, with its record
        self._txn_pages: int | None = None  # pages per set transaction while the disk is full
        self._files: SlabEnv | None = None
        self._lock = threading.RLock()
        self._open()

    def _open(self) -> None:
        fp = self.namespace.fingerprint
        self._files = SlabEnv(self.path, fp, self.page_nbytes, self.budget_bytes, self._durable)
        self._bind()

    def _bind(self) -> None:
        files = self._files
        self._lock, self._books = files.lock, files.books
        self._alloc = SlabAllocator(
            files.books, files.fp, files.slab, files.slab_of, self.budget_bytes - BASE_COST
        )

    def _here(self) -> SlabEnv:
        """The files, reopened first in a forked child."""
        if self._files.forked():
            self._touched = {}
            self._bind()
        return self._files

    def _read(self, fn):
        return self._here().read(fn)

    def _write(self, fn, what: str):
        return self._here().write(fn, self._stats, what)

    def _flush_touched(self, txn: lmdb.Transaction, pending: Pending | None = None) -> None:
        touched, self._touched = self._touched, {}
        if touched:
            self._books.refresh(txn, touched, touched)

    def _flush_recency(self) -> None:
        """Write the recency of pages read since the last write, in parts of ``_txn_pages``
        while a full disk keeps transactions small (halved like a set's on a failed commit)."""
        known, self._touched = self._touched, {}
        touched = list(known)
        while touched:
            part = touched[: self._txn_pages or len(touched)]

            def refresh(txn: lmdb.Transaction, _: Pending, part=part) -> bool:
                self._books.refresh(txn, part, known)
                return True

            if self._write(refresh, "recency"):
                touched = touched[len(part) :]
            elif self._files.out_of_space and len(part) > 1:
                self._txn_pages = len(part) // 2
            else:
                return

    def _free(self, txn: lmdb.Transaction, freed: dict[bytes, list[int]]) -> None:
        for fp, slots in freed.items():
            self._books.put_free(txn, fp, slots)

    def _intact(self) -> bool:
        """False (and counted) when the directory was removed or replaced under this store."""
        if self._files.intact():
            return True
        self._stats.count_error("store directory removed or replaced")
        return False

    # -- the contract -------------------------------------------------------------------------
    @lmdb_env.absorbs_lmdb_errors(lambda store, keys, *rest: [False] * len(keys))
    def batch_get(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        keys = self._check_keys(keys)
        pages = self._check_pages(keys, source, pages)
        moved = self._misses_if_moved(keys)
        if moved is not None:
            return moved
        zero_copy = bool(getattr(source, "page_bytes_zero_copy", False))
        rows = page_rows(source)
        fp = self.namespace.fingerprint
        with self._lock:
            entries = self._read(lambda txn: [self._books.lookup(txn, k) for k in keys])
            slab = self._files.slab
            jobs = [(i, e) for i, e in enumerate(entries) if e is not None]
            jobs, threads = read_plan(slab, jobs, self._io_threads if zero_copy else 1)
            results = shared_map(
                lambda job: deliver(
                    slab, fp, job[1], source, pages[job[0]], rows, zero_copy, keys[job[0]]
                ),
                jobs,
                threads,
            )
            found = dict(zip((job[0] for job in jobs), results, strict=True))
            out, bad = [], []
            for i, key in enumerate(keys):
                self._stats.gets += 1
                ok, err = found.get(i, (None, None))
                if err:
                    self._stats.count_error(f"batch_get: {err}")
                if ok:
                    self._touched[key] = entries[i]
                    self._stats.hits += 1
                else:
                    self._stats.misses += 1
                    if ok is False:
                        self._stats.checksum_failures += 1
                        bad.append((key, entries[i].raw))
                out.append(bool(ok))
            if bad:
                self._write(
                    lambda txn, _: self._free(txn, drop_if_unchanged(txn, self._books, bad)),
                    "delete corrupt",
                )
            if len(self._touched) >= _FLUSH_EVERY:
                self._flush_recency()
        return out

    @lmdb_env.absorbs_lmdb_errors(lambda store, keys, *rest: [False] * len(keys))
    def batch_set(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        keys = self._check_keys(keys)
        pages = self._check_pages(keys, source, pages)
        n = len(keys)
        if not self._intact():
            self._stats.sets += n
            self._stats.set_skipped += n
            return [False] * n
        rows = page_rows(source)

        def page_view(page: int) -> memoryview:
            if rows is not None:
                return memoryview(rows[page])
            return memoryview(source.get_page_bytes(page).numpy())

        first: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        with self._lock:
            self._stats.sets += n
            done, evicted = self._store_all(list(first.values()), keys, pages, page_view)
            out = [first[k] in done for k in keys]
            self._stats.existing_refreshed += sum(
                1 for i, k in enumerate(keys) if first[k] != i and out[i]
            )
            if evicted:  # a batch larger than the store evicts its own first pages
                headers = self._books.headers
                there = self._read(lambda txn: [txn.get(k, db=headers) is not None for k in keys])
                out = [o and t for o, t in zip(out, there, strict=True)]
            self._stats.set_skipped += out.count(False)
            return out

    def _store_all(self, todo, keys, pages, page_view) -> tuple[set[int], int]:
        """Store the pages ``todo`` (indices into ``keys``) in parts of at most ``_txn_pages``
        (all of them unless a full disk failed a commit), each in up to ``_SET_TRANSACTIONS``
        transactions. A transaction that failed for want of disk space (its commit needed index
        pages the full disk does not have) is retried with half as many pages, and later sets
        keep that size until the file system has ``UNCAP_FREE`` bytes free. Returns the indices
        stored or refreshed and the pages evicted."""
        if self._txn_pages is not None:
            if _free_bytes(self.path) >= UNCAP_FREE:
                self._txn_pages = None
            else:  # not in the set's own transactions, which stay small
                self._flush_recency()
        done: set[int] = set()
        evicted = 0
        while todo:
            cap = self._txn_pages or len(todo)
            part, todo = todo[:cap], todo[cap:]
            for _ in range(_SET_TRANSACTIONS):
                got = self._write(
                    lambda txn, p, part=part: self._store(txn, p, keys, pages, part, page_view),
                    "batch_set",
                )
                if got is None:
                    break
                stored, refreshed, ev = got
                self._stats.existing_refreshed += len(refreshed)
                done.update(stored, refreshed)
                part = [i for i in part if i not in done]
                evicted += ev
                if not part or not ev:
                    break
            if got is None:
                if not self._files.out_of_space or len(part) <= 1:
                    break  # the rest is skipped (and counted by the caller)
                self._txn_pages = len(part) // 2
                todo = part + todo
        return done, evicted

    def _store(self, txn, pending: Pending, keys, pages, todo, page_view):
        """One transaction of a set: refresh present keys, hand out slots for as many of the
        rest as fit, write the pages into them, map them. Returns (stored, refreshed, evicted)."""
        self._flush_touched(txn)
        refreshed = [i for i in todo if self._books.touch(txn, keys[i])]
        skip = set(refreshed)
        want = [i for i in todo if i not in skip]
        freed: dict[bytes, list[int]] = {}
        alloc = self._alloc.allocate(txn, len(want), freed)
        pending.errors.extend(alloc.errors)
        pairs = list(zip(want, alloc.slots, strict=False))
        slab = self._files.slab
        try:
            sums = shared_map(
                lambda pair: slab.write_if_room(pair[1], page_view(pages[pair[0]])),
                pairs,
                self._io_threads,
            )
            if self._durable and pairs:
                slab.sync()  # the bytes reach the disk before the commit that maps them
        except BaseException:
            self._alloc.undo_blocks(alloc)  # under the write lock still: nobody grew since
            raise
        lost = [slot for (_, slot), csum in zip(pairs, sums, strict=True) if csum is None]
        if lost:  # free slots whose blocks an aborted transaction gave back, on a full disk
            self._alloc.lose_blocks(txn, lost)
            pending.errors.append("write slab: ENOSPC")
            kept = [(pair, c) for pair, c in zip(pairs, sums, strict=True) if c is not None]
            pairs, sums = [pair for pair, _ in kept], [c for _, c in kept]
        fp = self.namespace.fingerprint
        for (i, slot), csum in zip(pairs, sums, strict=True):
            view = page_view(pages[i])

            def header_of(tick: int, view=view, csum=csum, key=keys[i]) -> bytes:
                return value_format.pack(fp, view, tick, csum, key=key)

            self._books.insert(txn, keys[i], header_of, slot)
        self._free(txn, freed)
        pending.evicted += alloc.evicted
        return [i for i, _ in pairs], refreshed, alloc.evicted

    @lmdb_env.absorbs_lmdb_errors(lambda store, keys: 0)
    def delete(self, keys: Sequence[bytes]) -> int:
        keys = self._check_keys(keys)
        with self._lock:
            return self._write(lambda txn, _: self._remove(txn, keys), "delete") or 0

    def _remove(self, txn: lmdb.Transaction, keys: Sequence[bytes]) -> int:
        freed: dict[bytes, list[int]] = {}
        removed = 0
        for key in keys:
            present, slot = self._books.remove(txn, key)
            removed += present
            if slot is not None:
                freed.setdefault(key[:FINGERPRINT_BYTES], []).append(slot)
        self._free(txn, freed)
        return removed

    @lmdb_env.absorbs_lmdb_errors(lambda store: None)
    def clear(self) -> None:
        fp = self.namespace.fingerprint
        with self._lock:
            self._touched = {}
            self._write(lambda txn, _: self._remove(txn, self._books.keys_of(txn, fp)), "clear")

    @lmdb_env.absorbs_lmdb_errors(lambda store: None)
    def flush(self) -> None:
        """Write pending recency refreshes, and sync the slab and the index to disk."""
        with self._lock:
            self._flush_recency()
            files = self._here()
            try:
                files.slab.sync()
            except OSError as exc:
                count_os_error(self._stats, "flush", exc)
            files.env.sync(True)

    @lmdb_env.absorbs_lmdb_errors(lambda store: store._stats.snapshot())
    def stats(self) -> StorageStats:
        def read(txn: lmdb.Transaction) -> None:
            self._stats.pages = txn.stat(self._books.headers)["entries"]
            self._stats.bytes = self._books.used(txn)

        with self._lock:
            self._read(read)
            return self._stats.snapshot()

    def disk_bytes(self) -> int:
        """Disk blocks the store's files hold (what ``du`` counts for the directory)."""
        self._check_open("disk_bytes")
        return self._files.disk_bytes()

    def close(self) -> None:
        """Flush recency, sync, close the slab files and release the environment (the last
        store of the directory in this process closes it). Safe to call twice; any other call after
        it raises StorageClosedError."""
        with self._lock:
            if self._files is None:
                return
            if os.getpid() == self._files.pid:
                try:
                    self.flush()
                finally:
                    self._files.close()
            else:  # a forked child that never used the store: its copies of the descriptors
                self._files.close_files()
            self._files = None
            self._closed = True
