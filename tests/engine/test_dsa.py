"""Issue 14: the DSA variant of the reference model (MLA plus a sparse indexer over fp8 keys).
Latents and indexer keys restored from every tier give the no-cache logits bit for bit; one
corrupted restored latent or indexer key makes them differ (the comparison can fail); the
indexer really chooses what each query attends to."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.cache import TieredKVCache
from tiered_kv.engine.dsa import DenseDSAKV, DSAModelConfig, TinyDSA
from tiered_kv.engine.mla import MLAModelConfig, TinyMLA
from tiered_kv.engine.serve import PagedKV, Server
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

DSA = DSAModelConfig(
    vocab_size=512, hidden=64, num_layers=3, num_heads=4, head_dim=16, intermediate=96,
    kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, seed=5,
    index_head_dim=128, index_topk=6,
)  # fmt: skip


@pytest.fixture
def make_cache(tmp_path, request):
    def make(**changes) -> TieredKVCache:
        opts = dict(
            model="dsa", kv_lora_rank=DSA.kv_lora_rank, qk_rope_head_dim=DSA.qk_rope_head_dim,
            index_head_dim=DSA.index_head_dim,
        )  # fmt: skip
        opts.update(changes)
        cache = TieredKVCache(cache_config(tmp_path, DSA, **opts))
        request.addfinalizer(cache.close)
        return cache

    return make


def scribble(cache: TieredKVCache, host: bool) -> None:
    """Overwrite every device byte (and host byte): what is found later was copied back."""
    for buf in cache.device_pool.buffers():
        buf.view(torch.uint8).fill_(0x7B)
    if host:
        for m in cache.host_pool.members:
            m.buffer.view(torch.uint8).fill_(0x7B)


def move(cache: TieredKVCache, tier: str) -> None:
    cache.drain()
    if tier == "host":
        cache.manager.evict_device(1 << 30)
    elif tier == "storage":
        cache.clear_tree()
    cache.drain()
    if tier != "device":
        scribble(cache, host=tier == "storage")


@pytest.mark.parametrize("hisparse", [0, 2])
@pytest.mark.parametrize("tier", ["device", "host", "storage"])
def test_latents_and_indexer_keys_restored_from_each_tier_are_bitwise(
    make_cache, gen, tier, hisparse
):
    """``hisparse``: the same on a HiSparse allocator (dense requests hold logical ids, which
    differ from their device rows: an untranslated read or write would hit another row)."""
    cache = make_cache(hisparse_logical_ratio=hisparse)
    if hisparse:
        assert cache.allocator.logical_allocator.alloc(3 * cache.config.page_size) is not None
    server = Server(Recorder(TinyDSA(DSA)), cache)
    shared = tokens(gen, 45)
    p1 = shared + tokens(gen, 11)
    p2 = diverging(gen, shared, p1, 7)
    check_against_no_cache(server, p1, serve(server, p1, 3), bitwise=True)
    move(cache, tier)
    s = serve(server, p2, 3)
    expected = {"device": 0, "host": 0, "storage": 0}
    expected[tier] = aligned(len(shared), 16)
    assert tier_counts(s.record) == expected
    check_against_no_cache(server, p2, s, bitwise=True)


@pytest.mark.parametrize("tier", ["host", "storage"])
@pytest.mark.parametrize("corrupt", [None, "latent", "indexer"])
def test_a_corrupted_restored_part_changes_the_logits(make_cache, gen, tier, corrupt):
    page = 8
    cache = make_cache(page_size=page, prefetch_threshold=page)
    model = TinyDSA(DSA)
    server = Server(Recorder(model), cache)
    shared = tokens(gen, 32)
    p1 = shared + tokens(gen, 9)
    serve(server, p1, 1)
    move(cache, tier)
    p2 = diverging(gen, shared, p1, 7)
    req = cache.begin(p2)
    assert req.prefix_len == 32 and getattr(req.hits, tier) == 32
    cache.extend(req, p2[32:])
    pool = cache.device_pool
    restored = req.slots[:32]
    if corrupt == "latent":  # every restored latent of one layer: whatever the indexer picks
        pool.get_key_buffer(1)[restored] += 0.25
    elif corrupt == "indexer":  # each restored token gets its neighbour's indexer key
        rows = pool.get_index_k_with_scale_buffer(DSA.num_layers - 1)
        rows[restored] = rows[restored.roll(1)]
    logits = model.forward(torch.tensor(p2[32:]), 32, PagedKV(cache, req), page)
    cache.abort(req)
    ref, _ = no_cache(model, p2, [], page)
    if corrupt is None:
        assert torch.equal(logits, ref[32:])
    else:
        assert not torch.equal(logits, ref[32:]), corrupt


def test_the_indexer_chooses_what_a_query_attends_to(gen):
    prompt = torch.tensor(tokens(gen, 40))
    sparse, dense = TinyDSA(DSA), TinyMLA(MLAModelConfig(**{
        k: getattr(DSA, k) for k in MLAModelConfig.__dataclass_fields__
    }))  # fmt: skip
    kv = DenseDSAKV(DSA, 48)
    out = sparse.forward(prompt, 0, kv, 8)
    assert kv.index[0].dtype == torch.uint8 and kv.index[0].shape == (48, 128 + 4)
    wide = TinyDSA(DSAModelConfig(**{**DSA.__dict__, "index_topk": 64}))
    out_wide = wide.forward(prompt, 0, DenseDSAKV(DSA, 48), 8)
    assert not torch.equal(out, out_wide)  # top 6 of up to 40 keys is really sparse
    # with every key selected, the sparse model is the dense MLA model on the same weights
    from tiered_kv.engine.model import DenseKV

    mla_out = dense.forward(prompt, 0, DenseKV(dense.cfg, 48), 8)
    assert not torch.equal(out, mla_out)


def test_config_and_server_checks(make_cache):
    with pytest.raises(InvalidArgumentError, match="index_head_dim"):
        DSAModelConfig(index_head_dim=100)
    with pytest.raises(InvalidArgumentError, match="index_topk"):
        DSAModelConfig(index_topk=0)
    with pytest.raises(InvalidArgumentError, match="index_head_dim"):
        Server(TinyDSA(DSA), make_cache(index_head_dim=256))
    with pytest.raises(InvalidArgumentError, match="cache kind"):
        Server(TinyDSA(DSA), make_cache(model="mla"))
