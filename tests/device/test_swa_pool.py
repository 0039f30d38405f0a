"""Issue 14: SWAKVPool and SWATokenToKVPoolAllocator beyond the state machine: the layer map and
window writes (bit-exact, into the right sub-pool only), both sub-pools declared to the host tier
with their global layer ids, the -1 sentinel, a window side that is short refusing the whole
allocation, debug-mode misuse, the per-request ring (capacity in request rows, row reuse refused
by generation), and typed errors for bad input."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device.allocator.swa import SWATokenToKVPoolAllocator
from tiered_kv.device.req_to_token_pool import ReqToTokenPool
from tiered_kv.device.swa_pool import SWAKVPool
from tiered_kv.device.write_loc import KVWriteLoc
from tiered_kv.errors import InvalidArgumentError, OwnershipError, StateError

FULL, SWA = [0, 4], [1, 2, 3, 5]


def _t(*v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def make(page=4, size=64, size_swa=32, **kw):
    pool = SWAKVPool(size, size_swa, page, torch.float16, 2, 8, FULL, SWA, **kw)
    alloc = SWATokenToKVPoolAllocator(
        size, size_swa, page, torch.float16, "cpu", pool, debug_mode=True, kernel_backend="torch"
    )
    return pool, alloc


def test_writes_land_in_their_sub_pool_only(gen):
    pool, alloc = make()
    n = 7
    full = alloc.alloc_extend(_t(0), _t(0), _t(n), _t(n), _t(-1), n)
    swa = alloc.translate_loc_from_full_to_swa(full)
    assert bool((swa > 0).all()) and len(set(swa.tolist())) == n
    before = [b.clone() for b in pool.buffers()]
    written = {}
    for layer in range(6):
        k = torch.randn(n, 2, 8, generator=gen).half()
        v = torch.randn(n, 2, 8, generator=gen).half()
        pool.set_kv_buffer(layer, KVWriteLoc(full, swa_loc=swa), k, v)
        written[layer] = (k, v)
    for layer, (k, v) in written.items():
        sub, local, is_swa = pool.sub_pool(layer)
        loc = swa if is_swa else full
        assert is_swa == (layer in SWA) and sub is (
            pool.swa_kv_pool if is_swa else pool.full_kv_pool
        )
        assert torch.equal(pool.get_key_buffer(layer)[loc], k)
        assert torch.equal(pool.get_value_buffer(layer)[loc], v)
    # nothing outside the written rows changed, in either sub-pool
    for b0, b1 in zip(before, pool.buffers(), strict=True):
        mask = torch.ones(b1.shape[0], dtype=torch.bool)
        mask[torch.cat([full, swa])] = False
        assert torch.equal(b0[mask], b1[mask])


def test_a_window_layer_needs_swa_loc_and_bad_layers_are_named():
    pool, alloc = make()
    full = alloc.alloc(4)
    k = torch.randn(4, 2, 8).half()
    with pytest.raises(InvalidArgumentError, match="layer 1 is a window layer"):
        pool.set_kv_buffer(1, full, k, k)
    pool.set_kv_buffer(0, full, k, k)  # a full layer takes a bare loc
    with pytest.raises(InvalidArgumentError, match="layer_id=6 is not held.*0..5"):
        pool.get_key_buffer(6)


def test_both_sub_pools_are_declared_with_their_global_layers():
    pool, _ = make(page=4, size=64, size_swa=32)
    full, swa = pool.host_pool_decls()
    assert (full.name, full.layer_ids, full.num_slots) == ("full", tuple(FULL), 68)
    assert (swa.name, swa.layer_ids, swa.num_slots) == ("swa", tuple(SWA), 36)
    assert full.device_pool is pool.full_kv_pool and swa.device_pool is pool.swa_kv_pool
    assert swa.parts[0].buffer(2) is pool.swa_kv_pool.k_buffer[2]  # local index of layer 3


def test_the_sentinel_and_a_short_window_side_refusing_everything():
    pool, alloc = make(page=4, size=64, size_swa=8)  # 2 window pages, 16 full pages
    assert alloc.translate_loc_from_full_to_swa(_t(-1)).tolist() == [-1]
    assert alloc.available_size() == 8
    full_before = sorted(alloc.full_attn_allocator.get_all_free_pages().tolist())
    table_before = alloc.full_to_swa_index_mapping.clone()
    assert alloc.alloc_extend(_t(0), _t(0), _t(9), _t(9), _t(-1), 9) is None  # 3 pages
    assert sorted(alloc.full_attn_allocator.get_all_free_pages().tolist()) == full_before
    assert torch.equal(alloc.full_to_swa_index_mapping, table_before)
    got = alloc.alloc_extend(_t(0), _t(0), _t(8), _t(8), _t(-1), 8)
    assert got is not None and alloc.swa_available_size() == 0
    assert alloc.alloc_decode(_t(9), _t(9), got[-1:]) is None  # would open a window page
    alloc.free_swa(got[:4])  # the first page left the window
    slot = alloc.alloc_decode(_t(9), _t(9), got[-1:])
    assert slot is not None and int(alloc.translate_loc_from_full_to_swa(slot)) > 0
    alloc.free(torch.cat([got, slot]))
    assert alloc.available_size() == 8 and alloc.full_available_size() == 64


def test_debug_mode_catches_misuse_before_anything_changes():
    pool, alloc = make(page=4)
    got = alloc.alloc_extend(_t(0), _t(0), _t(6), _t(6), _t(-1), 6)
    snap = alloc.backup_state()
    with pytest.raises(OwnershipError, match="still have window peers"):
        alloc.free_full(got)
    alloc.free_swa(got[:4])
    with pytest.raises(OwnershipError, match="window peer was freed"):
        # continuing a page whose window peer is gone (the page of token 5 is still filling)
        alloc.free_swa(got[4:])
        alloc.alloc_decode(_t(7), _t(7), got[-1:])
    alloc.restore_state(snap)
    assert alloc.translate_loc_from_full_to_swa(got).gt(0).all()
    with pytest.raises(InvalidArgumentError):
        alloc.free_swa(_t(0))  # the padding slot is never a caller's
    with pytest.raises(InvalidArgumentError):
        alloc.free(torch.tensor([1.5]))
    alloc.free(got)
    assert alloc.available_size() == 32


def test_page_size_one_pairs_every_token():
    pool, alloc = make(page=1, size=20, size_swa=6)
    got = alloc.alloc(5)
    swa = alloc.translate_loc_from_full_to_swa(got)
    assert len(set(swa.tolist())) == 5 and swa.min() >= 1
    assert alloc.alloc(2) is None and alloc.full_available_size() == 15
    alloc.free_swa(got[:2])
    assert alloc.swa_available_size() == 3
    alloc.free(got)  # mixed: two peers already gone
    assert alloc.available_size() == 6 and alloc.full_available_size() == 20


def make_ring(rows=3, ring=6, page=4, size=64):
    cost = -(-ring // page) * page
    pool = SWAKVPool(
        size, rows * cost, page, torch.float16, 2, 8, FULL, SWA, swa_req_ring_size=ring
    )
    req = ReqToTokenPool(rows, 128)
    alloc = SWATokenToKVPoolAllocator(
        size, 0, page, torch.float16, "cpu", pool, req_to_token_pool=req, debug_mode=True,
        kernel_backend="torch",
    )  # fmt: skip
    return pool, req, alloc


def test_ring_capacity_is_request_rows_and_addresses_follow_the_row():
    pool, req, alloc = make_ring(rows=3, ring=6, page=4)
    assert alloc.swa_req_ring and alloc.swa_ring_cost_tokens == 8
    assert alloc.swa_available_size() == 24 and alloc.available_size() == 64
    assert alloc.swa_attn_allocator is None  # no paged window indices are built
    (r1,) = req.alloc_rows(1)
    assert alloc.swa_available_size() == 16
    pos = torch.arange(14)
    loc = alloc.ring_loc(torch.full((14,), r1), pos)
    base = 4 + (r1 - 1) * 8
    assert loc.tolist() == [base + i % 6 for i in range(14)]
    full = alloc.alloc_extend(_t(0), _t(0), _t(14), _t(14), _t(-1), 14)
    assert full is not None and int(alloc.full_to_swa_index_mapping[:-1].abs().sum()) == 0
    with pytest.raises(InvalidArgumentError, match="ring_loc"):
        alloc.translate_loc_from_full_to_swa(full)
    alloc.free(full)  # the window side has nothing paged to give back
    assert alloc.full_available_size() == 64


def test_a_reused_row_is_refused_to_a_reader_of_the_old_generation(gen):
    pool, req, alloc = make_ring(rows=2, ring=5, page=4)
    (row,) = req.alloc_rows(1)
    gen0 = req.req_generation[[row]].clone()
    rows = torch.full((5,), row)
    loc = alloc.ring_loc(rows, torch.arange(5), generations=gen0.expand(5))
    k = torch.randn(5, 2, 8, generator=gen).half()
    pool.set_kv_buffer(1, KVWriteLoc(loc, swa_loc=loc), k, -k)
    req.free(row)
    (again,) = req.alloc_rows(1)
    assert again == row  # the same ring, another owner now
    with pytest.raises(StateError, match="changed owner"):
        alloc.ring_loc(rows, torch.arange(5), generations=gen0.expand(5))
    assert torch.equal(alloc.ring_loc(rows, torch.arange(5)), loc)


def test_bad_construction_is_named():
    with pytest.raises(InvalidArgumentError, match="both full and window"):
        SWAKVPool(16, 16, 4, torch.float16, 1, 4, [0, 1], [1, 2])
    with pytest.raises(InvalidArgumentError, match="one range of layers"):
        SWAKVPool(16, 16, 4, torch.float16, 1, 4, [0], [2])
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        SWAKVPool(16, 16, 4, torch.float16, 1, 4, [], [0])
    with pytest.raises(InvalidArgumentError, match="rows x ring cost 8"):
        SWAKVPool(16, 12, 4, torch.float16, 1, 4, [0], [1], swa_req_ring_size=6)
    pool = SWAKVPool(16, 16, 4, torch.float16, 1, 4, [0], [1], swa_req_ring_size=8)
    with pytest.raises(InvalidArgumentError, match="pass req_to_token_pool"):
        SWATokenToKVPoolAllocator(16, 16, 4, torch.float16, "cpu", pool)
    with pytest.raises(InvalidArgumentError, match="holds 2 request rows"):
        SWATokenToKVPoolAllocator(
            16, 16, 4, torch.float16, "cpu", pool, req_to_token_pool=ReqToTokenPool(3, 8)
        )
    with pytest.raises(InvalidArgumentError, match="must be an SWAKVPool"):
        SWATokenToKVPoolAllocator(16, 16, 4, torch.float16, "cpu", object())
