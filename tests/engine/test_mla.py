"""The MLA variant of the reference model: latents restored from every tier give the no-cache
logits bit for bit, and the latent path is really used."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.cache import TieredKVCache
from tiered_kv.engine.mla import MLAModelConfig, TinyMLA
from tiered_kv.engine.model import DenseKV, TinyLlama
from tiered_kv.engine.serve import Server
from tiered_kv.errors import InvalidArgumentError

from .test_serve import (
    Recorder,
    aligned,
    assert_no_leak,
    cache_config,
    check_against_no_cache,
    diverging,
    move_to_host,
    move_to_storage,
    serve,
    tier_counts,
    tokens,
)

MLA = MLAModelConfig(
    vocab_size=512,
    hidden=64,
    num_layers=3,
    num_heads=4,
    head_dim=16,
    intermediate=96,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    seed=3,
)


@pytest.fixture
def make_cache(tmp_path, request):
    def make(mc=MLA, **changes) -> TieredKVCache:
        cache = TieredKVCache(cache_config(tmp_path, mc, **changes))
        request.addfinalizer(cache.close)
        return cache

    return make


@pytest.fixture
def make_mla_cache(make_cache):
    def make(**changes):
        opts = dict(
            model="mla", kv_lora_rank=MLA.kv_lora_rank, qk_rope_head_dim=MLA.qk_rope_head_dim
        )
        opts.update(changes)
        return make_cache(MLA, **opts)

    return make


@pytest.mark.parametrize("tier", ["device", "host", "storage"])
def test_mla_latents_restored_from_each_tier_are_bitwise(make_mla_cache, gen, tier):
    cache = make_mla_cache()
    initial = cache.free_sizes()
    server = Server(Recorder(TinyMLA(MLA)), cache)
    shared = tokens(gen, 45)
    p1 = shared + tokens(gen, 11)
    p2 = diverging(gen, shared, p1, 7)
    first = serve(server, p1, 3)
    check_against_no_cache(server, p1, first, bitwise=True)
    if tier == "host":
        move_to_host(cache)
    elif tier == "storage":
        move_to_storage(cache)
    s = serve(server, p2, 3)
    expected = {"device": 0, "host": 0, "storage": 0}
    expected[tier] = aligned(len(shared), 16)
    assert tier_counts(s.record) == expected
    check_against_no_cache(server, p2, s, bitwise=True)
    assert_no_leak(cache, initial)


def test_mla_multi_turn_history_is_bitwise(make_mla_cache, gen):
    cache = make_mla_cache(device_tokens=256, host_tokens=512)
    server = Server(Recorder(TinyMLA(MLA)), cache)
    history = tokens(gen, 30)
    for _ in range(3):
        prompt = history + tokens(gen, 19)
        s = serve(server, prompt, 5)
        check_against_no_cache(server, prompt, s, bitwise=True)
        history = prompt + s.out
    assert s.record.recomputed < len(prompt) // 2  # the history came from the cache


def test_mla_latent_is_what_attention_reads(gen):
    """Changing one stored latent changes the next token's logits; the latent has the pool's
    shape (1, kv_lora_rank + qk_rope_head_dim)."""
    model = TinyMLA(MLA)
    prompt = torch.tensor(tokens(gen, 20))
    kv = DenseKV(MLA, 32)
    model.forward(prompt, 0, kv, 16)
    assert kv.v is None and kv.k[0].shape == (32, 1, MLA.kv_lora_rank + MLA.qk_rope_head_dim)
    base = model.forward(torch.tensor([5]), 20, kv, 16)
    kv.k[1][3, 0, 0] += 1.0  # one latent column of an earlier token in layer 1
    changed = model.forward(torch.tensor([5]), 20, kv, 16)
    assert not torch.equal(base, changed)


def test_mla_config_and_server_checks(make_mla_cache, make_cache):
    for bad in (dict(kv_lora_rank=0), dict(qk_rope_head_dim=7), dict(num_kv_heads=2)):
        with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
            MLAModelConfig(**bad)
    with pytest.raises(InvalidArgumentError, match="MLAModelConfig"):
        TinyMLA(TinyLlama(MLA).cfg.__class__.__mro__[1]())  # a plain ModelConfig
    wrong = make_mla_cache(qk_rope_head_dim=16)
    with pytest.raises(InvalidArgumentError, match="qk_rope_head_dim"):
        Server(TinyMLA(MLA), wrong)
    with pytest.raises(InvalidArgumentError, match="cache kind"):
        Server(TinyMLA(MLA), make_cache(MLA, head_num=1))  # an MHA cache
