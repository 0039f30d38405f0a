"""Issue 14: DSATokenToKVPool. The indexer cache is declared beside the KV pool, and both parts
round-trip bit-exactly through host memory (every layout, whole and layer by layer) and through
both store layouts; the indexer's fp8 keys dequantize within e4m3's step."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device import PagedTokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import DSATokenToKVPool, dequantize_index_k, quantize_index_k
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host import host_pool_for
from tiered_kv.names import HostLayout
from tiered_kv.storage import LMDBStorage, SlabStorage, StorageNamespace, page_keys

PAGE, LAYERS, RANK, ROPE = 4, 3, 16, 8


def rig(gen, index_head_dim=256):
    pool = DSATokenToKVPool(
        96, PAGE, torch.bfloat16, RANK, ROPE, LAYERS, index_head_dim=index_head_dim
    )
    alloc = PagedTokenToKVPoolAllocator(96, PAGE, torch.bfloat16, "cpu", kvcache=pool)
    return pool, alloc


def fill(pool, slots, gen):
    for layer in range(LAYERS):
        lat = torch.randn(len(slots), 1, RANK + ROPE, generator=gen)
        pool.set_kv_buffer(layer, slots, lat)
        pool.set_index_k_buffer(layer, slots, torch.randn(len(slots), 256, generator=gen) * 3)


def snapshot(pool, slots):
    return [b[slots].clone() for b in pool.buffers()]


def scramble(pool, slots):
    for b in pool.buffers():
        b[slots] = b[slots].flip(0)


def test_both_parts_are_declared(gen):
    pool, _ = rig(gen)
    kv, indexer = pool.host_pool_decls()
    assert (kv.name, indexer.name, indexer.kind) == ("kv", "indexer", "dsa_indexer")
    assert indexer.layer_ids == kv.layer_ids and indexer.num_slots == kv.num_slots
    assert indexer.dtype == torch.uint8 and indexer.bytes_per_token_per_layer == 256 + 8
    assert indexer.parts[0].buffer(1) is pool.index_k_with_scale_buffer[1]


def test_quantized_keys_dequantize_within_the_fp8_step(gen):
    x = torch.randn(37, 256, generator=gen) * torch.rand(37, 1, generator=gen) * 10
    x[3] = 0  # an all-zero block keeps scale 1
    rows = quantize_index_k(x)
    assert rows.dtype == torch.uint8 and rows.shape == (37, 256 + 8)
    y = dequantize_index_k(rows, 256)
    blockmax = x.reshape(37, 2, 128).abs().amax(-1, keepdim=True).clamp_min(1e-30)
    err = ((x - y).reshape(37, 2, 128).abs() / blockmax).max()
    assert float(err) <= 1 / 16 + 1e-6  # e4m3: 3 mantissa bits
    assert torch.equal(y[3], torch.zeros(256))


@pytest.mark.parametrize("layout", HostLayout.values())
def test_every_part_round_trips_through_host(gen, layout):
    pool, alloc = rig(gen)
    slots = alloc.alloc(4 * PAGE)[torch.randperm(4 * PAGE, generator=gen)]
    fill(pool, slots, gen)
    want = snapshot(pool, slots)
    hosts = [
        host_pool_for(d, alloc, layout=layout, size_tokens=8 * PAGE) for d in pool.host_pool_decls()
    ]
    host_slots = [h.alloc(len(slots)) for h in hosts]
    for h, hs in zip(hosts, host_slots, strict=True):
        h.backup_from_device_all_layer(pool, hs, slots)
    scramble(pool, slots)
    assert not all(torch.equal(a, b) for a, b in zip(want, snapshot(pool, slots), strict=True))
    for layer in range(LAYERS):
        for h, hs in zip(hosts, host_slots, strict=True):
            h.load_to_device_per_layer(pool, hs, slots, layer)
    got = snapshot(pool, slots)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    scramble(pool, slots)
    for h, hs in zip(hosts, host_slots, strict=True):
        h.load_to_device_all_layer(pool, hs, slots)
    assert all(torch.equal(a, b) for a, b in zip(want, snapshot(pool, slots), strict=True))
    for h in hosts:
        h.destroy()


@pytest.mark.parametrize("store_cls", [SlabStorage, LMDBStorage])
def test_every_part_round_trips_through_storage(gen, tmp_path, store_cls):
    pool, alloc = rig(gen)
    slots = alloc.alloc(3 * PAGE)
    fill(pool, slots, gen)
    want = snapshot(pool, slots)
    tokens = torch.randint(0, 50_000, (3 * PAGE,), generator=gen)
    parts = []
    for d in pool.host_pool_decls():
        host = host_pool_for(d, alloc, layout="page_first", size_tokens=8 * PAGE)
        hs = host.alloc(len(slots))
        host.backup_from_device_all_layer(pool, hs, slots)
        ns = StorageNamespace.for_host_pool(host, model=f"dsa-test/{d.name}")
        store = store_cls(tmp_path / d.name, ns, host.page_nbytes, budget_bytes=64 << 20)
        keys = page_keys(ns, tokens, PAGE)
        assert all(store.batch_set(keys, host, [int(s) // PAGE for s in hs[::PAGE]]))
        host.free(hs)  # only the stores hold the pages now
        parts.append((host, store, keys))
    scramble(pool, slots)
    for host, store, keys in parts:
        bits = host.buffer.view(torch.uint8).view(-1)  # no stale copy can pass for a read
        bits.copy_(torch.randint(0, 256, bits.shape, dtype=torch.uint8, generator=gen))
        back = host.alloc(len(slots))
        assert store.batch_get(keys, host, [int(s) // PAGE for s in back[::PAGE]]) == [True] * 3
        host.load_to_device_all_layer(pool, back, slots)
        store.close()
        host.destroy()
    assert all(torch.equal(a, b) for a, b in zip(want, snapshot(pool, slots), strict=True))


def test_bad_input_is_named(gen):
    with pytest.raises(InvalidArgumentError, match="multiple of the 128-element"):
        DSATokenToKVPool(16, 4, torch.bfloat16, 16, 8, 1, index_head_dim=100)
    pool, alloc = rig(gen)
    slots = alloc.alloc(PAGE)
    before = pool.index_k_with_scale_buffer[0].clone()
    with pytest.raises(InvalidArgumentError, match=r"expected \(4, 256\) floating"):
        pool.set_index_k_buffer(0, slots, torch.randn(4, 128))
    with pytest.raises(InvalidArgumentError, match="4 slots but the KV has 3"):
        pool.set_index_k_buffer(0, slots, torch.randn(3, 256))
    assert torch.equal(before, pool.index_k_with_scale_buffer[0])
