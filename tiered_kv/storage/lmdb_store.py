"""LMDBStorage: the embedded page store, safe across processes, crashes and restarts.

One LMDB environment (a directory) holds four named databases:
- ``pages``:   key -> the page bytes, written straight from the host page (one copy);
- ``headers``: key -> magic, version, namespace fingerprint, length, xxh3-64 checksum, tick;
- ``lru``:     big-endian tick + key -> empty, ordered oldest first (approximate LRU that
  survives restart);
- ``meta``:    the recency clock and the bytes in use, updated in the same transactions
  (that bookkeeping is ``storage.lmdb_books``).
A page and its header are written in one transaction, so a reader sees both or neither; every
read verifies the header and checksum, and a page that fails is deleted, counted and missed.
Reads refresh recency in memory; the refresh reaches LMDB with the next write (or ``flush``),
and skips pages already among the newest quarter. Page bytes move through ``lmdb_copy``. The
map grows up to ``budget_bytes``; a full map or disk evicts old pages or skips the write and
counts it, never raising. LMDB's locks make several processes on one directory safe; an
instance used after ``fork`` reopens the environment in the child.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import lmdb

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage import lmdb_env, value_format
from tiered_kv.storage.booked_store import BookedStorage
from tiered_kv.storage.contract import PageSource, StorageStats, page_rows
from tiered_kv.storage.io_threads import check_io_threads, ordered_map, split_map
from tiered_kv.storage.keys import StorageNamespace
from tiered_kv.storage.lmdb_books import Books
from tiered_kv.storage.lmdb_copy import ChecksumsAhead, deliver
from tiered_kv.storage.lmdb_env import StorageOpenError, record_cost
from tiered_kv.storage.slab_env import SLABS

_MIN_MAP = 32 << 20
_FLUSH_EVERY = 256
READER_CHECK_S = 1.0  # a reader killed in any process stops others' writes at most this long
# Evict down to this fraction of the budget: LMDB needs room for branch pages, its free list,
# and the pages the last two snapshots still hold.
_FILL = 3 / 4
_SET_TRIES = 3  # a batch that meets a full map at the budget frees room at most twice


class LMDBStorage(BookedStorage):
    """``path``: the store directory; ``budget_bytes``: the most disk it may use (the map never
    grows past it). Options are described in ``docs/storage_tier.md``: ``durable`` (fsync every
    commit), ``writemap`` (values straight into the reserved shared map), ``hugepages`` (huge-page
    advice on the map), ``io_threads`` (threads that hash and copy page bytes)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        namespace: StorageNamespace,
        page_nbytes: int,
        *,
        budget_bytes: int,
        durable: bool = False,
        readahead: bool = True,
        writemap: bool = True,
        hugepages: bool = False,
        io_threads: int | None = None,
    ) -> None:
        super().__init__(namespace, page_nbytes)
        self._record = record_cost(page_nbytes)
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
            raise InvalidArgumentError(f"budget_bytes={budget_bytes!r} must be an int")
        if budget_bytes < 4 * self._record + _MIN_MAP // 4:
            raise InvalidArgumentError(
                f"budget_bytes={budget_bytes} is too small for pages of {page_nbytes} bytes; "
                f"give at least {4 * self._record + _MIN_MAP // 4}"
            )
        self.path = Path(path)
        self.budget_bytes = budget_bytes
        self._options = dict(
            durable=durable, readahead=readahead, writemap=writemap, hugepages=hugepages
        )
        self._io_threads = check_io_threads(io_threads)
        self._lock = threading.RLock()
        self._stats = StorageStats(budget_bytes=budget_bytes)
        self._touched: dict[bytes, None] = {}
        self._open()

    # -- environment --------------------------------------------------------------------------
    def _open(self) -> None:
        if (self.path / SLABS).is_dir():  # refused before LMDB adds databases to a slab index
            raise StorageOpenError(f"{self.path} holds the slab layout: use storage_layout='slab'")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageOpenError(f"cannot create store directory {self.path}: {exc}") from exc
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise StorageOpenError(f"store directory {self.path} is not writable")
        data = self.path / "data.mdb"
        start = max(_MIN_MAP, data.stat().st_size if data.exists() else 0)
        opts = dict(self._options, map_size=min(self.budget_bytes, start))
        self._shared = lmdb_env.acquire(self.path, data, opts)
        self._env = self._shared.env
        self._lock = self._shared.lock
        self._data_file = data
        try:
            self._books = Books.open(self._env, self.page_nbytes)
        except lmdb.Error as exc:  # a full disk while creating its databases, a corrupt file
            lmdb_env.release(self._shared)
            raise StorageOpenError(f"cannot open LMDB store at {self.path}: {exc}") from exc
        self._pages, self._headers = self._books.pages, self._books.headers
        self._pid = os.getpid()

    def _env_for_this_process(self) -> lmdb.Environment:
        # An LMDB environment must not be used across fork: the child closes the one it
        # inherited (LMDB then clears only its own reader slots) and opens its own.
        if os.getpid() != self._pid:
            lmdb_env.drop_inherited(self._shared)
            self._touched = {}
            self._open()
        return self._env

    def _read(self, fn):
        """Run ``fn(txn)`` in a read transaction, adopting a map another process grew."""
        env = self._env_for_this_process()
        for _ in range(8):
            try:
                with env.begin(buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                self._shared.adopt()
        raise StorageOpenError(f"LMDB store at {self.path} keeps resizing under this reader")

    def _grow(self) -> bool:
        """Double the map, up to the budget. False when it is already there, or when the disk
        has no room for the larger map (counted)."""
        size = self._env.info()["map_size"]
        if size >= self.budget_bytes:
            return False
        err = self._shared.resize(min(self.budget_bytes, size * 2))
        if err:
            self._stats.count_error(f"grow map: {errno.errorcode.get(err, err)}")
            return False
        self._stats.map_resizes += 1
        return True

    def _grow_for(self, incoming: int) -> None:
        """Grow the map before a write that would fill it: a MapFull aborts the whole batch
        transaction, and its retry copies and checksums every page again."""
        env = self._env_for_this_process()
        used = self._read(self._books.used)
        while (used + incoming) * 2 > env.info()["map_size"] and self._grow():
            pass

    def _write(self, fn, what: str):
        """Run ``fn(txn)`` in one write transaction, growing the map on MapFull and adopting a
        size another process set. Disk trouble is counted and returns None."""
        env = self._env_for_this_process()
        self._shared.clear_stale_readers(READER_CHECK_S)
        for _ in range(64):
            self._pending_evictions = 0
            try:
                with env.begin(write=True) as txn:
                    result = fn(txn)
                self._stats.evictions += self._pending_evictions
                return result
            except lmdb.MapResizedError:
                self._shared.adopt()
            except lmdb.MapFullError:
                if not self._grow():
                    raise
            except (lmdb.Error, OSError) as exc:
                if not lmdb_env.disk_trouble(exc):
                    raise
                self._stats.count_error(f"{what}: {type(exc).__name__}")
                return None
        return None

    def _evict_for(self, txn: lmdb.Transaction, need: int) -> bool:
        """Evict oldest pages (any namespace) until ``need`` more bytes fit the budget."""
        fits, evicted = self._books.evict_oldest(txn, need, int(self.budget_bytes * _FILL))
        if not fits:
            self._shared.clear_stale_readers()  # a dead reader may pin what eviction freed
        self._pending_evictions += evicted
        return fits

    def _evict_fraction(self, denominator: int) -> None:
        """Free ``1/denominator`` of the store in its own transaction, then commit an empty one:
        LMDB reuses freed pages only once no snapshot (the last two commits) still holds them."""

        def evict(txn: lmdb.Transaction) -> None:
            used = self._books.used(txn)
            self._evict_for(txn, int(self.budget_bytes * _FILL) - used + used // denominator)

        try:
            self._write(evict, "evict")
            self._write(self._books.next_tick, "evict")
        except lmdb.MapFullError:
            self._stats.count_error("evict: map full")

    def _flush_touched(self, txn: lmdb.Transaction) -> None:
        touched, self._touched = self._touched, {}
        if touched:
            self._books.refresh(txn, touched)

    def _intact(self) -> bool:
        """False (and counted) when the store's data file was removed or replaced under this
        open environment: its reads would come from a deleted file and its writes be lost."""
        if lmdb_env.inode(self._data_file) == self._shared.inode:
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
        out: list[bool] = []
        bad: list[bytes] = []
        zero_copy = bool(getattr(source, "page_bytes_zero_copy", False))
        rows = page_rows(source)
        fp = self.namespace.fingerprint

        def serve(txn: lmdb.Transaction) -> None:
            jobs = []
            for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
                raw = txn.get(key, db=self._headers)
                payload = txn.get(key, db=self._pages)
                if raw is None or payload is None:
                    continue
                header = value_format.unpack(raw) if len(payload) == self.page_nbytes else None
                dst = None
                if zero_copy:
                    dst = rows[page] if rows is not None else source.get_page_bytes(page).numpy()
                jobs.append((i, header, payload, page, dst, key))
            # Copy and verify pages on the I/O threads while this transaction keeps the map's
            # pages alive; a source that is not a writable view takes its pages one at a time.
            threads = self._io_threads if zero_copy else 1
            delivered = split_map(
                lambda job: deliver(fp, job[1], job[2], source, job[3], job[4], job[5]),
                jobs,
                threads,
            )
            found = dict(zip((job[0] for job in jobs), delivered, strict=True))
            for i, key in enumerate(keys):
                self._stats.gets += 1
                ok = found.get(i)
                if ok is None:
                    self._stats.misses += 1
                    out.append(False)
                elif not ok:
                    bad.append(key)
                    self._stats.checksum_failures += 1
                    self._stats.misses += 1
                    out.append(False)
                else:
                    self._touched[key] = None
                    self._stats.hits += 1
                    out.append(True)

        with self._lock:
            self._read(serve)
            if bad:
                self._write(lambda txn: [self._books.remove(txn, k) for k in bad], "delete corrupt")
            if len(self._touched) >= _FLUSH_EVERY:
                self._write(self._flush_touched, "recency")
        return out

    @lmdb_env.absorbs_lmdb_errors(lambda store, keys, *rest: [False] * len(keys))
    def batch_set(
        self, keys: Sequence[bytes], source: PageSource, pages: Sequence[int]
    ) -> list[bool]:
        keys = self._check_keys(keys)
        pages = self._check_pages(keys, source, pages)
        if not self._intact():
            self._stats.sets += len(keys)
            self._stats.set_skipped += len(keys)
            return [False] * len(keys)
        fp = self.namespace.fingerprint
        rows = page_rows(source)

        def page_view(page: int) -> memoryview:
            if rows is not None:
                return memoryview(rows[page])
            return memoryview(source.get_page_bytes(page).numpy())

        sums = ChecksumsAhead()

        def write(txn: lmdb.Transaction) -> list[bool]:
            self._flush_touched(txn)
            done = []
            for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
                if self._books.touch(txn, key):
                    self._stats.existing_refreshed += 1
                    done.append(True)
                    continue
                if not self._evict_for(txn, self._record):
                    done.append(False)
                    continue
                view = page_view(page)
                self._books.insert(
                    txn,
                    key,
                    view,
                    lambda tick, i=i, view=view, key=key: value_format.pack(
                        fp, view, tick, sums.of(i, view), key=key
                    ),
                )
                done.append(True)
            # A batch larger than the budget evicts its own first pages: report what stayed.
            headers = self._headers
            return [
                ok and txn.get(k, db=headers) is not None for ok, k in zip(done, keys, strict=True)
            ]

        def hash_page(i: int) -> tuple[int, int]:
            return i, value_format.checksum(page_view(pages[i]))

        with self._lock:
            self._stats.sets += len(keys)
            headers = self._headers
            present = self._read(lambda txn: [txn.get(k, db=headers) is not None for k in keys])
            missing = [i for i, there in enumerate(present) if not there]
            sums.start(ordered_map(hash_page, missing, self._io_threads))
            self._grow_for(len(missing) * self._record)
            result = None
            for attempt in range(_SET_TRIES):
                try:
                    result = self._write(write, "batch_set")
                    break
                except lmdb.MapFullError:
                    # At the budget with the map fragmented, or another process took the room
                    # freed for this batch: free a quarter of the store, retry.
                    self._stats.count_error("batch_set: map full at budget")
                    if attempt + 1 < _SET_TRIES:
                        self._shared.clear_stale_readers()
                        self._evict_fraction(4)
            if result is None:
                self._stats.set_skipped += len(keys)
                return [False] * len(keys)
            self._stats.set_skipped += result.count(False)
            return result

    @lmdb_env.absorbs_lmdb_errors(lambda store, keys: 0)
    def delete(self, keys: Sequence[bytes]) -> int:
        keys = self._check_keys(keys)
        with self._lock:
            removed = self._write(
                lambda txn: sum(self._books.remove(txn, k) for k in keys), "delete"
            )
            return removed or 0

    @lmdb_env.absorbs_lmdb_errors(lambda store: None)
    def clear(self) -> None:
        fp = self.namespace.fingerprint
        with self._lock:
            self._touched = {}
            self._write(lambda txn: self._books.remove_prefix(txn, fp), "clear")

    @lmdb_env.absorbs_lmdb_errors(lambda store: None)
    def flush(self) -> None:
        """Write pending recency refreshes to LMDB and sync the map to disk."""
        with self._lock:
            if self._touched:
                self._write(self._flush_touched, "recency")
            self._env_for_this_process().sync(True)

    @lmdb_env.absorbs_lmdb_errors(lambda store: store._stats.snapshot())
    def stats(self) -> StorageStats:
        def read(txn: lmdb.Transaction) -> None:
            self._stats.pages = txn.stat(self._headers)["entries"]
            self._stats.bytes = self._books.used(txn)

        with self._lock:
            self._read(read)
            return self._stats.snapshot()

    def disk_bytes(self) -> int:
        """Size of the data file on disk."""
        return self._data_file.stat().st_size if self._data_file.exists() else 0

    def close(self) -> None:
        """Flush recency, sync, and release this process's environment when its last store on
        the directory closes. Safe to call twice; any other call after it raises
        StorageClosedError."""
        with self._lock:
            if self._env is None:
                return
            if os.getpid() == self._pid:
                try:
                    self.flush()
                finally:
                    lmdb_env.release(self._shared)
            self._env = None  # type: ignore[assignment]
            self._closed = True
