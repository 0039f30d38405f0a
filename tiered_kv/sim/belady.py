"""The offline bound: Belady's MIN over the block access sequence of a trace.

With capacity ``C`` blocks, on a miss the cache keeps the ``C`` blocks (among those it holds and
the one just accessed) whose next use is soonest, dropping the one used furthest in the future
(possibly the new block itself: not caching it). Its block hit count is the most any cache of
``C`` blocks can get on that sequence, so it bounds from above the hits of every policy whose
tiers together hold at most ``C`` distinct blocks (a prefix hit is a block hit).
"""

from __future__ import annotations

import heapq

from tiered_kv.errors import InvalidArgumentError

_NEVER = float("inf")


def access_sequence(trace) -> list[int]:
    return [b for r in trace for b in r.blocks]


def belady_hits(accesses: list[int], capacity: int) -> int:
    """Block hits of Belady's MIN (with bypass) at ``capacity`` blocks."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise InvalidArgumentError(f"capacity={capacity!r} must be an int >= 0")
    n = len(accesses)
    next_use = [0.0] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        next_use[i] = last.get(accesses[i], _NEVER)
        last[accesses[i]] = i
    if capacity == 0:
        return 0
    cached: dict[int, float] = {}  # block -> its next use
    heap: list[tuple[float, int]] = []  # (-next use, block), lazily invalidated
    hits = 0
    for i, b in enumerate(accesses):
        nxt = next_use[i]
        if b in cached:
            hits += 1
        elif len(cached) >= capacity:
            # Drop whichever of the cached blocks and b is used furthest in the future.
            while True:
                neg, victim = heap[0]
                if cached.get(victim) == -neg:
                    break
                heapq.heappop(heap)
            if -neg <= nxt:
                continue  # b itself is the furthest: do not cache it
            heapq.heappop(heap)
            del cached[victim]
        if nxt == _NEVER:
            cached.pop(b, None)  # never used again: holding it can only cost
            continue
        cached[b] = nxt
        heapq.heappush(heap, (-nxt, b))
    return hits
