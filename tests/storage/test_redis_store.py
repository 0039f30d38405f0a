"""RedisStorage against a real redis-server (127.0.0.1, a free port, no persistence): values
are verified on every read (a flipped byte, another namespace's record or a torn value is a
counted miss, deleted, never served), a killed server gives counted misses and the store
recovers when it comes back, and two clients (two nodes) share pages and one budget."""

from __future__ import annotations

import numpy as np
import pytest
import redis
import torch

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage import StorageNamespace, page_keys, value_format
from tiered_kv.storage.redis_store import RedisStorage

from ._util import P, make_host
from .redis_server import RedisServer


@pytest.fixture
def host(gen):
    return make_host(gen, host_pages=16)


@pytest.fixture
def ns(host) -> StorageNamespace:
    return StorageNamespace.for_host_pool(host, model="redis-test")


@pytest.fixture
def keys(ns, gen):
    tokens = torch.randint(0, 2**31, (8 * P + 1,), generator=gen).tolist()
    return page_keys(ns, tokens, P)


@pytest.fixture
def server(redis_server):
    redis_server.flush()
    return redis_server


def raw(server) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def page(host, i) -> torch.Tensor:
    return host.get_page_bytes(i).clone()


@pytest.mark.parametrize(
    "where", ["payload", "header", "torn", "no_header", "other_namespace", "other_key"]
)
def test_a_damaged_value_is_a_counted_miss_and_is_deleted(server, host, ns, keys, where):
    store = RedisStorage(ns, host.page_nbytes, url=server.url)
    assert store.batch_set(keys[:3], host, [0, 1, 2]) == [True] * 3
    r, name, hname = raw(server), b"tkv:v:" + keys[1], b"tkv:h:" + keys[1]
    value, header = bytearray(r.get(name)), bytearray(r.get(hname))
    assert len(value) == host.page_nbytes and len(header) == value_format.HEADER_BYTES
    if where == "payload":
        value[17 % len(value)] ^= 0x01
    elif where == "header":
        header[5] ^= 0x40
    elif where == "torn":
        value = value[: len(value) // 2]
    elif where == "no_header":  # the server evicted the header alone
        header = None
    elif where == "other_key":  # another key's intact value and header, under this key
        value, header = r.get(b"tkv:v:" + keys[2]), r.get(b"tkv:h:" + keys[2])
    else:  # a record written for another namespace under this key
        other = StorageNamespace.for_host_pool(host, tenant="someone-else", model="redis-test")
        head = value_format.pack(other.fingerprint, bytes(value), 0, key=keys[1])
        header = bytearray(head)
    r.set(name, bytes(value))
    if header is None:
        r.delete(hname)
    else:
        r.set(hname, bytes(header))
    untouched = page(host, 9)
    assert store.batch_get(keys[:3], host, [8, 9, 10]) == [True, False, True]
    assert torch.equal(page(host, 9), untouched)  # nothing of the damaged value reached it
    assert torch.equal(page(host, 8), page(host, 0)) and torch.equal(page(host, 10), page(host, 2))
    s = store.stats()
    assert (s.checksum_failures, s.hits, s.misses, s.pages) == (1, 2, 1, 2)
    assert r.get(name) is None and r.get(hname) is None  # deleted: the next set writes it again
    assert store.batch_set(keys[1:2], host, [1]) == [True]
    assert store.batch_get(keys[1:2], host, [9]) == [True]
    assert torch.equal(page(host, 9), page(host, 1))
    store.close()


def test_a_killed_server_gives_counted_misses_and_the_store_recovers(host, ns, keys):
    server = RedisServer()
    try:
        store = RedisStorage(ns, host.page_nbytes, url=server.url, timeout_s=0.5)
        assert store.batch_set(keys[:2], host, [0, 1]) == [True, True]
        server.stop()
        before = page(host, 8)
        assert store.batch_exists(keys) == 0
        assert store.batch_get(keys[:2], host, [8, 9]) == [False, False]
        assert torch.equal(page(host, 8), before)
        assert store.batch_set(keys[2:4], host, [2, 3]) == [False, False]
        assert store.delete(keys[:1]) == 0
        store.clear()
        s = store.stats()
        assert sum(s.errors.values()) >= 5 and s.set_skipped == 2 and s.misses == 2
        assert any(k.startswith("batch_get: ") for k in s.errors), s.errors
        server.start()  # back, empty (no persistence): the store works again
        assert store.batch_exists(keys) == 0
        assert store.batch_set(keys[:3], host, [4, 5, 6]) == [True] * 3
        assert store.batch_get(keys[:3], host, [12, 13, 14]) == [True] * 3
        for src, dst in ((4, 12), (5, 13), (6, 14)):
            assert torch.equal(page(host, dst), page(host, src))
        store.close()
    finally:
        server.stop()


def test_two_nodes_share_pages_and_one_budget(server, host, ns, keys, gen):
    record = host.page_nbytes + value_format.HEADER_BYTES
    a = RedisStorage(ns, host.page_nbytes, url=server.url, budget_bytes=5 * record)
    b = RedisStorage(ns, host.page_nbytes, url=server.url, budget_bytes=5 * record)
    other = make_host(gen, host_pages=16)  # node b's own host memory
    assert a.batch_set(keys[:3], host, [0, 1, 2]) == [True] * 3
    assert b.batch_exists(keys) == 3  # written by a, seen by b
    assert b.batch_get(keys[:3], other, [5, 6, 7]) == [True] * 3
    for src, dst in ((0, 5), (1, 6), (2, 7)):
        assert np.array_equal(other.get_page_bytes(dst).numpy(), host.get_page_bytes(src).numpy())
    # b's reads refreshed keys 0..2; its new pages push the namespace over the shared budget:
    # the least recently used go, whoever wrote them.
    assert b.batch_set(keys[3:6], other, [3, 4, 8]) == [True] * 3
    assert a.stats().pages == b.stats().pages == 5
    assert b.stats().evictions == 1
    assert a.batch_exists(keys[:1]) == 0 and a.batch_exists(keys[1:6]) == 5
    a.close()
    b.close()


def test_a_server_that_evicts_by_itself_leaves_no_stale_index(host, ns, keys):
    server = RedisServer(maxmemory="3mb")  # allkeys-lru: values vanish without our script
    try:
        store = RedisStorage(ns, host.page_nbytes, url=server.url)
        written = 0
        filler = StorageNamespace.for_host_pool(host, model="filler")
        big = redis.Redis.from_url(server.url)
        for i in range(400):  # other data pushes ours out
            big.set(f"other:{i}".encode(), np.random.bytes(16 << 10))
            if i == 0:
                assert store.batch_set(keys[:4], host, [0, 1, 2, 3]) == [True] * 4
                written = 4
        got = store.batch_get(keys[:written], host, [8, 9, 10, 11])
        assert got.count(True) < written  # some went (the server's own LRU)
        assert store.stats().pages == got.count(True)  # their index entries dropped on read
        for i, ok in enumerate(got):
            if ok:
                assert torch.equal(page(host, 8 + i), page(host, i))
        assert filler.fingerprint != ns.fingerprint
        store.close()
    finally:
        server.stop()


def test_constructor_rejects_bad_options(host, ns):
    for kwargs, needle in (
        ({"url": "http://x"}, "url="),
        ({"timeout_s": 0}, "timeout_s=0"),
        ({"budget_bytes": 1.5}, "budget_bytes=1.5"),
        ({"budget_bytes": 10}, "cannot hold one page"),
    ):
        with pytest.raises(InvalidArgumentError, match=needle):
            RedisStorage(ns, host.page_nbytes, **kwargs)
