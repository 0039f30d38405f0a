"""Sampled live verification (``cache.verify``): which restored prefixes the cache hands to the
engine's verifier, what a wrong page costs (quarantined on every tier, the request cut back to
compute it), a verifier that fails, and the counters."""

from __future__ import annotations

import math

import pytest
import torch

from tests.cache.test_facade import PAGE, Model, make_config
from tests.cache.test_fault_campaign import differs
from tests.cache.test_metrics import scrape
from tiered_kv.cache import TieredKVCache
from tiered_kv.cache.verify import bad_pages
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.storage.keys import page_digests, page_keys_of


class Oracle:
    """The stand-in model's verifier: per prefix token, whether the cache's KV is not the
    model's (called with the request, as the cache calls it)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.calls: list[int] = []

    def __call__(self, req) -> torch.Tensor:
        self.calls.append(req.prefix_len)
        self.model.identity = req.extra_key
        k, v = self.model.read(req.slots[: req.prefix_len])
        ek, ev = self.model.expected(req.tokens, 0, req.prefix_len)
        return differs(k, ek) | differs(v, ev)


@pytest.fixture
def setup(tmp_path):
    made = []

    def make(**changes):
        cache = TieredKVCache(make_config(tmp_path, **changes))
        made.append(cache)
        model = Model(cache, torch.Generator().manual_seed(1))
        oracle = Oracle(model)
        cache.set_verifier(oracle)
        return cache, model, oracle

    yield make
    for cache in made:
        cache.close()


def prompt(n: int = 25, base: int = 7) -> list[int]:
    return [base * 1000 + i for i in range(n)]


def flip(cache, slot: int, layer: int = 1) -> None:
    """A silent change of one byte of a token's K on the device (no checksum sees it)."""
    cache.device_pool.get_key_buffer(layer)[slot].view(torch.uint8).view(-1)[3] ^= 0x40


def stored_keys(cache, tokens, pages) -> list[bytes]:
    digests = page_digests(tokens, PAGE)
    return page_keys_of(cache.manager.namespace, [digests[p] for p in pages])


def in_store(cache, key: bytes) -> bool:
    return cache.storage.batch_exists([key]) == 1


@pytest.mark.parametrize("fraction", [-0.1, 1.5, math.nan, "x", None, True])
def test_invalid_fractions_are_refused_by_name(fraction):
    with pytest.raises(InvalidArgumentError, match=f"verify_fraction={fraction!r}"):
        TieredKVConfig.flat(verify_fraction=fraction)
    assert TieredKVConfig.flat(verify_fraction=1).policies.verify_fraction == 1


def test_fraction_zero_never_calls_the_verifier(setup):
    cache, model, oracle = setup(verify_fraction=0.0)
    p = prompt()
    model.serve(p)
    for _ in range(3):
        req = cache.begin(p)
        assert req.prefix_len and cache.verify_restored(req)
        cache.abort(req)
    assert oracle.calls == [] and cache.stats()["verify"]["skipped"] == 3


def test_fraction_one_checks_every_restored_prefix_once(setup):
    cache, model, oracle = setup(verify_fraction=1.0)
    p = prompt()
    miss = cache.begin(p)  # nothing restored: nothing to check
    assert miss.prefix_len == 0 and cache.verify_restored(miss) and oracle.calls == []
    cache.abort(miss)
    model.serve(p)
    for _ in range(4):
        req = cache.begin(p)
        assert cache.verify_restored(req) and cache.verify_restored(req)  # decided once
        cache.abort(req)
    assert oracle.calls == [24] * 4
    v = cache.stats()["verify"]
    assert v["sampled"] == v["verified"] == 4 and v["verified_tokens"] == 96 and not v["skipped"]


def sampled_pattern(setup, fraction: float, seed: int, n: int) -> list[bool]:
    cache, model, oracle = setup(verify_fraction=fraction)
    cache.set_verifier(oracle, seed=seed)
    p = prompt()
    model.serve(p)
    out = []
    for _ in range(n):
        before = len(oracle.calls)
        req = cache.begin(p)
        cache.verify_restored(req)
        cache.abort(req)
        out.append(len(oracle.calls) > before)
    return out


def test_a_fraction_samples_about_that_share_reproducibly(setup):
    a = sampled_pattern(setup, 0.3, seed=5, n=300)
    assert 0.22 < sum(a) / len(a) < 0.38, sum(a)
    assert sampled_pattern(setup, 0.3, seed=5, n=300) == a  # the same seed, the same draws
    assert sampled_pattern(setup, 0.3, seed=6, n=300) != a


