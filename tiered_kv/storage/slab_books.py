"""The index of a slab page store, inside one LMDB transaction: which slot holds each page, the
recency clock and LRU order, the free slots of every namespace, the bytes charged and each
namespace's high-water slot.

Databases (created by ``SlabBooks.open``; named ``slab_*`` so they never mix with the lmdb
layout's):
- ``slab_headers``: key -> the ``value_format`` header (fingerprint, length, xxh3-64 of the
  payload, recency tick, all as in the lmdb layout) followed by a slot record: the slot number
  and an xxh32 over key + slot, so a flipped slot number is caught instead of read;
- ``slab_lru``: big-endian tick + key -> empty (a cursor walks oldest first);
- ``slab_free``: fingerprint + kind + big-endian slot -> empty, kind ``BLOCKS`` for a free slot
  that still has its disk blocks, ``HOLE`` for one whose blocks were given back;
- ``slab_meta``: ``tick`` (the clock), ``used`` (bytes charged), ``hw`` + fingerprint (slots
  ever handed out in that namespace's file), ``sb`` + fingerprint (its slot size).
Every method takes the caller's transaction, so an index change happens whole or not at all.
Nothing here touches a slab file: the store allocates and writes blocks, these books say which.

Charges (``used``): every slot with disk blocks its ``slot_bytes``, every page ``ENTRY_COST``
(its header and LRU records with LMDB's page overhead), every free-slot record ``FREE_COST``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import lmdb
import xxhash

from tiered_kv.storage import lmdb_env, value_format
from tiered_kv.storage.keys import FINGERPRINT_BYTES

ENTRY_COST = 1024
FREE_COST = 256
BLOCKS, HOLE = b"\0", b"\1"
_U64 = struct.Struct("<Q")
_SLOT = struct.Struct("<QI")
_TICK, _USED, _HW, _SB = b"tick", b"used", b"hw", b"sb"
VALUE_BYTES = value_format.HEADER_BYTES + _SLOT.size


def _u64(raw) -> int:
    return _U64.unpack(bytes(raw))[0] if raw is not None and len(raw) == _U64.size else 0


def _slot_check(key: bytes, slot: int) -> int:
    return xxhash.xxh32_intdigest(key + slot.to_bytes(8, "little"))


def _free_key(fp: bytes, kind: bytes, slot: int) -> bytes:
    return fp + kind + slot.to_bytes(8, "big")


def _lru_key(tick: int, key: bytes) -> bytes:
    return tick.to_bytes(8, "big") + key


class Entry(NamedTuple):
    """A page's index record: the raw value (to tell later whether it changed), its header and
    its slot (None where that part is unreadable)."""

    raw: bytes
    header: value_format.Header | None
    slot: int | None


def pack_value(key: bytes, header: bytes, slot: int) -> bytes:
    return header + _SLOT.pack(slot, _slot_check(key, slot))


def unpack_value(key: bytes, raw) -> Entry:
    raw = bytes(raw)
    if len(raw) != VALUE_BYTES:
        return Entry(raw, None, None)
    header = value_format.unpack(raw[: value_format.HEADER_BYTES])
    slot, check = _SLOT.unpack(raw[value_format.HEADER_BYTES :])
    return Entry(raw, header, slot if check == _slot_check(key, slot) else None)


@dataclass(frozen=True)
class SlabBooks:
    headers: lmdb._Database
    lru: lmdb._Database
    free: lmdb._Database
    meta: lmdb._Database

    @classmethod
    def open(cls, env: lmdb.Environment) -> SlabBooks:
        names = (b"slab_headers", b"slab_lru", b"slab_free", b"slab_meta")
        return cls(*(env.open_db(name) for name in names))

    # -- counters -----------------------------------------------------------------------------
    def used(self, txn: lmdb.Transaction) -> int:
        return _u64(txn.get(_USED, db=self.meta))

    def add_used(self, txn: lmdb.Transaction, delta: int) -> int:
        used = max(0, self.used(txn) + delta)
        txn.put(_USED, _U64.pack(used), db=self.meta)
        return used

    def next_tick(self, txn: lmdb.Transaction) -> int:
        tick = _u64(txn.get(_TICK, db=self.meta)) + 1
        txn.put(_TICK, _U64.pack(tick), db=self.meta)
        return tick

    def high_water(self, txn: lmdb.Transaction, fp: bytes) -> int:
        return _u64(txn.get(_HW + fp, db=self.meta))

    def set_high_water(self, txn: lmdb.Transaction, fp: bytes, slots: int) -> None:
        txn.put(_HW + fp, _U64.pack(slots), db=self.meta)

    def register(self, txn: lmdb.Transaction, fp: bytes, slot_bytes: int) -> None:
        """Record a namespace's slot size (so another namespace can give its blocks back)."""
        if self.slot_bytes_of(txn, fp) != slot_bytes:
            txn.put(_SB + fp, _U64.pack(slot_bytes), db=self.meta)

    def slot_bytes_of(self, txn: lmdb.Transaction, fp: bytes) -> int:
        return _u64(txn.get(_SB + fp, db=self.meta))

    def namespaces(self, txn: lmdb.Transaction) -> list[bytes]:
        """Fingerprints of every namespace with a slot size on record."""
        cursor, out = txn.cursor(db=self.meta), []
        if cursor.set_range(_SB):
            for key in cursor.iternext(values=False):
                key = bytes(key)
                if not key.startswith(_SB):
                    break
                if len(key) == len(_SB) + FINGERPRINT_BYTES:
                    out.append(key[len(_SB) :])
        return out

    # -- pages --------------------------------------------------------------------------------
    def lookup(self, txn: lmdb.Transaction, key: bytes) -> Entry | None:
        raw = txn.get(key, db=self.headers)
        return None if raw is None else unpack_value(key, raw)

    def leading_present(self, txn: lmdb.Transaction, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, have a page (a header) in the store."""
        return lmdb_env.leading_present(txn, self.headers, keys)

    def insert(self, txn: lmdb.Transaction, key: bytes, header_of, slot: int) -> None:
        """Map a new page to ``slot`` (header ``header_of(tick)``), newest in the LRU."""
        tick = self.next_tick(txn)
        txn.put(key, pack_value(key, header_of(tick), slot), db=self.headers)
        txn.put(_lru_key(tick, key), b"", db=self.lru)
        self.add_used(txn, ENTRY_COST)

    def touch(
        self,
        txn: lmdb.Transaction,
        key: bytes,
        newer_than: int | None = None,
        tick=None,
        known: Entry | None = None,
    ) -> bool:
        """Make ``key`` the most recent page unless its tick is above ``newer_than``; False when
        it is absent (or unreadable). ``known``: the record a read found for ``key``; while the
        index still holds exactly those bytes it is not parsed again."""
        raw = txn.get(key, db=self.headers)
        if raw is None:
            return False
        if known is not None and known.header is not None and known.raw == raw:
            entry = known
        else:
            entry = unpack_value(key, raw)
        if entry.header is None or entry.slot is None:
            return False
        if newer_than is not None and entry.header.tick > newer_than:
            return True
        if tick is None:
            tick = self.next_tick(txn)
        txn.delete(_lru_key(entry.header.tick, key), db=self.lru)
        txn.put(_lru_key(tick, key), b"", db=self.lru)
        header = value_format.with_tick(entry.raw[: value_format.HEADER_BYTES], tick)
        txn.put(key, header + entry.raw[value_format.HEADER_BYTES :], db=self.headers)
        return True

    def refresh(
        self, txn: lmdb.Transaction, keys, known: Mapping[bytes, Entry] | None = None
    ) -> None:
        """Write the recency of pages that were read (``known``: the records the reads found,
        by key); one already among the newest quarter keeps its place (the bump-once rule, as
        in ``lmdb_books``)."""
        clock = _u64(txn.get(_TICK, db=self.meta))
        newest_quarter = clock - txn.stat(self.headers)["entries"] // 4
        known = known or {}
        for key in keys:
            if self.touch(txn, key, newest_quarter, clock + 1, known.get(key)):
                clock += 1
        txn.put(_TICK, _U64.pack(clock), db=self.meta)

    def remove(self, txn: lmdb.Transaction, key: bytes) -> tuple[bool, int | None]:
        """Unmap ``key``: (whether it was present, its slot if readable). The slot is not yet
        free: the caller frees it with ``put_free`` at the end of the transaction."""
        entry = self.lookup(txn, key)
        if entry is None:
            return False, None
        if entry.header is not None:
            txn.delete(_lru_key(entry.header.tick, key), db=self.lru)
        txn.delete(key, db=self.headers)
        self.add_used(txn, -ENTRY_COST)
        return True, entry.slot

    def evict_oldest(self, txn: lmdb.Transaction) -> tuple[bytes, int | None] | None:
        """Unmap the least recent page (any namespace): (its key, its slot), or None when the
        store is empty. LRU records whose page is gone are dropped on the way."""
        cursor = txn.cursor(db=self.lru)
        while cursor.first():
            key = bytes(cursor.key())[8:]
            cursor.delete()
            entry = self.lookup(txn, key)
            if entry is None:
                continue
            txn.delete(key, db=self.headers)
            self.add_used(txn, -ENTRY_COST)
            return key, entry.slot
        return None

    def keys_of(self, txn: lmdb.Transaction, fp: bytes) -> list[bytes]:
        cursor, keys = txn.cursor(db=self.headers), []
        if cursor.set_range(fp):
            for key in cursor.iternext(values=False):
                if not bytes(key).startswith(fp):
                    break
                keys.append(bytes(key))
        return keys

    # -- free slots ---------------------------------------------------------------------------
    def put_free(self, txn: lmdb.Transaction, fp: bytes, slots, kind: bytes = BLOCKS) -> None:
        for slot in slots:
            if txn.put(_free_key(fp, kind, slot), b"", db=self.free, overwrite=False):
                self.add_used(txn, FREE_COST)

    def take_free(self, txn: lmdb.Transaction, fp: bytes, kind: bytes = BLOCKS) -> int | None:
        """A free slot of ``fp``'s file of that kind (its record removed), or None."""
        cursor = txn.cursor(db=self.free)
        prefix = fp + kind
        if not cursor.set_range(prefix):
            return None
        key = bytes(cursor.key())
        if not key.startswith(prefix) or len(key) != len(prefix) + 8:
            return None
        cursor.delete()
        self.add_used(txn, -FREE_COST)
        return int.from_bytes(key[len(prefix) :], "big")

    def free_of_others(
        self, txn: lmdb.Transaction, fp: bytes, limit: int, kind: bytes = BLOCKS
    ) -> list[tuple[bytes, int]]:
        """Up to ``limit`` free slots of that kind in other namespaces' files."""
        cursor, out = txn.cursor(db=self.free), []
        more = cursor.first()
        while more and len(out) < limit:
            key = bytes(cursor.key())
            other = key[:FINGERPRINT_BYTES]
            if other == fp or len(key) != FINGERPRINT_BYTES + 9:
                more = cursor.set_range(other + b"\xff" * 10)
                continue
            if key[FINGERPRINT_BYTES : FINGERPRINT_BYTES + 1] != kind:
                more = cursor.set_range(other + b"\xff" * 10)
                continue
            out.append((other, int.from_bytes(key[FINGERPRINT_BYTES + 1 :], "big")))
            more = cursor.next()
        return out

    def mark_hole(self, txn: lmdb.Transaction, fp: bytes, slot: int, slot_bytes: int) -> None:
        """A free slot of ``fp`` gave its blocks back: it is a hole now, uncharged."""
        if txn.delete(_free_key(fp, BLOCKS, slot), db=self.free):
            txn.put(_free_key(fp, HOLE, slot), b"", db=self.free)
            self.add_used(txn, -slot_bytes)

    def holes(self, txn: lmdb.Transaction, fp: bytes) -> list[int]:
        cursor, out, prefix = txn.cursor(db=self.free), [], fp + HOLE
        if cursor.set_range(prefix):
            for key in cursor.iternext(values=False):
                key = bytes(key)
                if not key.startswith(prefix):
                    break
                out.append(int.from_bytes(key[len(prefix) :], "big"))
        return out
