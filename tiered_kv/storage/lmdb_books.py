"""The bookkeeping of an LMDB page store, inside one transaction: the recency clock, the bytes in
use, the LRU index, and removing or evicting pages with everything that names them.

Databases (opened by ``LMDBStorage``): ``pages`` key -> payload, ``headers`` key -> header (with
the page's recency tick), ``lru`` big-endian tick + key -> empty (a cursor walks oldest first)
and ``meta`` (``tick``: the clock, ``used``: bytes charged). Every method takes the caller's
transaction, so a page, its header, its LRU entry and the counters change together or not at all.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import lmdb

from tiered_kv.storage import lmdb_env, value_format
from tiered_kv.storage.lmdb_env import record_cost

_U64 = struct.Struct("<Q")
_TICK = b"tick"
_USED = b"used"


def _u64(raw: bytes | memoryview | None) -> int:
    return 0 if raw is None else _U64.unpack(bytes(raw))[0]


def _lru_key(tick: int, key: bytes) -> bytes:
    return tick.to_bytes(8, "big") + key


@dataclass(frozen=True)
class Books:
    pages: lmdb._Database
    headers: lmdb._Database
    lru: lmdb._Database
    meta: lmdb._Database
    page_nbytes: int  # what a page without a readable header is charged as

    @classmethod
    def open(cls, env: lmdb.Environment, page_nbytes: int) -> Books:
        """The store's four named databases in ``env`` (created on first open). A map another
        process grew since ``env`` was opened is adopted (its blocks are reserved there)."""
        for _ in range(8):
            try:
                dbs = [env.open_db(name) for name in (b"pages", b"headers", b"lru", b"meta")]
                return cls(*dbs, page_nbytes)
            except lmdb.MapResizedError:
                env.set_mapsize(0)
        raise lmdb.MapResizedError("the map kept growing while the store's databases were opened")

    def used(self, txn: lmdb.Transaction) -> int:
        return _u64(txn.get(_USED, db=self.meta))

    def leading_present(self, txn: lmdb.Transaction, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, have a page (a header) in the store."""
        return lmdb_env.leading_present(txn, self.headers, keys)

    def remove_prefix(self, txn: lmdb.Transaction, prefix: bytes) -> int:
        """Remove every page whose key starts with ``prefix`` (a namespace); returns how many."""
        cursor, keys = txn.cursor(db=self.headers), []
        if cursor.set_range(prefix):
            for key in cursor.iternext(values=False):
                if not bytes(key).startswith(prefix):
                    break
                keys.append(bytes(key))
        return sum(self.remove(txn, key) for key in keys)

    def next_tick(self, txn: lmdb.Transaction) -> int:
        tick = _u64(txn.get(_TICK, db=self.meta)) + 1
        txn.put(_TICK, _U64.pack(tick), db=self.meta)
        return tick

    def add_used(self, txn: lmdb.Transaction, delta: int) -> int:
        used = max(0, self.used(txn) + delta)
        txn.put(_USED, _U64.pack(used), db=self.meta)
        return used

    def insert(self, txn: lmdb.Transaction, key: bytes, payload, header_of) -> None:
        """Store a new page: payload, header (``header_of(tick)``), LRU entry, bytes charged."""
        tick = self.next_tick(txn)
        txn.put(key, payload, db=self.pages)
        txn.put(key, header_of(tick), db=self.headers)
        txn.put(_lru_key(tick, key), b"", db=self.lru)
        self.add_used(txn, record_cost(self.page_nbytes))

    def touch(
        self,
        txn: lmdb.Transaction,
        key: bytes,
        newer_than: int | None = None,
        tick: int | None = None,
    ) -> bool:
        """Make ``key`` the most recent page (with ``tick`` when the caller hands out ticks),
        unless its tick is already above ``newer_than``; False when the key is absent."""
        raw = txn.get(key, db=self.headers)
        header = value_format.unpack(raw) if raw is not None else None
        if header is None:
            return False
        if newer_than is not None and header.tick > newer_than:
            return True
        if tick is None:
            tick = self.next_tick(txn)
        txn.delete(_lru_key(header.tick, key), db=self.lru)
        txn.put(_lru_key(tick, key), b"", db=self.lru)
        txn.put(key, value_format.with_tick(bytes(raw), tick), db=self.headers)
        return True

    def refresh(self, txn: lmdb.Transaction, keys) -> None:
        """Write the recency of pages that were read. A page already among the newest quarter
        of the store keeps its place (eviction takes from the old end, so moving it changes
        nothing until it has aged: the bump-once rule of production caches)."""
        clock = _u64(txn.get(_TICK, db=self.meta))
        newest_quarter = clock - txn.stat(self.headers)["entries"] // 4
        for key in keys:
            if self.touch(txn, key, newest_quarter, clock + 1):
                clock += 1  # handed out (or not needed: a skipped tick is harmless)
        txn.put(_TICK, _U64.pack(clock), db=self.meta)

    def remove(self, txn: lmdb.Transaction, key: bytes) -> bool:
        raw = txn.get(key, db=self.headers)
        if raw is None and txn.get(key, db=self.pages) is None:
            return False
        header = value_format.unpack(raw) if raw is not None else None
        if header is not None:
            txn.delete(_lru_key(header.tick, key), db=self.lru)
            self.add_used(txn, -record_cost(header.length))
        txn.delete(key, db=self.headers)
        txn.delete(key, db=self.pages)
        return True

    def evict_oldest(self, txn: lmdb.Transaction, need: int, limit: int) -> tuple[bool, int]:
        """Evict the oldest pages (any namespace) until ``need`` more bytes fit under ``limit``.
        Returns (whether they fit, pages evicted)."""
        used = self.used(txn)
        cursor = txn.cursor(db=self.lru)
        evicted = 0
        while used + need > limit:
            if not cursor.first():
                if used:  # nothing left, so nothing is stored: a count that says otherwise (a
                    # flipped bit) would skip every write for ever
                    used = self.add_used(txn, -used)
                    continue
                return False, evicted
            key = bytes(cursor.key())[8:]
            cursor.delete()
            raw = txn.get(key, db=self.headers)
            header = value_format.unpack(raw) if raw is not None else None
            txn.delete(key, db=self.headers)
            txn.delete(key, db=self.pages)
            used = self.add_used(txn, -record_cost(header.length if header else self.page_nbytes))
            evicted += 1
        return True, evicted
