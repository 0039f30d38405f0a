"""Issue 14: a sliding-window pool's two sub-pools through host memory and storage as one group.
A host slot holds a token's full KV and its window KV: the transfer worker backs up the full
slots and, through the allocator's table, the window slots of the same tokens; a layer-wise load
puts each layer back into its own sub-pool (window layers at the tokens' new window slots).
Bytes are checked exactly, every host layout; a token whose window KV was freed moves its full
KV only (its window part is never copied from the padding slot or loaded back); a ring-mode
pool's window KV is not offloaded."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device.allocator.swa import SWATokenToKVPoolAllocator
from tiered_kv.device.req_to_token_pool import ReqToTokenPool
from tiered_kv.device.swa_pool import SWAKVPool
from tiered_kv.device.write_loc import KVWriteLoc
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host.pool_group import HostPoolGroup
from tiered_kv.names import HostLayout
from tiered_kv.storage import SlabStorage, StorageNamespace, page_keys
from tiered_kv.transfer import DeviceHostTransfer, HostStorageTransfer, TransferJob

PAGE, FULL, SWA = 4, [0, 3], [1, 2, 4]


def _t(*v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def rig(layout):
    pool = SWAKVPool(64, 48, PAGE, torch.float16, 2, 8, FULL, SWA, swa_head_num=1)
    alloc = SWATokenToKVPoolAllocator(
        64, 48, PAGE, torch.float16, "cpu", pool, debug_mode=True, kernel_backend="torch"
    )
    group = HostPoolGroup(pool.host_pool_decls(), alloc, layout=layout, size_tokens=64)
    assert alloc.swa_attn_allocator.alloc(3 * PAGE) is not None  # window slots != full slots
    return pool, alloc, group


def extend(alloc, n):
    return alloc.alloc_extend(_t(0), _t(0), _t(n), _t(n), _t(-1), n)


def fill(pool, alloc, full, gen):
    swa = alloc.translate_loc_from_full_to_swa(full)
    want = {}
    for layer in range(5):
        heads = 1 if layer in SWA else 2
        k = torch.randn(len(full), heads, 8, generator=gen).half()
        v = torch.randn(len(full), heads, 8, generator=gen).half()
        pool.set_kv_buffer(layer, KVWriteLoc(full, swa_loc=swa), k, v)
        want[layer] = (k, v)
    return want


def check(pool, alloc, full, want):
    swa = alloc.translate_loc_from_full_to_swa(full)
    for layer, (k, v) in want.items():
        loc = swa if layer in SWA else full
        assert torch.equal(pool.get_key_buffer(layer)[loc], k), f"K of layer {layer}"
        assert torch.equal(pool.get_value_buffer(layer)[loc], v), f"V of layer {layer}"


@pytest.mark.parametrize("layout", HostLayout.values())
def test_both_sub_pools_round_trip_through_host(gen, layout):
    pool, alloc, group = rig(layout)
    worker = DeviceHostTransfer(alloc, group, io_backend="kernel")
    try:
        full = extend(alloc, 12)
        want = fill(pool, alloc, full, gen)
        host = group.alloc(len(full))
        assert worker.submit(TransferJob.write(1, full, host))
        worker.wait([1])
        assert [r.ok for r in worker.poll()] == [True]
        alloc.free(full)  # gone from the device; loaded back into fresh slots of both pools
        for b in pool.buffers():
            b.view(torch.uint8).fill_(0x6D)
        back = extend(alloc, 12)
        assert worker.submit(TransferJob.load(2, host, back))
        for layer in range(5):
            pool.get_key_buffer(layer)  # waits for that layer, in whichever sub-pool
        worker.wait([2])
        assert [r.ok for r in worker.poll()] == [True]
        check(pool, alloc, back, want)
    finally:
        worker.close()
        group.destroy()


def test_both_sub_pools_round_trip_through_storage(gen, tmp_path):
    pool, alloc, group = rig("page_first")
    ns = StorageNamespace.for_host_pool(group, model="swa-test@1")
    store = SlabStorage(tmp_path / "s", ns, group.page_nbytes, budget_bytes=64 << 20)
    worker = HostStorageTransfer(group, store, batch_pages=2)
    try:
        full = extend(alloc, 12)
        want = fill(pool, alloc, full, gen)
        host = group.alloc(12)
        group.backup_from_device_all_layer(pool, host, full)
        keys = page_keys(ns, torch.randint(0, 9999, (12,), generator=gen), PAGE)
        assert worker.submit(TransferJob.backup(1, keys, host))
        worker.wait([1])
        assert worker.poll()[0].pages_done == 3
        for m in group.members:
            m.buffer.view(torch.uint8).fill_(0x11)
        assert worker.submit(TransferJob.prefetch(2, keys, host))
        worker.wait([2])
        assert worker.poll()[0].pages_done == 3
        alloc.free(full)
        back = extend(alloc, 12)
        group.load_to_device_all_layer(pool, host, back)
        check(pool, alloc, back, want)
    finally:
        worker.close()
        store.close()
        group.destroy()


@pytest.mark.parametrize("layout", HostLayout.values())
def test_a_token_without_window_kv_moves_its_full_kv_only(gen, layout):
    """A page that left the window (a tombstone's) keeps its full KV through host; its window
    part is neither copied from the padding slot nor loaded back over anything."""
    pool, alloc, group = rig(layout)
    try:
        full = extend(alloc, 8)
        want = fill(pool, alloc, full, gen)
        alloc.free_swa(full[:4])  # the first page left the window
        host = group.alloc(8)
        window_member = group.members[1]
        before = window_member.get_page_bytes(int(host[0]) // PAGE).clone()
        group.backup_from_device_all_layer(pool, host, full)
        after = window_member.get_page_bytes(int(host[0]) // PAGE)
        assert torch.equal(before, after), "the freed page's window part was written"
        alloc.free(full)
        for b in pool.buffers():
            b.view(torch.uint8).fill_(0x6D)
        back = extend(alloc, 8)
        alloc.free_swa(back[:4])  # loaded back as a tombstone: window slots given back first
        pad = [pool.get_key_buffer(i)[:PAGE].clone() for i in SWA]
        for layer in range(5):
            group.load_to_device_per_layer(pool, host, back, layer)
        for layer, (k, v) in want.items():
            if layer in SWA:
                loc = alloc.translate_loc_from_full_to_swa(back[4:])
                k, v = k[4:], v[4:]
            else:
                loc = back
            assert torch.equal(pool.get_key_buffer(layer)[loc], k), f"K of layer {layer}"
            assert torch.equal(pool.get_value_buffer(layer)[loc], v), f"V of layer {layer}"
        assert all(
            torch.equal(pool.get_key_buffer(i)[:PAGE], p) for i, p in zip(SWA, pad, strict=True)
        ), "the padding page was written"
    finally:
        group.destroy()


def test_a_ring_pool_is_not_offloaded():
    pool = SWAKVPool(32, 16, 4, torch.float16, 1, 8, [0], [1], swa_req_ring_size=8)
    req = ReqToTokenPool(2, 64)
    alloc = SWATokenToKVPoolAllocator(
        32, 16, 4, torch.float16, "cpu", pool, req_to_token_pool=req, kernel_backend="torch"
    )
    with pytest.raises(InvalidArgumentError, match="ring's window KV"):
        HostPoolGroup(pool.host_pool_decls(), alloc, size_tokens=16)


def test_a_job_routed_again_after_its_window_kv_left_reads_the_table_again(gen):
    """The group keeps a job's routed slots between calls (every layer of one load); a window
    freed in between must not be copied from its old (now someone else's) slots."""
    pool, alloc, group = rig("page_first")
    try:
        full = extend(alloc, 8)
        fill(pool, alloc, full, gen)
        host = group.alloc(8)
        group.backup_from_device_all_layer(pool, host, full)
        old = alloc.translate_loc_from_full_to_swa(full[:4])
        window_member = group.members[1]
        page = int(host[0]) // PAGE
        before = window_member.get_page_bytes(page).clone()
        alloc.free_swa(full[:4])
        for layer in SWA:  # the freed window slots get another owner's bytes
            pool.get_key_buffer(layer)[old] += 1
        group.backup_from_device_all_layer(pool, host, full)  # the same index tensors
        assert torch.equal(window_member.get_page_bytes(page), before)
    finally:
        group.destroy()
