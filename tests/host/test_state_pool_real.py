"""The real state pools (MambaPool with per-layer conv shapes, ShortConvPool and NGramPool
siblings, as a HybridReqToTokenPool declares them) through host state slots and both store
layouts, for every host layout: every part of every pool comes back bit for bit."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device.hybrid_req_pool import HybridReqToTokenPool, HybridRequestKV
from tiered_kv.device.mamba_pool import MambaPool
from tiered_kv.device.slot_states import NGramPool, ShortConvPool
from tiered_kv.host.state_pool import HostStatePool
from tiered_kv.names import HostLayout, StorageLayout
from tiered_kv.storage.keys import state_keys_of
from tiered_kv.storage.layouts import open_store


def _rows() -> HybridReqToTokenPool:
    size = 7
    mamba = MambaPool(
        size=size, conv_shapes=[(12, 3), (20, 2), (12, 5)], temporal_shape=(2, 4, 6),
        mamba_layer_ids=[0, 2, 5], conv_dtype=torch.bfloat16,
    )  # fmt: skip
    short = ShortConvPool(size=size, state_shape=(9, 3), layer_ids=[1, 4], dtype=torch.float16)
    ngram = NGramPool(size=size, context_len=5, eos_token_id=2)
    return HybridReqToTokenPool(
        3, 32, mamba_pool=mamba, enable_extra_buffer=True, short_conv=short, ngram=ngram
    )


def _buffers(rows: HybridReqToTokenPool) -> list[torch.Tensor]:
    return [p.buffer() for d in rows.state_pool_decls() for p in d.parts]


def _slot(rows: HybridReqToTokenPool, slot: int) -> list[torch.Tensor]:
    return [b[slot].reshape(-1).view(torch.uint8).clone() for b in _buffers(rows)]


def _fill_random(rows: HybridReqToTokenPool, gen: torch.Generator) -> None:
    for b in _buffers(rows):
        raw = b.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


@pytest.mark.parametrize("layout", HostLayout.values())
@pytest.mark.parametrize("store_layout", StorageLayout.values())
def test_every_state_pool_and_sibling_round_trips_through_host_and_storage(
    tmp_path, layout, store_layout
):
    gen = torch.Generator().manual_seed(hash((layout, store_layout)) % 2**31)
    rows = _rows()
    decls = rows.state_pool_decls()
    assert [d.kind for d in decls] == ["mamba", "short_conv", "ngram"]
    reqs = [HybridRequestKV() for _ in range(2)]
    assert rows.alloc(reqs) is not None
    _fill_random(rows, gen)  # every row random, the requests' slots included
    src = [r.mamba_pool_idx for r in reqs]
    want = [_slot(rows, s) for s in src]
    host = HostStatePool(decls, 5, layout=layout)
    h = host.alloc(2)
    host.backup_from_device(torch.tensor(src), h)
    ns = host.namespace(model="real-pools@1")
    keys = state_keys_of(ns, [bytes([i]) * 32 for i in range(2)])
    store = open_store(store_layout, tmp_path, ns, host.page_nbytes, budget_bytes=32 << 20)
    assert store.batch_set(keys, host, h.tolist()) == [True, True]
    store.close()
    fresh = HostStatePool(decls, 4, layout=layout)  # a restart: nothing on the host
    f = fresh.alloc(2)
    store = open_store(store_layout, tmp_path, ns, fresh.page_nbytes, budget_bytes=32 << 20)
    assert store.batch_get(keys, fresh, f.tolist()) == [True, True]
    store.close()
    _fill_random(rows, gen)  # scribble everything, then load into other slots
    dst = [s for s in range(1, rows.mamba_pool.size + 1) if s not in src][:2]
    fresh.load_to_device(f, torch.tensor(dst))
    for d, w in zip(dst, want, strict=True):
        got = _slot(rows, d)
        assert all(torch.equal(a, b) for a, b in zip(got, w, strict=True))
    for r in reqs:
        rows.free(r)
