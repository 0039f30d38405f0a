"""The storage tier chosen by config: ``storage_backend`` local (the default), ``redis`` on a
real redis-server, or any ``module.path:ClassName``; every prefix served from it is byte-exact,
a server killed mid-run is counted misses while serving goes on, and bad choices are refused
before anything is built."""

from __future__ import annotations

import time

import pytest

from tests.cache.test_facade import Model, aligned, assert_no_leak, make_prompts
from tests.storage.redis_server import RedisServer
from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import InvalidArgumentError, StorageOpenError
from tiered_kv.storage.redis_store import RedisStorage

BASE = dict(
    num_layers=3, head_num=2, head_dim=8, page_size=4, device_tokens=64, host_tokens=160,
    storage_bytes=16 << 20, model_id="backend-test@1", prefetch_threshold=4,
    prefetch_policy="wait_complete", max_requests=8, max_context_len=256,
)  # fmt: skip


@pytest.fixture(scope="module")
def server():
    s = RedisServer()
    yield s
    s.stop()


def cache_on(request, **changes) -> TieredKVCache:
    cache = TieredKVCache(TieredKVConfig.flat(**{**BASE, **changes}))
    request.addfinalizer(cache.close)
    return cache


def served_from_storage(cache: TieredKVCache, model: Model, prompts) -> list[int]:
    """Serve ``prompts`` (computing them), empty device and host, serve them again: the
    storage hits of the second round (every byte checked by the model)."""
    for p in prompts:
        model.serve(p, drain=True)
    cache.clear_tree()
    return [model.serve(p, drain=True).hits.storage for p in prompts]


def test_the_redis_backend_serves_exact_pages(request, server, gen):
    server.flush()
    cache = cache_on(request, storage_backend="redis", storage_options={"url": server.url})
    assert isinstance(cache.storage._inner, RedisStorage)  # behind the guard
    model = Model(cache, gen)
    prompts = make_prompts(gen, [21, 34, 13])
    assert served_from_storage(cache, model, prompts) == [aligned(len(p)) for p in prompts]
    assert cache.storage.stats().pages >= sum(aligned(len(p)) for p in prompts) // 4
    assert_no_leak(cache)


def test_a_killed_server_is_counted_misses_and_serving_goes_on(request, gen):
    server = RedisServer()
    request.addfinalizer(server.stop)
    cache = cache_on(
        request, storage_backend="redis", storage_options={"url": server.url, "timeout_s": 0.5}
    )
    model = Model(cache, gen)
    a, b = make_prompts(gen, [21, 26])
    model.serve(a, drain=True)
    server.stop()
    cache.clear_tree()
    # The store is gone: its probes and backups fail, the prompts are computed, bytes exact.
    assert model.serve(a, drain=True).hits.storage == 0
    assert model.serve(b, drain=True).hits.storage == 0
    assert cache.stats()["storage"]["errors"] > 0, cache.stats()["storage"]
    server.start()  # back, empty: new pages are stored and served again
    cache.clear_tree()
    model.serve(b, drain=True)
    cache.clear_tree()
    assert model.serve(b, drain=True).hits.storage == aligned(26)
    assert_no_leak(cache)


