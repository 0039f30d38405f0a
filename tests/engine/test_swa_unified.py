"""Issue 29: a sliding-window model served from a cache built with ``swa_unified_pool=True``
(one page range over one shared buffer, virtual ids). Prefixes restored from every tier, in
every host layout, give the no-cache logits bit for bit; the pool holds the larger side's
layers only; a window page handed to the full side (and back) never serves the other side's
bytes."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.device.allocator.unified_swa import UnifiedSWATokenToKVPoolAllocator
from tiered_kv.device.kv_cache import mha_kv_bytes
from tiered_kv.device.unified_swa_pool import UnifiedSWAKVPool
from tiered_kv.engine.serve import Server
from tiered_kv.engine.swa import TinySWA
from tiered_kv.errors import InvalidArgumentError

from .test_serve import (
    Recorder,
    aligned,
    cache_config,
    check_against_no_cache,
    serve,
    tier_counts,
    tokens,
)
from .test_swa import SWA, move


@pytest.fixture
def make_cache(tmp_path, request):
    def make(**changes) -> TieredKVCache:
        opts = dict(model="swa", sliding_window=12, full_layer_every=2, swa_unified_pool=True)
        opts.update(changes)
        cache = TieredKVCache(cache_config(tmp_path, SWA, **opts))
        request.addfinalizer(cache.close)
        return cache

    return make


def test_the_config_builds_one_shared_buffer(make_cache):
    cache = make_cache()
    pool, alloc = cache.device_pool, cache.allocator
    assert isinstance(pool, UnifiedSWAKVPool) and pool.shared is not None
    assert isinstance(alloc, UnifiedSWATokenToKVPoolAllocator)
    rows = cache.config.device.device_tokens + cache.config.device.page_size
    # 4 layers, 2 full and 2 window: one buffer of 2 layers' KV, half of two sub-pools'.
    want = mha_kv_bytes(2, rows, SWA.num_kv_heads, SWA.head_dim, torch.float32)
    assert pool.get_kv_size_bytes() == want == pool.shared.nbytes
    assert pool.full_kv_pool.k_buffer[0].data_ptr() == pool.swa_kv_pool.k_buffer[0].data_ptr()


@pytest.mark.parametrize("tier", ["device", "host", "storage"])
def test_restored_from_each_tier_is_bitwise(make_cache, gen, tier):
    cache = make_cache()
    server = Server(Recorder(TinySWA(SWA)), cache)
    p1 = tokens(gen, 56)
    s1 = serve(server, p1, 3)
    check_against_no_cache(server, p1, s1, bitwise=True)
    assert [n for n in cache.tree.nodes() if n.windowless], "no tombstone was formed"
    move(cache, tier)
    p2 = p1 + s1.out + tokens(gen, 7)
    s = serve(server, p2, 3)
    expected = {"device": 0, "host": 0, "storage": 0}
    expected[tier] = aligned(len(p1) + 3, 16)
    assert tier_counts(s.record) == expected
    check_against_no_cache(server, p2, s, bitwise=True)
    cache.drain()
    cache.manager.check_integrity()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_every_host_layout_round_trips(make_cache, gen, layout, io):
    if io == "direct" and layout == "page_first":
        pytest.skip("the direct io backend takes layer_first or page_first_direct")
    cache = make_cache(host_layout=layout, io_backend=io)
    server = Server(Recorder(TinySWA(SWA)), cache)
    p1 = tokens(gen, 40)
    s1 = serve(server, p1, 2)
    move(cache, "host")
    p2 = p1 + s1.out + tokens(gen, 5)
    s = serve(server, p2, 2)
    assert tier_counts(s.record)["host"] == aligned(len(p1) + 2, 16)
    check_against_no_cache(server, p2, s, bitwise=True)


def test_a_small_range_moves_pages_between_the_sides(make_cache, gen):
    """Eight pages for both sides: a first request's window pages reach low in the range,
    then a long decode takes the range for its full KV (the first one's pages evicted), so
    pages that held window-layer KV now hold full-layer KV; every answer is the no-cache
    one."""
    cache = make_cache(device_tokens=8 * 16, host_tokens=512)
    server = Server(Recorder(TinySWA(SWA)), cache)
    pages = cache.allocator.pages
    p1 = tokens(gen, 46)
    s1 = serve(server, p1, 2)
    check_against_no_cache(server, p1, s1, bitwise=True)
    window_held = set(range(pages.swa_bottom, pages.num_pages + 1))
    assert min(window_held) <= 6  # 3 window pages from the top of 8 at the prefill
    p2 = tokens(gen, 20)  # decoded to 96 tokens: 6 full pages, the window's 2 at the top
    s2 = serve(server, p2, 76)
    check_against_no_cache(server, p2, s2, bitwise=True)
    full_now = set(torch.nonzero(pages.p2v["full"]).reshape(-1).tolist())
    assert full_now & window_held, "no physical page served both sides"
    cache.drain()
    cache.manager.check_integrity()


def test_the_config_field_is_checked_by_name():
    with pytest.raises(InvalidArgumentError, match="swa_unified_pool"):
        TieredKVConfig.flat(swa_unified_pool=True)  # an MHA model
    with pytest.raises(InvalidArgumentError, match="swa_unified_pool"):
        TieredKVConfig.flat(model="swa", num_layers=4, swa_unified_pool="yes")
    with pytest.raises(InvalidArgumentError, match="device_swa_tokens"):
        TieredKVConfig.flat(model="swa", num_layers=4, swa_unified_pool=True, device_swa_tokens=256)
