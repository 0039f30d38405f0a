"""A process-wide pool of I/O threads that stores use to hash and copy page bytes in parallel.

xxhash and numpy release the GIL on large buffers, so page checksums and map-to-host copies
scale with cores. ``ordered_map`` yields results in input order while later items are still
being computed, which lets a write transaction insert page i while page i+1 is hashed;
``split_map`` cuts a batch into one run per thread; ``shared_map`` lets the threads take the next
item as they finish one, so a thread the OS does not run (a busy core) holds back nothing. After a
``fork`` the child gets a fresh pool (the parent's threads do not exist there).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

from tiered_kv.errors import InvalidArgumentError

T = TypeVar("T")
R = TypeVar("R")

_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def default_io_threads() -> int:
    """Two threads where two cores exist (enough to overlap hashing with copying), else one."""
    return max(1, min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))


def check_io_threads(io_threads: int | None) -> int:
    if io_threads is None:
        return default_io_threads()
    if isinstance(io_threads, bool) or not isinstance(io_threads, int) or not 1 <= io_threads <= 64:
        raise InvalidArgumentError(
            f"io_threads={io_threads!r} must be an int in [1, 64] (1 = no threads) or None"
        )
    return io_threads


def _pool(threads: int) -> ThreadPoolExecutor:
    key = (os.getpid(), threads)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(threads, thread_name_prefix="tiered-kv-io")
        return pool


def ordered_map(fn: Callable[[T], R], items: Iterable[T], threads: int) -> Iterator[R]:
    """``map(fn, items)``, computed by ``threads`` pool threads when ``threads > 1`` and there
    is more than one item; results come back in order, each as soon as it and those before it
    are done. With one thread (or one item) it runs lazily in the caller's thread."""
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return map(fn, items)
    return _pool(threads).map(fn, items)


def split_map(fn: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    """``[fn(x) for x in items]`` with ``items`` cut into ``threads`` contiguous runs: the first
    run on the calling thread, the others on pool threads at the same time. One hand-off per
    run instead of one per item, which matters when an item takes a few hundred microseconds."""
    runs = max(1, min(threads, len(items)))
    if runs == 1:
        return [fn(x) for x in items]
    bounds = [len(items) * r // runs for r in range(runs + 1)]
    pool = _pool(runs - 1)
    futures = [
        pool.submit(lambda lo, hi: [fn(x) for x in items[lo:hi]], bounds[r], bounds[r + 1])
        for r in range(1, runs)
    ]
    try:
        out = [fn(x) for x in items[: bounds[1]]]
    finally:
        # Never return (or raise) while a run is still going: the items may point into memory
        # that is only valid until the caller returns (an LMDB read transaction's map pages).
        wait(futures)
    for future in futures:
        out.extend(future.result())
    return out


def shared_map(fn: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    """``[fn(x) for x in items]`` on the calling thread and up to ``threads - 1`` pool threads,
    each taking the next item from one shared counter as it finishes the last (no hand-off per
    item): on a machine whose other cores are busy, the caller does the items a pool thread has
    not started, instead of waiting for a fixed run. Returns (or raises) only after every
    thread has stopped, as ``split_map`` does."""
    n = len(items)
    workers = max(1, min(threads, n))
    if workers == 1:
        return [fn(x) for x in items]
    out: list = [None] * n
    claim = itertools.count().__next__  # atomic under the GIL: each index goes to one thread

    def work() -> None:
        i = claim()
        while i < n:
            out[i] = fn(items[i])
            i = claim()

    futures = [_pool(workers - 1).submit(work) for _ in range(workers - 1)]
    try:
        work()
    finally:
        wait(futures)
    for future in futures:
        future.result()
    return out
