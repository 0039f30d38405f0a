"""PagedTokenToKVPoolAllocator: allocation, release, staging, groups, bad input, capacity hooks."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import naive_decode, naive_extend
from tiered_kv import InvalidArgumentError, OwnershipError, StateError, TieredKVError
from tiered_kv.device import PagedTokenToKVPoolAllocator
from tiered_kv.device.allocator import num_new_pages

BACKENDS = ["torch", "triton"]


def make(size_pages=32, page_size=16, backend="torch", **kw):
    return PagedTokenToKVPoolAllocator(
        size_pages * page_size, page_size, torch.float16, "cpu", kernel_backend=backend, **kw
    )


def snapshot(alloc):
    return (
        alloc.free_pages.clone(),
        [t.clone() for t in alloc.staged_pages],
        alloc.num_staged_pages,
        alloc.available_size(),
    )


def assert_unchanged(alloc, snap):
    free, staged, n_staged, avail = snap
    assert torch.equal(alloc.free_pages, free)
    assert len(alloc.staged_pages) == len(staged)
    assert all(torch.equal(a, b) for a, b in zip(alloc.staged_pages, staged, strict=True))
    assert alloc.num_staged_pages == n_staged
    assert alloc.available_size() == avail


def grow(alloc, prefix_slots, extend_lens):
    """alloc_extend for requests whose current slots are ``prefix_slots`` (lists)."""
    pre = torch.tensor([len(s) for s in prefix_slots], dtype=torch.int64)
    seq = pre + torch.tensor(extend_lens, dtype=torch.int64)
    last = torch.tensor([s[-1] if s else -1 for s in prefix_slots], dtype=torch.int64)
    out = alloc.alloc_extend(pre, pre.clone(), seq, seq.clone(), last, int((seq - pre).sum()))
    return out, pre, seq, last


def split(out, extend_lens):
    return [t.tolist() for t in torch.split(out, list(extend_lens))]


# -- construction -------------------------------------------------------------------------------
def test_construction_rejects_bad_sizes():
    with pytest.raises(InvalidArgumentError, match="size=100 is not a multiple of page_size=16"):
        PagedTokenToKVPoolAllocator(100, 16, torch.float16, "cpu")
    with pytest.raises(InvalidArgumentError, match="page_size=0"):
        PagedTokenToKVPoolAllocator(64, 0, torch.float16, "cpu")
    with pytest.raises(InvalidArgumentError, match="kernel backend"):
        PagedTokenToKVPoolAllocator(64, 16, torch.float16, "cpu", kernel_backend="cuda-magic")


def test_clear_state_and_padding_page_excluded():
    alloc = make(size_pages=8)
    assert alloc.free_pages.tolist() == list(range(1, 9))
    assert alloc.available_size() == 8 * 16
    slots = alloc.alloc(8 * 16)
    assert int(slots.min()) >= 16  # page 0 (slots 0..15) is the padding sink
    assert alloc.alloc(16) is None
    alloc.clear()
    assert alloc.available_size() == 8 * 16


# -- alloc --------------------------------------------------------------------------------------
def test_alloc_whole_pages_and_rejects_partial_pages():
    alloc = make(size_pages=4)
    out = alloc.alloc(32)
    assert out.tolist() == list(range(16, 48))
    snap = snapshot(alloc)
    with pytest.raises(InvalidArgumentError, match="need_size=5 is not a multiple of page_size=16"):
        alloc.alloc(5)
    with pytest.raises(InvalidArgumentError, match="need_size=-16"):
        alloc.alloc(-16)
    assert_unchanged(alloc, snap)
    assert alloc.alloc(0).numel() == 0


# -- alloc_extend -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_alloc_extend_continues_last_page_then_opens_pages(gen, backend, page_size):
    alloc = make(size_pages=200, page_size=page_size, backend=backend)
    # Shuffle the free list so pages are not consecutive.
    alloc.free_pages = alloc.free_pages[torch.randperm(200, generator=gen)]
    first_lens = torch.randint(0, 3 * page_size, (7,), generator=gen).tolist()
    first_lens[0] = page_size  # exactly one page: the next extend starts on a boundary
    first, *_ = grow(alloc, [[] for _ in first_lens], first_lens)
    reqs = split(first, first_lens)
    free_before = alloc.free_pages.tolist()
    ext = torch.randint(0, 2 * page_size + 3, (7,), generator=gen).tolist()
    out, pre, seq, last = grow(alloc, reqs, ext)
    expect, used = naive_extend(pre.tolist(), seq.tolist(), last.tolist(), free_before, page_size)
    assert out.tolist() == expect
    assert alloc.free_pages.tolist() == free_before[used:]
    assert used == num_new_pages(pre, seq, page_size)
    for slots, more in zip(reqs, split(out, ext), strict=True):
        full = slots + more
        for j, slot in enumerate(full):
            assert slot % page_size == j % page_size  # token j sits at offset j % P of its page
            if j % page_size:
                assert slot == full[j - 1] + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_alloc_extend_short_pool_returns_none_and_changes_nothing(backend):
    alloc = make(size_pages=6, page_size=16, backend=backend)
    first, *_ = grow(alloc, [[]], [20])  # takes pages for 20 tokens: 2 pages
    req = first.tolist()
    snap = snapshot(alloc)
    # 12 more tokens fill page 2, then 4 pages of 16 plus 1 token need 5 new pages; 4 are free.
    out, *_ = grow(alloc, [req], [12 + 64 + 1])
    assert out is None
    assert_unchanged(alloc, snap)
    out, *_ = grow(alloc, [req], [12 + 64])  # exactly fits: 4 pages
    assert out is not None and len(out) == 76
    assert alloc.available_size() == 0
    assert len(set(out.tolist()) | set(req)) == 96


@pytest.mark.parametrize("backend", BACKENDS)
def test_alloc_extend_exact_fit_uses_slow_path_and_reads_no_further(backend):
    """The optimistic bound fails, the exact count fits: the kernel must read only the pages it
    may take (the free list is exactly that long)."""
    alloc = make(size_pages=10, page_size=16, backend=backend)
    lens = [16, 16, 16, 16, 16, 16, 16, 16, 16, 16]
    out, *_ = grow(alloc, [[] for _ in lens], lens)
    assert sorted(out.tolist()) == list(range(16, 176))
    assert alloc.available_size() == 0


def test_alloc_extend_zero_tokens_and_empty_batch():
    alloc = make()
    snap = snapshot(alloc)
    e = torch.empty((0,), dtype=torch.int64)
    assert alloc.alloc_extend(e, e, e, e, e, 0).numel() == 0
    pre = torch.tensor([0, 0])
    assert alloc.alloc_extend(pre, pre, pre, pre, torch.tensor([-1, -1]), 0).numel() == 0
    assert_unchanged(alloc, snap)


def _extend_args():
    pre = torch.tensor([3, 0], dtype=torch.int64)
    seq = torch.tensor([10, 5], dtype=torch.int64)
    last = torch.tensor([16 + 2, -1], dtype=torch.int64)
    return [pre, pre.clone(), seq, seq.clone(), last, 12]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.__setitem__(1, torch.tensor([11, 0])), "prefix_lens\\[0\\]=11 is longer"),
        (lambda a: a.__setitem__(1, torch.tensor([-1, 0])), "prefix_lens\\[0\\]=-1 is negative"),
        (lambda a: a.__setitem__(5, 13), "extend_num_tokens=13"),
        (lambda a: a.__setitem__(2, torch.tensor([10.0, 5.0])), "seq_lens has dtype torch.float32"),
        (lambda a: a.__setitem__(3, torch.tensor([10, 5, 1])), "seq_lens_cpu has 3 entries"),
        (lambda a: a.__setitem__(0, torch.tensor([3, 0], device="meta")), "prefix_lens is on meta"),
        (lambda a: a.__setitem__(4, torch.tensor([16 + 5, -1])), "last_loc\\[0\\]=21"),
        (lambda a: a.__setitem__(4, torch.tensor([2, -1])), "last_loc\\[0\\]=2"),
        (lambda a: a.__setitem__(0, torch.tensor([4, 0])), "prefix_lens and prefix_lens_cpu"),
        (lambda a: a.__setitem__(5, 12.0), "extend_num_tokens=12.0 must be an int"),
    ],
)
def test_alloc_extend_bad_input_raises_and_changes_nothing(mutate, message):
    alloc = make()
    args = _extend_args()
    mutate(args)
    snap = snapshot(alloc)
    with pytest.raises(InvalidArgumentError, match=message) as info:
        alloc.alloc_extend(*args)
    assert isinstance(info.value, TieredKVError) and isinstance(info.value, ValueError)
    assert_unchanged(alloc, snap)


# -- alloc_decode -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_alloc_decode(gen, backend, page_size):
    alloc = make(size_pages=80, page_size=page_size, backend=backend)
    lens = torch.randint(1, 2 * page_size + 2, (9,), generator=gen).tolist()
    lens[0] = page_size  # the next token opens a page
    first, *_ = grow(alloc, [[] for _ in lens], lens)
    reqs = split(first, lens)
    seq = torch.tensor([n + 1 for n in lens])
    last = torch.tensor([r[-1] for r in reqs])
    free_before = alloc.free_pages.tolist()
    out = alloc.alloc_decode(seq, seq.clone(), last)
    expect, used = naive_decode(seq.tolist(), last.tolist(), free_before, page_size)
    assert out.tolist() == expect
    assert alloc.free_pages.tolist() == free_before[used:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_alloc_decode_short_pool(backend):
    alloc = make(size_pages=3, page_size=16, backend=backend)
    first, *_ = grow(alloc, [[], []], [16, 16])
    reqs = split(first, [16, 16])
    seq = torch.tensor([17, 17])
    last = torch.tensor([reqs[0][-1], reqs[1][-1]])
    snap = snapshot(alloc)
    assert alloc.alloc_decode(seq, seq.clone(), last) is None  # needs 2 pages, 1 free
    assert_unchanged(alloc, snap)
    one = alloc.alloc_decode(seq[:1], seq[:1].clone(), last[:1])
    assert one.tolist() == [48]


def test_alloc_decode_bad_input():
    alloc = make()
    snap = snapshot(alloc)
    seq = torch.tensor([0, 3])
    with pytest.raises(InvalidArgumentError, match="seq_lens\\[0\\]=0"):
        alloc.alloc_decode(seq, seq.clone(), torch.tensor([-1, 17]))
    seq = torch.tensor([5, 3])
    with pytest.raises(InvalidArgumentError, match="last_loc\\[1\\]=20"):
        alloc.alloc_decode(seq, seq.clone(), torch.tensor([16 + 3, 20]))
    with pytest.raises(InvalidArgumentError, match="last_loc has 1 entries"):
        alloc.alloc_decode(seq, seq.clone(), torch.tensor([19]))
    assert_unchanged(alloc, snap)


# -- free ---------------------------------------------------------------------------------------
def test_free_returns_each_page_once():
    alloc = make(size_pages=4)
    slots = alloc.alloc(64)
    assert alloc.available_size() == 0
    # Every slot of pages 1 and 2, in shuffled order and with repeats: two pages come back.
    alloc.free(torch.cat([slots[:32].flip(0), slots[:5]]))
    assert sorted(alloc.free_pages.tolist()) == [1, 2]
    assert alloc.available_size() == 32


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.tensor([0]), "outside the valid range \\[16, 528\\)"),
        (torch.tensor([5, 17]), "\\[5\\] outside"),
        (torch.tensor([528]), "\\[528\\] outside"),
        (torch.tensor([-3]), "\\[-3\\] outside"),
        (torch.tensor([17.0]), "dtype torch.float32"),
        (torch.tensor([[17]]), "must be 1-D"),
    ],
)
def test_free_rejects_padding_and_out_of_range(bad, message):
    alloc = make()
    alloc.alloc(64)
    snap = snapshot(alloc)
    with pytest.raises(InvalidArgumentError, match=message):
        alloc.free(bad)
    assert_unchanged(alloc, snap)


def test_debug_mode_detects_double_free_and_changes_nothing():
    alloc = make(debug_mode=True)
    slots = alloc.alloc(32)
    alloc.free(slots[:16])
    snap = snapshot(alloc)
    with pytest.raises(OwnershipError, match="double free: pages \\[1\\]"):
        alloc.free(slots[3:4])
    assert_unchanged(alloc, snap)
    alloc.debug_check_no_duplicate_pages()


def test_need_sort_stages_frees_and_counts_them():
    alloc = make(size_pages=8, need_sort=True)
    slots = alloc.alloc(8 * 16)
    alloc.free(slots[5 * 16 : 6 * 16])  # page 6
    alloc.free(slots[0:16])  # page 1
    assert alloc.free_pages.numel() == 0
    assert alloc.num_staged_pages == 2
    assert alloc.available_size() == 32  # staged pages count
    out = alloc.alloc(16)  # free_pages is short: merge and sort, then take the lowest page
    assert out.tolist() == list(range(16, 32))
    assert alloc.staged_pages == [] and alloc.free_pages.tolist() == [6]


def test_need_sort_does_not_merge_when_free_pages_suffice():
    alloc = make(size_pages=8, need_sort=True)
    slots = alloc.alloc(4 * 16)
    alloc.free(slots[:16])
    out = alloc.alloc(16)
    assert out.tolist() == list(range(5 * 16, 6 * 16))  # from free_pages, page 1 stays staged
    assert alloc.num_staged_pages == 1


def test_merge_and_sort_free_sorts_everything():
    alloc = make(size_pages=8, need_sort=True)
    slots = alloc.alloc(8 * 16)
    for page in (7, 2, 5):
        alloc.free(slots[(page - 1) * 16 : page * 16])
    alloc.merge_and_sort_free()
    assert alloc.free_pages.tolist() == [2, 5, 7]
    assert alloc.num_staged_pages == 0


def test_free_segment_frees_each_page_once_without_unique():
    alloc = make(size_pages=8, debug_mode=True)
    slots = alloc.alloc(4 * 16)
    alloc.free_segment(slots[32:], start_pos=32)
    assert sorted(alloc.free_pages.tolist()) == [3, 4, 5, 6, 7, 8]
    with pytest.raises(InvalidArgumentError, match="segment start 5 is not page-aligned"):
        alloc.free_segment(slots[5:16], start_pos=5)
    with pytest.raises(InvalidArgumentError, match="contiguously"):
        # Pages 1 and 2 interleaved: [::16] names page 1 twice and misses page 2.
        alloc.free_segment(slots[:32].view(2, 16).t().reshape(-1), start_pos=0)
    alloc.free_segment(torch.empty((0,), dtype=torch.int64), start_pos=0)
    assert alloc.available_size() == 6 * 16


def test_free_group_defers_release_to_end():
    alloc = make(size_pages=8, debug_mode=True)
    slots = alloc.alloc(8 * 16)
    alloc.free_group_begin()
    alloc.free(slots[:20])  # pages 1, 2
    alloc.free_segment(slots[64:96], start_pos=64)  # pages 5, 6
    assert alloc.available_size() == 0
    with pytest.raises(StateError, match="free_group_begin called twice"):
        alloc.free_group_begin()
    alloc.free_group_end()
    assert sorted(alloc.free_pages.tolist()) == [1, 2, 5, 6]
    with pytest.raises(StateError, match="without free_group_begin"):
        alloc.free_group_end()


def test_free_group_end_detects_double_free_in_debug_mode():
    alloc = make(size_pages=8, debug_mode=True)
    slots = alloc.alloc(8 * 16)
    alloc.free_group_begin()
    alloc.free(slots[:16])
    alloc.free_segment(slots[:16], start_pos=0)  # page 1 again
    snap = snapshot(alloc)
    with pytest.raises(OwnershipError, match="double free: pages \\[1\\]"):
        alloc.free_group_end()
    assert_unchanged(alloc, snap)


# -- state --------------------------------------------------------------------------------------
def test_backup_and_restore_state(gen):
    alloc = make(size_pages=16, need_sort=True)
    slots = alloc.alloc(6 * 16)
    alloc.free(slots[:16])
    state = alloc.backup_state()
    snap = snapshot(alloc)
    alloc.alloc(5 * 16)
    alloc.free(slots[16:48])
    alloc.merge_and_sort_free()
    alloc.restore_state(state)
    assert_unchanged(alloc, snap)
    other = make(size_pages=16)
    with pytest.raises(InvalidArgumentError, match="backup_state"):
        other.restore_state(state)


def test_translate_kv_indices_is_identity():
    alloc = make()
    idx = torch.tensor([17, 18, 40])
    assert alloc.translate_kv_indices_for_transfer(idx) is idx


# -- capacity hooks -----------------------------------------------------------------------------
def test_max_new_tokens_for_memory_formula():
    alloc = make(size_pages=64, page_size=16)
    # ceil(100 / 16) * 16 = 112; 1024 - 112 - 16 - 1 = 895
    kw = dict(token_capacity=1024, sliding_window_size=None, chunk_size=None)
    assert alloc.max_new_tokens_for_memory(100, 4096, **kw) == 895
    assert alloc.max_new_tokens_for_memory(100, 10, **kw) == 10
    # 1007 tokens take 1008 slots: 1025 - 1008 - 16 - 1 = 0 new tokens, but the prompt fits.
    assert alloc.max_new_tokens_for_memory(1007, 10, **{**kw, "token_capacity": 1025}) == 0
    # The seed's max(0, ...): a prompt that fits gets 0 new tokens once the budget is used up
    # (1007 tokens in 1024 at page 16), never None (issue 12).
    assert alloc.max_new_tokens_for_memory(1007, 10, **kw) == 0
    # Boundaries: a budget of exactly 0 and 1; a prompt filling the pool; one page too many.
    assert alloc.max_new_tokens_for_memory(992, 10, **{**kw, "token_capacity": 1010}) == 1
    assert alloc.max_new_tokens_for_memory(992, 10, **{**kw, "token_capacity": 1009}) == 0
    assert alloc.max_new_tokens_for_memory(1024, 10, **kw) == 0
    assert alloc.max_new_tokens_for_memory(1025, 10, **kw) is None
    assert alloc.max_new_tokens_for_memory(0, 10, **{**kw, "token_capacity": 0}) == 0
    with pytest.raises(InvalidArgumentError, match="input_tokens=-1"):
        alloc.max_new_tokens_for_memory(-1, 10, **kw)


def test_prealloc_fits_and_ceiling():
    alloc = make(size_pages=4, page_size=16)
    alloc.alloc(48)
    assert alloc.prealloc_fits(16) and not alloc.prealloc_fits(17)
    assert alloc.prealloc_ceiling_fits(40, evictable_tokens=32)
    assert not alloc.prealloc_ceiling_fits(40, evictable_tokens=31)  # 31 tokens free 1 page
    assert alloc.request_slot_reserve() == 2


def test_evict_to_free_tokens_calls_evict_fn_with_the_shortfall():
    alloc = make(size_pages=4, page_size=16)
    slots = alloc.alloc(64)
    asked = []

    def evict(n):
        asked.append(n)
        alloc.free(slots[: n + (-n % 16)])

    assert alloc.evict_to_free_tokens(20, evict)
    assert asked == [32]
    assert alloc.evict_to_free_tokens(20, lambda n: pytest.fail("must not evict"))
    assert not alloc.evict_to_free_tokens(1000, lambda n: None)


@pytest.mark.parametrize("n_pages", [3, 10, 40, 400])
@pytest.mark.parametrize("page_size", [16, 48])
def test_free_finds_each_page_once_on_every_path(gen, n_pages, page_size):
    """Small frees (a Python set on CPU), large ones (torch.unique) and very large ones (runs of
    a page dropped first): each page comes back once, and the pages come back ascending."""
    alloc = make(size_pages=512, page_size=page_size)
    slots = alloc.alloc(512 * page_size)
    pages = torch.randperm(512, generator=gen)[:n_pages] + 1
    owned = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    # Runs of a page in order, then the same slots shuffled again (every slot twice).
    listed = torch.cat((owned, owned[torch.randperm(owned.numel(), generator=gen)]))
    assert slots.numel() == 512 * page_size
    alloc.free(listed)
    assert alloc.free_pages.tolist() == sorted(pages.tolist())
