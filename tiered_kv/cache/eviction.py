"""Evictor: frees what the tree's victims hold, tier by tier, per the write policy.

The tree chooses (``tree.victims``, in the tier policy's order); this acts. Device: a victim
with a host copy only loses its device slots; under ``write_back`` a victim without one is
copied to host first (waiting for the copy); otherwise it and everything below it leave the
tree (when nothing there is locked or copying); one eviction's device frees are released together
through the allocator's free group. Host: under ``write_back`` a victim not yet in
storage is backed up first (waiting for the backup); a victim still on the device only loses its
host copy, a host-only leaf leaves the tree. Under ``write_through`` host-only nodes go before
the host copies of device-resident ones, so the tiers stay inclusive while they can. Each
eviction pass is one DEBUG record (tokens and nodes freed, tokens asked), never one per node.
"""

from __future__ import annotations

import logging

from tiered_kv.cache.interfaces import DeviceSlots, HostSlots, JobBook, Snapshots
from tiered_kv.cache.metrics import CacheMetrics
from tiered_kv.errors import StateError
from tiered_kv.names import PendingKind, Tier, WritePolicy
from tiered_kv.tree.node import TreeNode, walk
from tiered_kv.tree.tiered_tree import TieredTree
from tiered_kv.tree.victims import device_resident_last, victims

log = logging.getLogger(__name__)


def _open_group(device: DeviceSlots) -> bool:
    """Open a free group on ``device``; False where it has none or one is open already (the
    caller's: its frees then wait for the caller's ``free_group_end``)."""
    begin = getattr(device, "free_group_begin", None)
    if begin is None:
        return False
    try:
        begin()
    except StateError:
        return False
    return True


def _summary(tier: Tier, asked: int, freed: int, nodes: int) -> None:
    if freed < asked or nodes:
        log.debug(
            "%s eviction: %d tokens (%d nodes) freed, %d asked%s",
            tier.value,
            freed,
            nodes,
            asked,
            "" if freed >= asked else " (nothing more could leave)",
        )


class Evictor:
    def __init__(
        self,
        book: JobBook,
        tree: TieredTree,
        device: DeviceSlots,
        host: HostSlots | None,
        write_policy: WritePolicy,
        metrics: CacheMetrics,
    ) -> None:
        self.book = book
        self.tree = tree
        self.device = device
        self.host = host
        self.write_policy = write_policy
        self.metrics = metrics
        # A hybrid model's snapshots leave a tier with their pages (set by the manager).
        self.states: Snapshots | None = None

    def evict_device(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots if unlocked nodes allow; returns freed."""
        self.book.poll()
        freed, queue = 0, victims(self.tree, Tier.DEVICE)
        nodes = self.metrics.device.evicted_nodes
        # The victims' slots go back in one release (the seed's free group): one concatenation
        # and one free-list merge for the whole eviction, not one per node.
        group = _open_group(self.device)
        try:
            while freed < num_tokens:
                node = next(queue, None)
                if node is None:
                    break
                freed += self._device_one(node)
        finally:
            if group:
                self.device.free_group_end()
        _summary(Tier.DEVICE, num_tokens, freed, self.metrics.device.evicted_nodes - nodes)
        return freed

    def _device_one(self, n: TreeNode) -> int:
        size = len(n)
        if not n.on_host and self.write_policy is WritePolicy.WRITE_BACK:
            self.book.write_to_host(n, wait=True)
        if n.on_host and PendingKind.WRITE not in n.pending:
            self.device.free(self.tree.take_device(n))
            if self.states is not None:
                self.states.drop_device(n.digests)
        elif self.tree.subtree_free(n):
            if self.states is not None:
                gone = [n, *walk(n)]
                self.states.drop_device([d for x in gone for d in x.digests])
                self.states.drop_host([d for x in gone for d in x.digests])
            released = self.tree.detach(n)
            for slots in released.device:
                self.device.free(slots)
            for slots in released.host:
                self.host.free(slots)
            self.metrics.device.dropped_tokens += released.tokens
        else:
            return 0
        self.metrics.device.evicted_tokens += size
        self.metrics.device.evicted_nodes += 1
        return size

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots if unprotected nodes allow; returns freed."""
        if self.host is None:
            return 0
        self.book.poll()
        # Inclusive tiers: host-only nodes go first, the host copies of device-resident ones
        # only when nothing else can.
        rank = device_resident_last if self.write_policy is WritePolicy.WRITE_THROUGH else None
        freed, queue = 0, victims(self.tree, Tier.HOST, rank)
        nodes = self.metrics.host.evicted_nodes
        while freed < num_tokens:
            node = next(queue, None)
            if node is None:
                break
            freed += self._host_one(node)
        _summary(Tier.HOST, num_tokens, freed, self.metrics.host.evicted_nodes - nodes)
        return freed

    def _host_one(self, n: TreeNode) -> int:
        size = len(n)
        if self.write_policy is WritePolicy.WRITE_BACK and not n.in_storage:
            self.book.backup_to_storage(n, wait=True)
        leaves_tree = not n.on_device
        self.host.free(self.tree.take_host(n))
        if self.states is not None:
            self.states.drop_host(n.digests)
        if leaves_tree:
            self.metrics.host.dropped_tokens += size
        self.metrics.host.evicted_tokens += size
        self.metrics.host.evicted_nodes += 1
        return size
