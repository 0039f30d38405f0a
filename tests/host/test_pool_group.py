"""Issue 14: HostPoolGroup, several declared host pools of one device pool moved as one. With a
DSA pool (latent + indexer keys) in every host layout: the transfer worker's writes and
layer-wise loads move both parts bit-exactly, the storage worker stores one value per page
holding both parts, and a page whose indexer part (or latent part) was corrupted on disk is a
miss as a whole, while the pages before it are served exactly."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device import PagedTokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import DSATokenToKVPool
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host import host_pool_for
from tiered_kv.host.pool_group import HostPoolGroup
from tiered_kv.names import HostLayout
from tiered_kv.storage import SlabStorage, StorageNamespace, page_keys
from tiered_kv.transfer import DeviceHostTransfer, HostStorageTransfer, TransferJob

PAGE, LAYERS = 4, 3


def rig(gen, layout):
    pool = DSATokenToKVPool(96, PAGE, torch.bfloat16, 16, 8, LAYERS, index_head_dim=128)
    alloc = PagedTokenToKVPoolAllocator(96, PAGE, torch.bfloat16, "cpu", kvcache=pool)
    group = HostPoolGroup(pool.host_pool_decls(), alloc, layout=layout, size_tokens=16 * PAGE)
    return pool, alloc, group


def fill(pool, slots, gen):
    for layer in range(LAYERS):
        pool.set_kv_buffer(layer, slots, torch.randn(len(slots), 1, 24, generator=gen))
        pool.set_index_k_buffer(layer, slots, torch.randn(len(slots), 128, generator=gen))


def snap(pool, slots):
    return [b[slots].clone() for b in pool.buffers()]


def scramble(pool, slots):
    for b in pool.buffers():
        raw = b.view(torch.uint8)
        raw[slots] = torch.randint(0, 256, raw[slots].shape, dtype=torch.uint8)


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("layout", HostLayout.values())
def test_the_transfer_worker_moves_every_part(gen, layout):
    pool, alloc, group = rig(gen, layout)
    assert group.page_nbytes == sum(m.page_nbytes for m in group.members)
    worker = DeviceHostTransfer(alloc, group, io_backend="kernel")
    try:
        slots = alloc.alloc(3 * PAGE)
        fill(pool, slots, gen)
        want = snap(pool, slots)
        host = group.alloc(3 * PAGE)
        assert worker.submit(TransferJob.write(1, slots, host))
        worker.wait([1])
        assert [r.ok for r in worker.poll()] == [True]
        scramble(pool, slots)
        assert worker.submit(TransferJob.load(2, host, slots))
        for layer in range(LAYERS):  # the layer waits cover both parts of each layer
            pool.get_key_buffer(layer)
        worker.wait([2])
        assert [r.ok for r in worker.poll()] == [True]
        assert same(want, snap(pool, slots))
    finally:
        worker.close()
        group.destroy()


def _corrupt_part(store: SlabStorage, key: bytes, offset: int) -> None:
    files = store._files
    entry = files.read(lambda txn: files.books.lookup(txn, key))
    with open(files.slab.path, "r+b") as f:
        f.seek(entry.slot * files.slab.slot_bytes + offset)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("layout", HostLayout.values())
@pytest.mark.parametrize("part", ["latent", "indexer"])
def test_one_value_per_page_and_a_corrupt_part_is_a_miss(gen, tmp_path, layout, part):
    pool, alloc, group = rig(gen, layout)
    ns = StorageNamespace.for_host_pool(group, model="dsa-test@1")
    single = StorageNamespace.for_host_pool(
        host_pool_for(pool.host_pool_decls()[0], alloc, layout=layout, size_tokens=PAGE),
        model="dsa-test@1",
    )
    assert ns.fingerprint != single.fingerprint  # a group never shares a single pool's pages
    store = SlabStorage(tmp_path / "s", ns, group.page_nbytes, budget_bytes=64 << 20)
    worker = HostStorageTransfer(group, store, batch_pages=2)
    try:
        slots = alloc.alloc(4 * PAGE)
        fill(pool, slots, gen)
        want = snap(pool, slots)
        host = group.alloc(4 * PAGE)
        group.backup_from_device_all_layer(pool, host, slots)
        keys = page_keys(ns, torch.randint(0, 50_000, (4 * PAGE,), generator=gen), PAGE)
        assert worker.submit(TransferJob.backup(1, keys, host))
        worker.wait([1])
        (r,) = worker.poll()
        assert r.ok and r.pages_done == 4
        latent_bytes = group.members[0].page_nbytes
        _corrupt_part(store, keys[2], latent_bytes // 2 if part == "latent" else latent_bytes + 7)
        for m in group.members:  # no stale host copy can pass for a read
            bits = m.buffer.view(torch.uint8).view(-1)
            bits.copy_(torch.randint(0, 256, bits.shape, dtype=torch.uint8, generator=gen))
        back = group.alloc(4 * PAGE)
        assert worker.submit(TransferJob.prefetch(2, keys, back))
        worker.wait([2])
        (r,) = worker.poll()
        assert r.pages_done == 2, r  # the corrupt page and everything after it are misses
        scramble(pool, slots)
        group.load_to_device_all_layer(pool, back[: 2 * PAGE], slots[: 2 * PAGE])
        got = snap(pool, slots[: 2 * PAGE])
        assert same([w[: 2 * PAGE] for w in want], got)
    finally:
        worker.close()
        store.close()
        group.destroy()


def test_bad_groups_are_refused(gen):
    pool, alloc, group = rig(gen, "page_first")
    kv, indexer = pool.host_pool_decls()
    with pytest.raises(InvalidArgumentError, match="2 or more"):
        HostPoolGroup([kv], alloc, size_tokens=16)
    with pytest.raises(InvalidArgumentError, match="repeat"):
        HostPoolGroup([kv, kv], alloc, size_tokens=16)
    with pytest.raises(InvalidArgumentError, match="a page of this group has"):
        group.set_page_bytes(0, bytes(group.page_nbytes - 1))
    with pytest.raises(InvalidArgumentError, match="held by no member"):
        group.load_to_device_per_layer(pool, group.alloc(PAGE), alloc.alloc(PAGE), 7)
    group.destroy()
