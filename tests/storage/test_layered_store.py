"""LayeredStorage: a node's local slab store in front of a shared Redis: writes reach both,
the remote store's hits fill the local one, the local store keeps serving (and survives a
restart) while the server is down, and a damaged local copy is served from the remote one."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage import MemoryStorage, StorageNamespace, page_keys
from tiered_kv.storage.layered_store import LayeredStorage
from tiered_kv.storage.redis_store import RedisStorage
from tiered_kv.storage.slab_store import SlabStorage

from ._util import P, make_host
from .redis_server import RedisServer


@pytest.fixture
def host(gen):
    return make_host(gen, host_pages=16)


@pytest.fixture
def ns(host) -> StorageNamespace:
    return StorageNamespace.for_host_pool(host, model="layered-test")


@pytest.fixture
def keys(ns, gen):
    return page_keys(ns, torch.randint(0, 2**31, (8 * P + 1,), generator=gen).tolist(), P)


def page(host, i) -> torch.Tensor:
    return host.get_page_bytes(i).clone()


def layered(tmp_path, ns, host, url: str) -> LayeredStorage:
    local = SlabStorage(tmp_path / "local", ns, host.page_nbytes, budget_bytes=32 << 20)
    return LayeredStorage(local, RedisStorage(ns, host.page_nbytes, url=url, timeout_s=0.5))


def test_remote_hits_fill_the_local_store_and_it_serves_when_the_server_is_gone(
    tmp_path, host, ns, keys
):
    server = RedisServer()
    try:
        # Node A writes through both; node B (its own local store) reads from the remote.
        a = layered(tmp_path / "a", ns, host, server.url)
        assert a.batch_set(keys[:4], host, [0, 1, 2, 3]) == [True] * 4
        b = layered(tmp_path / "b", ns, host, server.url)
        assert b.local.batch_exists(keys) == 0 and b.batch_exists(keys) == 4
        assert b.batch_get(keys[:4], host, [8, 9, 10, 11]) == [True] * 4
        assert b.local.batch_exists(keys) == 4  # filled on the remote hits
        server.stop()
        b.close()  # a restart of node B with the server down: its own pages stay
        b = layered(tmp_path / "b", ns, host, server.url)
        assert b.batch_exists(keys) == 4
        assert b.batch_get(keys[:5], host, [12, 13, 14, 15, 4]) == [True] * 4 + [False]
        for src, dst in ((0, 12), (1, 13), (2, 14), (3, 15)):
            assert torch.equal(page(host, dst), page(host, src))
        s = b.stats()
        assert any(k.startswith("remote: ") for k in s.errors), s.errors
        # Writes while the server is down land locally; the page is still a hit here.
        assert b.batch_set(keys[5:6], host, [5]) == [True]
        assert b.batch_get(keys[5:6], host, [6]) == [True]
        assert torch.equal(page(host, 6), page(host, 5))
        a.close()
        b.close()
    finally:
        server.stop()


def test_a_damaged_local_copy_is_served_from_the_remote_store(tmp_path, host, ns, keys):
    server = RedisServer()
    try:
        local = MemoryStorage(ns, host.page_nbytes)
        store = LayeredStorage(local, RedisStorage(ns, host.page_nbytes, url=server.url))
        assert store.batch_set(keys[:2], host, [0, 1]) == [True, True]
        local.corrupt_for_test(keys[1], 33)
        assert store.batch_get(keys[:2], host, [8, 9]) == [True, True]
        assert torch.equal(page(host, 9), page(host, 1))  # the remote copy, verified
        s = store.stats()
        assert s.checksum_failures == 1 and (s.hits, s.misses) == (2, 0)
        assert local.batch_exists(keys[1:2]) == 1  # refilled from the remote copy
        store.close()
    finally:
        server.stop()


def test_the_layers_must_agree(host, ns, gen):
    other = StorageNamespace.for_host_pool(host, tenant="t2", model="layered-test")
    with pytest.raises(InvalidArgumentError, match="different namespaces"):
        LayeredStorage(MemoryStorage(ns, host.page_nbytes), MemoryStorage(other, host.page_nbytes))
    with pytest.raises(InvalidArgumentError, match="must be equal"):
        LayeredStorage(MemoryStorage(ns, host.page_nbytes), MemoryStorage(ns, 2 * host.page_nbytes))
    with pytest.raises(InvalidArgumentError, match="not a PageStorage"):
        LayeredStorage(MemoryStorage(ns, host.page_nbytes), object())
