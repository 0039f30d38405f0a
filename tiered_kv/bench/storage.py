"""One store, one repeat: the timed phases of the storage benchmark.

For a ``Case`` (pages of one size, their keys, a source and a destination ``PageSource``),
``kv_store_times`` times, in a fresh store (``open_kv``: ``lmdb`` ``LMDBStorage``, ``slab``
``SlabStorage``, ``files`` ``page_stores.FileStore``, ``hicache`` SGLang's ``HiCacheFile`` where
importable), ``set`` (every page once, into an empty store), ``warm_get`` (right after an untimed
``sync``: the bytes are in the page cache) and, with ``cold``, ``cold_get`` (after closing the
store, dropping the page cache, reopening it and dropping it again: the kernel does not drop
pages a process still maps, and opening may read). ``full_set_times`` times ``full_set``: the
same pages into a store already full of as many other pages, each write evicting an old one
(the steady state of a cache). The clock runs around the whole loop over batches, with the
garbage collector off; every get is checked outside the timing (each call returned True, the
bytes equal the source's).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tiered_kv.bench.disk import cached_mib, drop_page_cache
from tiered_kv.bench.page_stores import BenchPages, EvictingFileStore, FileStore
from tiered_kv.bench.timing import timed
from tiered_kv.bench.verify import fail
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage import LMDBStorage, StorageNamespace, page_keys
from tiered_kv.storage.lmdb_env import record_cost
from tiered_kv.storage.slab_books import ENTRY_COST
from tiered_kv.storage.slab_file import slot_bytes_for
from tiered_kv.storage.slab_store import BASE_COST, SlabStorage

MIB = 1 << 20
ALIGN = 4096
LMDB_DEFAULTS = {"durable": False, "readahead": True, "writemap": True, "hugepages": False}
SLAB_OPTIONS = ("durable", "hugepages", "io_threads")  # the options both layouts take

# (seconds, page cache MiB right before the op or None) per op
Times = dict[str, tuple[float, float | None]]


@dataclass
class Case:
    """The pages of one size: keys, the source of sets and the destination of gets (pages
    ``src_first ..`` and ``dst_first ..`` of them; they may be one host pool)."""

    size_mib: float
    page_nbytes: int
    keys: list[bytes]
    src: object  # a PageSource with page_bytes_rows()
    dst: object
    namespace: StorageNamespace
    src_first: int = 0
    dst_first: int = 0

    @property
    def n(self) -> int:
        return len(self.keys)

    def src_rows(self) -> np.ndarray:
        return self.src.page_bytes_rows()[self.src_first : self.src_first + self.n]

    def dst_rows(self) -> np.ndarray:
        return self.dst.page_bytes_rows()[self.dst_first : self.dst_first + self.n]


def random_keys(namespace: StorageNamespace, n: int, seed: int) -> list[bytes]:
    """``n`` keys of random one-token pages (distinct with overwhelming probability)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    return [bytes(k) for k in page_keys(namespace, tokens, 1)]


