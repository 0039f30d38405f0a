"""Model presets: real models' KV bytes per token, each one building a cache when scaled down;
the modeled cost figures and their checks."""

from __future__ import annotations

import pytest

from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.engine import presets as P
from tiered_kv.engine.cost_model import COST_MODELS, CostModel, cost_model
from tiered_kv.errors import InvalidArgumentError

# Small enough to build on any machine, keeping each preset's layer pattern.
SMALL = {
    "llama-3-8b": dict(layers=2),
    "qwen2.5-7b": dict(layers=2),
    "deepseek-v3": dict(layers=2),
    "deepseek-v3.2": dict(layers=2),
    "gemma-2-9b": dict(layers=4, sliding_window=32),
    "gemma-3-4b": dict(layers=6, head_dim=32, sliding_window=32),
    "gemma-3-12b": dict(layers=6, head_dim=32, sliding_window=32),
    "qwen3-next-80b-a3b": dict(layers=4, linear_heads=2, linear_key_dim=16, linear_value_dim=32),
}


def test_llama_3_8b_is_128_kib_per_token():
    p = P.preset("llama-3-8b")
    assert P.bytes_per_token(p) == 131072 == 2 * 32 * 8 * 128 * 2
    assert P.state_bytes(p) == 0


def test_bytes_per_token_of_the_other_presets():
    assert P.bytes_per_token(P.preset("qwen2.5-7b")) == 2 * 28 * 4 * 128 * 2  # 56 KiB
    mla = P.preset("deepseek-v3")
    assert mla.kv_lora_rank + mla.qk_rope_head_dim == 576
    assert P.bytes_per_token(mla) == 61 * 576 * 2
    # the indexer's fp8 key and one float32 scale per 128-element block
    assert P.bytes_per_token(P.preset("deepseek-v3.2")) == 61 * (576 * 2 + 128 + 4)
    assert P.bytes_per_token(P.preset("gemma-2-9b")) == 2 * 42 * 8 * 256 * 2
    hybrid = P.preset("qwen3-next-80b-a3b")
    assert P.kv_layer_ids(hybrid) == [i for i in range(48) if (i + 1) % 4 == 0]
    assert P.bytes_per_token(hybrid) == 12 * 2 * 2 * 256 * 2
    g = hybrid.to_geometry()
    assert g.conv_state_shape() == (8192, 3)  # 2 x 16 x 128 key + 32 x 128 value channels
    h, dk, dv = g.temporal_state_shape()
    assert h * dk * dv == 32 * 128 * 128  # the model's 32 value heads x (128 x 128)
    assert P.state_bytes(hybrid) == 36 * (8192 * 3 + 16 * 128 * 256) * 4


def test_gemma_3_keeps_8_full_and_40_window_layers():
    p = P.preset("gemma-3-12b")
    b = P.kv_bytes(p, 64)
    assert (len(b.full_layers), len(b.window_layers)) == (8, 40)  # 1 global in 6, as published
    assert b.full_layers == list(range(0, 48, 6))  # the cache's rule, shifted from (i + 1) % 6
    assert b.layer_per_token == 8 * (256 + 256) * 2 == 8192
    assert P.bytes_per_token(p) == 48 * 8192 and b.all_full_per_token == 48 * 8192


