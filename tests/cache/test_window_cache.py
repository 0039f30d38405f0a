"""Issue 14: the window-aware prefix cache of a sliding-window model (``cache.window``).

A running request gives back the window KV its later queries have left behind, its pages go
into the tree as tombstones (full KV only), a cached prefix is a hit only where the window KV
of its last window is present, the window side is evicted (tombstoned) before full KV, and
tombstones travel through host and storage as full-KV-only pages under keys of their own.
Every served prefix is compared byte for byte with what the model wrote (window layers inside
the window of the next query, full layers everywhere)."""

from __future__ import annotations

import random

import pytest
import torch

from tiered_kv.cache.window import SlidingWindow
from tiered_kv.storage.keys import page_keys_of

from .test_facade import PAGE, Model, assert_no_leak, make_prompts

W = 9  # the window: a query sees itself and the 8 positions before it


def swa_cache(make_cache, **changes):
    opts = dict(model="swa", full_layer_every=2, sliding_window=W, num_layers=4)
    opts.update(changes)
    cache = make_cache(**opts)
    # Window slots must differ from full slots (else a wrong-pool index goes unseen).
    assert cache.allocator.swa_attn_allocator.alloc(3 * PAGE) is not None
    cache._initial = cache.free_sizes()
    cache.manager._device0 = cache.allocator.full_available_size()
    return cache


def tombstones(cache) -> list:
    return [n for n in cache.tree.nodes() if n.windowless]


def check_integrity(cache) -> None:
    cache.drain()
    cache.manager.check_integrity()


