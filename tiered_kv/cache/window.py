"""SlidingWindow: what a sliding-window model changes in the cache.

A query at position p of a window layer reads the window KV of positions p-W+1..p only (W the
window, its own position included); a full layer reads every earlier position. Hence:

- a running request gives back the window slots of its own whole pages that every later query
  of it has left behind (``release``), keeping their full slots, and those pages go into the tree
  as tombstones (``TreeNode.windowless``: full KV only, on every tier that holds the node);
- a cached prefix of k pages is a hit only if the full KV of all k pages is present and the pages
  holding its last W-1 tokens have their window KV (``hit_pages``); a match whose end lies in
  tombstones is cut back to the longest prefix that qualifies (``trim``), possibly nothing;
- when the device's window side is short, unlocked cached nodes lose their window KV in the
  device policy's order (``evict_window``) before anything loses its full KV;
- offload moves only what a hit needs: a tombstone's host copy gets its full part only (the host
  pool group skips tokens without window slots), a host -> device load of one gives its new
  window slots straight back (``drop_windowless``), and its storage value is full-KV-only under
  a key of its own (``page_keys_of(windowless=True)``), so it is never read as a page with window
  KV. After the tree's match, storage is probed for both kinds (``probe``): the longest run of
  complete pages, or windowless pages followed by complete ones, whichever gives the longer hit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiered_kv.cache.metrics import CacheMetrics, WindowCounters
from tiered_kv.cache.prefix_match import StorageHit
from tiered_kv.device.allocator.swa import SWATokenToKVPoolAllocator
from tiered_kv.names import PendingKind
from tiered_kv.storage.keys import page_keys_of
from tiered_kv.tree.node import TreeNode
from tiered_kv.tree.tiered_tree import TieredTree, TreeMatch


def probe_complete(namespace, digests: Sequence[bytes], exists) -> tuple[StorageHit, StorageHit]:
    """The plain probe (every model but a sliding-window one): complete pages from the first."""
    keys = page_keys_of(namespace, digests)
    hit = StorageHit(keys[: exists(keys)])
    return hit, hit


class SlidingWindow:
    def __init__(
        self,
        allocator: SWATokenToKVPoolAllocator | None,
        window: int,
        page_size: int,
        metrics: CacheMetrics | None = None,
    ) -> None:
        self.allocator = allocator
        self.window = window
        self.page_size = page_size
        self.counts = metrics.window if metrics is not None else WindowCounters()

    # -- the hit rule -------------------------------------------------------------------------
    def first_needed(self, position: int) -> int:
        """The first position whose window KV a query at ``position`` (or later) reads."""
        return max(0, position - self.window + 1)

    def first_needed_page(self, pages: int) -> int:
        """The first page whose window KV a hit of ``pages`` pages needs (its next query, at
        position pages * page_size, reads the window KV of the W-1 positions before it)."""
        return self.first_needed(pages * self.page_size) // self.page_size

    def hit_pages(self, has_window: Sequence[bool]) -> int:
        """The longest prefix (in pages) of a chain with these per-page window flags that is a
        hit: every page from ``first_needed_page`` to its end has its window KV."""
        best = run = 0
        for k in range(1, len(has_window) + 1):
            run = run + 1 if has_window[k - 1] else 0
            if run >= k - self.first_needed_page(k):
                best = k
        return best

    def tree_flags(self, m: TreeMatch) -> list[bool]:
        ps = self.page_size
        return [not node.windowless for node, n in m.steps for _ in range(n // ps)]

    def trim(
        self,
        tree: TieredTree,
        tokens,
        m: TreeMatch,
        hit: StorageHit,
        alt: StorageHit,
        count: bool = True,
    ) -> tuple[TreeMatch, StorageHit]:
        """The tree match and the storage hit (the better of two probes) cut back to the
        longest prefix that is a hit (``count``: count the tokens cut in the metrics)."""
        flags = self.tree_flags(m)
        best, best_hit = -1, hit
        for h in (hit, alt):
            ext = [False] * h.windowless + [True] * (h.pages - h.windowless)
            k = self.hit_pages(flags + ext)
            if k > best:
                best, best_hit = k, h
        found = len(flags) + max(hit.pages, alt.pages)
        if count:
            self.counts.trimmed_tokens += (found - best) * self.page_size
        if best >= len(flags):
            keep = best - len(flags)
            return m, StorageHit(best_hit.keys[:keep], min(best_hit.windowless, keep))
        cut = list(tokens)[: best * self.page_size]
        return tree.match(cut, probe=False, prior=m.prior), StorageHit([])

    def probe(self, namespace, digests: Sequence[bytes], exists) -> tuple[StorageHit, StorageHit]:
        """Two readings of the pages after the tree's match (``exists(keys)``: how many of
        ``keys`` the store holds from the first): complete pages from the first, and
        windowless pages followed by complete ones."""
        complete = page_keys_of(namespace, digests)
        c = exists(complete)
        first = StorageHit(complete[:c])
        if c == len(complete):
            return first, first
        bare = page_keys_of(namespace, digests, windowless=True)
        a = exists(bare)
        if a == 0:
            return first, first
        b = exists(complete[a:])
        return first, StorageHit(bare[:a] + complete[a : a + b], a)

    # -- inserting ------------------------------------------------------------------------------
    @staticmethod
    def insert(manager, tokens, slots, windowless: int, prior: bytes = b"") -> int:
        """``CacheManager.insert`` of a request whose first ``windowless`` tokens hold full KV
        only: those go in as tombstones, the rest as whole nodes. Returns the leading tokens
        that were on the device already; duplicates after them are the request's own slots and
        are freed here (the tree owns the tokens between)."""
        n, first, start = len(tokens), None, 0
        for end in sorted({min(windowless, n), n} - {0}):
            dup, new, kept = manager.tree.insert(
                tokens[:end], slots[:end], windowless=end <= windowless, prior=prior
            )
            if first is None:
                first = dup
            elif dup > start:
                manager.device.free(slots[start:dup])
            manager.written(new)
            if kept < end:
                manager.device.free(slots[kept:])
                break
            start = end
        return first or 0

    # -- window KV on the device ---------------------------------------------------------------
    def release(self, req) -> None:
        """Give back the window slots of ``req``'s own whole pages that its next query (at
        position ``len(req.tokens)``) and every later one have left behind; their full slots
        stay (the pages are inserted as tombstones at finish)."""
        ps = self.page_size
        end = self.first_needed(len(req.tokens)) // ps * ps
        start = max(req.window_freed, req.prefix_len)
        if end > start:
            self.allocator.free_swa(req.slots[start:end])
            self.counts.released_tokens += end - start
            req.window_freed = end

    def drop_windowless(self, chain: list[TreeNode]) -> None:
        """New device slots of tombstones being loaded back: their window slots go straight
        back (the load copies full KV only for them)."""
        for n in chain:
            if n.windowless:
                self.allocator.free_swa(n.device)

    def drop_adopted(self, tree: TieredTree, tokens, prior: bytes = b"") -> None:
        """Tombstones on the path of ``tokens`` that adopted an inserting request's slots
        while host-only stay tombstones (their host copy and stored value hold full KV only):
        the window slots they adopted go back, else the window side would hold slots no budget
        and no eviction can see."""
        to_window = self.allocator.translate_loc_from_full_to_swa
        for node, _ in tree.match(tokens, probe=False, prior=prior).steps:
            if node.windowless and node.on_device and not node.stale:
                if bool((to_window(node.device.to(torch.int64)) > 0).any()):
                    self.allocator.free_swa(node.device)

    def window_short(self, n: int) -> int:
        """How many more window slots ``n`` new tokens need than are free (page-rounded)."""
        ps = self.page_size
        need = -(-n // ps) * ps
        return need - self.allocator.swa_available_size()

    def evictable_tokens(self, tree: TieredTree) -> int:
        """Window slots ``evict_window`` could free now: those of unlocked cached nodes (the
        scheduler's window budget)."""
        roots = tree.roots.values()
        return sum(len(n) for r in roots for n in _device_nodes(r) if _window_evictable(n))

    def evict_window(self, tree: TieredTree, num_tokens: int) -> int:
        """Tombstone unlocked cached nodes in the device policy's order until ``num_tokens``
        window slots were freed; their full KV stays (children may keep their window KV).
        Returns the tokens whose window KV went."""
        order = sorted(
            (n for r in tree.roots.values() for n in _device_nodes(r) if _window_evictable(n)),
            key=lambda n: tuple(tree.device_policy.priority(n)),
        )
        freed = 0
        for n in order:
            if freed >= num_tokens:
                break
            self.allocator.free_swa(n.device)
            tree.set_windowless(n)
            freed += len(n)
        self.counts.evicted_tokens += freed
        return freed


def _window_evictable(n: TreeNode) -> bool:
    """Holds window KV that no request uses (its path unlocked) and no copy reads or fills."""
    return (
        not n.windowless
        and n.lock_ref == 0
        and PendingKind.WRITE not in n.pending
        and PendingKind.LOAD not in n.pending
    )


def _device_nodes(root: TreeNode):
    stack = [c for c in root.children.values() if c.on_device]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(c for c in n.children.values() if c.on_device)