def test_held_and_restored_bytes_against_every_layer_full_by_hand():
    """KVBytes on the published geometries, worked out by hand: a 4096-token request and a
    restore of its last 2048 tokens, against the same model with every layer full attention."""
    g = P.kv_bytes(P.preset("gemma-3-12b"), 64)
    # window layers: from the page of position 4096 - 1024 on (3072 is page-aligned): 1024
    assert g.window_held(4096) == 1024 and g.window_held(1000) == 1000
    assert g.window_held(1100) == 1100 - 64  # page 0 (0..63) left behind by position 76
    assert g.device(4096) == 8 * 8192 * 4096 + 40 * 8192 * 1024 == 603_979_776
    assert g.all_full_device(4096) == 48 * 8192 * 4096 == 1_610_612_736  # 2.67x
    # a restore needs the window KV of the pages of the last 1023 positions (3073..4095)
    assert g.window_needed(4096) == 4096 - 3072
    assert g.restored(4096, 2048) == 8 * 8192 * 2048 + 40 * 8192 * 1024 == 469_762_048
    assert g.restored(4096, 512) == 8 * 8192 * 512 + 40 * 8192 * 512  # all of it inside
    assert g.all_full_restored(2048) == 48 * 8192 * 2048 == 805_306_368
    q = P.kv_bytes(P.preset("qwen3-next-80b-a3b"), 64)
    state = 36 * (8192 * 3 + 16 * 128 * 256) * 4
    assert q.state == state == 79_036_416  # 75.4 MiB: 36 recurrent layers, float32
    assert q.device(4096) == 12 * 2048 * 4096 + state == 179_699_712
    assert q.all_full_device(4096) == 48 * 2048 * 4096 == 402_653_184  # 2.24x
    assert q.restored(4096, 2048) == 12 * 2048 * 2048 + state
    assert q.restored(4096, 0) == 0
    d = P.kv_bytes(P.preset("deepseek-v3.2"), 64)
    assert d.device(4096) == 61 * (1152 + 132) * 4096  # the indexer key and its scales
    assert d.all_full_device(4096) == 61 * 1152 * 4096  # DeepSeek-V3's MLA cache: 11% less
    assert d.read(4096) == d.device(4096)
    assert g.read(4096) == 8 * 8192 * 4096 + 40 * 8192 * 1024


def test_every_preset_says_where_its_numbers_come_from():
    assert set(SMALL) == set(P.PRESETS)
    for p in P.PRESETS.values():
        assert p.source and "\n" not in p.source
        assert P.geometry(p)["num_layers"] == p.num_layers


@pytest.mark.parametrize("name", sorted(SMALL))
def test_each_preset_builds_a_cache_when_scaled_down(tmp_path, name):
    p = P.scaled(P.preset(name), **SMALL[name])
    assert p.model == P.preset(name).model and p.name.startswith(name)
    cfg = TieredKVConfig.flat(
        **P.geometry(p), page_size=16, device_tokens=256, host_tokens=512, max_requests=2,
        max_context_len=512, storage_bytes=8 << 20, storage_path=str(tmp_path),
        model_id=f"{name}@test",
    )  # fmt: skip
    cache = TieredKVCache(cfg)
    try:
        prompt = list(range(1, 40))
        req = cache.begin(prompt)
        cache.extend(req, prompt[req.prefix_len :])
        cache.finish(req)
    finally:
        cache.close()


def test_unknown_preset_and_bad_scaling_are_typed_errors():
    with pytest.raises(InvalidArgumentError, match="llama-3-8b, qwen2.5-7b"):
        P.preset("llama-2-7b")
    with pytest.raises(InvalidArgumentError, match="geometry fields"):
        P.scaled(P.preset("llama-3-8b"), heads=2)
    with pytest.raises(InvalidArgumentError, match="full_layer_every"):
        P.scaled(P.preset("qwen3-next-80b-a3b"), layers=2)  # no full-attention layer left


def test_cost_models_are_modeled_and_checked():
    m = cost_model("h100-llama-3-8b")
    assert m.label == "modeled" and m.source.startswith("modeled")
    assert m.prefill_s(30_000) == pytest.approx(1.0)
    assert m.decode_s(8) == pytest.approx(0.0064)
    assert m.decode_s(8, kv_bytes=int(2.5e9)) == pytest.approx(0.0074)
    assert all(c.source for c in COST_MODELS.values())
    with pytest.raises(InvalidArgumentError, match="prefill_tokens_per_s"):
        CostModel("x", prefill_tokens_per_s=0, decode_step_s=0.01)
    with pytest.raises(InvalidArgumentError, match="decode_step_s"):
        CostModel("x", prefill_tokens_per_s=1.0, decode_step_s=float("nan"))
    with pytest.raises(InvalidArgumentError, match="batch"):
        m.decode_s(0)
    with pytest.raises(InvalidArgumentError, match="h100-llama-3-8b"):
        cost_model("tpu")
