"""Which host slot holds which page: the connector's host-tier bookkeeping (no tensors).

A slot is *cached* (named by its page's chain digest, findable by ``lookup``), *pinned* (a copy
in flight reads or writes it: never handed out, never evicted) or free. ``take`` hands out a
free slot, else the least recently used cached slot nobody pins (its page leaves the host tier;
the store may still hold it). A slot being filled is pinned and unnamed until ``publish`` names
it: a half-written slot is never found. One lock; every method is safe from any thread.

Every naming and unnaming is also kept in order for ``take_changes``: the scheduler half, in
another process, keeps a mirror of which pages the host tier holds from them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from tiered_kv.errors import InvalidArgumentError, StateError


class HostSlots:
    """``num_slots`` host slots of whole pages, least recently used replaced first."""

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise InvalidArgumentError(f"num_slots={num_slots!r} must be an int >= 1")
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._free = list(range(num_slots - 1, -1, -1))
        self._cached: OrderedDict[bytes, int] = OrderedDict()  # digest -> slot, LRU first
        self._digest_of: dict[int, bytes] = {}
        self._pins = [0] * num_slots
        self._changes: list[tuple[bool, bytes]] = []  # (cached now, digest), in order
        self.evictions = 0

    def lookup(self, digests: Sequence[bytes]) -> int:
        """How many of ``digests`` from the start are cached (a read: recency unchanged)."""
        with self._lock:
            n = 0
            for d in digests:
                if d not in self._cached:
                    break
                n += 1
            return n

    def pin_cached(self, digest: bytes) -> int | None:
        """The slot caching ``digest``, pinned and marked recently used; None when not cached."""
        with self._lock:
            slot = self._cached.get(digest)
            if slot is None:
                return None
            self._cached.move_to_end(digest)
            self._pins[slot] += 1
            return slot

    def take(self) -> int | None:
        """A slot to fill, pinned and unnamed: a free one, else the least recently used cached
        slot nobody pins; None when every slot is pinned (the caller counts a skipped copy)."""
        with self._lock:
            if self._free:
                slot = self._free.pop()
            else:
                slot = next((s for s in self._cached.values() if not self._pins[s]), None)
                if slot is None:
                    return None
                digest = self._digest_of.pop(slot)
                del self._cached[digest]
                self._changes.append((False, digest))
                self.evictions += 1
            self._pins[slot] = 1
            return slot

    def publish(self, slot: int, digest: bytes) -> None:
        """Name a filled slot by its page (still pinned by the caller). Where another slot
        already caches the page, this one stays unnamed and is freed at its last unpin."""
        with self._lock:
            self._check_pinned(slot)
            if digest in self._cached or slot in self._digest_of:
                return
            self._cached[digest] = slot
            self._digest_of[slot] = digest
            self._changes.append((True, digest))

    def unpin(self, slot: int) -> None:
        """Drop one pin; an unnamed slot's last pin frees it."""
        with self._lock:
            self._check_pinned(slot)
            self._pins[slot] -= 1
            if not self._pins[slot] and slot not in self._digest_of:
                self._free.append(slot)

    def forget(self, slot: int) -> None:
        """Unname a slot whose bytes are not (or no longer) its page's; freed at its last
        unpin (now, when nobody pins it)."""
        with self._lock:
            digest = self._digest_of.pop(slot, None)
            if digest is not None:
                del self._cached[digest]
                self._changes.append((False, digest))
                if not self._pins[slot]:
                    self._free.append(slot)

    def take_changes(self) -> list[tuple[bool, bytes]]:
        """The (cached now, digest) changes since the last call, in order."""
        with self._lock:
            out, self._changes = self._changes, []
            return out

    def counts(self) -> dict[str, int]:
        with self._lock:
            pinned = sum(1 for p in self._pins if p)
            return {
                "slots": self.num_slots,
                "cached": len(self._cached),
                "pinned": pinned,
                "free": len(self._free),
                "evictions": self.evictions,
            }

    def _check_pinned(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or not self._pins[slot]:
            raise StateError(f"host slot {slot} is not pinned (0..{self.num_slots - 1})")