def make_case(size_mib: float, total_mib: float, seed: int) -> Case:
    """About ``total_mib`` of random pages of ``size_mib`` each (at least one)."""
    page_nbytes = round(size_mib * MIB)
    n = max(1, int(total_mib * MIB) // page_nbytes)
    ns = StorageNamespace.create(
        model="bench",
        kind="bench",
        parts=[("kv", (page_nbytes,))],
        dtype="uint8",
        layer_ids=[0],
        page_size=1,
        layout="page_first",
    )
    src, dst = BenchPages(n, page_nbytes, seed + 1), BenchPages(n, page_nbytes)
    return Case(size_mib, page_nbytes, random_keys(ns, n, seed), src, dst, ns)


def host_case(host, n: int, seed: int) -> Case:
    """Pages ``0 .. n-1`` of a page_first host pool set, read back into pages ``n .. 2n-1``."""
    if host.page_bytes_rows() is None or host.num_pages < 2 * n:
        raise InvalidArgumentError(
            f"host_case needs a page_first host pool of at least {2 * n} pages; this one is "
            f"{host.layout.value} with {host.num_pages}"
        )
    ns = StorageNamespace.for_host_pool(host, tenant="bench", model="bench")
    size_mib = host.page_nbytes / MIB
    return Case(size_mib, host.page_nbytes, random_keys(ns, n, seed), host, host, ns, 0, n)


def run_batches(fn, case: Case, source, first: int, batch: int) -> list[bool]:
    """``fn(keys, source, pages)`` over the case's keys in batches of ``batch``."""
    out: list[bool] = []
    for i in range(0, case.n, batch):
        end = min(i + batch, case.n)
        out.extend(fn(case.keys[i:end], source, range(first + i, first + end)))
    return out


def _sets(store, case: Case, batch: int) -> list[bool]:
    return run_batches(store.batch_set, case, case.src, case.src_first, batch)


def _gets(store, case: Case, batch: int) -> list[bool]:
    return run_batches(store.batch_get, case, case.dst, case.dst_first, batch)


def check_get(case: Case, ok: list[bool], where: str) -> None:
    """Every get returned True and the destination pages equal the source pages."""
    if len(ok) != case.n or not all(ok):
        fail(where, f"{ok.count(False)} of {case.n} gets returned False")
    got, want = case.dst_rows(), case.src_rows()
    if not np.array_equal(got, want):
        bad = np.flatnonzero((got != want).any(axis=1))
        fail(where, f"{bad.size} pages differ from what was written (first {bad[:5].tolist()})")


def _timed_into(ok: list[bool], fn: Callable[[], list[bool]]) -> float:
    return timed(lambda: ok.extend(fn()), collect=True)


def open_kv(kind: str, path: str, case: Case, budget: int, opts: dict, fsync: bool):
    """A store of ``kind`` in ``path`` for the case's pages (``opts``: LMDBStorage's options;
    ``slab`` takes those it shares with it)."""
    if kind == "lmdb":
        return LMDBStorage(path, case.namespace, case.page_nbytes, budget_bytes=budget, **opts)
    if kind == "slab":
        shared = {k: v for k, v in opts.items() if k in SLAB_OPTIONS}
        return SlabStorage(path, case.namespace, case.page_nbytes, budget_bytes=budget, **shared)
    if kind == "hicache":
        from tiered_kv.bench import sglang_peer  # SGLang: found on demand

        peer = sglang_peer.find_sglang()
        if isinstance(peer, str):
            raise InvalidArgumentError(f"store kind 'hicache': {peer}")
        return sglang_peer.SGLangFileStore(peer, path)
    return FileStore(path, fsync)


def close_kv(store) -> None:
    if hasattr(store, "close"):
        store.close()


def kv_store_times(
    case: Case,
    kind: str,
    workdir: str,
    batch: int,
    opts: dict,
    fsync: bool,
    cold: bool,
    drop: Callable[[], bool] = drop_page_cache,
) -> Times:
    """``set``, ``warm_get`` (and with ``cold``, ``cold_get``) of one fresh store of ``kind``
    (``open_kv``) in a temporary directory under ``workdir`` (removed after). ``drop`` drops
    the page cache before the cold get."""
    path = tempfile.mkdtemp(prefix=f"{kind}-", dir=workdir)
    budget = max(2 * case.n * (case.page_nbytes + ALIGN), 4 * (case.page_nbytes + ALIGN) + 32 * MIB)

    def open_store():
        return open_kv(kind, path, case, budget, opts, fsync)

    where = f"size={case.size_mib:g} MiB store={kind} {opts or ''} batch={batch}"
    out: Times = {}
    store = open_store()
    try:
        ok: list[bool] = []
        # Start every store's writes with no dirty pages left by an earlier phase: writeback of
        # someone else's bytes would throttle whichever store happens to write next.
        os.sync()
        out["set"] = (_timed_into(ok, lambda: _sets(store, case, batch)), None)
        if not all(ok):
            fail(where, f"{ok.count(False)} of {case.n} sets returned False")
        os.sync()
        case.dst_rows().fill(0)
        ok = []
        out["warm_get"] = (_timed_into(ok, lambda: _gets(store, case, batch)), None)
        check_get(case, ok, where + " warm_get")
        if cold:
            close_kv(store)  # a mapped page survives drop_caches: close, drop, reopen
            if not drop():
                fail(where, "dropping the page cache worked before and failed now")
            store = open_store()
            # and drop again: opening an LMDB environment checks its trees, which reads the
            # first page of every stored value and, through the map's read-around, most of
            # the values themselves (cold gets ran faster than a raw read of the same file)
            if not drop():
                fail(where, "dropping the page cache worked before and failed now")
            before = cached_mib()
            case.dst_rows().fill(0)
            ok = []
            out["cold_get"] = (_timed_into(ok, lambda: _gets(store, case, batch)), before)
            check_get(case, ok, where + " cold_get")
    finally:
        close_kv(store)
        shutil.rmtree(path, ignore_errors=True)
    return out


def full_set_times(
    case: Case, kind: str, workdir: str, batch: int, opts: dict, fsync: bool
) -> Times:
    """``full_set``: fill a store to its capacity with other pages (other keys; at least
    ``case.n``), then time writing the case's pages, each of which evicts an old one; then check
    the case's pages read back. Both stores hold the same number of pages."""
    path = tempfile.mkdtemp(prefix=f"full-{kind}-", dir=workdir)
    cost = record_cost(case.page_nbytes)
    # LMDBStorage evicts down to 3/4 of its budget; it also has a minimum budget
    budget = max(-(-case.n * cost * 4 // 3) + 4 * MIB, 4 * cost + 8 * MIB)
    capacity = budget * 3 // 4 // cost
    if kind == "slab":  # the same capacity: slabs fill the whole budget but its fixed part
        budget = BASE_COST + capacity * (slot_bytes_for(case.page_nbytes) + ENTRY_COST)
    old_keys = page_keys(case.namespace, np.arange(capacity, dtype=np.uint32), 1)
    where = f"size={case.size_mib:g} MiB store={kind} {opts or ''} batch={batch} full_set"
    if kind in ("lmdb", "slab"):
        store = open_kv(kind, path, case, budget, opts, fsync)
    else:
        store = EvictingFileStore(path, fsync, capacity)
    try:
        ok: list[bool] = []
        for i in range(0, capacity, batch):
            idx = range(i, min(i + batch, capacity))
            keys = [bytes(old_keys[j]) for j in idx]
            ok += store.batch_set(keys, case.src, [case.src_first + j % case.n for j in idx])
        if not all(ok):
            fail(where, f"{ok.count(False)} of {capacity} fill sets returned False")
        os.sync()
        ok = []
        seconds = _timed_into(ok, lambda: _sets(store, case, batch))
        if not all(ok):
            fail(where, f"{ok.count(False)} of {case.n} sets returned False")
        case.dst_rows().fill(0)
        check_get(case, _gets(store, case, batch), where)
    finally:
        close_kv(store)
        shutil.rmtree(path, ignore_errors=True)
    return {"full_set": (seconds, None)}
