"""Debug mode: one switch (TIERED_KV_DEBUG, or debug_mode=), on in this suite, off in production.

Off, the allocators still hand out the right slots and still check shapes, dtypes, devices,
counts and the range of freed ids (one aminmax); the other checks that read index values run
only when it is on. Each misuse in MISUSES is refused with debug mode on and let through with it
off, so turning those value checks always on (a sync per call on CUDA) or always off (no
double-free detection) fails here; each in RANGE_MISUSES is refused in both modes.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import naive_decode, naive_extend
from tiered_kv import InvalidArgumentError, OwnershipError, platform
from tiered_kv.device import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from tiered_kv.device.allocator import num_new_pages


def paged(page_size=16, pages=32, debug=False, **kw):
    return PagedTokenToKVPoolAllocator(
        pages * page_size, page_size, None, "cpu", debug_mode=debug, kernel_backend="torch", **kw
    )


def token(size=64, debug=False, **kw):
    return TokenToKVPoolAllocator(size, None, "cpu", debug_mode=debug, **kw)


# -- the switch ---------------------------------------------------------------------------------
def test_suite_runs_with_debug_on():
    assert platform.debug_mode()
    assert PagedTokenToKVPoolAllocator(64, 16, None, "cpu").debug_mode
    assert TokenToKVPoolAllocator(8, None, "cpu").debug_mode


@pytest.mark.parametrize(
    "value, on",
    [("1", True), ("true", True), ("ON", True), ("0", False), ("", False), ("no", False)],
)
def test_env_switch_sets_the_default(monkeypatch, value, on):
    monkeypatch.setenv(platform.ENV_DEBUG, value)
    assert platform.debug_mode() is on
    assert PagedTokenToKVPoolAllocator(64, 16, None, "cpu").debug_mode is on
    assert TokenToKVPoolAllocator(8, None, "cpu").debug_mode is on
    # An explicit argument wins over the environment.
    assert PagedTokenToKVPoolAllocator(64, 16, None, "cpu", debug_mode=not on).debug_mode is not on


def test_production_default_is_off(monkeypatch):
    monkeypatch.delenv(platform.ENV_DEBUG, raising=False)
    assert not platform.debug_mode()
    assert not TokenToKVPoolAllocator(8, None, "cpu").debug_mode


def test_bad_switch_value_is_refused(monkeypatch):
    monkeypatch.setenv(platform.ENV_DEBUG, "maybe")
    with pytest.raises(InvalidArgumentError, match="TIERED_KV_DEBUG='maybe'"):
        PagedTokenToKVPoolAllocator(64, 16, None, "cpu")


# -- debug off: the right slots -----------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_debug_off_extend_decode_free_match_the_oracles(gen, page_size):
    alloc = paged(page_size, pages=400)
    for bs in (1, 5, 40):  # one request; a few (Python counts); many (tensor counts)
        alloc.clear()
        alloc.free_pages = alloc.free_pages[torch.randperm(400, generator=gen)]
        first = torch.randint(0, 3 * page_size, (bs,), generator=gen)
        zeros = torch.zeros_like(first)
        pre_slots = alloc.alloc_extend(zeros, zeros, first, first, zeros - 1, int(first.sum()))
        reqs = [t.tolist() for t in torch.split(pre_slots, first.tolist())]
        pre = first
        seq = pre + torch.randint(0, 2 * page_size + 3, (bs,), generator=gen)
        last = torch.tensor([r[-1] if r else -1 for r in reqs])
        free_before = alloc.free_pages.tolist()
        out = alloc.alloc_extend(pre, pre, seq, seq, last, int((seq - pre).sum()))
        expect, used = naive_extend(
            pre.tolist(), seq.tolist(), last.tolist(), free_before, page_size
        )
        assert out.tolist() == expect and used == num_new_pages(pre, seq, page_size)
        assert alloc.free_pages.tolist() == free_before[used:]
        parts = torch.split(out, (seq - pre).tolist())
        reqs = [r + m.tolist() for r, m in zip(reqs, parts, strict=True)]
        dseq = torch.tensor([len(r) + 1 for r in reqs])
        dlast = torch.tensor([r[-1] if r else -1 for r in reqs])
        free_before = alloc.free_pages.tolist()
        dec = alloc.alloc_decode(dseq, dseq, dlast)
        expect, used = naive_decode(dseq.tolist(), dlast.tolist(), free_before, page_size)
        assert dec.tolist() == expect and alloc.free_pages.tolist() == free_before[used:]
        everything = torch.tensor([s for r in reqs for s in r] + dec.tolist())
        alloc.free(everything)
        assert sorted(alloc.free_pages.tolist()) == list(range(1, 401))


@pytest.mark.parametrize(
    "lens, opens",
    [([15, 5], [False, False]), ([16, 32], [True, True]), ([16, 5], [True, False])],
)
def test_debug_off_decode_with_no_all_or_some_new_pages(lens, opens):
    alloc = paged(16, pages=64)
    n = torch.tensor(lens)
    zeros = torch.zeros_like(n)
    slots = alloc.alloc_extend(zeros, zeros, n, n, zeros - 1, int(n.sum()))
    last = torch.stack([t[-1] for t in torch.split(slots, lens)])
    head = alloc.free_pages[:3].tolist()
    seq = n + 1
    got = alloc.alloc_decode(seq, seq, last)
    fresh = iter(head)
    expect = [next(fresh) * 16 if o else int(s) + 1 for o, s in zip(opens, last, strict=True)]
    assert got.tolist() == expect
    used = sum(-(-n // 16) for n in lens) + sum(opens)
    assert alloc.available_size() == (64 - used) * 16
    assert int(alloc.free_pages[0]) == head[sum(opens)]


def test_token_allocator_debug_off_is_a_fifo_of_views():
    alloc = token(8)
    a = alloc.alloc(3)
    held = a.clone()
    b = alloc.alloc(5)
    alloc.free(b[[4, 0]])  # slots 8 and 4 come back behind the (empty) free list
    assert a.tolist() == held.tolist()  # a slice handed out never changes
    assert alloc.alloc(2).tolist() == [8, 4]
    alloc.free(a)
    for _ in range(50):  # many cycles through the buffer: the queue moves to fresh buffers
        got = alloc.alloc(3)
        alloc.free(got)
    assert sorted(alloc.free_pages.tolist()) == [1, 2, 3]
    assert alloc.available_size() == 3


# -- always on, also with debug off -------------------------------------------------------------
def test_debug_off_still_checks_shapes_dtypes_devices_and_counts():
    alloc = paged()
    pre, seq, last = torch.tensor([0]), torch.tensor([5]), torch.tensor([-1])
    with pytest.raises(InvalidArgumentError, match="seq_lens has dtype torch.float32"):
        alloc.alloc_extend(pre, pre, seq.float(), seq, last, 5)
    with pytest.raises(InvalidArgumentError, match="last_loc has 2 entries"):
        alloc.alloc_extend(pre, pre, seq, seq, torch.tensor([-1, -1]), 5)
    with pytest.raises(InvalidArgumentError, match="prefix_lens is on meta"):
        alloc.alloc_extend(pre.to("meta"), pre, seq, seq, last, 5)
    with pytest.raises(InvalidArgumentError, match="extend_num_tokens=5.0"):
        alloc.alloc_extend(pre, pre, seq, seq, last, 5.0)
    with pytest.raises(InvalidArgumentError, match="must be 1-D"):
        alloc.free(torch.tensor([[17]]))
    with pytest.raises(InvalidArgumentError, match="need_size=True"):
        token().alloc(True)
    # More pages back than are handed out is a double free that needs no value read.
    slots = alloc.alloc(16)
    with pytest.raises(OwnershipError, match="2 pages freed but only 1"):
        alloc.free(torch.cat((slots, slots + 16)))
    assert alloc.available_size() == 31 * 16


# -- value checks: on with debug mode, skipped without it -----------------------------------------
def _double_free(alloc):
    slots = alloc.alloc(2 * alloc.page_size)
    alloc.free(slots[: alloc.page_size])
    alloc.free(slots[:1])  # that page again


def _free_padding_slot(alloc):
    alloc.alloc(alloc.page_size)
    alloc.free(torch.tensor([0]))


def _free_outside_pool(alloc):
    alloc.alloc(alloc.page_size)
    alloc.free(torch.tensor([(alloc.num_pages + 1) * alloc.page_size]))


def _repeat_in_one_free(alloc):
    slots = alloc.alloc(4)
    alloc.free(torch.cat((slots[:1], slots[:1])))


def _bad_last_loc_decode(alloc):
    slots = alloc.alloc(16)
    seq = torch.tensor([6])
    alloc.alloc_decode(seq, seq, slots[7:8])  # the 5th slot ends 5 tokens, not the 8th


def _device_cpu_lengths_differ(alloc):
    pre, seq = torch.tensor([0]), torch.tensor([5])
    alloc.alloc_extend(pre, pre, seq, torch.tensor([4]), torch.tensor([-1]), 4)


def _extend_count_wrong(alloc):
    pre, seq = torch.tensor([0, 0]), torch.tensor([5, 3])
    alloc.alloc_extend(pre, pre, seq, seq, torch.tensor([-1, -1]), 9)


def _free_segment_not_contiguous(alloc):
    slots = alloc.alloc(32)
    alloc.free_segment(slots.view(2, 16).t().reshape(-1), start_pos=0)


def _group_double_free(alloc):
    slots = alloc.alloc(32)
    alloc.free_group_begin()
    alloc.free(slots[:16])
    alloc.free_segment(slots[:16], start_pos=0)
    alloc.free_group_end()


MISUSES = [
    (paged, _double_free, OwnershipError, "double free: pages \\[1\\]"),
    (token, _double_free, OwnershipError, "double free: pages \\[1\\]"),
    (token, _repeat_in_one_free, OwnershipError, "double free"),
    (paged, _bad_last_loc_decode, InvalidArgumentError, "last_loc\\[0\\]"),
    (paged, _device_cpu_lengths_differ, InvalidArgumentError, "hold different values"),
    (token, _extend_count_wrong, InvalidArgumentError, "extend_num_tokens=9"),
    (paged, _free_segment_not_contiguous, InvalidArgumentError, "contiguously"),
    (paged, _group_double_free, OwnershipError, "double free: pages \\[1\\]"),
]


@pytest.mark.parametrize("make, misuse, error, message", MISUSES)
def test_value_checks_run_in_debug_mode_only(make, misuse, error, message):
    with pytest.raises(error, match=message):
        misuse(make(debug=True))
    misuse(make(debug=False))  # not read: the caller's bug goes through, as in SGLang


# A freed id outside the pool is refused in every mode: it would enter the free list, be handed
# out, and turn a later legitimate free into a double free (tests/device/test_free_range.py).
RANGE_MISUSES = [
    (paged, _free_padding_slot, InvalidArgumentError, "outside the valid range \\[16, "),
    (token, _free_padding_slot, InvalidArgumentError, "outside the valid range \\[1, "),
    (paged, _free_outside_pool, InvalidArgumentError, "outside the valid range"),
]


@pytest.mark.parametrize("make, misuse, error, message", RANGE_MISUSES)
@pytest.mark.parametrize("debug", [True, False])
def test_range_checks_run_in_every_mode(make, misuse, error, message, debug):
    with pytest.raises(error, match=message):
        misuse(make(debug=debug))


def test_debug_mode_refuses_before_anything_changes():
    for make in (paged, token):
        alloc = make(debug=True)
        slots = alloc.alloc(2 * alloc.page_size)
        alloc.free(slots[: alloc.page_size])
        before = (alloc.free_pages.clone(), alloc.available_size())
        with pytest.raises(OwnershipError):
            alloc.free(slots)  # one page free already, one not: nothing released
        assert torch.equal(alloc.free_pages, before[0]) and alloc.available_size() == before[1]
