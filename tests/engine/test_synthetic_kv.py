"""SyntheticKV: deterministic real-geometry KV bytes, written through a real cache and verified
exactly after restores from every tier (and a restart), for every kind of preset; a flipped
byte is found (the negative control)."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.engine import presets as P
from tiered_kv.engine.synthetic_kv import SyntheticKV, rows_differ, token_digests
from tiered_kv.storage.keys import page_digests

PS = 16
SMALL = {
    "llama-3-8b": dict(layers=3, head_num=2, head_dim=32),
    "deepseek-v3": dict(layers=3),
    "deepseek-v3.2": dict(layers=2),
    "gemma-2-9b": dict(layers=4, head_num=2, head_dim=32, sliding_window=40),
    "qwen3-next-80b-a3b": dict(layers=4, linear_heads=2, linear_key_dim=16, linear_value_dim=32),
}


def config(tmp_path, name: str, **over) -> TieredKVConfig:
    p = P.scaled(P.preset(name), **SMALL[name])
    fields = dict(
        page_size=PS, device_tokens=512, host_tokens=1024, max_requests=4, max_context_len=1024,
        storage_bytes=64 << 20, storage_path=str(tmp_path / "store"), model_id=f"{p.name}@1",
        prefetch_policy="wait_complete", prefetch_threshold=PS, state_snapshot_every=2,
    )  # fmt: skip
    fields.update(over)
    return TieredKVConfig.flat(**P.geometry(p), **fields)


def test_prefix_digests_continue_the_page_chain():
    tokens = list(range(7, 7 + 5 * PS + 3))
    d = token_digests(tokens, 0, len(tokens), PS)
    pages = page_digests(tokens, PS)
    assert [d[(i + 1) * PS - 1] for i in range(5)] == pages
    assert token_digests(tokens, 2 * PS + 5, 4 * PS, PS) == d[2 * PS + 5 : 4 * PS]
    assert len(set(d)) == len(d)


def test_bytes_are_deterministic_and_differ_by_prefix_position_and_layer(tmp_path):
    cfg = config(tmp_path, "llama-3-8b", storage_bytes=0)
    a, b = SyntheticKV(cfg), SyntheticKV(cfg)
    tokens = list(range(100, 100 + 3 * PS))
    d = token_digests(tokens, 0, len(tokens), PS)
    pos = np.arange(len(tokens))
    rows = a.kv_rows(d, pos, 1)
    assert torch.equal(rows, b.kv_rows(d, pos, 1))
    k, v = a.kv_for(d[5], 5, 1)
    assert torch.equal(torch.cat([k.view(torch.uint8).flatten(), v.view(torch.uint8).flatten()]),
                       rows[5])  # fmt: skip
    assert torch.isfinite(k.float()).all() and torch.isfinite(v.float()).all()
    other = token_digests([*tokens[:5], 999, *tokens[6:]], 0, len(tokens), PS)
    changed = a.kv_rows(other, pos, 1)
    assert torch.equal(changed[:5], rows[:5])  # the same prefix: the same bytes
    assert (changed[5:] != rows[5:]).float().mean() > 0.9  # every later token differs
    assert (a.kv_rows(d, pos + 1, 1) != rows).float().mean() > 0.9
    assert (a.kv_rows(d, pos, 2) != rows).float().mean() > 0.9
    assert not torch.equal(rows[:, : a.k_bytes], rows[:, a.k_bytes :])  # K is not V
    assert (SyntheticKV(cfg, seed=1).kv_rows(d, pos, 1) != rows).float().mean() > 0.9


def _serve(cache, syn, prompt):
    """Begin (checking the restored prefix), compute the rest synthetically, finish."""
    req = cache.begin(prompt)
    restored = syn.verify(cache, req)
    cache.extend(req, prompt[req.prefix_len :])
    syn.write(cache, req, req.prefix_len, len(prompt))
    written = syn.verify(cache, req, len(prompt))
    cache.finish(req)
    return req, restored, written


def _evict_device(cache) -> None:
    cache.drain()  # a page whose host backup is in flight stays on the device
    cache.manager.evict_device(1 << 62)
    cache.drain()
    assert cache.tree.device_tokens == 0


@pytest.mark.parametrize("name", sorted(SMALL))
def test_restored_pages_verify_from_every_tier_and_after_a_restart(tmp_path, name):
    rng = random.Random(7)
    prompt = [rng.randrange(1, 30000) for _ in range(6 * PS + 5)]
    cfg = config(tmp_path, name)
    syn = SyntheticKV(cfg)
    cache = TieredKVCache(cfg)
    req, restored, written = _serve(cache, syn, prompt)
    assert req.prefix_len == 0 and restored == written == 0
    prompt += [rng.randrange(1, 30000) for _ in range(PS)]
    seen = {}
    for tier in ("device", "host", "storage"):
        if tier == "host":
            _evict_device(cache)
        if tier == "storage":
            cache.clear_tree()
        req, restored, written = _serve(cache, syn, prompt)
        seen[tier] = getattr(req.hits, tier)
        assert req.prefix_len >= 4 * PS, (tier, req.hits)
        assert restored == written == 0, (tier, restored, written)
    assert all(seen.values()), seen
    cache.close()
    cache = TieredKVCache(cfg)  # a restart: only the store remembers
    req, restored, written = _serve(cache, syn, prompt + [5, 6])
    assert req.hits.storage >= 4 * PS and restored == written == 0
    cache.close()


@pytest.mark.parametrize("name", ["llama-3-8b", "deepseek-v3.2", "qwen3-next-80b-a3b"])
def test_a_flipped_byte_after_a_restore_is_found(tmp_path, name):
    """The negative control: verify() can fail, for KV (and for a hybrid's state)."""
    cfg = config(tmp_path, name, storage_bytes=0)
    syn = SyntheticKV(cfg)
    cache = TieredKVCache(cfg)
    prompt = list(range(1, 4 * PS + 3))
    _serve(cache, syn, prompt)
    _evict_device(cache)
    req = cache.begin(prompt)
    assert req.hits.host and syn.verify(cache, req) == 0
    layer = syn.kv_layers[-1]
    slot = int(req.slots[PS + 3])
    row = cache.device_pool.get_key_buffer(layer)[slot]
    row.view(torch.uint8).view(-1)[7] ^= 0x20  # one bit of one token of one layer
    assert syn.verify(cache, req) == 1
    if syn.state_layers:
        temporal = cache.req_to_token.mamba_pool.temporal
        temporal[0, req.kv.mamba_pool_idx].view(-1)[3] += 1.0
        assert syn.verify(cache, req) == 2  # that token and one recurrent layer's state
    cache.abort(req)
    cache.close()


def test_generator_throughput_is_measured(tmp_path):
    """Printed, not asserted: GB/s of the synthetic rows at Llama-3-8B's full geometry, and of
    writing them through a cache (generation plus the device pool's scatter)."""
    p = P.preset("llama-3-8b")
    cfg = TieredKVConfig.flat(
        **P.geometry(P.scaled(p, layers=4)), page_size=PS, device_tokens=2048, host_tokens=0,
        max_requests=1, max_context_len=2048,
    )  # fmt: skip
    syn = SyntheticKV(TieredKVConfig.flat(**P.geometry(p), page_size=PS, host_tokens=0))
    tokens = list(range(2048))
    d, pos = token_digests(tokens, 0, len(tokens), PS), np.arange(len(tokens))
    t = time.perf_counter()
    nbytes = sum(syn.kv_rows(d, pos, layer).numel() for layer in range(p.num_layers))
    gen_gbs = nbytes / (time.perf_counter() - t) / 1e9
    cache = TieredKVCache(cfg)
    small = SyntheticKV(cfg)
    req = cache.begin(tokens)
    cache.extend(req, tokens)
    t = time.perf_counter()
    small.write(cache, req, 0, len(tokens))
    write_gbs = len(tokens) * P.bytes_per_token(P.scaled(p, layers=4)) / (time.perf_counter() - t)
    assert small.verify(cache, req, len(tokens)) == 0
    cache.abort(req)
    cache.close()
    print(
        f"\nsynthetic KV: generate {gen_gbs:.2f} GB/s ({nbytes / 2**20:.0f} MiB, llama-3-8b), "
        f"write through the cache {write_gbs / 1e9:.2f} GB/s"
    )


def test_another_identity_gives_the_same_tokens_other_digests():
    """Issue 27: the synthetic KV of a request is a function of its identity too (as another
    LoRA adapter's KV would be), chained from its extra key's prior."""
    from tiered_kv.storage.keys import extra_key_prior, page_digests

    rng = np.random.default_rng(11)
    tokens = rng.integers(0, 50_000, 23).tolist()
    plain = token_digests(tokens, 0, 23, 5)
    lora = token_digests(tokens, 0, 23, 5, extra_key_prior("lora=a@1"))
    assert len(plain) == len(lora) == 23 and set(plain).isdisjoint(lora)
    # A page's last position is that page's chain digest under the same prior.
    prior = extra_key_prior("lora=a@1")
    assert [lora[p * 5 + 4] for p in range(4)] == page_digests(tokens, 5, prior)
    assert token_digests(tokens, 7, 19, 5, prior) == lora[7:19]


@pytest.mark.parametrize("width", [1152, 132, 66, 7, 1])
def test_rows_differ_finds_every_single_byte_change(width):
    """rows_differ compares in words where it can: a one-byte change anywhere in a row (any
    offset inside a word) is found, and only in that row."""
    gen = torch.Generator().manual_seed(width)
    want = torch.randint(0, 256, (37, width), dtype=torch.uint8, generator=gen)
    got = want.clone()
    assert not rows_differ(got, want).any()
    rows = torch.randperm(37, generator=gen)[:9]
    for r in rows.tolist():
        col = int(torch.randint(0, width, (1,), generator=gen))
        got[r, col] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
    flagged = torch.zeros(37, dtype=torch.bool)
    flagged[rows] = True
    assert torch.equal(rows_differ(got, want), flagged)
