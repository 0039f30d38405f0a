"""The cache on ``storage_backend="mooncake"``, a real Mooncake Store (a master on 127.0.0.1 in a
loopback-only network namespace, see tests/storage/mooncake_server): every prefix served from it
is byte-exact, and a master killed mid-run is counted misses while serving goes on, with pages
stored and served again once it is back."""

from __future__ import annotations

import time

import pytest

from tests.cache.test_facade import Model, aligned, assert_no_leak, make_prompts
from tests.cache.test_storage_backends import cache_on, served_from_storage
from tests.storage.mooncake_server import MooncakeServer
from tiered_kv.storage.mooncake_store import MooncakeStorage


@pytest.fixture(scope="module")
def server():
    s = MooncakeServer(lent_bytes=0)  # the caches lend their storage_bytes
    yield s
    s.close()


def test_the_mooncake_backend_serves_exact_pages(request, server, gen):
    server.flush()
    cache = cache_on(request, storage_backend="mooncake", storage_options=server.options)
    assert isinstance(cache.storage._inner, MooncakeStorage)  # behind the guard
    model = Model(cache, gen)
    prompts = make_prompts(gen, [21, 34, 13])
    assert served_from_storage(cache, model, prompts) == [aligned(len(p)) for p in prompts]
    assert cache.storage.stats().pages >= sum(aligned(len(p)) for p in prompts) // 4
    assert cache.stats()["storage"]["errors"] == 0
    assert_no_leak(cache)


def test_a_killed_master_is_counted_misses_and_serving_goes_on(request, server, gen):
    server.flush()
    cache = cache_on(request, storage_backend="mooncake", storage_options=server.options)
    model = Model(cache, gen)
    a, b = make_prompts(gen, [21, 26])
    model.serve(a, drain=True)
    server.master.stop()
    cache.clear_tree()
    # The store is gone: its probes and backups fail, the prompts are computed, bytes exact.
    assert model.serve(a, drain=True).hits.storage == 0
    assert model.serve(b, drain=True).hits.storage == 0
    assert cache.stats()["storage"]["errors"] > 0, cache.stats()["storage"]
    server.master.start()  # back, empty: the client reconnects, pages are stored again
    deadline = time.monotonic() + 60
    while True:  # the guard may have turned the store off for a back-off: bounded retries
        cache.clear_tree()
        model.serve(b, drain=True)
        cache.clear_tree()
        if model.serve(b, drain=True).hits.storage == aligned(26):
            break
        assert time.monotonic() < deadline, cache.stats()["storage"]
        time.sleep(0.5)
    assert_no_leak(cache)
