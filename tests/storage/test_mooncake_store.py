"""MooncakeStorage against a real Mooncake Store (a master on 127.0.0.1, memory lent by this
process, in a loopback-only network namespace: see mooncake_server): values are verified on
every read (a flipped byte, a torn or oversized value, another namespace's record is a counted
miss, removed, never served), a killed master or a killed process lending the store's memory
gives counted misses and the store recovers when it comes back, a full store refuses some sets
(counted) and keeps serving, pages written by one store are read by another, staged sources and
batches over many chunks round-trip."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tiered_kv.errors import InvalidArgumentError, StorageOpenError
from tiered_kv.storage import StorageNamespace, page_keys, value_format
from tiered_kv.storage.mooncake_master import MooncakeLender, MooncakeMaster, free_port
from tiered_kv.storage.mooncake_store import MooncakeStorage

from ._util import ByteSource, P, byte_namespace, make_host, raw_key
from .mooncake_server import MooncakeServer, require_mooncake


@pytest.fixture
def host(gen):
    return make_host(gen, host_pages=16)


@pytest.fixture
def ns(host) -> StorageNamespace:
    return StorageNamespace.for_host_pool(host, model="mooncake-test")


@pytest.fixture
def keys(ns, gen):
    tokens = torch.randint(0, 2**31, (8 * P + 1,), generator=gen).tolist()
    return page_keys(ns, tokens, P)


@pytest.fixture
def server(mooncake_server):
    mooncake_server.flush()
    return mooncake_server


@pytest.fixture(scope="module")
def small_server():
    """A master of its own with 16 MiB lent and short leases (so a full store evicts soon)."""
    s = MooncakeServer(lent_bytes=16 << 20, lease_ms=300)
    yield s
    s.close()


def page(source, i) -> np.ndarray:
    return source.get_page_bytes(i).numpy().copy()


def name(key: bytes) -> str:
    return "tkv:" + key.hex()


@pytest.mark.parametrize(
    "where", ["payload", "header", "torn", "oversized", "other_namespace", "other_key"]
)
def test_a_damaged_value_is_a_counted_miss_and_is_removed(server, host, ns, keys, where):
    store = MooncakeStorage(ns, host.page_nbytes, **server.options)
    assert store.batch_set(keys[:3], host, [0, 1, 2]) == [True] * 3
    raw = server.client.raw
    value = bytearray(raw.get(name(keys[1])))
    assert len(value) == value_format.HEADER_BYTES + host.page_nbytes
    if where == "payload":
        value[value_format.HEADER_BYTES + 17] ^= 0x01
    elif where == "header":
        value[5] ^= 0x40
    elif where == "torn":
        value = value[: len(value) // 2]
    elif where == "oversized":
        value += b"\x5a" * 13
    elif where == "other_key":  # another key's intact value, answered for this key
        value = bytearray(raw.get(name(keys[2])))
    else:  # a record written for another namespace under this key
        other = StorageNamespace.for_host_pool(host, tenant="someone-else", model="mooncake-test")
        payload = bytes(value[value_format.HEADER_BYTES :])
        key = other.fingerprint + keys[1][16:]
        head = value_format.pack(other.fingerprint, payload, 0, key=key)
        value = bytearray(head + payload)
    assert raw.upsert(name(keys[1]), bytes(value)) == 0  # a put would keep the old value
    assert store.batch_get(keys[:3], host, [8, 9, 10]) == [True, False, True]
    assert np.array_equal(page(host, 8), page(host, 0))
    assert np.array_equal(page(host, 10), page(host, 2))
    s = store.stats()
    assert (s.checksum_failures, s.hits, s.misses, s.pages) == (1, 2, 1, 2)
    assert raw.is_exist(name(keys[1])) == 0  # removed: the next set writes it again
    assert store.batch_set(keys[1:2], host, [1]) == [True]
    assert store.stats().existing_refreshed == 0
    assert store.batch_get(keys[1:2], host, [9]) == [True]
    assert np.array_equal(page(host, 9), page(host, 1))
    store.close()


def test_a_staged_source_and_many_chunks_round_trip(server, gen):
    nbytes, n = 1000 + 7, 1100  # more keys than one call takes (512): three chunks
    src, dst = ByteSource(nbytes, n), ByteSource(nbytes, n)
    src.buf.random_(0, 256, generator=gen)
    dst.buf.random_(0, 256, generator=gen)
    ns = byte_namespace(nbytes)
    ks = [raw_key(ns, f"page-{i}") for i in range(n)]
    store = MooncakeStorage(ns, nbytes, **server.options)
    assert store.batch_set(ks, src, list(range(n))) == [True] * n
    order = list(np.random.default_rng(3).permutation(n))
    assert store.batch_get([ks[i] for i in order], dst, list(range(n))) == [True] * n
    for j, i in enumerate(order):
        assert torch.equal(dst.buf[j], src.buf[i]), (j, i)
    value = bytearray(server.client.raw.get(name(ks[700])))
    value[-1] ^= 0x80
    server.client.raw.upsert(name(ks[700]), bytes(value))
    before = dst.buf[100].clone()
    assert store.batch_get(ks[600:720], dst, list(range(120))) == [i != 100 for i in range(120)]
    assert torch.equal(dst.buf[100], before)  # a staged read fills nothing it did not verify
    assert torch.equal(dst.buf[101], src.buf[701])
    assert store.stats().checksum_failures == 1
    store.close()


def test_a_layer_first_host_pool_round_trips(server, gen):
    host = make_host(gen, layout="layer_first", host_pages=8)
    ns = StorageNamespace.for_host_pool(host, model="mooncake-test")
    ks = page_keys(ns, torch.randint(0, 2**31, (6 * P,), generator=gen).tolist(), P)
    store = MooncakeStorage(ns, host.page_nbytes, **server.options)
    assert store.batch_set(ks[:3], host, [0, 1, 2]) == [True] * 3
    assert store.batch_get(ks[:3], host, [7, 6, 5]) == [True] * 3
    for src, dst in ((0, 7), (1, 6), (2, 5)):
        assert np.array_equal(page(host, dst), page(host, src))
    store.close()


def test_two_stores_share_pages(server, host, ns, keys, gen):
    a = MooncakeStorage(ns, host.page_nbytes, **server.options)
    b = MooncakeStorage(ns, host.page_nbytes, **server.options)
    other = make_host(gen, host_pages=16)  # b's own host memory
    assert a.batch_set(keys[:3], host, [0, 1, 2]) == [True] * 3
    assert b.batch_exists(keys) == 3  # written by a, seen by b
    assert b.batch_get(keys[:3], other, [5, 6, 7]) == [True] * 3
    for src, dst in ((0, 5), (1, 6), (2, 7)):
        assert np.array_equal(page(other, dst), page(host, src))
    assert b.batch_set(keys[:4], other, [9, 9, 9, 3]) == [True] * 4
    assert b.stats().existing_refreshed == 3  # a's pages kept, not overwritten
    assert a.batch_get(keys[:1], host, [12]) == [True]
    assert np.array_equal(page(host, 12), page(host, 0))
    a.close()
    b.close()


def test_a_killed_master_gives_counted_misses_and_the_store_recovers(small_server, host, ns, keys):
    small_server.flush()
    store = MooncakeStorage(ns, host.page_nbytes, **small_server.options)
    assert store.batch_set(keys[:2], host, [0, 1]) == [True, True]
    small_server.master.stop()
    before = page(host, 8)
    assert store.batch_exists(keys) == 0
    assert store.batch_set(keys[2:4], host, [2, 3]) == [False, False]
    assert store.batch_get(keys[:2], host, [8, 9]) == [False, False]
    assert np.array_equal(page(host, 8), before)
    assert store.delete(keys[:1]) == 0
    store.clear()
    s = store.stats()
    assert sum(s.errors.values()) >= 5 and s.set_skipped == 2 and s.misses == 2, s
    assert any(k.startswith("batch_get: ") for k in s.errors), s.errors
    assert any(k.startswith("batch_set: ") for k in s.errors), s.errors
    small_server.master.start()  # back, empty: the client reconnects and lends its memory again
    deadline = time.monotonic() + 30
    while store.batch_set(keys[4:5], host, [4]) != [True]:
        assert time.monotonic() < deadline, store.stats().errors
        time.sleep(0.2)
    assert store.batch_exists(keys[:2]) == 0  # the old master's pages are gone
    assert store.batch_set(keys[:3], host, [5, 6, 7]) == [True] * 3
    assert store.batch_get(keys[:3], host, [12, 13, 14]) == [True] * 3
    for src, dst in ((5, 12), (6, 13), (7, 14)):
        assert np.array_equal(page(host, dst), page(host, src))
    store.close()


def test_a_killed_lender_gives_counted_misses_and_the_store_recovers(host, ns, keys):
    """The process lending the store's memory dies: its pages are gone, reads and writes are
    counted misses; a new lender brings room back. Then the client closes under the store."""
    require_mooncake()
    master = MooncakeMaster(lease_ms=300)
    lender = MooncakeLender(master.address, 32 << 20)
    store = None
    try:
        store = MooncakeStorage(ns, host.page_nbytes, master=master.address, segment_bytes=0)
        assert store.batch_set(keys[:3], host, [0, 1, 2]) == [True] * 3
        lender.stop()
        deadline = time.monotonic() + 60
        while store.batch_get(keys[:3], host, [8, 9, 10]) != [False] * 3:
            assert time.monotonic() < deadline, "the dead lender's pages were still served"
            time.sleep(0.5)
        while store.batch_set(keys[3:4], host, [3]) != [False]:
            assert time.monotonic() < deadline, "a set succeeded with no memory lent"
            time.sleep(0.5)
        s = store.stats()
        assert s.set_skipped >= 1 and s.misses >= 3
        assert any(k.startswith("batch_get: ") for k in s.errors), s.errors
        assert any(k.startswith("batch_set: ") for k in s.errors), s.errors
        lender = MooncakeLender(master.address, 32 << 20)
        while store.batch_set(keys[4:6], host, [4, 5]) != [True, True]:
            assert time.monotonic() < deadline, store.stats().errors
            time.sleep(0.2)
        assert store.batch_get(keys[4:6], host, [12, 13]) == [True, True]
        assert np.array_equal(page(host, 12), page(host, 4))
        assert np.array_equal(page(host, 13), page(host, 5))
        # Its process's client closed under it (at exit, say): counted misses, not a crash.
        store._client.close()
        errors = sum(store.stats().errors.values())
        assert store.batch_exists(keys) == 0
        assert store.batch_get(keys[4:6], host, [12, 13]) == [False, False]
        assert store.batch_set(keys[6:7], host, [6]) == [False]
        assert store.delete(keys[:1]) == 0
        store.clear()
        s = store.stats()
        store.close()  # after the stats: a closed store refuses every call but close
        assert sum(s.errors.values()) >= errors + 6, s.errors
        for call in ("batch_exists", "batch_get", "batch_set", "delete", "clear"):
            assert s.errors.get(f"{call}: ClientClosedError", 0) >= 1, s.errors
    finally:
        lender.stop()
        master.stop()
        if store is not None:
            store._client.close()


def test_a_full_store_refuses_some_sets_counted_and_keeps_serving(small_server, gen):
    small_server.flush()
    nbytes = (1 << 20) + 4093  # 16 MiB lent holds fewer than 16 of these
    src = ByteSource(nbytes, 4)
    src.buf.random_(0, 256, generator=gen)
    ns = byte_namespace(nbytes)
    store = MooncakeStorage(ns, nbytes, segment_bytes=0, **small_server.options)
    ks = [raw_key(ns, f"p{i}") for i in range(120)]
    got = []
    for i, k in enumerate(ks):  # bounded: 120 pages into room for ~14
        got.append(store.batch_set([k], src, [i % 4])[0])
    s = store.stats()
    assert got.count(False) > 0 and s.set_skipped == got.count(False)
    assert any(k.startswith("batch_set: ") for k in s.errors), s.errors
    assert got.count(True) > 14  # the store evicted (expired leases) to take more
    dst = ByteSource(nbytes, 1)
    served = 0
    for i, k in enumerate(ks):  # what is still there is served exactly, the rest are misses
        if store.batch_get([k], dst, [0]) == [True]:
            served += 1
            assert torch.equal(dst.buf[0], src.buf[i % 4]), i
    assert 0 < served <= 16
    store.close()


def test_an_unreachable_master_is_refused_at_open(host, ns):
    t0 = time.monotonic()
    with pytest.raises(StorageOpenError, match="no Mooncake master answers"):
        MooncakeStorage(ns, host.page_nbytes, master=f"127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < 10


def test_constructor_rejects_bad_options(host, ns):
    for kwargs, needle in (
        ({"master": "127.0.0.1"}, "master="),
        ({"master": 5}, "master=5"),
        ({"protocol": "udp"}, "protocol='udp'"),
        ({"metadata_server": ""}, "metadata_server=''"),
        ({"local_hostname": None}, "local_hostname=None"),
        ({"device_name": 3}, "device_name=3"),
        ({"budget_bytes": 1.5}, "budget_bytes=1.5"),
        ({"budget_bytes": 10}, "cannot hold one page"),
        ({"segment_bytes": -1}, "segment_bytes=-1"),
        ({"local_buffer_bytes": None}, "local_buffer_bytes=None"),
    ):
        with pytest.raises(InvalidArgumentError, match=needle):
            MooncakeStorage(ns, host.page_nbytes, **kwargs)