def test_a_wrong_page_is_quarantined_on_every_tier_and_recomputed(setup):
    cache, model, oracle = setup(verify_fraction=1.0, prefetch_threshold=PAGE)
    p = prompt()
    model.serve(p, drain=True)  # device, host (write-through) and storage hold every page
    keys = stored_keys(cache, p, range(6))
    assert all(in_store(cache, k) for k in keys)
    req = cache.begin(p)
    flip(cache, int(req.slots[2 * PAGE + 1]))  # page 2
    assert cache.verify_restored(req) is False
    assert req.prefix_len == 2 * PAGE and req.tokens == p[: 2 * PAGE]
    assert req.hits.device == 2 * PAGE and req.hits.missed == len(p) - 2 * PAGE
    v = cache.stats()["verify"]
    assert v["mismatched"] == 1 and v["quarantined_pages"] == 1 and v["recomputed_tokens"] == 16
    assert cache.verifier.recent[-1] == keys[2].hex()
    # Gone from the store; the tree holds nothing from page 2 on, on any tier.
    assert not in_store(cache, keys[2]) and in_store(cache, keys[1]) and in_store(cache, keys[3])
    m = cache.tree.match(p, probe=False)
    assert m.length == 2 * PAGE
    cache.manager.check_integrity()
    model.compute(req, p[len(req.tokens) :])
    model.check(req, len(req.tokens))
    cache.finish(req)
    cache.drain()
    again = cache.begin(p)  # the recomputed pages are served (and stored) again, exact
    assert again.prefix_len == 24 and cache.verify_restored(again)
    model.check(again)
    cache.abort(again)
    cache.drain()
    assert in_store(cache, keys[2])
    cache.clear_tree()
    assert cache.free_sizes() == cache._initial