# -- the hit rule -------------------------------------------------------------------------------
def brute_force_hit(flags, window, page) -> int:
    best = 0
    for k in range(len(flags) + 1):
        end = k * page  # the next query's position
        needed = range(max(0, end - window + 1), end)  # positions whose window KV it reads
        if all(flags[p // page] for p in needed):
            best = k
    return best


def test_hit_pages_is_the_rule(gen):
    rng = random.Random(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
    for _ in range(400):
        page, window = rng.randint(1, 6), rng.randint(1, 30)
        flags = [rng.random() < 0.6 for _ in range(rng.randint(0, 14))]
        rule = SlidingWindow(None, window, page)
        assert rule.hit_pages(flags) == brute_force_hit(flags, window, page), (
            flags, window, page,
        )  # fmt: skip
    rule = SlidingWindow(None, 9, 4)
    assert rule.hit_pages([False, False, True, True, True]) == 5  # needs pages 3-4 (12..19)
    assert rule.hit_pages([True, False, True]) == 1  # 12 needs 4..11: page 1 is gone
    assert rule.hit_pages([False, True]) == 0  # 8 needs 0..7
    assert SlidingWindow(None, 1, 4).hit_pages([False] * 3) == 3  # a query sees only itself


# -- a request's window KV ------------------------------------------------------------------------
def test_a_request_releases_window_kv_its_queries_left_behind(make_cache, gen):
    cache = swa_cache(make_cache)
    model = Model(cache, gen)
    alloc = cache.allocator
    (prompt,) = make_prompts(gen, [29])
    req = model.begin(prompt)
    model.compute(req, prompt)
    full0, swa0 = alloc.full_available_size(), alloc.swa_available_size()
    for step in range(7):
        model.compute(req, [int(torch.randint(0, 50_000, (1,), generator=gen))])
        pos = len(req.tokens) - 1  # the query just computed
        # Whole pages before the window of that query have no window slot any more.
        expect = max(0, pos - W + 1) // PAGE * PAGE
        assert req.window_freed == expect, step
        swa = alloc.translate_loc_from_full_to_swa(req.slots.to(torch.int64))
        assert bool((swa[:expect] == 0).all()) and bool((swa[expect:] > 0).all())
    assert alloc.swa_available_size() - swa0 == req.window_freed - 4  # 4 new decode slots
    assert full0 - alloc.full_available_size() == 4  # full KV of every token stays
    model.check(req, len(req.tokens))
    cache.finish(req)
    bare = tombstones(cache)
    assert sum(len(n) for n in bare) == req.window_freed
    assert cache.stats()["window"]["released_tokens"] == req.window_freed
    check_integrity(cache)
    assert_no_leak(cache)


@pytest.mark.parametrize("tier", ["device", "host", "storage"])
def test_a_continuation_hits_through_tombstones(make_cache, gen, tier):
    """The next turn of a conversation: the full KV of everything and the window KV of the
    last window come back from any tier; the tombstones' window KV is not needed."""
    cache = swa_cache(make_cache, device_tokens=96)
    model = Model(cache, gen)
    (first,) = make_prompts(gen, [31])
    req = model.serve(first, decode=6, drain=True)
    turn = req.tokens + torch.randint(0, 50_000, (10,), generator=gen).tolist()
    assert tombstones(cache)
    if tier == "host":
        cache.manager.evict_device(1 << 30)
    elif tier == "storage":
        cache.clear_tree()
    cache.drain()
    nxt = model.begin(turn)  # checks the served prefix byte for byte
    assert nxt.prefix_len == len(req.tokens) // PAGE * PAGE
    assert getattr(nxt.hits, tier) == nxt.prefix_len
    if tier != "device":
        bare = [n for n in tombstones(cache) if n.on_device]
        assert bare, "the loaded tombstones are marked"
        for n in bare:  # loaded with their full KV only: no window slot was kept for them
            assert bool((cache.allocator.translate_loc_from_full_to_swa(n.device) == 0).all())
    model.compute(nxt, turn[nxt.prefix_len :])
    model.check(nxt, len(nxt.tokens))
    cache.finish(nxt)
    check_integrity(cache)
    assert_no_leak(cache)


@pytest.mark.parametrize("tier", ["device", "storage"])
def test_a_branch_inside_tombstones_is_cut_back(make_cache, gen, tier):
    """A prompt sharing 24 tokens of a finished request whose pages 0-2 are tombstones: the
    window KV before 24 is gone, so no part of that prefix is a hit (serving it would read
    window KV from the padding slot)."""
    cache = swa_cache(make_cache)
    model = Model(cache, gen)
    (first,) = make_prompts(gen, [41])
    req = model.serve(first, decode=2, drain=True)
    assert req.window_freed >= 24
    if tier == "storage":
        cache.clear_tree()
    branch = req.tokens[:24] + torch.randint(0, 50_000, (7,), generator=gen).tolist()
    before = cache.stats()["window"]["trimmed_tokens"]
    nxt = model.begin(branch)
    assert nxt.prefix_len == 0
    assert cache.stats()["window"]["trimmed_tokens"] - before == 24
    model.compute(nxt, branch)
    cache.finish(nxt)
    # A branch ending where the window KV is still there is a hit.
    end = req.tokens[: len(req.tokens) // PAGE * PAGE]
    again = model.begin(end + [5])
    assert again.prefix_len == len(end)
    cache.abort(again)
    check_integrity(cache)
    assert_no_leak(cache)


def test_tombstones_are_stored_under_their_own_keys(make_cache, gen):
    cache = swa_cache(make_cache)
    model = Model(cache, gen)
    (first,) = make_prompts(gen, [37])
    req = model.serve(first, decode=3, drain=True)
    bare = tombstones(cache)
    assert bare and all(n.in_storage for n in bare)
    ns, store = cache.manager.namespace, cache.storage
    for n in bare:
        assert store.batch_exists(page_keys_of(ns, n.digests, windowless=True)) == len(n.digests)
        assert store.batch_exists(page_keys_of(ns, n.digests)) == 0  # never as a whole page
    whole = [n for n in cache.tree.nodes() if not n.windowless]
    assert whole and all(store.batch_exists(page_keys_of(ns, n.digests)) for n in whole)
    cache.clear_tree()
    nxt = model.begin(req.tokens + [7])
    assert nxt.hits.storage == len(req.tokens) // PAGE * PAGE
    cache.abort(nxt)
    assert_no_leak(cache)


def test_window_side_is_evicted_before_full_kv(make_cache, gen):
    """A window sub-pool smaller than the full one: cached prefixes lose their window KV
    (tombstoned, full KV kept on the device) before anything loses its full KV."""
    cache = swa_cache(make_cache, device_tokens=128, device_swa_tokens=60, host_tokens=0,
                      storage_bytes=0)  # fmt: skip
    model = Model(cache, gen)
    served = [model.serve(p) for p in make_prompts(gen, [13, 11, 14, 12, 13, 11])]
    window = cache.stats()["window"]
    assert window["evicted_tokens"] > 0, window
    assert cache.metrics.device.evicted_tokens == 0  # no full KV left the device
    assert cache.tree.device_tokens == sum(len(r.tokens) // PAGE * PAGE for r in served)
    # The oldest request's window KV went: its prefix is no hit now, though its full KV is there.
    old = served[0].tokens
    req = model.begin(old[: len(old) // PAGE * PAGE] + [3])
    assert req.prefix_len < len(old) // PAGE * PAGE
    model.compute(req, list(req_tail(old, req)) + [3])
    model.check(req, len(req.tokens))
    cache.finish(req)
    check_integrity(cache)
    assert_no_leak(cache)


def req_tail(tokens, req):
    return tokens[req.prefix_len : len(tokens) // PAGE * PAGE]


def test_integrity_catches_a_node_without_its_window_kv(make_cache, gen):
    cache = swa_cache(make_cache)
    model = Model(cache, gen)
    (p,) = make_prompts(gen, [13])
    model.serve(p, drain=True)
    node = next(n for n in cache.tree.nodes() if n.on_device and not n.windowless)
    cache.allocator.free_swa(node.device)  # window KV gone behind the tree's back
    with pytest.raises(Exception, match="not marked windowless"):
        cache.manager.check_integrity()
