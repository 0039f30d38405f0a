"""The unified sliding-window allocator: full pages from the low end of one page range, window
pages from the high end, virtual ids from a FIFO queue. The ends never cross, the split between
full and window KV follows the workload, a short allocation changes nothing, unbound ids are
refused by the host translation and the write plan, and bad input raises typed errors that
leave every table as it was."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device.allocator.swa import SWATokenToKVPoolAllocator
from tiered_kv.device.allocator.unified_swa import UnifiedSWATokenToKVPoolAllocator
from tiered_kv.device.allocator.unified_swa_pages import joint_pages
from tiered_kv.device.unified_swa_pool import UnifiedSWAKVPool
from tiered_kv.device.write_loc import KVWriteLoc
from tiered_kv.errors import (
    InvalidArgumentError,
    OwnershipError,
    PhysicalWriteLocError,
    StateError,
)

P = 4


def _t(*v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def rig(num_pages=10, page_size=P):
    pool = UnifiedSWAKVPool(num_pages, page_size, torch.float16, 2, 8, [0, 2], [1, 3])
    alloc = UnifiedSWATokenToKVPoolAllocator(
        num_pages, page_size, torch.float16, "cpu", pool, debug_mode=True, kernel_backend="torch"
    )
    return pool, alloc


def extend(alloc, n, prefix=(), page_size=P):
    pre = len(prefix)
    last = prefix[-1] if pre else -1
    return alloc.alloc_extend(_t(pre), _t(pre), _t(pre + n), _t(pre + n), _t(last), n)


def state(alloc):
    return (alloc.pages.snapshot(), alloc.get_all_free_pages().clone())


def assert_same(alloc, before):
    now = state(alloc)
    a, b = now[0], before[0]
    assert all(torch.equal(x, y) for x, y in zip(a[:4], b[:4], strict=True)), "a table changed"
    assert a[4:] == b[4:], "counts or ends changed"
    assert torch.equal(now[1], before[1]), "the virtual queue changed"


def phys(alloc, side, v):
    return alloc.pages.v2p[side][v // alloc.page_size]


def test_the_ends_grow_toward_each_other_and_never_cross():
    _, alloc = rig()
    v = extend(alloc, 5 * P)
    assert phys(alloc, "full", v[::P]).tolist() == [1, 2, 3, 4, 5]
    assert phys(alloc, "swa", v[::P]).tolist() == [10, 9, 8, 7, 6]
    assert alloc.available_size() == 0 and extend(alloc, 1) is None
    assert alloc.pages.full_top < alloc.pages.swa_bottom


def test_the_split_between_full_and_window_follows_the_workload():
    """Window pages given back widen the gap the full side grows into: here the full side
    ends up holding 6 of 10 pages, more than any fixed half-and-half split allows."""
    _, alloc = rig()
    a = extend(alloc, 2 * P)
    b = extend(alloc, 3 * P)
    alloc.free(a)
    assert alloc.available_size() == 2 * P  # each side's holes, the gap is closed
    alloc.free_swa(b)  # b's tokens all left the window; their full KV stays
    assert alloc.full_available_size() == 7 * P  # full holes 1, 2 and the gap 6..10
    assert alloc.available_size() == 3 * P
    c = extend(alloc, 3 * P)
    assert phys(alloc, "full", c[::P]).tolist() == [1, 2, 6]
    assert phys(alloc, "swa", c[::P]).tolist() == [10, 9, 8]
    assert alloc.pages.live == {"full": 6, "swa": 3}
    assert extend(alloc, 1) is None


@pytest.mark.parametrize("holes_full", range(4))
@pytest.mark.parametrize("holes_swa", range(4))
@pytest.mark.parametrize("gap", range(6))
def test_joint_pages_is_the_largest_fit(holes_full, holes_swa, gap):
    def fits(n):
        return max(0, n - holes_full) + max(0, n - holes_swa) <= gap

    best = max(n for n in range(20) if fits(n))
    assert joint_pages(holes_full, holes_swa, gap) == best


def test_a_short_allocation_returns_none_and_changes_nothing():
    _, alloc = rig()
    v = extend(alloc, 3 * P + 1)
    before = state(alloc)
    assert extend(alloc, 3 * P, prefix=v.tolist()) is None  # needs 3 more pages, 2 are free
    assert alloc.alloc(3 * P) is None
    assert alloc.alloc_decode(_t(14), _t(14), _t(int(v[-1]))) is not None  # continues a page
    before = state(alloc)
    alloc.free_swa(v[:P])
    alloc.free_swa(v[:P])  # already gone: skipped
    assert alloc.swa_available_size() == 3 * P  # the hole and the gap
    before = state(alloc)
    assert alloc.alloc(3 * P) is None  # the full side has no hole: it cannot use the window's
    assert_same(alloc, before)


def test_virtual_ids_come_from_a_fifo_queue_and_differ_from_physical_slots():
    _, alloc = rig()
    a = alloc.alloc(2 * P)
    alloc.free(a)
    b = alloc.alloc(2 * P)
    assert (b // P).tolist()[::P] == [3, 4]  # the freed ids wait behind the others
    assert alloc.translate_kv_loc(b).tolist() == list(range(P, 3 * P))
    assert alloc.get_all_free_pages().tolist() == [5, 6, 7, 8, 9, 10, 1, 2]


def test_the_sentinel_and_unbound_ids():
    _, alloc = rig()
    assert alloc.translate_kv_loc(_t(-1)).tolist() == [-1]
    assert alloc.translate_loc_from_full_to_swa(_t(-1)).tolist() == [-1]
    v = extend(alloc, 2 * P)
    alloc.free_swa(v[:P])
    # Read path: a token without window KV reads the padding page.
    assert alloc.translate_loc_from_full_to_swa(v[:P]).tolist() == list(range(P))
    # Host copies and writes refuse it.
    with pytest.raises(StateError, match="no window page"):
        alloc.plan(v)
    full_decl, swa_decl = alloc.get_kvcache().host_pool_decls()
    _, to_swa = alloc.host_part_route(swa_decl)
    with pytest.raises(StateError, match="no window page"):
        to_swa(v)
    assert to_swa(v[P:]).tolist() == list(range(9 * P, 10 * P))
    assert alloc.host_part_route(full_decl)[1](v).tolist() == list(range(P, 3 * P))
    alloc.free(v)
    with pytest.raises(StateError, match="no full page"):
        alloc.translate_kv_indices_for_transfer(v)
    with pytest.raises(InvalidArgumentError, match="outside the valid range"):
        alloc.translate_kv_indices_for_transfer(_t(0, 1))  # the padding page
    with pytest.raises(InvalidArgumentError, match="outside the valid range"):
        alloc.translate_kv_indices_for_transfer(_t(11 * P))


def test_plan_binds_virtual_ids_to_physical_write_slots():
    pool, alloc = rig()
    alloc.free(alloc.alloc(P))  # virtual page 1 goes to the back of the queue
    v = extend(alloc, P + 2)
    padded = torch.cat([v, _t(0, 0)])
    loc = alloc.plan(padded)
    assert loc.physical
    assert loc.loc.tolist() == [4, 5, 6, 7, 8, 9, 0, 0]
    assert loc.swa_loc.tolist() == [40, 41, 42, 43, 36, 37, 0, 0]
    k = torch.randn(8, 2, 8).half()
    pool.set_kv_buffer(1, loc, k, k)
    assert torch.equal(pool.get_key_buffer(1)[loc.swa_loc[:6]], k[:6])
    with pytest.raises(InvalidArgumentError, match="outside"):
        alloc.plan(_t(11 * P))
    with pytest.raises(StateError, match="no full page"):
        alloc.plan(_t(7 * P))


def test_the_pool_refuses_unmarked_locs_and_the_static_allocator():
    pool, alloc = rig()
    v = extend(alloc, 3)
    k = torch.randn(3, 2, 8).half()
    before = pool.get_key_buffer(0).clone()
    for bad in (v, KVWriteLoc(v, swa_loc=v)):
        with pytest.raises(PhysicalWriteLocError, match="plan"):
            pool.set_kv_buffer(0, bad, k, k)
    assert torch.equal(pool.get_key_buffer(0), before)
    with pytest.raises(InvalidArgumentError, match="no full -> window table"):
        SWATokenToKVPoolAllocator(40, 40, P, torch.float16, "cpu", pool, kernel_backend="torch")
    with pytest.raises(InvalidArgumentError, match="num_pages"):
        UnifiedSWATokenToKVPoolAllocator(9, P, torch.float16, "cpu", pool)
    assert pool.translate_loc_from_full_to_swa(v).tolist() == [40, 41, 42]


def test_free_swa_gives_back_window_pages_only():
    _, alloc = rig()
    v = extend(alloc, 2 * P)
    swa_before = alloc.swa_available_size()
    alloc.free_swa(v[1:2])  # a whole page, whichever of its ids is named
    assert alloc.swa_available_size() == swa_before + P
    assert alloc.translate_kv_loc(v).tolist() == list(range(P, 3 * P))  # full stays
    assert alloc.pages.live == {"full": 2, "swa": 1}
    alloc.free(v)
    assert alloc.pages.live == {"full": 0, "swa": 0}
    assert alloc.available_size() == 5 * P and alloc.full_available_size() == 10 * P


def test_free_groups_defer_and_refuse_a_page_freed_twice():
    _, alloc = rig()
    a, b = extend(alloc, P), extend(alloc, 2 * P)
    alloc.free_group_begin()
    alloc.free(a)
    alloc.free_swa(b[:P])
    alloc.free_segment(b, start_pos=0)
    assert alloc.pages.live == {"full": 3, "swa": 3}
    alloc.free_group_end()
    assert alloc.pages.live == {"full": 0, "swa": 0}
    c = extend(alloc, P)
    alloc.free_group_begin()
    alloc.free(c)
    alloc.free(c)
    before = state(alloc)
    with pytest.raises(OwnershipError, match="twice"):
        alloc.free_group_end()
    assert_same(alloc, before)
    with pytest.raises(StateError):
        alloc.free_group_begin()


@pytest.mark.parametrize(
    ("call", "err", "match"),
    [
        (lambda a, v: a.free(_t(11 * P)), InvalidArgumentError, "outside the valid range"),
        (lambda a, v: a.free(_t(1)), InvalidArgumentError, "outside the valid range"),
        (lambda a, v: a.free(v.float()), InvalidArgumentError, "dtype"),
        (lambda a, v: a.free(_t(5 * P)), OwnershipError, "not allocated"),
        (lambda a, v: a.free_swa(_t(5 * P)), OwnershipError, "not allocated"),
        (lambda a, v: a.free_segment(v, start_pos=1), InvalidArgumentError, "page boundary"),
        (lambda a, v: a.free_segment(v[1:], start_pos=0), InvalidArgumentError, "contiguous"),
        (lambda a, v: a.alloc(3), InvalidArgumentError, "multiple of page_size"),
        (lambda a, v: a.alloc(-P), InvalidArgumentError, "need_size"),
        (lambda a, v: a.alloc_decode(_t(5), _t(5), _t(0, 1)), InvalidArgumentError, "entries"),
        (
            lambda a, v: a.alloc_extend(_t(0), _t(0), _t(3), _t(3), _t(-1), 4),
            InvalidArgumentError,
            "extend_num_tokens",
        ),
        (lambda a, v: a.free_group_end(), StateError, "without free_group_begin"),
        (lambda a, v: a.plan(v.float()), InvalidArgumentError, "dtype"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, err, match):
    _, alloc = rig()
    v = extend(alloc, 2 * P)
    before = state(alloc)
    with pytest.raises(err, match=match):
        call(alloc, v)
    assert_same(alloc, before)


def test_a_freed_page_is_refused_the_second_time():
    _, alloc = rig()
    v = extend(alloc, P)
    alloc.free(v)
    before = state(alloc)
    with pytest.raises(OwnershipError, match="double free"):
        alloc.free(v)
    assert_same(alloc, before)


def test_a_window_page_freed_mid_fill_is_caught_in_debug_mode():
    _, alloc = rig()
    v = extend(alloc, P + 2)
    alloc.free_swa(v[P:])  # the page still being filled
    before = state(alloc)
    with pytest.raises(OwnershipError, match="still being filled"):
        alloc.alloc_decode(_t(P + 3), _t(P + 3), _t(int(v[-1])))
    assert_same(alloc, before)


def test_page_size_one_and_clear():
    _, alloc = rig(num_pages=6, page_size=1)
    v = alloc.alloc_extend(_t(0), _t(0), _t(3), _t(3), _t(-1), 3)
    assert alloc.translate_kv_loc(v).tolist() == [1, 2, 3]
    assert alloc.translate_loc_from_full_to_swa(v).tolist() == [6, 5, 4]
    assert alloc.alloc_decode(_t(4), _t(4), v[-1:]) is None
    alloc.clear()
    assert alloc.available_size() == 3 and alloc.full_available_size() == 6
    assert alloc.get_all_free_pages().tolist() == list(range(1, 7))


def test_host_part_route_refuses_a_foreign_declaration():
    pool, alloc = rig()
    other, _ = rig()
    with pytest.raises(InvalidArgumentError, match="not one of this pool's"):
        alloc.host_part_route(other.host_pool_decls()[0])
    full_view, _ = alloc.host_part_route(pool.host_pool_decls()[0])
    assert full_view.get_kvcache() is pool.full_kv_pool
