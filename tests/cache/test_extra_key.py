"""Issue 27: a request's own identity (``begin(tokens, extra_key=...)``) beyond its tokens.

The same token ids under another extra key (a LoRA adapter, a cache salt, a multimodal hash)
have other KV: they never share a page on the device, the host or in storage, a restart
included; the same extra key still hits everywhere. Bad extra keys are refused before anything
changes."""

from __future__ import annotations

import pytest
import torch

from tests.cache.test_facade import Model, aligned, assert_no_leak, make_config, make_prompts
from tiered_kv.cache import TieredKVCache
from tiered_kv.errors import InvalidArgumentError, TieredKVError
from tiered_kv.storage.keys import extra_key_prior, page_keys

KEYS = [None, "lora=a@1", "lora=b@1", b"mm:" + bytes(range(200)) + b"\x01"]


def test_same_tokens_under_other_keys_miss_on_every_tier(make_cache, gen):
    cache = make_cache(device_tokens=128, host_tokens=256)
    model = Model(cache, gen)
    (prompt,) = make_prompts(gen, [37])
    full = aligned(len(prompt))
    model.identity = KEYS[1]
    model.serve(prompt, drain=True)
    for key in KEYS:  # device: only the key that wrote it hits
        model.identity = key
        req = model.serve(prompt, drain=True)
        assert req.hits.device == (full if key == KEYS[1] else 0), (key, req.hits)
    cache.manager.evict_device(1 << 30)  # host only now
    cache.drain()
    for key in reversed(KEYS):
        model.identity = key
        req = model.begin(prompt)
        assert req.prefix_len == full, (key, req.hits)  # each key wrote its own copy
        assert req.hits.device == 0 and req.hits.host == full, (key, req.hits)
        model.check(req)
        cache.abort(req)
    cache.clear_tree()  # storage only now
    for key in KEYS:
        model.identity = key
        req = model.begin(prompt)
        assert req.hits.storage == full, (key, req.hits)
        model.check(req)
        cache.abort(req)
    assert_no_leak(cache)


def test_keys_separate_storage_across_a_restart(tmp_path, gen):
    cfg = make_config(tmp_path)
    (prompt,) = make_prompts(gen, [29])
    cache = TieredKVCache(cfg)
    model = Model(cache, gen)
    model.identity = "salt=tenant-a"
    model.serve(prompt, drain=True)
    cache.close()
    cache = model.cache = TieredKVCache(cfg)
    try:
        for key, want in (("salt=tenant-b", 0), (None, 0), ("salt=tenant-a", aligned(29))):
            model.identity = key
            req = model.begin(prompt)
            assert req.hits.storage == want, (key, req.hits)
            model.check(req)
            cache.abort(req)
    finally:
        cache.close()


def test_a_stored_page_key_differs_per_extra_key(make_cache, gen):
    cache = make_cache()
    tokens = torch.randint(0, 50_000, (13,), generator=gen).tolist()
    ns, ps = cache.manager.namespace, cache.config.page_size
    keys = {k: tuple(page_keys(ns, tokens, ps, extra_key_prior(k))) for k in KEYS}
    assert len(set(keys.values())) == len(KEYS)
    assert len({k for ks in keys.values() for k in ks}) == len(KEYS) * (13 // ps)
    model = Model(cache, gen)
    model.identity = KEYS[2]
    model.serve(tokens, drain=True)
    assert cache.storage.batch_exists(list(keys[KEYS[2]])) == 13 // ps
    assert cache.storage.batch_exists(list(keys[None])) == 0


def test_a_key_that_differs_only_in_its_last_byte_is_another_identity(make_cache, gen):
    cache = make_cache()
    model = Model(cache, gen)
    (prompt,) = make_prompts(gen, [21])
    image = bytes(torch.randint(0, 256, (4096,), generator=gen).tolist())
    model.identity = image + b"\x00"
    model.serve(prompt, drain=True)
    model.identity = image + b"\x01"
    assert model.serve(prompt, drain=True).prefix_len == 0
    model.identity = image + b"\x00"
    assert model.serve(prompt, drain=True).prefix_len == aligned(21)


def test_begin_many_takes_one_key_per_prompt(make_cache, gen):
    cache = make_cache(device_tokens=160)
    model = Model(cache, gen)
    (prompt,) = make_prompts(gen, [25])
    model.identity = "lora=a@1"
    model.serve(prompt, drain=True)
    reqs = cache.begin_many([prompt, prompt, prompt], extra_keys=["lora=a@1", None, "lora=b@1"])
    assert [r.prefix_len for r in reqs] == [aligned(25), 0, 0]
    assert [r.extra_key for r in reqs] == ["lora=a@1", None, "lora=b@1"]
    model.check(reqs[0])
    for r in reqs:
        cache.abort(r)
    assert_no_leak(cache)


@pytest.mark.parametrize(
    "bad, needle",
    [("", "non-empty"), (b"", "non-empty"), (7, "extra_key=7"), (["a"], "str or bytes")],
)
def test_bad_extra_keys_are_refused_before_anything_changes(make_cache, gen, bad, needle):
    cache = make_cache()
    before = cache.free_sizes()
    (prompt,) = make_prompts(gen, [17])
    with pytest.raises(InvalidArgumentError, match=needle):
        cache.begin(prompt, extra_key=bad)
    with pytest.raises(TieredKVError, match=needle):
        cache.begin_many([prompt, prompt], extra_keys=[None, bad])
    assert cache.free_sizes() == before and not cache.tree.nodes()


def test_begin_many_refuses_a_key_list_of_another_length(make_cache, gen):
    cache = make_cache()
    (prompt,) = make_prompts(gen, [17])
    with pytest.raises(InvalidArgumentError, match="2 prompts and 3 extra keys"):
        cache.begin_many([prompt, prompt], extra_keys=[None, None, None])
    assert cache.free_sizes() == cache._initial


def test_hybrid_state_snapshots_are_kept_per_identity(tmp_path):
    """A hybrid model's state snapshot is named by its page's digest, so it is another
    identity's only under that identity: the same prompt under another extra key neither hits
    the pages nor restores the state."""
    from tiered_kv.config import TieredKVConfig

    cache = TieredKVCache(
        TieredKVConfig.flat(
            model="hybrid_linear", num_layers=4, full_layer_every=2, head_num=2, head_dim=8,
            page_size=4, device_tokens=64, host_tokens=128, max_requests=4,
        )
    )  # fmt: skip
    try:
        prompt = list(range(100, 123))

        def serve(key) -> int:
            req = cache.begin(prompt, extra_key=key)
            got = req.prefix_len
            slots = cache.extend(req, prompt[req.prefix_len :])
            for layer in (1, 3):
                kv = torch.randn(len(slots), 2, 8)
                cache.write_kv(layer, slots, kv, -kv)
            for pos in range(req.prefix_len, len(prompt)):
                if (pos + 1) % 4 == 0:
                    cache.track_state(req, pos + 1)
            cache.finish(req)
            return got

        assert serve("lora=a@1") == 0
        assert serve("lora=b@1") == 0 and serve(None) == 0  # neither pages nor state shared
        assert serve("lora=a@1") == 20 and serve(None) == 20
    finally:
        cache.close()
