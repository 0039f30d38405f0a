"""The storage contract, run against every implementation (MemoryStorage, LMDBStorage and
SlabStorage, the two layouts of the disk tier, RedisStorage on a real redis-server,
LayeredStorage: a local store in front of the Redis one, and MooncakeStorage on a real Mooncake
Store, run in a loopback-only network namespace as mooncake_server says)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered_kv.errors import InvalidArgumentError, StorageClosedError, TieredKVError
from tiered_kv.storage import LMDBStorage, MemoryStorage, StorageNamespace, page_keys, value_format
from tiered_kv.storage.keys import KEY_BYTES
from tiered_kv.storage.layered_store import LayeredStorage
from tiered_kv.storage.mooncake_store import MooncakeStorage
from tiered_kv.storage.redis_store import RedisStorage
from tiered_kv.storage.slab_store import SlabStorage

from ._util import (
    ByteSource,
    P,
    byte_namespace,
    expected_bytes,
    fill_for_keys,
    make_host,
    min_lmdb_budget,
    raw_key,
)

IMPLS = ["memory", "lmdb", "lmdb-1-thread", "slab", "slab-1-thread", "redis", "layered", "mooncake"]


def _tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 2**32, size=n, dtype=np.uint64).tolist()


@pytest.fixture
def host(gen):
    return make_host(gen, host_pages=16)


@pytest.fixture
def ns(host) -> StorageNamespace:
    return StorageNamespace.for_host_pool(host, model="test-model")


@pytest.fixture
def keys(ns):
    return page_keys(ns, _tokens(8 * P + 1, seed=7), P)


@pytest.fixture(params=IMPLS)
def make_store(request, tmp_path):
    """A factory of stores of the parametrized kind; every store is closed at teardown."""
    made = []
    server = None
    if request.param in ("redis", "layered"):  # one server for the session, emptied per test
        server = request.getfixturevalue("redis_server")
        server.flush()
    elif request.param == "mooncake":  # one master and lent memory for the session
        server = request.getfixturevalue("mooncake_server")
        server.flush()

    def make(ns, page_nbytes, budget_bytes=None, path=None):
        if request.param == "memory":
            store = MemoryStorage(ns, page_nbytes, budget_bytes=budget_bytes)
        elif request.param == "redis":
            store = RedisStorage(ns, page_nbytes, url=server.url, budget_bytes=budget_bytes)
        elif request.param == "mooncake":
            store = MooncakeStorage(ns, page_nbytes, budget_bytes=budget_bytes, **server.options)
        elif request.param == "layered":  # a node's own store in front of the shared one
            store = LayeredStorage(
                MemoryStorage(ns, page_nbytes, budget_bytes=budget_bytes),
                RedisStorage(ns, page_nbytes, url=server.url, budget_bytes=budget_bytes),
            )
        else:
            threads = 1 if request.param.endswith("-1-thread") else 3
            store = (SlabStorage if request.param.startswith("slab") else LMDBStorage)(
                path or tmp_path / "store",
                ns,
                page_nbytes,
                budget_bytes=budget_bytes or 64 << 20,
                io_threads=threads,
            )
        made.append(store)
        return store

    make.kind = request.param
    yield make
    for s in made:
        s.close()


@pytest.fixture
def store(make_store, ns, host):
    return make_store(ns, host.page_nbytes)


def page(host, i) -> torch.Tensor:
    return host.get_page_bytes(i).clone()


def test_batch_exists_counts_consecutive_prefix(store, host, keys):
    assert store.batch_exists(keys) == 0
    assert store.batch_set([keys[0], keys[1], keys[3]], host, [0, 1, 3]) == [True] * 3
    assert store.batch_exists(keys) == 2
    assert store.batch_exists(keys[:2]) == 2
    assert store.batch_exists(keys[1:]) == 1
    assert store.batch_exists(keys[2:]) == 0
    assert store.batch_exists(keys[3:4]) == 1
    assert store.batch_set([keys[2]], host, [2]) == [True]
    assert store.batch_exists(keys) == 4


def test_empty_key_lists(store, host, keys):
    assert store.batch_exists([]) == 0
    assert store.batch_get([], host, []) == []
    assert store.batch_set([], host, []) == []
    assert store.delete([]) == 0
    store.batch_set(keys[:2], host, [0, 1])
    assert store.batch_exists([]) == 0
    assert store.batch_get([], host, []) == []
    assert store.batch_set([], host, []) == []
    assert store.delete([]) == 0
    assert store.batch_exists(keys) == 2


def test_set_then_get_round_trips_bytes(store, host, keys):
    before = [page(host, i) for i in range(8)]
    assert store.batch_set(keys, host, list(range(8))) == [True] * 8
    assert store.batch_exists(keys) == 8
    # Into other host pages, in another order.
    targets = [15, 8, 14, 9, 13, 10, 12, 11]
    assert all(not torch.equal(page(host, t), before[i]) for i, t in enumerate(targets))
    assert store.batch_get(keys, host, targets) == [True] * 8
    for i, t in enumerate(targets):
        assert torch.equal(page(host, t), before[i]), i
    # The source pages are unchanged by set or get.
    for i in range(8):
        assert torch.equal(page(host, i), before[i])


def test_pages_as_tensor_and_numpy(store, host, keys):
    before = page(host, 2)
    assert store.batch_set(keys[:1], host, torch.tensor([2])) == [True]
    assert store.batch_get(keys[:1], host, np.array([9])) == [True]
    assert torch.equal(page(host, 9), before)


def test_set_of_present_key_is_noop_that_refreshes(store, host, keys):
    original = page(host, 0)
    assert store.batch_set(keys[:1], host, [0]) == [True]
    s0 = store.stats()
    # Same key, other host page: the stored bytes stay those of the first write.
    assert store.batch_set(keys[:1], host, [5]) == [True]
    s1 = store.stats()
    assert s1.existing_refreshed == s0.existing_refreshed + 1
    assert s1.sets == s0.sets + 1
    assert s1.pages == s0.pages == 1
    assert s1.bytes == s0.bytes
    assert store.batch_get(keys[:1], host, [12]) == [True]
    assert torch.equal(page(host, 12), original)


def test_duplicate_key_in_one_batch(store, host, keys):
    original = page(host, 1)
    assert store.batch_set([keys[0], keys[0]], host, [1, 2]) == [True, True]
    assert store.stats().existing_refreshed == 1
    assert store.stats().pages == 1
    assert store.batch_get(keys[:1], host, [10]) == [True]
    assert torch.equal(page(host, 10), original)
    assert store.delete([keys[0], keys[0]]) == 1


def test_set_refresh_protects_from_eviction(make_store, tmp_path):
    # Pages that fill whole LMDB overflow pages, so the store's byte accounting is close to
    # LMDB's real use and eviction (not a full map) makes room; see test_lmdb_store for the
    # tight-budget behaviour of other page sizes.
    if make_store.kind == "mooncake":
        pytest.skip(
            "a Mooncake Store evicts by its own lease-based policy, store-wide (its budget is the "
            "memory a node lends); test_mooncake_store covers a full store"
        )
    nbytes = 16 * 4096 - 16
    src = ByteSource(nbytes, 4)
    ns = byte_namespace(nbytes)
    if make_store.kind in ("memory", "redis", "layered"):  # a budget of whole records
        budget = 8 * (nbytes + value_format.HEADER_BYTES)
    else:
        budget = min_lmdb_budget(tmp_path, ns, nbytes) + 8 * nbytes
    store = make_store(ns, nbytes, budget_bytes=budget)
    a, b = raw_key(ns, "A"), raw_key(ns, "B")
    fill_for_keys(src, [a, b], [0, 1])
    assert store.batch_set([a, b], src, [0, 1]) == [True, True]
    # Refresh A (written before B) with a set before every batch of newer pages; each batch
    # is smaller than what the store holds.
    refreshes, i = 0, 0
    while store.stats().evictions == 0:
        assert i < 100_000, "no eviction"
        assert store.batch_set([a], src, [3]) == [True]
        refreshes += 1
        batch = [raw_key(ns, f"filler-{j}") for j in range(i, i + 2)]
        assert store.batch_set(batch, src, [2, 2]) == [True, True], i
        i += len(batch)
    s = store.stats()
    assert s.evictions > 0
    assert s.existing_refreshed == refreshes  # A was never evicted and rewritten
    assert store.batch_exists([b]) == 0  # the oldest page went
    assert store.batch_exists([a]) == 1  # the refreshed one stayed
    assert store.batch_get([a, b], src, [3, 2]) == [True, False]
    assert np.array_equal(src.buf[3].numpy(), expected_bytes(a, nbytes))


def test_get_of_missing_key_leaves_host_page_untouched(store, host, keys):
    assert store.batch_set([keys[0], keys[2]], host, [0, 2]) == [True, True]
    untouched = page(host, 11)
    got = store.batch_get(keys[:3], host, [10, 11, 12])
    assert got == [True, False, True]
    assert torch.equal(page(host, 11), untouched)
    assert torch.equal(page(host, 10), page(host, 0))
    assert torch.equal(page(host, 12), page(host, 2))


def test_delete_returns_number_present(store, host, keys):
    store.batch_set(keys[:4], host, [0, 1, 2, 3])
    assert store.delete([keys[1], keys[5], keys[3]]) == 2
    assert store.batch_exists(keys) == 1
    assert store.batch_exists(keys[2:3]) == 1
    assert store.delete([keys[1], keys[3]]) == 0
    assert store.batch_get(keys[:4], host, [8, 9, 10, 11]) == [True, False, True, False]
    assert store.stats().pages == 2


def test_clear_removes_only_this_namespace(make_store, tmp_path, host, ns, keys):
    # One store object per directory at a time in this process (see test_lmdb_store for two
    # at once): the other namespace writes, closes, and is reopened after the clear.
    shared = tmp_path / "shared"
    other_ns = StorageNamespace.for_host_pool(host, tenant="other", model="test-model")
    other_keys = page_keys(other_ns, _tokens(8 * P + 1, seed=7), P)
    other = make_store(other_ns, host.page_nbytes, path=shared)
    assert other.batch_set(other_keys[:3], host, [4, 5, 6]) == [True] * 3
    if make_store.kind.startswith("lmdb"):
        other.close()
    store = make_store(ns, host.page_nbytes, path=shared)
    assert store.batch_set(keys[:4], host, [0, 1, 2, 3]) == [True] * 4
    store.clear()
    if make_store.kind.startswith("lmdb"):
        store.close()
        other = make_store(other_ns, host.page_nbytes, path=shared)
        store = None
    assert other.batch_exists(other_keys) == 3
    assert other.batch_get(other_keys[:3], host, [12, 13, 14]) == [True] * 3
    for src, dst in ((4, 12), (5, 13), (6, 14)):
        assert torch.equal(page(host, dst), page(host, src))
    if store is None:
        other.close()
        store = make_store(ns, host.page_nbytes, path=shared)
    assert store.batch_exists(keys[:1]) == 0
    assert store.batch_get(keys[:4], host, [8, 9, 10, 11]) == [False] * 4
    # The store works after clear.
    assert store.batch_set(keys[:2], host, [0, 1]) == [True, True]
    assert store.batch_exists(keys) == 2


def test_stats_counters(store, host, keys):
    s = store.stats()
    assert (s.hits, s.misses, s.sets, s.existing_refreshed, s.gets) == (0, 0, 0, 0, 0)
    assert s.pages == 0 and s.bytes == 0
    store.batch_set(keys[:3], host, [0, 1, 2])
    s = store.stats()
    assert (s.sets, s.existing_refreshed, s.pages) == (3, 0, 3)
    assert s.bytes >= 3 * host.page_nbytes
    store.batch_set(keys[1:5], host, [1, 2, 3, 4])
    s = store.stats()
    assert (s.sets, s.existing_refreshed, s.pages) == (7, 2, 5)
    store.batch_get([keys[0], keys[6], keys[4], keys[7]], host, [8, 9, 10, 11])
    s = store.stats()
    assert (s.gets, s.hits, s.misses) == (4, 2, 2)
    store.batch_exists(keys)  # exists does not count as get
    s = store.stats()
    assert (s.gets, s.hits, s.misses, s.checksum_failures, s.evictions) == (4, 2, 2, 0, 0)
    assert s.set_skipped == 0
    store.delete(keys[:2])
    assert store.stats().pages == 3
    assert store.stats().bytes < s.bytes


def _snapshot(store, keys, host):
    return (store.batch_exists(keys), store.stats(), host.buffer.clone())


def _assert_unchanged(store, keys, host, snap):
    n, s, buf = snap
    assert store.batch_exists(keys) == n
    after = store.stats()
    assert after.pages == s.pages
    assert after.bytes == s.bytes
    assert torch.equal(host.buffer.view(torch.uint8), buf.view(torch.uint8))


@pytest.mark.parametrize("op", ["exists", "get", "set", "delete"])
def test_key_of_other_namespace_raises(store, host, keys, op):
    store.batch_set(keys[:2], host, [0, 1])
    other = page_keys(
        StorageNamespace.for_host_pool(host, tenant="x", model="test-model"), _tokens(8 * P), P
    )
    snap = _snapshot(store, keys, host)
    with pytest.raises(InvalidArgumentError, match="unknown namespace"):
        _call(store, op, [keys[2], other[0]], host, [8, 9])
    _assert_unchanged(store, keys, host, snap)


def _call(store, op, ks, source, pages):
    if op == "exists":
        return store.batch_exists(ks)
    if op == "get":
        return store.batch_get(ks, source, pages)
    if op == "set":
        return store.batch_set(ks, source, pages)
    return store.delete(ks)


@pytest.mark.parametrize("op", ["exists", "get", "set", "delete"])
@pytest.mark.parametrize("bad", ["short", "long", "str", "int"])
def test_malformed_key_raises(store, host, keys, op, bad):
    store.batch_set(keys[:2], host, [0, 1])
    badkey = {
        "short": keys[2][:-1],
        "long": keys[2] + b"\0",
        "str": "x" * KEY_BYTES,
        "int": 7,
    }[bad]
    snap = _snapshot(store, keys, host)
    with pytest.raises(InvalidArgumentError):
        _call(store, op, [keys[0], badkey], host, [8, 9])
    _assert_unchanged(store, keys, host, snap)


@pytest.mark.parametrize("op", ["exists", "get", "set", "delete"])
def test_single_bytes_key_raises(store, host, keys, op):
    store.batch_set(keys[:2], host, [0, 1])
    snap = _snapshot(store, keys, host)
    with pytest.raises(InvalidArgumentError):
        _call(store, op, keys[0], host, [8])
    with pytest.raises(InvalidArgumentError):
        _call(store, op, bytearray(keys[0]), host, [8])
    _assert_unchanged(store, keys, host, snap)


@pytest.mark.parametrize("op", ["get", "set"])
def test_keys_pages_length_mismatch_raises(store, host, keys, op):
    store.batch_set(keys[:2], host, [0, 1])
    snap = _snapshot(store, keys, host)
    with pytest.raises(InvalidArgumentError):
        _call(store, op, keys[:3], host, [8, 9])
    with pytest.raises(InvalidArgumentError):
        _call(store, op, keys[:1], host, [8, 9])
    _assert_unchanged(store, keys, host, snap)


@pytest.mark.parametrize("op", ["get", "set"])
def test_wrong_page_byte_length_raises(store, host, keys, op):
    store.batch_set(keys[:2], host, [0, 1])
    snap = _snapshot(store, keys, host)
    for wrong in (ByteSource(host.page_nbytes + 1, 4), ByteSource(host.page_nbytes // 2, 4)):
        before = wrong.buf.clone()
        with pytest.raises(InvalidArgumentError, match="bytes"):
            _call(store, op, keys[:3], wrong, [0, 1, 2])
        assert torch.equal(wrong.buf, before)
    other_host = make_host(page_size=2 * P)
    with pytest.raises(InvalidArgumentError):
        _call(store, op, keys[:3], other_host, [0, 1, 2])
    _assert_unchanged(store, keys, host, snap)


BAD_PAGES = [16, -1]


@pytest.mark.parametrize("bad_page", BAD_PAGES)
def test_set_with_invalid_host_page_raises_and_stores_nothing(store, host, keys, bad_page):
    store.batch_set(keys[:2], host, [0, 1])
    snap = _snapshot(store, keys, host)
    # The bad page comes last: the valid pair before it must not have been stored either.
    with pytest.raises(InvalidArgumentError):
        store.batch_set([keys[2], keys[3]], host, [8, bad_page])
    _assert_unchanged(store, keys, host, snap)
    assert store.batch_exists(keys[2:3]) == 0


@pytest.mark.parametrize("bad_page", BAD_PAGES)
def test_set_of_present_key_with_invalid_host_page_raises(store, host, keys, bad_page):
    store.batch_set(keys[:2], host, [0, 1])
    snap = _snapshot(store, keys, host)
    with pytest.raises(InvalidArgumentError):
        store.batch_set([keys[1]], host, [bad_page])
    _assert_unchanged(store, keys, host, snap)


@pytest.mark.parametrize("bad_page", BAD_PAGES)
def test_get_with_invalid_host_page_raises_and_fills_nothing(store, host, keys, bad_page):
    store.batch_set(keys[:2], host, [0, 1])
    snap = _snapshot(store, keys, host)
    # The bad page comes last: host page 8 must not have been filled before the error.
    with pytest.raises(InvalidArgumentError):
        store.batch_get([keys[0], keys[1]], host, [8, bad_page])
    _assert_unchanged(store, keys, host, snap)


@pytest.mark.parametrize("bad_page", BAD_PAGES)
def test_get_of_missing_key_with_invalid_host_page_raises(store, host, keys, bad_page):
    store.batch_set(keys[:2], host, [0, 1])
    snap = _snapshot(store, keys, host)
    with pytest.raises(InvalidArgumentError):
        store.batch_get([keys[5]], host, [bad_page])
    _assert_unchanged(store, keys, host, snap)


def test_constructor_checks(make_store, ns, host):
    with pytest.raises(InvalidArgumentError):
        make_store("not a namespace", host.page_nbytes)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError):
            make_store(ns, bad)
    with pytest.raises(InvalidArgumentError):
        make_store(ns, host.page_nbytes, budget_bytes=host.page_nbytes)


def test_a_closed_store_refuses_every_call_and_changes_nothing(
    make_store, ns, host, keys, tmp_path
):
    store = make_store(ns, host.page_nbytes, path=tmp_path / "closed")
    assert store.batch_set(keys[:3], host, [0, 1, 2]) == [True] * 3
    store.close()
    store.close()  # closing twice is fine
    assert store.closed
    targets = [page(host, 8), page(host, 9)]
    calls = {
        "batch_exists": lambda: store.batch_exists(keys),
        "batch_get": lambda: store.batch_get(keys[:2], host, [8, 9]),
        "batch_set": lambda: store.batch_set(keys[3:5], host, [3, 4]),
        "delete": lambda: store.delete(keys[:1]),
        "clear": store.clear,
        "stats": store.stats,
    }
    for name, call in calls.items():
        with pytest.raises(StorageClosedError, match=rf"{type(store).__name__}\.{name}: .*closed"):
            call()
    assert issubclass(StorageClosedError, TieredKVError)
    assert torch.equal(page(host, 8), targets[0]) and torch.equal(page(host, 9), targets[1])
    if make_store.kind != "memory":  # the others keep their pages: nothing above reached them
        again = make_store(ns, host.page_nbytes, path=tmp_path / "closed")
        assert again.batch_exists(keys) == 3