def test_a_server_down_for_long_turns_the_store_off_then_a_probe_brings_it_back(request, gen):
    """A server that stays down: the guard reopens once, then turns the store off (every call a
    miss without touching the network); the server comes back; nothing changes until the retry
    wait (30 s by default: the guard's clock is moved on) has passed, then the next call's probe
    reconnects and the store serves storage hits again."""
    server = RedisServer()
    request.addfinalizer(server.stop)
    cache = cache_on(
        request, storage_backend="redis", storage_options={"url": server.url, "timeout_s": 0.3}
    )
    guard = cache.storage
    model = Model(cache, gen)
    server.stop()
    prompts = make_prompts(gen, [21, 26, 17, 30, 23, 19, 28, 25, 22, 27, 18, 29])
    for q in prompts:
        assert model.serve(q, drain=True).hits.storage == 0
        if guard.off:
            break
    st = cache.stats()["storage"]
    assert st["off"] == 1 and st["reopens"] == 1 and st["turned_off"] == 1, st
    server.start()
    a, b = make_prompts(gen, [33, 20])
    model.serve(a, drain=True)  # off: a's backup is skipped though the server is back
    assert guard.off and cache.stats()["storage"]["skipped_while_off"] > 0
    assert guard.retry_s == 30.0
    now = time.monotonic()
    later = now + guard.retry_s + 1
    guard._clock = lambda: later + (time.monotonic() - now)  # noqa: SLF001 - the wait passed
    model.serve(b, drain=True)  # the probe: reconnected, b's pages stored
    assert not guard.off and cache.stats()["storage"]["off"] == 0
    cache.clear_tree()
    assert model.serve(b, drain=True).hits.storage == aligned(len(b))
    assert model.serve(a, drain=True).hits.storage == 0  # skipped while off: never stored
    assert_no_leak(cache)


def test_a_backend_by_module_path(request, gen):
    cache = cache_on(request, storage_backend="tiered_kv.storage.memory_store:MemoryStorage")
    model = Model(cache, gen)
    prompts = make_prompts(gen, [17, 30])
    assert served_from_storage(cache, model, prompts) == [aligned(len(p)) for p in prompts]
    assert_no_leak(cache)


@pytest.mark.parametrize(
    "changes, error, needle",
    [
        ({"storage_backend": "s3"}, InvalidArgumentError, "storage_backend='s3'"),
        ({"storage_backend": "a.b:"}, InvalidArgumentError, "module.path:ClassName"),
        ({"storage_options": {1: 2}}, InvalidArgumentError, "storage_options"),
        ({"storage_backend": "no.such.module:Store"}, StorageOpenError, "cannot be loaded"),
        ({"storage_backend": "tiered_kv.config:TieredKVConfig"}, StorageOpenError, "PageStorage"),
        (
            {"storage_backend": "redis", "storage_options": {"colour": "red"}},
            StorageOpenError,
            "refused storage_options",
        ),
    ],
)
def test_bad_backends_are_refused_naming_them(request, changes, error, needle):
    with pytest.raises(error, match=needle):
        cache_on(request, **changes)


def test_the_local_backend_still_needs_a_directory_and_remote_ones_do_not():
    with pytest.raises(InvalidArgumentError, match="storage_path"):
        TieredKVConfig.flat(**BASE)
    cfg = TieredKVConfig.flat(**BASE, storage_backend="redis")
    assert cfg.storage_dir is None and cfg.storage.storage_backend == "redis"


def test_a_local_copy_in_front_keeps_serving_across_a_restart_without_the_server(
    request, tmp_path, gen
):
    server = RedisServer()
    request.addfinalizer(server.stop)
    changes = dict(
        storage_backend="redis",
        storage_options={"url": server.url, "timeout_s": 0.5},
        storage_local_copy=True,
        storage_path=str(tmp_path / "local"),
    )
    cache = cache_on(request, **changes)
    model = Model(cache, gen)
    prompts = make_prompts(gen, [21, 30])
    assert served_from_storage(cache, model, prompts) == [aligned(len(p)) for p in prompts]
    cache.close()
    server.stop()  # the shared store is gone; the node restarts with its own copy
    cache = cache_on(request, **changes)
    model.cache = cache
    for p in prompts:
        assert model.serve(p, drain=True).hits.storage == aligned(len(p))
    assert_no_leak(cache)


def test_a_local_copy_needs_a_remote_backend_and_a_directory():
    with pytest.raises(InvalidArgumentError, match="storage_local_copy"):
        TieredKVConfig.flat(**BASE, storage_path="/tmp/x", storage_local_copy=True)
    with pytest.raises(InvalidArgumentError, match="storage_path"):
        TieredKVConfig.flat(**BASE, storage_backend="redis", storage_local_copy=True)
