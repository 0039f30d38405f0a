"""The batched scheduler's budget, in whole pages, on every side a cache has.

- The full side (every model: the slots every token holds): what the allocator has free plus
  what the tree could evict. A running request claims the rest of its prefill.
- A sliding-window cache's window side: the window slots a request holds are bounded (each
  ``extend`` first gives back those its later queries have left behind, ``SlidingWindow.release``),
  so a running request claims the most it will ever hold, less what it holds now. Reachable:
  the free window slots plus those of unlocked cached nodes (``evict_window`` tombstones them).
- A hybrid model's state slots: every running request holds its own Mamba slot and tracking
  slots for its whole life; device snapshots give theirs back on demand (``alloc_row``).

Bookkeeping only: nothing here allocates, frees or evicts.
"""

from __future__ import annotations

from typing import NamedTuple

from tiered_kv.cache import TieredKVCache
from tiered_kv.errors import InvalidArgumentError


class Need(NamedTuple):
    full: int  # tokens, whole pages, on the side every token holds
    window: int = 0  # window slots (sliding-window caches; whole pages)

    def __add__(self, other: Need) -> Need:  # type: ignore[override]
        return Need(self.full + other.full, self.window + other.window)


class Budget:
    def __init__(self, cache: TieredKVCache, chunk_size: int) -> None:
        self.cache = cache
        self.page_size = ps = cache.config.page_size
        alloc = cache.allocator
        window = cache.manager.window
        # A per-request ring holds window KV in the request's row: no shared window pages.
        self.window = None if window is None or getattr(alloc, "swa_req_ring", False) else window
        self._full_free = getattr(alloc, "full_available_size", None)
        self.chunk_size = chunk_size
        self.state_per_request = self.state_rows = 0
        if cache.states is not None:
            pool = cache.req_to_token
            self.state_per_request = 1 + max(
                pool.initial_tracking_slots, getattr(pool, "tracking_buffer_size", 0)
            )
            self.state_rows = pool.mamba_allocator.size // self.state_per_request
            if self.state_rows == 0:
                raise InvalidArgumentError(
                    f"the cache's {pool.mamba_allocator.size} state slots cannot hold one request "
                    f"({self.state_per_request} slots each); raise device_state_slots"
                )
        if self.window is not None and not hasattr(alloc, "swa_attn_allocator"):
            raise InvalidArgumentError(
                "the batched scheduler budgets a split sliding-window pool only; build the cache "
                "with swa_unified_pool=False (the unified pool is served by Server)"
            )
        if self.window is not None:
            size = alloc.swa_attn_allocator.size
            peak = self.window_peak(chunk_size, 1 << 62)
            if peak > size:
                raise InvalidArgumentError(
                    f"a request may hold {peak} window slots (window {self.window.window} + a "
                    f"chunk of {chunk_size} + 2 pages of {ps}); the window pool has {size}: "
                    "raise device_swa_tokens or lower chunk_size"
                )

    def paged(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    # -- a request's claims ---------------------------------------------------------------------
    def window_peak(self, step_tokens: int, length: int) -> int:
        """The most window slots a request of at most ``length`` tokens holds right after an
        ``extend`` of ``step_tokens``: from the page of the first position its next query reads
        to the end of the new tokens (release runs before each allocation)."""
        ps = self.page_size
        return min(self.paged(length), self.paged(self.window.window + step_tokens) + 2 * ps)

    def claim(self, r) -> Need:
        """What running request ``r`` may still take: the rest of its prefill on the full side
        and, for a sliding-window cache, its window peak less what it holds now."""
        req = r.cache_req
        held = self.paged(len(req.tokens))
        full = max(0, self.paged(len(r.target)) - held)
        if self.window is None:
            return Need(full)
        own = max(req.window_freed, req.prefix_len)
        length = len(r.prompt) + r.max_new_tokens - req.prefix_len
        peak = self.window_peak(self.chunk_size if r.prefilling else 1, length)
        return Need(full, max(0, peak - (held - own)))

    def claims(self, running) -> Need:
        total = Need(0)
        for r in running:
            total = total + self.claim(r)
        return total

    def admission(self, r, tokens: int, device: int, host: int) -> Need:
        """What admitting ``r`` (``tokens`` tokens, ``device`` / ``host`` of them cached there)
        takes beyond its cached device prefix: its pages on the full side, and on the window
        side the host hits loaded back plus its own window peak."""
        full = self.paged(tokens) - device
        if self.window is None:
            return Need(full)
        peak = self.window_peak(self.chunk_size, len(r.prompt) + r.max_new_tokens - device)
        return Need(full, host + peak)  # tombstones loaded back give theirs back at once

    # -- what is reachable ----------------------------------------------------------------------
    def fits(self, need: Need, locking: int = 0) -> bool:
        """Whether ``need`` fits in the free pages plus what eviction could free, after
        ``locking`` evictable device tokens are locked by requests about to begin."""
        tree, alloc, ps = self.cache.tree, self.cache.allocator, self.page_size
        evictable = max(0, tree.evictable_device_tokens - locking)
        if self._full_free is None:
            if not alloc.prealloc_ceiling_fits(need.full, evictable):
                return False
        elif self.paged(need.full) > self._full_free() + evictable // ps * ps:
            return False
        if self.window is None:
            return True
        reach = alloc.swa_available_size() + self.window.evictable_tokens(tree) - locking
        return self.paged(need.window) <= max(0, reach) // ps * ps

    def describe(self, need: Need) -> str:
        """``need`` against what is reachable, on every side (for a stall's message)."""
        tree, alloc = self.cache.tree, self.cache.allocator
        free = self._full_free() if self._full_free is not None else alloc.available_size()
        text = (
            f"needs {self.paged(need.full)} full-side tokens, {free} free + "
            f"{tree.evictable_device_tokens} evictable"
        )
        if self.window is not None:
            text += (
                f"; needs {self.paged(need.window)} window slots, "
                f"{alloc.swa_available_size()} free + "
                f"{self.window.evictable_tokens(tree)} evictable"
            )
        return text

    def state_room(self, requests: int) -> bool:
        """Whether ``requests`` running requests fit the state slots (always, without state)."""
        return self.state_per_request == 0 or requests <= self.state_rows
