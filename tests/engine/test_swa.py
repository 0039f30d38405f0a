"""Issue 14: the sliding-window variant of the reference model on a sliding-window pool. KV
restored into both sub-pools from every tier gives the no-cache logits bit for bit; corrupting a
restored token's window-layer KV inside the window, or its full-layer KV, changes them, while a
window layer's KV of a token every query's window has left cannot (the window is real, and that
KV is what a window-aware cache may drop)."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.cache import TieredKVCache
from tiered_kv.device.swa_pool import SWAKVPool
from tiered_kv.engine.serve import PagedKV, Server
from tiered_kv.engine.swa import SWAModelConfig, TinySWA
from tiered_kv.errors import InvalidArgumentError

from .test_serve import (
    Recorder,
    aligned,
    cache_config,
    check_against_no_cache,
    diverging,
    no_cache,
    serve,
    tier_counts,
    tokens,
)

SWA = SWAModelConfig(
    vocab_size=256, hidden=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate=96, seed=7, sliding_window=12, full_layer_every=2,
)  # fmt: skip


@pytest.fixture
def make_cache(tmp_path, request):
    def make(**changes) -> TieredKVCache:
        opts = dict(model="swa", sliding_window=12, full_layer_every=2)
        opts.update(changes)
        cache = TieredKVCache(cache_config(tmp_path, SWA, **opts))
        request.addfinalizer(cache.close)
        # Window slots must differ from full slots, or a read or write at the wrong sub-pool
        # index would go unnoticed: take a few window pages for good.
        page = cache.config.device.page_size
        if hasattr(cache.allocator, "swa_attn_allocator"):
            assert cache.allocator.swa_attn_allocator.alloc(3 * page) is not None
        return cache

    return make


def move(cache: TieredKVCache, tier: str) -> None:
    cache.drain()
    if tier == "host":
        cache.manager.evict_device(1 << 30)
    elif tier == "storage":
        cache.clear_tree()
    cache.drain()
    if tier != "device":
        for b in cache.device_pool.buffers():
            b.view(torch.uint8).fill_(0x5C)
    if tier == "storage":
        for m in cache.host_pool.members:
            m.buffer.view(torch.uint8).fill_(0x5C)


@pytest.mark.parametrize("tier", ["device", "host", "storage"])
def test_both_sub_pools_restored_from_each_tier_are_bitwise(make_cache, gen, tier):
    """The next turn of a conversation restores the full KV of the whole prefix and the window
    KV of its last window (the pages before it are tombstones: full KV only)."""
    cache = make_cache()
    assert isinstance(cache.device_pool, SWAKVPool)
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


def test_a_branch_behind_the_window_is_computed_again(make_cache, gen):
    """A prompt sharing 45 tokens whose window KV was released: that prefix is no hit."""
    cache = make_cache()
    server = Server(Recorder(TinySWA(SWA)), cache)
    shared = tokens(gen, 45)
    p1 = shared + tokens(gen, 11)
    serve(server, p1, 3)
    p2 = diverging(gen, shared, p1, 7)
    s = serve(server, p2, 3)
    assert tier_counts(s.record) == {"device": 0, "host": 0, "storage": 0}
    assert cache.stats()["window"]["trimmed_tokens"] >= aligned(len(shared), 16)
    check_against_no_cache(server, p2, s, bitwise=True)


@pytest.mark.parametrize(
    "corrupt, changes",
    [(None, False), ("window-in", True), ("full", True), ("window-out", False)],
)
def test_what_a_corrupted_restored_slot_changes(make_cache, gen, corrupt, changes):
    page = 8
    cache = make_cache(page_size=page, prefetch_threshold=page)
    model = TinySWA(SWA)
    server = Server(Recorder(model), cache)
    first = tokens(gen, 41)
    s1 = serve(server, first, 1)  # 42 tokens cached: pages 0-2 tombstones, 3-4 whole
    move(cache, "host")
    p2 = (first + s1.out)[:40] + tokens(gen, 7)
    req = cache.begin(p2)
    assert req.prefix_len == 40 and req.hits.host == 40
    cache.extend(req, p2[40:])
    pool, full = cache.device_pool, req.slots
    if corrupt == "full":  # layer 0 is full attention: every later query reads token 3
        pool.get_key_buffer(0)[int(full[3])] += 0.25
    elif corrupt is not None:  # layer 1 is a window layer (window 12; queries from 40 on)
        token = 38 if corrupt == "window-in" else 25  # 25: in a whole page, out of the window
        swa = cache.allocator.translate_loc_from_full_to_swa(full[token : token + 1])
        assert int(swa) > 0
        pool.get_key_buffer(1)[int(swa)] += 0.25
    logits = model.forward(torch.tensor(p2[40:]), 40, PagedKV(cache, req), page)
    cache.abort(req)
    ref, _ = no_cache(model, p2, [], page)
    assert torch.equal(logits, ref[40:]) is not changes, corrupt


def test_config_and_server_checks(make_cache):
    with pytest.raises(InvalidArgumentError, match="full_layer_every"):
        SWAModelConfig(full_layer_every=1)
    with pytest.raises(InvalidArgumentError, match="num_layers=1"):
        SWAModelConfig(num_layers=1)
    with pytest.raises(InvalidArgumentError, match="sliding_window"):
        Server(TinySWA(SWA), make_cache(sliding_window=16))
    with pytest.raises(InvalidArgumentError, match="cache kind"):
        Server(TinySWA(SWA), make_cache(model="mha"))
