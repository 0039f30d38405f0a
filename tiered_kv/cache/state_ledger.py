"""StateLedger: where each recurrent-state snapshot of a hybrid model lives, on every tier.

A hybrid model's linear layers keep no per-token KV, only a fixed-size state per request, so a
cached prefix is usable only with the state *at its end*. The cache keeps snapshots of that
state at page boundaries (``cache.state_hits`` decides which), each named by the chain digest
of the prefix's last page: the digest names the exact token prefix (and the state namespace the
model), so a snapshot is never applied to another prefix, and a split of a tree node leaves
every snapshot where it was.

A snapshot lives in a Mamba slot of the device state pool (taken from the request pool's slot
allocator, so no request row can own it), in a host state slot (``HostStatePool``: every
declared state part of the slot together) and as one checksummed value in the state store
(the page store's directory and budget, its own namespace and value size). Copies are
synchronous: a snapshot is one request's state (kilobytes to a few MiB), not a prefix's KV.

Capacities are the state pools' own (device Mamba slots, host state slots, the store's budget),
each with least-recently-used replacement: a device snapshot that must make room is backed up
to host first, a host one stored first (when a store exists); snapshots also leave a tier with
their prefix's pages (``drop_device`` / ``drop_host``, called by the evictor). Every store call
that fails or raises is a counted miss (``StateCounters.errors``), never an error.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tiered_kv.cache.metrics import StateCounters
from tiered_kv.device.allocator.mamba_slots import MambaSlotAllocator
from tiered_kv.device.mamba_pool import MambaPool
from tiered_kv.host.state_pool import HostStatePool
from tiered_kv.names import Tier
from tiered_kv.storage.contract import PageStorage
from tiered_kv.storage.keys import StorageNamespace, state_keys_of


@dataclass
class Snapshot:
    device: int | None = None  # Mamba slot holding it
    host: int | None = None  # host state slot
    stored: bool = False  # written to the state store (the store may have evicted it since)


def _one(slot: int) -> torch.Tensor:
    return torch.tensor([slot], dtype=torch.int64)


class StateLedger:
    def __init__(
        self,
        state_pool: MambaPool,
        slot_allocator: MambaSlotAllocator,
        host: HostStatePool | None = None,
        store: PageStorage | None = None,
        namespace: StorageNamespace | None = None,
        *,
        write_through: bool = True,
        counters: StateCounters | None = None,
    ) -> None:
        """``state_pool``: the device ``MambaPool`` (``copy_from`` copies its siblings too);
        ``slot_allocator``: its ``MambaSlotAllocator``; ``host``: a ``HostStatePool`` or None;
        ``store``: the state store (a ``PageStorage`` over ``host``) with its ``namespace``;
        ``write_through``: new snapshots go to host (and store) at once, else on eviction."""
        self.pool = state_pool
        self.slots = slot_allocator
        self.host = host
        self.store = store if host is not None else None
        self.namespace = namespace
        self.write_through = write_through
        self.counts = counters if counters is not None else StateCounters()
        self.snaps: OrderedDict[bytes, Snapshot] = OrderedDict()  # oldest use first
        # Snapshots a call in progress works on (nested: capture -> make room -> back one up
        # -> make host room): never chosen to make room, so none is dropped under its caller.
        self._busy: set[bytes] = set()

    # -- reading --------------------------------------------------------------------------------
    def held(self, digest: bytes) -> Tier | None:
        """The fastest tier holding the snapshot in memory (device or host), else None."""
        s = self.snaps.get(digest)
        if s is None:
            return None
        if s.device is not None:
            return Tier.DEVICE
        return Tier.HOST if s.host is not None else None

    def stored(self, digest: bytes) -> bool:
        """Whether the store holds the snapshot now (a probe; trouble is a counted miss)."""
        if self.store is None:
            return False
        try:
            return self.store.batch_exists(state_keys_of(self.namespace, [digest])) == 1
        except Exception:  # noqa: BLE001 - storage trouble is a miss
            self.counts.errors += 1
            return False

    def device_slots(self) -> list[int]:
        return [s.device for s in self.snaps.values() if s.device is not None]

    def host_slots(self) -> list[int]:
        return [s.host for s in self.snaps.values() if s.host is not None]

    # -- taking and restoring -------------------------------------------------------------------
    def capture(self, digest: bytes, source_slot: int) -> bool:
        """Keep a snapshot of device state slot ``source_slot`` (the state after the page
        named ``digest``). Returns whether one is kept (False: no slot could be made free)."""
        s = self.snaps.get(digest)
        if s is not None and s.device is not None:
            self.snaps.move_to_end(digest)  # the same prefix's state: bytes equal, keep ours
            return True
        with self._working(digest):
            return self._capture(digest, source_slot)

    def _capture(self, digest: bytes, source_slot: int) -> bool:
        slot = self.take_device_slot()
        s = self.snaps.get(digest)
        if slot is None:
            self.counts.capture_skipped += 1
            return False
        try:
            self.pool.copy_from(_one(source_slot), _one(slot))
        except Exception:  # noqa: BLE001 - a failed copy keeps no snapshot
            self.slots.free(_one(slot))
            self.counts.errors += 1
            return False
        if s is None:
            s = self.snaps[digest] = Snapshot()
        s.device = slot
        self.snaps.move_to_end(digest)
        self.counts.captured += 1
        if self.write_through:
            self.to_host(digest)
            self.to_store(digest)
        return True

    def restore(self, digest: bytes, dst_slot: int) -> Tier | None:
        """Copy the snapshot into device state slot ``dst_slot`` from the fastest tier that
        has it (a stored one comes through a host slot and stays there). None: it is nowhere
        (or the store failed to serve it, a counted miss); ``dst_slot`` may then hold partial
        bytes and must be cleared or filled again."""
        s = self.snaps.get(digest)
        dst = _one(dst_slot)
        try:
            if s is not None and s.device is not None:
                self.pool.copy_from(_one(s.device), dst)
                tier = Tier.DEVICE
            elif s is not None and s.host is not None:
                self.host.load_to_device(_one(s.host), dst)
                tier = Tier.HOST
            elif self._fetch(digest):
                self.host.load_to_device(_one(self.snaps[digest].host), dst)
                tier = Tier.STORAGE
            else:
                return None
        except Exception:  # noqa: BLE001 - a failed copy is a miss (dst is cleared or refilled)
            self.counts.errors += 1
            return None
        self.snaps.move_to_end(digest)
        name = f"restored_{tier.value}"
        setattr(self.counts, name, getattr(self.counts, name) + 1)
        return tier

    def _fetch(self, digest: bytes) -> bool:
        if self.store is None:
            return False
        with self._working(digest):
            h = self.take_host_slot()
        if h is None:
            return False
        try:
            ok = self.store.batch_get(state_keys_of(self.namespace, [digest]), self.host, [h])[0]
        except Exception:  # noqa: BLE001 - storage trouble is a miss
            ok = False
            self.counts.errors += 1
        if not ok:
            self.host.free(_one(h))
            self.counts.store_misses += 1
            return False
        s = self.snaps.setdefault(digest, Snapshot())
        s.host, s.stored = h, True
        return True

    # -- moving down the tiers ------------------------------------------------------------------
    def to_host(self, digest: bytes) -> bool:
        """Back the device snapshot up to a host slot (no-op without a host tier or when it
        is there already). Returns whether the host holds it."""
        s = self.snaps.get(digest)
        if s is None or self.host is None:
            return False
        if s.host is not None or s.device is None:
            return s.host is not None
        with self._working(digest):
            h = self.take_host_slot()
        if h is None:
            self.counts.host_skipped += 1
            return False
        try:
            self.host.backup_from_device(_one(s.device), _one(h))
        except Exception:  # noqa: BLE001 - a failed copy leaves no host snapshot
            self.host.free(_one(h))
            self.counts.errors += 1
            return False
        s.host = h
        return True

    def to_store(self, digest: bytes) -> bool:
        """Store the host snapshot (no-op without a store, or once stored)."""
        s = self.snaps.get(digest)
        if self.store is None or s is None or s.host is None:
            return False
        if s.stored:
            return True
        try:
            ok = self.store.batch_set(state_keys_of(self.namespace, [digest]), self.host, [s.host])
            s.stored = bool(ok[0])
        except Exception:  # noqa: BLE001 - storage trouble is a miss
            self.counts.errors += 1
            s.stored = False
        self.counts.stored += int(s.stored)
        return s.stored

    def drop_device(self, digests) -> None:
        """The pages these digests name left the device: so do their snapshots (backed up to
        host first where there is a host tier)."""
        for d in digests:
            s = self.snaps.get(d)
            if s is not None and s.device is not None:
                self._evict_device(d, s)

    def drop_host(self, digests) -> None:
        """The pages these digests name left the host: so do their host snapshots (stored
        first where there is a store)."""
        for d in digests:
            s = self.snaps.get(d)
            if s is not None and s.host is not None:
                self._evict_host(d, s)

    def discard(self, digests) -> int:
        """Forget the snapshots these digests name on every tier (their prefix's pages were
        found wrong, so the state after them was computed over wrong KV): device and host slots
        freed, stored values deleted (trouble there is a counted error). Returns how many this
        ledger held."""
        digests, held = list(digests), 0
        for d in digests:
            s = self.snaps.pop(d, None)
            if s is None:
                continue
            held += 1
            if s.device is not None:
                self.slots.free(_one(s.device))
            if s.host is not None:
                self.host.free(_one(s.host))
        if self.store is not None and digests:
            try:
                self.store.delete(state_keys_of(self.namespace, digests))
            except Exception:  # noqa: BLE001 - storage trouble is counted, never raised
                self.counts.errors += 1
        return held

    def _evict_device(self, d: bytes, s: Snapshot) -> None:
        with self._working(d):
            self.to_host(d)
        self.slots.free(_one(s.device))
        s.device = None
        self.counts.evicted_device += 1
        self._forget_if_gone(d, s)

    def _evict_host(self, d: bytes, s: Snapshot) -> None:
        self.to_store(d)
        self.host.free(_one(s.host))
        s.host = None
        self.counts.evicted_host += 1
        self._forget_if_gone(d, s)

    def _forget_if_gone(self, d: bytes, s: Snapshot) -> None:
        if s.device is None and s.host is None and not s.stored:
            del self.snaps[d]

    # -- capacity -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _working(self, digest: bytes):
        added = digest not in self._busy
        self._busy.add(digest)
        try:
            yield
        finally:
            if added:
                self._busy.discard(digest)

    def _victims(self, tier: str):
        """(digest, snapshot) holding a copy on ``tier``, least recently used first, skipping
        those a call in progress works on; read afresh at each step (making room may drop
        others)."""
        for d in list(self.snaps):
            s = self.snaps.get(d)
            if s is not None and d not in self._busy and getattr(s, tier) is not None:
                yield d, s

    def take_device_slot(self) -> int | None:
        """A free Mamba slot for a snapshot, evicting the least recently used device snapshots
        (never one a call in progress works on) until one frees. None when none can."""
        if not self.free_device_slots(1):
            return None
        return int(self.slots.alloc(1)[0])

    def free_device_slots(self, n: int) -> bool:
        """Evict device snapshots (oldest first) until ``n`` Mamba slots are free (for a
        snapshot, or for the requests a scheduler admits). Returns whether they are."""
        for d, s in self._victims("device"):
            if self.slots.available_size() >= n:
                break
            if s.device is not None:  # still (an earlier eviction may have moved it)
                self._evict_device(d, s)
        return self.slots.available_size() >= n

    def take_host_slot(self) -> int | None:
        if self.host is None:
            return None
        got = self.host.alloc(1)
        if got is None:
            for d, s in self._victims("host"):
                self._evict_host(d, s)
                break
            got = self.host.alloc(1)
        return int(got[0]) if got is not None else None

    def clear_memory(self) -> None:
        """Drop every device and host snapshot (stored values stay in the store)."""
        for d in list(self.snaps):
            s = self.snaps[d]
            if s.device is not None:
                self.slots.free(_one(s.device))
                s.device = None
            if s.host is not None:
                self.host.free(_one(s.host))
                s.host = None
            self._forget_if_gone(d, s)