def test_a_wrong_host_copy_is_dropped_with_its_storage_value(setup):
    """The device copy is right, the host copy (its source after an eviction) is not: the
    load brings the wrong bytes, the check finds them, host and storage copies both go."""
    cache, model, oracle = setup(verify_fraction=1.0)
    p = prompt()
    model.serve(p, drain=True)
    node = cache.tree.match(p, probe=False).steps[-1][0]
    cache.manager.evict_device(1 << 20)  # host copies stay
    row = cache.host_pool.get_page_bytes(int(node.host[PAGE]) // PAGE)  # page 1's bytes
    row.view(-1)[5] ^= 0x11
    req = cache.begin(p)
    assert req.hits.host == 24
    assert cache.verify_restored(req) is False and req.prefix_len < 24
    cache.manager.check_integrity()
    cache.abort(req)
    bad = [p_ for p_ in range(6) if not in_store(cache, stored_keys(cache, p, [p_])[0])]
    assert bad and cache.tree.match(p, probe=False).length == req.prefix_len
    cache.drain()
    cache.clear_tree()
    assert cache.free_sizes() == cache._initial


def test_quarantine_while_other_requests_hold_the_pages(setup):
    cache, model, oracle = setup(verify_fraction=1.0, device_tokens=192)
    p = prompt()
    model.serve(p, drain=True)
    a, b = cache.begin(p), cache.begin(p)
    assert a.prefix_len == b.prefix_len == 24 and a.node is b.node
    flip(cache, int(a.slots[PAGE]))  # page 1
    assert cache.verify_restored(a) is False and a.prefix_len == PAGE
    # b still reads the wrong pages' slots: they stay until it lets go, and nothing holds
    # them but b; integrity (every slot accounted for) holds meanwhile.
    cache.manager.check_integrity(outside_device=0)
    assert cache.tree.match(p, probe=False).length == PAGE
    with pytest.raises(StateError, match="load of this request's prefix failed"):
        cache.prepare_forward(b)  # the usual answer to a prefix holding garbage
    calls = len(oracle.calls)
    assert cache.verify_restored(b) is False and b.prefix_len == PAGE  # cut, then checked
    assert len(oracle.calls) == calls + 1 and cache.stats()["verify"]["stale_cut"] == 1
    c = cache.begin(p)  # a newcomer never gets them
    assert c.prefix_len == PAGE
    for r in (a, b, c):
        model.compute(r, p[len(r.tokens) :])
        model.check(r, len(r.tokens))
    cache.finish(a)
    cache.finish(b)
    cache.abort(c)
    cache.drain()
    cache.manager.check_integrity()
    d = cache.begin(p)
    assert d.prefix_len == 24 and cache.verify_restored(d)
    model.check(d)
    cache.abort(d)
    cache.drain()
    cache.clear_tree()
    assert cache.free_sizes() == cache._initial


def test_a_request_that_extended_gets_fresh_slots_for_what_it_computes_again(setup):
    cache, model, oracle = setup(verify_fraction=1.0)
    p = prompt()
    model.serve(p, drain=True)
    req = cache.begin(p)
    tree_slots = req.slots.clone()
    own = cache.extend(req, p[24:])  # allocated, nothing computed yet
    flip(cache, int(req.slots[3 * PAGE]))
    assert cache.verify_restored(req) is False
    assert req.prefix_len == 3 * PAGE and len(req.tokens) == len(p) == len(req.slots)
    fresh = req.slots[3 * PAGE : 24]
    assert not set(fresh.tolist()) & set(tree_slots.tolist()) and torch.equal(req.slots[24:], own)
    row = cache.req_to_token.req_to_token[req.row, : len(p)].to(torch.int64)
    assert torch.equal(row, req.slots.to(torch.int64))
    cache.manager.check_integrity(outside_device=24 - 3 * PAGE + PAGE)  # + its own page
    model.write(req.tokens, req.prefix_len, len(req.tokens), req.slots[req.prefix_len :])
    model.check(req, len(req.tokens))
    cache.finish(req)
    cache.drain()
    again = cache.begin(p)
    assert again.prefix_len == 24 and cache.verify_restored(again)
    cache.abort(again)
    cache.drain()
    cache.clear_tree()
    assert cache.free_sizes() == cache._initial


@pytest.mark.parametrize("answer", ["raise", "short", "none", "ints"])
def test_a_failing_verifier_is_counted_and_the_prefix_recomputed(setup, answer):
    cache, model, oracle = setup(verify_fraction=1.0)
    p = prompt()
    model.serve(p, drain=True)

    def broken(req):
        if answer == "raise":
            raise RuntimeError("the engine's recompute failed")
        return {
            "short": torch.zeros(3, dtype=torch.bool),
            "none": None,
            "ints": torch.zeros(req.prefix_len, dtype=torch.int64),
        }[answer]

    cache.set_verifier(broken)
    req = cache.begin(p)
    assert cache.verify_restored(req) is False and req.prefix_len == 0 and req.tokens == []
    v = cache.stats()["verify"]
    assert v["errors"] == 1 and v["verified"] == 0 and v["quarantined_pages"] == 0
    assert cache.tree.match(p, probe=False).length == 24  # nothing was found wrong: kept
    model.compute(req, p)
    cache.finish(req)
    cache.drain()
    cache.manager.check_integrity()


def test_verdicts():
    assert bad_pages(True, 8, 4) == [] and bad_pages(False, 8, 4) == [0, 1]
    flags = torch.zeros(12, dtype=torch.bool)
    flags[5] = flags[11] = True
    assert bad_pages(flags, 12, 4) == [1, 2] and bad_pages(flags.tolist(), 12, 4) == [1, 2]
    for nonsense in (None, torch.zeros(11, dtype=torch.bool), torch.zeros(12)):
        with pytest.raises(InvalidArgumentError, match="True, False or 12 bools"):
            bad_pages(nonsense, 12, 4)


def test_counters_reach_prometheus(setup):
    cache, model, oracle = setup(verify_fraction=1.0)
    p = prompt()
    model.serve(p)
    req = cache.begin(p)
    flip(cache, int(req.slots[0]))
    assert not cache.verify_restored(req)
    cache.abort(req)
    got = scrape(cache.prometheus())
    assert got["tiered_kv_verify_mismatched_total"][()] == 1
    assert got["tiered_kv_verify_quarantined_pages_total"][()] == 1
    assert got["tiered_kv_verify_recomputed_tokens_total"][()] == 24


def test_a_hybrid_or_window_request_is_verified_before_it_extends(setup):
    cache, model, oracle = setup(
        verify_fraction=1.0, model="swa", full_layer_every=2, sliding_window=9
    )
    p = prompt()
    model.serve(p, drain=True)
    req = cache.begin(p)
    cache.extend(req, p[req.prefix_len :])
    with pytest.raises(InvalidArgumentError, match="before its first extend"):
        cache.verify_restored(req)
    cache.abort(req)
    req = cache.begin(p)
    assert cache.verify_restored(req)
    cache.abort(req)


def test_the_mismatch_log_names_the_pages(setup, caplog):
    from tiered_kv.cache.verify import VERIFY_LOG

    VERIFY_LOG.reset()
    cache, model, oracle = setup(verify_fraction=1.0)
    p = prompt()
    model.serve(p, drain=True)
    req = cache.begin(p)
    flip(cache, int(req.slots[PAGE]))
    with caplog.at_level("WARNING", logger="tiered_kv.cache.verify"):
        cache.verify_restored(req)
    cache.abort(req)
    text = caplog.text
    assert "failed verification: 1 of its 6 pages differ" in text
    assert stored_keys(cache, p, [1])[0].hex() in text


def test_known_garbage_is_cut_even_when_not_sampled(setup):
    """A prefix holding pages another request's check quarantined is cut back whether or not
    it is sampled: the cache never lets a request read what it knows is wrong."""
    cache, model, oracle = setup(verify_fraction=1.0, device_tokens=192)
    p = prompt()
    model.serve(p, drain=True)
    a, b = cache.begin(p), cache.begin(p)
    flip(cache, int(a.slots[2 * PAGE]))
    assert cache.verify_restored(a) is False and a.prefix_len == 2 * PAGE
    cache.set_verifier(None)  # b is not checked
    assert cache.verify_restored(b) is False and b.prefix_len == 2 * PAGE
    v = cache.stats()["verify"]
    assert v["stale_cut"] == 1 and v["skipped"] == 1 and len(oracle.calls) == 1
    for r in (a, b):
        model.compute(r, p[len(r.tokens) :])
        model.check(r, len(r.tokens))
        cache.finish(r)
    cache.drain()
    cache.manager.check_integrity()
