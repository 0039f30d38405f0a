"""The files behind one :class:`SlabStorage`: the shared LMDB environment of the index, this
namespace's slab file and others' (opened to give their blocks back), and the transactions run
on them.

The environment is ``lmdb_env``'s, shared per (directory, process), opened without ``writemap``
(the index is small; LMDB's ``pwrite`` reports a full disk as an error). Opening refuses a
directory of the lmdb layout, creates ``slabs/`` first (so a slab directory is recognisable even
if the first open dies), records the namespace's slot size, and, under the write lock, gives
back blocks that writers allocated and never committed (a crash, an abort): every slab file is
cut to its high-water mark and its holes are punched again. After ``fork`` the child drops the
inherited environment and descriptors and opens its own. ``intact`` notices a directory removed
or replaced under an open store (the data file's inode changed).

**The index reserve.** LMDB never changes a page in place: a commit writes its new copy of every
page it touched into a page of its free list or, when none can be reused, past the file's last
page. Without ``writemap`` ``data.mdb`` is sparse, so those pages needed new disk blocks, and on a
disk another file had filled, the commit of the very transaction that evicted pages to make room
failed (ENOSPC; EIO for a short write), its evictions rolled back with it and the store never
stored again. So before each write transaction ``data.mdb`` is kept allocated through
``INDEX_RESERVE`` bytes past LMDB's last page (``fallocate``, only when that page moved): a commit
on a full disk writes into blocks the file already has, and at the budget LMDB reuses its free
pages, so the reserve is rarely touched. A reserve the full disk cannot refill is counted once
(``reserve index: ENOSPC``); ``write`` says in ``out_of_space`` when a transaction failed for want
of space, so the store can retry it smaller.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from tiered_kv.storage import lmdb_env, map_file
from tiered_kv.storage.contract import StorageStats
from tiered_kv.storage.lmdb_env import StorageOpenError
from tiered_kv.storage.slab_books import SlabBooks
from tiered_kv.storage.slab_file import SlabFile

SLABS = "slabs"
READER_CHECK_S = 1.0  # a reader killed in any process stops others' writes at most this long
# Disk blocks data.mdb keeps allocated past LMDB's last page (64 pages of 4 KiB). Measured at the
# budget, a set of 16 pages moves the last page by 44-71 pages while a reader pins LMDB's free
# list, by 0-3 (256 pages: 0-11) while LMDB reuses it; bigger sets on a full disk are cut smaller.
INDEX_RESERVE = 256 << 10
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EIO)


@dataclass
class Pending:
    """What a write transaction did, counted only once it commits (or its errors, if not)."""

    evicted: int = 0
    errors: list[str] = field(default_factory=list)


def count_os_error(stats: StorageStats, what: str, exc: OSError) -> None:
    stats.count_error(f"{what}: {errno.errorcode.get(exc.errno or 0, type(exc).__name__)}")


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` may say the disk (or the quota) is full: ENOSPC, EDQUOT, or the EIO LMDB
    reports for a short write (a file system with room for part of a page)."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(exc, lmdb.Error) and getattr(exc, "code", 0) in _NO_SPACE


def recover(txn: lmdb.Transaction, books: SlabBooks, slab_of) -> None:
    """Give back the blocks no committed slot owns, in every namespace's file: past its
    high-water mark, and in its holes. Runs under the write lock, so no writer is between
    allocating and committing."""
    for fp in books.namespaces(txn):
        slab = slab_of(fp, books.slot_bytes_of(txn, fp))
        if slab is None:
            continue
        slab.trim(books.high_water(txn, fp))
        holes = books.holes(txn, fp)
        start = 0
        while start < len(holes):  # consecutive holes in one call
            end = start + 1
            while end < len(holes) and holes[end] == holes[end - 1] + 1:
                end += 1
            slab.release(holes[start], end - start)
            start = end


class SlabEnv:
    def __init__(
        self, path: Path, fp: bytes, page_nbytes: int, budget_bytes: int, durable: bool
    ) -> None:
        self.path, self.fp, self.page_nbytes = path, fp, page_nbytes
        self._budget, self._durable = budget_bytes, durable
        self.others: dict[bytes, SlabFile] = {}
        self._open()

    def _open(self) -> None:
        data, slabs = self.path / "data.mdb", self.path / SLABS
        if data.exists() and not slabs.is_dir():
            raise StorageOpenError(
                f"{self.path} holds a store of the lmdb layout; open it with "
                "storage_layout='lmdb' or give the slab layout another storage_path"
            )
        try:
            slabs.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageOpenError(f"cannot create store directory {slabs}: {exc}") from exc
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise StorageOpenError(f"store directory {self.path} is not writable")
        size = data.stat().st_size if data.exists() else 0
        opts = dict(
            durable=self._durable,
            readahead=True,
            writemap=False,
            hugepages=False,
            map_size=max(self._budget, size, 32 << 20),
        )
        self.shared = lmdb_env.acquire(self.path, data, opts)
        self.env, self.lock, self.data_file = self.shared.env, self.shared.lock, data
        self.slab: SlabFile | None = None
        try:
            self.books = SlabBooks.open(self.env)
            with self.env.begin() as txn:
                if txn.get(b"pages") is not None:
                    raise StorageOpenError(f"{self.path} holds a store of the lmdb layout")
            self.slab = SlabFile(slabs / f"{self.fp.hex()}.slab", self.page_nbytes)
            with self.env.begin(write=True) as txn:
                known = self.books.slot_bytes_of(txn, self.fp)
                if known and known != self.slab.slot_bytes:
                    raise StorageOpenError(
                        f"{self.path}: namespace {self.fp.hex()} holds slots of {known} bytes; "
                        f"pages of {self.page_nbytes} bytes need {self.slab.slot_bytes}"
                    )
                self.books.register(txn, self.fp, self.slab.slot_bytes)
                recover(txn, self.books, self.slab_of)
            self._psize, self._reserved_to = self.env.stat()["psize"], 0
            self.index_short = self.out_of_space = False
            self.keep_index_reserve(whole=True)  # short on a full disk: the first write counts it
        except (lmdb.Error, OSError, StorageOpenError) as exc:
            self.close_files()
            lmdb_env.release(self.shared)
            if isinstance(exc, StorageOpenError):
                raise
            raise StorageOpenError(f"cannot open slab store at {self.path}: {exc}") from exc
        self.pid = os.getpid()

    def slab_of(self, fp: bytes, slot_bytes: int) -> SlabFile | None:
        """A namespace's slab file of slots of ``slot_bytes`` (another's opened once, never
        created), or None."""
        if fp == self.fp:
            return self.slab
        slab = self.others.get(fp)
        if slab is None and slot_bytes > 0:
            try:
                slab = SlabFile(self.path / SLABS / f"{fp.hex()}.slab", slot_bytes, create=False)
            except OSError:
                return None
            self.others[fp] = slab
        return slab

    def close_files(self) -> None:
        for slab in [self.slab, *self.others.values()]:
            if slab is not None:
                slab.close()
        self.others = {}

    def close(self) -> None:
        self.close_files()
        lmdb_env.release(self.shared)

    def forked(self) -> bool:
        """In a child of ``fork``: drop what was inherited and open our own (True)."""
        if os.getpid() == self.pid:
            return False
        lmdb_env.drop_inherited(self.shared)
        self.close_files()
        self._open()
        return True

    def keep_index_reserve(self, whole: bool = False) -> int:
        """Allocate the blocks of ``data.mdb`` through ``INDEX_RESERVE`` bytes past LMDB's last
        page (the file's tail only, unless ``whole``). 0, or the errno that left the reserve
        short (ENOSPC: the disk is full; a file system without ``fallocate`` keeps none)."""
        try:
            end = (self.env.info()["last_pgno"] + 1) * self._psize + INDEX_RESERVE
        except lmdb.Error:
            return 0
        if end <= self._reserved_to and not whole:  # the file never shrinks: still there
            return 0
        try:
            fd = os.open(self.data_file, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            return exc.errno or errno.EIO
        try:
            start = 0 if whole else os.fstat(fd).st_size  # LMDB wrote every page below it
            if start < end and map_file._libc.fallocate(fd, 0, start, end - start) != 0:
                err = ctypes.get_errno() or errno.EIO
                return 0 if err in map_file.UNSUPPORTED else err
            self._reserved_to = max(start, end)
            return 0
        finally:
            os.close(fd)

    def intact(self) -> bool:
        return lmdb_env.inode(self.data_file) == self.shared.inode

    def disk_bytes(self) -> int:
        """Disk blocks the store's files hold (what ``du`` counts for the directory)."""
        paths = [self.path / "data.mdb", self.path / "lock.mdb"]
        try:
            paths += list((self.path / SLABS).iterdir())
        except OSError:
            pass
        total = 0
        for p in paths:
            try:
                total += os.stat(p).st_blocks * 512
            except OSError:
                pass
        return total

    # -- transactions -------------------------------------------------------------------------
    def read(self, fn):
        for _ in range(8):
            try:
                with self.env.begin(buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                self.shared.adopt()
        raise StorageOpenError(f"slab store at {self.path} keeps resizing under this reader")

    def write(self, fn, stats: StorageStats, what: str):
        """``fn(txn, pending)`` in one write transaction; once it commits, its evictions and
        errors are counted in ``stats``. LMDB or disk trouble is counted and returns None (the
        transaction aborted: nothing it did to the index stays)."""
        self.shared.clear_stale_readers(READER_CHECK_S)
        err = self.keep_index_reserve()
        if err and not self.index_short:  # once each time the disk fills under the index
            stats.count_error(f"reserve index: {errno.errorcode.get(err, err)}")
        self.index_short, self.out_of_space = bool(err), False
        for _ in range(8):
            pending = Pending()
            try:
                with self.env.begin(write=True) as txn:
                    result = fn(txn, pending)
            except lmdb.MapResizedError:
                self.shared.adopt()
                continue
            except (lmdb.Error, OSError) as exc:
                self.out_of_space = no_space(exc)
                for err in pending.errors:
                    stats.count_error(err)
                if isinstance(exc, OSError):
                    count_os_error(stats, what, exc)
                else:
                    stats.count_error(f"{what}: {type(exc).__name__}")
                return None
            stats.evictions += pending.evicted
            for err in pending.errors:
                stats.count_error(err)
            return result
        return None
