"""VictimQueue: one tier's evictable nodes, kept in policy order from one eviction to the next.

An eviction used to walk the whole tree and build a heap of every evictable node; this keeps
the heap instead. The tree :meth:`~VictimQueue.mark` s every node whose evictability or policy
order may have changed (residency, locks, refs, copies ending, hits, splits, a child leaving);
:meth:`~VictimQueue.prepare` (at the start of each eviction) offers the marked nodes that are
evictable now. Entries are never updated in place: a node's newest entry is its live one, older
ones are skipped when they surface, and an entry whose node is no longer evictable, or whose key
has moved, is dropped (and re-pushed with its current key) when it reaches the top.

Keys are ``(bucket, rank, order)``: ``order`` (a tuple) only grows while a node stays in its
bucket (LRU's last access, FIFO's insertion, LFU's hits then access), so an old entry is never
later than its node's true place; a node whose bucket or rank changes is marked, and gets a new
entry. ``bucket`` is a policy's queue (S3-FIFO's small and main, ghost-LRU's probationary and
protected); which bucket goes first may change with the policy's global state, so buckets have
separate heaps and their ranking is asked when each victim is chosen. The marked set is bounded:
past ``REBUILD_AT`` nodes it is dropped and the next eviction rebuilds from a walk (a tier that
never evicts costs nothing).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable
from typing import Any

REBUILD_AT = 1 << 16
_UNSET = object()

Key = tuple[Hashable, int, tuple]  # (bucket, rank, order)


class VictimQueue:
    def __init__(self) -> None:
        self._dirty: dict[Any, None] = {}
        self._rebuild = True  # the first eviction walks the tree once
        self._rank: object = _UNSET  # the rank function the entries were keyed with
        self._heaps: dict[Hashable, list] = {}
        # node -> its newest entry: (rank, order, seq, node, bucket)
        self._live: dict[Any, tuple] = {}
        self._seq = itertools.count()
        self.rebuilds = 0  # full walks so far (the first eviction's, overflows, rank changes)

    def mark(self, node: Any) -> None:
        """``node``'s evictability or order may have changed: re-examine it at the next
        :meth:`prepare`."""
        if self._rebuild:
            return
        self._dirty[node] = None
        if len(self._dirty) > REBUILD_AT:
            self._dirty.clear()
            self._rebuild = True

    def prepare(
        self,
        rank: Callable | None,
        walk: Callable[[], Iterable[Any]],
        evictable: Callable[[Any], bool],
        keyof: Callable[[Any], Key],
    ) -> None:
        """Offer every marked node that is evictable now (every node of ``walk()`` after an
        overflow, on the first call, or when ``rank`` is not the last call's)."""
        if self._rebuild or rank is not self._rank:
            self._heaps, self._live, self._dirty = {}, {}, {}
            self._rank, self._rebuild = rank, False
            self.rebuilds += 1
            nodes: Iterable[Any] = walk()
        else:
            nodes, self._dirty = self._dirty, {}
        for n in nodes:
            if evictable(n):
                self.offer(n, keyof(n))
        self._compact()

    def offer(self, node: Any, key: Key) -> None:
        """Queue ``node`` (evictable now) under ``key`` unless its live entry is in the same
        bucket and no later (then it surfaces in time and is re-keyed there)."""
        bucket, rank, order = key
        e = self._live.get(node)
        if e is not None and e[4] == bucket and (e[0], e[1]) <= (rank, order):
            return
        self._push(node, key)

    def _push(self, node: Any, key: Key) -> None:
        bucket, rank, order = key
        e = (rank, order, next(self._seq), node, bucket)
        self._live[node] = e
        heapq.heappush(self._heaps.setdefault(bucket, []), e)

    def pop(
        self,
        evictable: Callable[[Any], bool],
        keyof: Callable[[Any], Key],
        bucket_rank: Callable[[Hashable, Any], Any],
    ) -> Any | None:
        """The evictable node with the lowest (rank, bucket rank, order), taken out of the queue;
        None when no queued node is evictable."""
        while True:
            best = best_heap = None
            moved = False
            for bucket, heap in list(self._heaps.items()):
                head = self._head(heap, evictable, keyof)
                if head is _MOVED:
                    moved = True
                    break
                if head is None:
                    continue
                cand = (head[0], bucket_rank(bucket, head[3]), head[1], head[2])
                if best is None or cand < best:
                    best, best_heap = cand, heap
            if moved:
                continue  # an entry changed heap: look at every head again
            if best_heap is None:
                return None
            e = heapq.heappop(best_heap)
            del self._live[e[3]]
            return e[3]

    def _head(self, heap: list, evictable, keyof):
        """The heap's top entry once it is live, evictable and current (stale ones dropped);
        ``_MOVED`` when one was re-pushed under a new key."""
        while heap:
            e = heap[0]
            n = e[3]
            if self._live.get(n) is not e:
                heapq.heappop(heap)
                continue
            if not evictable(n):
                heapq.heappop(heap)
                del self._live[n]
                continue
            bucket, rank, order = key = keyof(n)
            if (rank, order, bucket) != (e[0], e[1], e[4]):
                heapq.heappop(heap)
                self._push(n, key)
                if bucket != e[4]:
                    return _MOVED
                continue
            return e
        return None

    def _compact(self) -> None:
        """Drop superseded entries once they outnumber the live ones."""
        held = sum(len(h) for h in self._heaps.values())
        if held <= 2 * len(self._live) + 4096:
            return
        heaps: dict[Hashable, list] = {}
        for e in self._live.values():
            heaps.setdefault(e[4], []).append(e)
        for h in heaps.values():
            heapq.heapify(h)
        self._heaps = heaps

    @property
    def rank_fn(self) -> Callable | None:
        """The rank function the entries are keyed with (None: none, or no eviction yet)."""
        return None if self._rank is _UNSET else self._rank  # type: ignore[return-value]

    def covers(self, node: Any, key: Key) -> bool:
        """Whether ``node`` (evictable, with ``key``) would be found in time: it is marked, a
        rebuild is due, or its live entry is in its bucket and no later (for integrity checks)."""
        if self._rebuild or node in self._dirty:
            return True
        e = self._live.get(node)
        bucket, rank, order = key
        return e is not None and e[4] == bucket and (e[0], e[1]) <= (rank, order)


_MOVED = object()
