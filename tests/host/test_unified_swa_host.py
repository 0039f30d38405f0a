"""The unified sliding-window pool's two sub-pools through host memory as one group. Callers
hold virtual ids: KV is written through the allocator's plan, backed up by virtual id (each
member translating to its own sub-pool's physical slots), and loaded back into other virtual
ids at other physical slots. Bytes are compared exactly for every host layout. A negative
control whose members skip the translation (virtual ids used as slots) moves the wrong bytes,
and a token whose window KV was freed is refused rather than copied from padding."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device.allocator.unified_swa import UnifiedSWATokenToKVPoolAllocator
from tiered_kv.device.unified_swa_pool import UnifiedSWAKVPool
from tiered_kv.errors import StateError
from tiered_kv.host.pool_group import HostPoolGroup
from tiered_kv.names import HostLayout
from tiered_kv.transfer import DeviceHostTransfer, TransferJob

PAGE, PAGES, FULL, SWA = 4, 24, [0, 3], [1, 2, 4]


def _t(*v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def rig(layout):
    pool = UnifiedSWAKVPool(PAGES, PAGE, torch.float16, 2, 8, FULL, SWA, swa_head_num=1)
    alloc = UnifiedSWATokenToKVPoolAllocator(
        PAGES, PAGE, torch.float16, "cpu", pool, debug_mode=True, kernel_backend="torch"
    )
    group = HostPoolGroup(pool.host_pool_decls(), alloc, layout=layout, size_tokens=64)
    alloc.free(alloc.alloc(3 * PAGE))  # virtual pages 1..3 to the back: virtual != physical
    return pool, alloc, group


def extend(alloc, n):
    return alloc.alloc_extend(_t(0), _t(0), _t(n), _t(n), _t(-1), n)


def random_half(n, heads, gen):
    """Random bits as float16 (NaNs included), with no all-zero token."""
    raw = torch.randint(1, 256, (n, heads, 8, 2), generator=gen, dtype=torch.uint8)
    return raw.view(torch.float16).reshape(n, heads, 8)


def fill(pool, alloc, virtual, gen):
    loc = alloc.plan(virtual)
    want = {}
    for layer in range(5):
        heads = 1 if layer in SWA else 2
        k, v = random_half(len(virtual), heads, gen), random_half(len(virtual), heads, gen)
        pool.set_kv_buffer(layer, loc, k, v)
        want[layer] = (k, v)
    return want


def matches(pool, alloc, virtual, want) -> dict[int, bool]:
    """Per layer: whether the KV at ``virtual``'s physical slots is ``want``, byte for byte."""
    loc = alloc.plan(virtual)
    out = {}
    for layer, (k, v) in want.items():
        slots = loc.swa_loc if layer in SWA else loc.loc
        got_k = pool.get_key_buffer(layer)[slots].view(torch.uint8)
        got_v = pool.get_value_buffer(layer)[slots].view(torch.uint8)
        out[layer] = torch.equal(got_k, k.view(torch.uint8)) and torch.equal(
            got_v, v.view(torch.uint8)
        )
    return out


def round_trip(pool, alloc, group, gen):
    """Write, back up, free, scribble, reallocate elsewhere, load; the new virtual ids."""
    worker = DeviceHostTransfer(alloc, group, io_backend="kernel")
    try:
        virtual = extend(alloc, 12)
        want = fill(pool, alloc, virtual, gen)
        host = group.alloc(len(virtual))
        assert worker.submit(TransferJob.write(1, virtual, host))
        worker.wait([1])
        assert [r.ok for r in worker.poll()] == [True]
        old_loc = alloc.plan(virtual)
        alloc.free(virtual)
        for b in pool.buffers():
            b.view(torch.uint8).fill_(0x6D)
        spacer = alloc.alloc(3 * PAGE)  # the reload lands at other physical pages too
        back = extend(alloc, 12)
        new_loc = alloc.plan(back)
        assert not set(back.tolist()) & set(virtual.tolist())
        assert not set(new_loc.loc.tolist()) & set(old_loc.loc.tolist())
        assert not set(new_loc.swa_loc.tolist()) & set(old_loc.swa_loc.tolist())
        assert worker.submit(TransferJob.load(2, host, back))
        for layer in range(5):
            pool.get_key_buffer(layer)  # waits for that layer, in whichever sub-pool
        worker.wait([2])
        assert [r.ok for r in worker.poll()] == [True]
        return back, want, spacer
    finally:
        worker.close()


@pytest.mark.parametrize("layout", HostLayout.values())
def test_both_sub_pools_round_trip_by_virtual_id(gen, layout):
    pool, alloc, group = rig(layout)
    try:
        back, want, _ = round_trip(pool, alloc, group, gen)
        assert matches(pool, alloc, back, want) == dict.fromkeys(range(5), True)
    finally:
        group.destroy()


class _Untranslated:
    """A sub-pool view that skips the translation: virtual ids used as physical slots."""

    def __init__(self, alloc, pool):
        self.page_size, self.device, self.debug_mode = alloc.page_size, alloc.device, True
        self._pool = pool

    def get_kvcache(self):
        return self._pool

    def translate_kv_indices_for_transfer(self, indices):
        return indices


class _NoTranslation:
    """The unified allocator with each host member's translation bypassed."""

    def __init__(self, alloc):
        self._alloc = alloc

    def __getattr__(self, name):
        return getattr(self._alloc, name)

    def host_part_route(self, decl):
        return _Untranslated(self._alloc, decl.device_pool), lambda ids: ids


@pytest.mark.parametrize("layout", HostLayout.values())
def test_negative_control_without_translation_moves_the_wrong_bytes(gen, layout):
    pool = UnifiedSWAKVPool(PAGES, PAGE, torch.float16, 2, 8, FULL, SWA, swa_head_num=1)
    alloc = UnifiedSWATokenToKVPoolAllocator(
        PAGES, PAGE, torch.float16, "cpu", pool, debug_mode=True, kernel_backend="torch"
    )
    wrong = _NoTranslation(alloc)
    group = HostPoolGroup(pool.host_pool_decls(), wrong, layout=layout, size_tokens=64)
    alloc.free(alloc.alloc(3 * PAGE))
    try:
        back, want, _ = round_trip(pool, wrong, group, gen)
        assert matches(pool, alloc, back, want) == dict.fromkeys(range(5), False)
    finally:
        group.destroy()


def test_a_token_without_window_kv_is_refused_and_nothing_is_copied(gen):
    pool, alloc, group = rig("layer_first")
    try:
        virtual = extend(alloc, 8)
        fill(pool, alloc, virtual, gen)
        alloc.free_swa(virtual[:4])  # the first page left the window
        host = group.alloc(8)
        before = [m.buffer.view(torch.uint8).clone() for m in group.members]
        with pytest.raises(StateError, match="no window page"):
            group.backup_from_device_all_layer(pool, host, virtual)
        raw = [m.buffer.view(torch.uint8) for m in group.members]
        assert all(torch.equal(a, b) for a, b in zip(before, raw, strict=True))
        group.backup_from_device_all_layer(pool, host[4:], virtual[4:])  # the rest still goes
    finally:
        group.destroy()
