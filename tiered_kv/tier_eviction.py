"""Per-tier eviction for :class:`TieredRadixCache` (a mixin over its tree and pools).

Device: a node may go when it is unlocked, has no copy in flight touching its device slots and
no child on the device (device residency stays prefix-closed). It keeps its place in the tree
if it has a host copy; under ``write_back`` it is first copied to host (waiting for the copy);
otherwise it and everything below it leave the tree. Host: a node may go when nothing protects
it, no copy is in flight, and it is either still on the device (only the host copy is dropped)
or a leaf (it leaves the tree); under ``write_through`` host-only nodes go before the host copies
of device-resident ones, so the host stays inclusive while it can; under ``write_back`` a node
is first backed up to storage (waiting for the backup). Victims come in the tier policy's
order; a parent that becomes evictable joins the queue.
"""

from __future__ import annotations

import heapq
import itertools

from tiered_kv.eviction import EvictionPolicy
from tiered_kv.radix_tree import TreeNode, first_page, walk


class TierEviction:
    # -- eviction -----------------------------------------------------------------------------
    def _device_evictable(self, n: TreeNode) -> bool:
        return (
            n.parent is not None
            and n.on_device
            and n.lock_ref == 0
            and "write" not in n.pending
            and "load" not in n.pending
            and not any(c.on_device for c in n.children.values())
        )

    def _host_evictable(self, n: TreeNode) -> bool:
        return (
            n.parent is not None
            and n.on_host
            and n.host_ref == 0
            and not n.pending
            and (n.on_device or not n.children)
        )

    def _evict(
        self, num_tokens: int, policy: EvictionPolicy, evictable, evict_one, rank=None
    ) -> int:
        """Evict in ``policy`` order, after ``rank`` (a node -> int, lower first) if given."""

        def key(n: TreeNode) -> tuple:
            return ((rank(n),) if rank else ()) + tuple(policy.priority(n))

        heap, order = [], itertools.count()
        for n in walk(self.root):
            if evictable(n):
                heapq.heappush(heap, (key(n), next(order), n))
        freed = 0
        while freed < num_tokens and heap:
            prio, _, n = heapq.heappop(heap)
            if not evictable(n):
                continue
            now = key(n)
            if now != prio:
                heapq.heappush(heap, (now, next(order), n))
                continue
            if policy.second_chance(n):
                heapq.heappush(heap, (key(n), next(order), n))
                continue
            parent = n.parent
            freed += evict_one(n)
            if parent is not None and evictable(parent):
                heapq.heappush(heap, (key(parent), next(order), parent))
        return freed

    def evict_device(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots if unlocked nodes allow; returns freed."""
        self.check_all()
        return self._evict(
            num_tokens, self.device_policy, self._device_evictable, self._evict_device_node
        )

    def _evict_device_node(self, n: TreeNode) -> int:
        size = len(n)
        if not n.on_host and self.write_policy == "write_back":
            self._write_to_host(n, wait=True)
        if n.on_host and "write" not in n.pending:
            self._free_device(n)
        elif self._subtree_free(n):
            self._drop(n)
        else:
            return 0
        self.device_counters.evicted_tokens += size
        self.device_counters.evicted_nodes += 1
        return size

    def _free_device(self, n: TreeNode) -> None:
        self.device_allocator.free(n.device)
        n.device = None
        self.device_policy.on_remove(n)

    def _subtree_free(self, n: TreeNode) -> bool:
        return all(m.host_ref == 0 and m.lock_ref == 0 and not m.pending for m in [n, *walk(n)])

    def _drop(self, n: TreeNode) -> None:
        """Remove ``n`` and everything below it from the tree, freeing all their slots."""
        for m in [*walk(n), n]:
            if m.on_device:
                self._free_device(m)
            if m.on_host:
                self.host_pool.free(m.host)
                m.host = None
                self.host_policy.on_remove(m)
            self.device_counters.dropped_tokens += len(m)
        del n.parent.children[first_page(n.key, self.page_size)]
        n.parent = None

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots if unprotected nodes allow; returns freed."""
        if self.host_pool is None:
            return 0
        self.check_all()
        # Under write_through the host keeps a copy of what the device holds (inclusive tiers):
        # host-only nodes go first, the copies of device-resident ones only when nothing else
        # can.
        rank = (lambda n: 1 if n.on_device else 0) if self.write_policy == "write_through" else None
        return self._evict(
            num_tokens, self.host_policy, self._host_evictable, self._evict_host_node, rank
        )

    def _evict_host_node(self, n: TreeNode) -> int:
        size = len(n)
        if self.write_policy == "write_back" and not n.in_storage:
            self._backup_to_storage(n, wait=True)
        self.host_pool.free(n.host)
        n.host = None
        self.host_policy.on_remove(n)
        if not n.on_device:  # a host-only leaf: it leaves the tree
            del n.parent.children[first_page(n.key, self.page_size)]
            n.parent = None
            self.host_counters.dropped_tokens += size
        self.host_counters.evicted_tokens += size
        self.host_counters.evicted_nodes += 1
        return size

