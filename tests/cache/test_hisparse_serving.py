"""Issue 29: HiSparse in the cache. A sparse request's prefix comes from the tree on host (or
from storage to host, after a restart), its prefill reads it from staging rows, its decode
swaps each layer's selected tokens in from host (the tree's host copies for the prefix), and
its tokens go back into the tree as host-only nodes: TinyDSA's logits equal the dense
no-cache run bit for bit, with the prefix served by host and by storage."""

from __future__ import annotations

import pytest
import torch

from tests.host.test_hisparse_decode import (
    CHUNK,
    PROMPT,
    STEPS,
    PoolKV,
    RecordingDSA,
    SwappedKV,
    _reference,
    _t,
)
from tiered_kv.cache import TieredKVCache
from tiered_kv.cache.hisparse_serving import HiSparseServing
from tiered_kv.config import TieredKVConfig
from tiered_kv.engine.dsa import DSAModelConfig
from tiered_kv.errors import InvalidArgumentError, StateError

BUFFER = 8


def dsa_config(tmp_path, cfg: DSAModelConfig, **changes) -> TieredKVConfig:
    fields = dict(
        model="dsa", num_layers=cfg.num_layers, kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, index_head_dim=cfg.index_head_dim,
        dtype="float32", page_size=CHUNK, device_tokens=64, hisparse_logical_ratio=4,
        host_tokens=256, storage_bytes=64 << 20, storage_path=str(tmp_path / "store"),
        model_id="tiny-dsa@1", prefetch_threshold=CHUNK, prefetch_policy="wait_complete",
        max_requests=8, max_context_len=256,
    )  # fmt: skip
    fields.update(changes)
    return TieredKVConfig.flat(**fields)


def serve(serving: HiSparseServing, cfg, prompt, tokens, selected):
    """Prefill, admit, decode ``tokens`` and finish one sparse request; its logits."""
    model = RecordingDSA(cfg)
    req = serving.begin(prompt.tolist())
    assert req is not None
    start = req.prefix_len
    kv = PoolKV(serving.pool, req.staging)
    logits = [model.forward(prompt[start:], start, kv, CHUNK)[-1]]
    assert serving.admit(req)
    for step, tok in enumerate(tokens):
        pos = PROMPT + step
        slot = serving.begin_token(req, tok)
        assert slot is not None
        kv = SwappedKV(req.swapper, slot, pos, selected)
        logits.append(model.forward(_t([tok]), pos, kv, CHUNK)[-1])
        assert serving.commit_token(req)
    loaded = req.swapper.num_loaded
    inserted = serving.finish(req)
    return model.selected, torch.stack(logits), req, loaded, inserted


def test_sparse_requests_hit_host_and_storage_and_equal_the_dense_run(tmp_path):
    cfg = DSAModelConfig(num_layers=3, index_topk=8, seed=3)
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5))
    ref_selected, tokens, ref_logits = _reference(cfg, prompt)
    config = dsa_config(tmp_path, cfg)
    cache = TieredKVCache(config)
    try:
        # Logical ids differ from device rows: an untranslated id would read another row.
        assert cache.allocator.logical_allocator.alloc(3 * CHUNK) is not None
        serving = HiSparseServing(cache, BUFFER)
        sel, logits, req, loaded, inserted = serve(serving, cfg, prompt, tokens, ref_selected)
        assert req.prefix_len == 0 and torch.equal(logits, ref_logits)
        assert loaded > 0 and inserted == (PROMPT + STEPS) // CHUNK * CHUNK
        # The same prompt again: its prefix from the tree's host copies (never on the device).
        sel, logits, req, loaded, _ = serve(serving, cfg, prompt, tokens, ref_selected)
        assert req.prefix_len == (PROMPT - 1) // CHUNK * CHUNK and req.hits.host == req.prefix_len
        assert torch.equal(logits, ref_logits) and loaded > 0
        assert {pos for pos, _ in sel} == set(range(req.prefix_len, PROMPT + STEPS))
        for key, s in sel.items():  # the same keys selected from restored indexer keys
            assert torch.equal(s, ref_selected[key]), key
        cache.drain()
        assert serving.counts["prefix_load_failed"] == 0 and not serving.live
    finally:
        cache.close()
    cache = TieredKVCache(config)  # a restart: the prefix comes from storage to host
    try:
        serving = HiSparseServing(cache, BUFFER)
        sel, logits, req, loaded, _ = serve(serving, cfg, prompt, tokens, ref_selected)
        assert req.hits.storage == req.prefix_len == (PROMPT - 1) // CHUNK * CHUNK
        assert torch.equal(logits, ref_logits)
        cache.drain()
        cache.manager.check_integrity()
    finally:
        cache.close()


def test_a_cache_without_hisparse_is_refused_by_name(tmp_path):
    cfg = DSAModelConfig(num_layers=2, index_topk=4, seed=1)
    cache = TieredKVCache(dsa_config(tmp_path, cfg, hisparse_logical_ratio=0))
    try:
        with pytest.raises(InvalidArgumentError, match="hisparse_logical_ratio"):
            HiSparseServing(cache, BUFFER)
    finally:
        cache.close()
    with pytest.raises(InvalidArgumentError, match="hisparse_logical_ratio"):
        dsa_config(tmp_path, cfg, model="mla")
    cache = TieredKVCache(dsa_config(tmp_path, cfg))
    try:
        with pytest.raises(InvalidArgumentError, match="buffer_tokens"):
            HiSparseServing(cache, BUFFER + 1)
        serving = HiSparseServing(cache, BUFFER)
        req = serving.begin(list(range(1, 11)))
        with pytest.raises(StateError, match="not admitted"):
            serving.begin_token(req, 3)
        serving.abort(req)
        with pytest.raises(StateError, match="not a live"):
            serving.abort(req)
        assert cache.free_sizes() == cache._initial
    finally:
        cache.close()
