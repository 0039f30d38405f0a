"""Issue 29: the unified sliding-window pool with one shared buffer (``share_bytes``) through
host memory as one group, in every host layout and on every copy path (the native copier,
torch, Triton interpreted, ``direct``). KV written through the plan is backed up by virtual id,
the device buffer is scribbled over, the ids are freed and the pages reloaded at other
physical pages (some of which the other side held before): every layer reads back byte for
byte. With ``skip_freed_window`` (the cache's setting) a token whose window KV was freed moves
its full KV only."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device.allocator.unified_swa import UnifiedSWATokenToKVPoolAllocator
from tiered_kv.device.unified_swa_pool import UnifiedSWAKVPool
from tiered_kv.host.pool_group import HostPoolGroup
from tiered_kv.names import HostLayout
from tiered_kv.transfer import DeviceHostTransfer, TransferJob

PAGE, PAGES, HEADS, DIM = 4, 16, 2, 8
FULL, SWA = [0, 3], [1, 2, 4]
IO = (("kernel", "native"), ("kernel", "torch"), ("kernel", "triton"), ("direct", "torch"))


def _t(*v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def rig(layout: str, kb: str, skip: bool = False):
    pool = UnifiedSWAKVPool(PAGES, PAGE, torch.float16, HEADS, DIM, FULL, SWA, share_bytes=True)
    alloc = UnifiedSWATokenToKVPoolAllocator(
        PAGES, PAGE, torch.float16, "cpu", pool, debug_mode=True, skip_freed_window=skip
    )
    group = HostPoolGroup(
        pool.host_pool_decls(), alloc, layout=layout, size_tokens=64, kernel_backend=kb
    )
    return pool, alloc, group


def extend(alloc, n):
    return alloc.alloc_extend(_t(0), _t(0), _t(n), _t(n), _t(-1), n)


def fill(pool, alloc, virtual, gen) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    loc, want = alloc.plan(virtual), {}
    for layer in range(5):
        k, v = (
            torch.randint(
                1, 1 << 15, (len(virtual), HEADS, DIM), generator=gen, dtype=torch.int16
            ).view(torch.float16)
            for _ in "kv"
        )
        pool.set_kv_buffer(layer, loc, k, v)
        want[layer] = (k, v)
    return want


def read(pool, alloc, virtual, layer):
    window = layer in SWA
    slots = (alloc.translate_loc_from_full_to_swa if window else alloc.translate_kv_loc)(virtual)
    return pool.get_key_buffer(layer)[slots], pool.get_value_buffer(layer)[slots]


def same(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def copy(worker, job) -> None:
    assert worker.submit(job)
    worker.wait([job.job_id])
    assert [r.ok for r in worker.poll()] == [True]


@pytest.mark.parametrize("layout", HostLayout.values())
@pytest.mark.parametrize(("io", "kb"), IO, ids=[f"{i}-{k}" for i, k in IO])
def test_both_sides_round_trip_over_one_buffer(gen, layout, io, kb):
    if io == "direct" and layout == HostLayout.PAGE_FIRST:
        pytest.skip("direct takes layer_first or page_first_direct")
    pool, alloc, group = rig(layout, kb)
    worker = DeviceHostTransfer(alloc, group, io_backend=io)
    try:
        virtual = extend(alloc, 8 * PAGE)  # full pages 1..8, window pages 16..9
        want = {layer: (k[6 * PAGE :], v[6 * PAGE :]) for layer, (k, v) in fill(
            pool, alloc, virtual, gen
        ).items()}  # fmt: skip
        moved = virtual[6 * PAGE :]  # full pages 7, 8; window pages 10, 9
        window_before = set(alloc.plan(virtual).swa_loc.div(PAGE, rounding_mode="floor").tolist())
        host = group.alloc(2 * PAGE)
        copy(worker, TransferJob.write(1, moved, host))
        alloc.free(virtual)
        pool.shared.buffer.view(torch.uint8).fill_(0x6D)
        # A request whose pages all left the window, then the reload: its full pages (8, 9)
        # reach page 9, which held window KV before; its window pages are 16, 15.
        alloc.free_swa(extend(alloc, 7 * PAGE))
        back = extend(alloc, 2 * PAGE)
        full_now = set(alloc.plan(back).loc.div(PAGE, rounding_mode="floor").tolist())
        assert full_now & window_before, (full_now, window_before)
        copy(worker, TransferJob.load(2, host, back))
        for layer, (k, v) in want.items():
            got_k, got_v = read(pool, alloc, back, layer)
            assert same(got_k, k) and same(got_v, v), layer
    finally:
        worker.close()
        group.destroy()


@pytest.mark.parametrize("layout", HostLayout.values())
def test_a_token_without_window_kv_moves_its_full_kv_only(gen, layout):
    pool, alloc, group = rig(layout, "native", skip=True)
    worker = DeviceHostTransfer(alloc, group, io_backend="kernel")
    try:
        virtual = extend(alloc, 2 * PAGE)
        want = fill(pool, alloc, virtual, gen)
        alloc.free_swa(virtual[:PAGE])  # page 0 left the window: a tombstone
        host = group.alloc(2 * PAGE)
        host_bytes = [m.buffer.clone() for m in group.members]
        copy(worker, TransferJob.write(1, virtual, host))
        swa_member = group.members[1]
        assert not torch.equal(group.members[0].buffer, host_bytes[0])
        # Only the second page's window KV was written to the window member.
        changed = (swa_member.buffer.view(torch.uint8) != host_bytes[1].view(torch.uint8)).sum()
        assert 0 < int(changed) <= PAGE * len(SWA) * 2 * HEADS * DIM * 2
        alloc.free(virtual)
        pool.shared.buffer.view(torch.uint8).fill_(0x6D)
        back = extend(alloc, 2 * PAGE)
        alloc.free_swa(back[:PAGE])
        copy(worker, TransferJob.load(2, host, back))
        for layer, (k, v) in want.items():
            if layer in SWA:
                got_k, got_v = read(pool, alloc, back[PAGE:], layer)
                assert same(got_k, k[PAGE:]) and same(got_v, v[PAGE:]), layer
            else:
                got_k, got_v = read(pool, alloc, back, layer)
                assert same(got_k, k) and same(got_v, v), layer
    finally:
        worker.close()
        group.destroy()
