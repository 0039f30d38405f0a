"""Handing out slots of one namespace's slab inside a write transaction, within the budget.

In order of cost: free slots of this namespace's file that still have their blocks (freed by
an earlier, committed transaction); then, where the budget has room, holes of this file filled
with new blocks and slots past its high-water mark (one ``fallocate`` for the run); where the
budget has no room, other namespaces' free slots first give their blocks back (a hole punched:
the budget is one for the whole directory). Whatever is still short is made room for by evicting
the oldest pages (any namespace), but their slots are *not* handed out in this transaction: a
slot is written before the transaction that maps it commits, so reusing a slot freed by the same
transaction would overwrite a page that is still mapped if that transaction aborted. The store
writes the rest in its next transaction.

A full disk is a failed ``fallocate``: counted, and treated like a full budget (evict, reuse).
A slot the index holds free with blocks may have none (a transaction gave them back, then
aborted): its write fails on a full disk, and ``lose_blocks`` makes it a hole.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass, field

import lmdb

from tiered_kv.storage.slab_books import ENTRY_COST, FREE_COST, HOLE, SlabBooks
from tiered_kv.storage.slab_file import SlabFile


@dataclass
class Allocation:
    """What one transaction's allocation did: slots to write (in order), pages evicted, the
    slots it unmapped (per namespace; the caller frees them at the end of the transaction) and
    errors to count."""

    slots: list[int] = field(default_factory=list)
    evicted: int = 0
    freed: dict[bytes, list[int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    grown: tuple[int, int] | None = None  # (high-water before, after) when the file grew
    filled: list[int] = field(default_factory=list)  # holes given blocks again


def _name(err: int) -> str:
    return errno.errorcode.get(err, str(err))


@dataclass
class SlabAllocator:
    books: SlabBooks
    fp: bytes
    slab: SlabFile
    slab_of: Callable[[bytes, int], SlabFile | None]  # a namespace's file of slots, or None
    limit: int  # bytes the books may charge

    def allocate(self, txn: lmdb.Transaction, n: int, freed: dict) -> Allocation:
        """Up to ``n`` slots for new pages of this namespace (their page entries charged by
        the caller's inserts); evicts for the shortfall (the slots freed go to ``freed``)."""
        out = Allocation(freed=freed)
        while len(out.slots) < n:
            slot = self.books.take_free(txn, self.fp)
            if slot is None:
                break
            out.slots.append(slot)
        if len(out.slots) < n:
            self._grow(txn, n - len(out.slots), out)
        short = n - len(out.slots)
        if short:
            out.evicted = self._evict_for(txn, short, out.freed)
        return out

    def undo_blocks(self, out: Allocation) -> None:
        """In a transaction about to abort (still under the write lock, so nobody grew the file
        since): give back the blocks it allocated, which the rolled-back index will not charge."""
        if out.grown is not None:
            try:
                self.slab.trim(out.grown[0])
            except OSError:
                pass
        for slot in out.filled:
            self.slab.release(slot)

    def lose_blocks(self, txn: lmdb.Transaction, slots: list[int]) -> None:
        """Slots of this file that could not be written for want of disk blocks become holes
        (their partial blocks given back, their charge dropped)."""
        for slot in slots:
            self.slab.release(slot)
        self.books.put_free(txn, self.fp, slots, HOLE)
        self.books.add_used(txn, -len(slots) * self.slab.slot_bytes)

    # -- growth -------------------------------------------------------------------------------
    def _room(self, txn: lmdb.Transaction, pending: int) -> int:
        """Slots the budget can still charge, after ``pending`` page entries to come."""
        per = self.slab.slot_bytes + ENTRY_COST
        return max(0, (self.limit - self.books.used(txn) - pending * ENTRY_COST) // per)

    def _grow(self, txn: lmdb.Transaction, want: int, out: Allocation) -> None:
        pending = len(out.slots)
        can = self._room(txn, pending)
        if can < want:
            self._release_others(txn, (want - can) * (self.slab.slot_bytes + ENTRY_COST), out)
            can = self._room(txn, pending)
        k = min(want, can)
        sb = self.slab.slot_bytes
        while k > 0:  # holes of this file first: the file does not get longer
            slot = self.books.take_free(txn, self.fp, HOLE)
            if slot is None:
                break
            err = self.slab.allocate(slot, 1)
            if err:
                self.books.put_free(txn, self.fp, [slot], HOLE)
                out.errors.append(f"grow slab: {_name(err)}")
                return
            self.books.add_used(txn, sb)
            out.filled.append(slot)
            out.slots.append(slot)
            k -= 1
        if k <= 0:
            return
        hw = self.books.high_water(txn, self.fp)
        got = k if self.slab.allocate(hw, k) == 0 else 0
        if not got:  # no room for the run: as many single slots as the disk has
            while got < k:
                err = self.slab.allocate(hw + got, 1)
                if err:
                    out.errors.append(f"grow slab: {_name(err)}")
                    break
                got += 1
            self.slab.trim(hw + got)  # a failed fallocate may leave blocks past the end
        if got:
            self.books.set_high_water(txn, self.fp, hw + got)
            self.books.add_used(txn, got * sb)
            out.grown = (hw, hw + got)
            out.slots.extend(range(hw, hw + got))

    def _release_others(self, txn: lmdb.Transaction, need: int, out: Allocation) -> None:
        """Give back the blocks of other namespaces' free slots until ``need`` bytes are freed
        (those slots are free in the committed index: nobody maps them)."""
        gained = 0
        while gained < need:
            batch = self.books.free_of_others(txn, self.fp, 64)
            if not batch:
                return
            for other, slot in batch:
                sb = self.books.slot_bytes_of(txn, other)
                slab = self.slab_of(other, sb)
                err = slab.release(slot) if slab is not None else errno.ENOENT
                if err:
                    out.errors.append(f"release slab blocks: {_name(err)}")
                    return
                self.books.mark_hole(txn, other, slot, sb)
                gained += sb
                if gained >= need:
                    return

    # -- eviction -----------------------------------------------------------------------------
    def _evict_for(self, txn: lmdb.Transaction, short: int, freed: dict) -> int:
        """Evict the oldest pages until ``short`` more pages of this namespace could be stored
        by the next transaction (a slot of this file each, or another file's blocks given back
        and this file grown by as much)."""
        sb = self.slab.slot_bytes
        need, gained, evicted = short * (sb + ENTRY_COST), 0, 0
        sizes: dict[bytes, int] = {self.fp: sb}
        while gained < need:
            got = self.books.evict_oldest(txn)
            if got is None:
                break
            key, slot = got
            evicted += 1
            other = key[: len(self.fp)]
            if slot is not None:
                freed.setdefault(other, []).append(slot)
            if other not in sizes:
                sizes[other] = self.books.slot_bytes_of(txn, other)
            if slot is None:  # its slot record was unreadable: the slot is lost, not freed
                gained += ENTRY_COST
            elif other == self.fp:  # reused as it is by the next transaction
                gained += ENTRY_COST + sb
            else:  # its blocks given back, a hole record left
                gained += ENTRY_COST + sizes[other] - FREE_COST
        return evicted
