"""HostSlotAllocator (and a host pool's alloc/free): whole pages, lazy release, ownership
checks that raise and change nothing, and thread safety."""

from __future__ import annotations

import random
import sys
import threading

import pytest
import torch

from tests.host._util import make_host, make_pool
from tiered_kv.errors import InvalidArgumentError, OwnershipError
from tiered_kv.host import HostSlotAllocator

P = 16
PAGES = 11


def _pages(slots: torch.Tensor, page_size: int = P) -> list[int]:
    return (slots[::page_size] // page_size).tolist()


def _slots(pages: list[int], page_size: int = P) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def _assert_whole_pages(slots: torch.Tensor, page_size: int) -> None:
    assert slots.dtype == torch.int64 and slots.device.type == "cpu"
    assert slots.numel() % page_size == 0
    blocks = slots.view(-1, page_size)
    assert (blocks[:, 0] % page_size == 0).all()
    assert torch.equal(blocks - blocks[:, :1], torch.arange(page_size).expand_as(blocks))


@pytest.mark.parametrize("page_size", (1, 3, 16))
def test_alloc_whole_pages_until_full(page_size, gen):
    a = HostSlotAllocator(PAGES * page_size, page_size)
    assert a.available_size() == PAGES * page_size
    seen: set[int] = set()
    while True:
        n = int(torch.randint(0, 4, (1,), generator=gen)) * page_size
        if n > a.available_size():
            assert a.alloc(n) is None
            break
        slots = a.alloc(n)
        assert slots is not None and slots.numel() == n
        _assert_whole_pages(slots, page_size)
        assert seen.isdisjoint(slots.tolist())
        seen.update(slots.tolist())
        assert a.available_size() == PAGES * page_size - len(seen)
    rest = a.available_size()
    assert a.alloc(rest + page_size) is None
    assert a.available_size() == rest  # a failed allocation changes nothing
    last = a.alloc(rest)
    assert last is not None
    seen.update(last.tolist())
    assert seen == set(range(PAGES * page_size))
    assert a.alloc(page_size) is None
    assert a.alloc(0).numel() == 0
    assert a.is_allocated(torch.arange(PAGES * page_size)).all()


def test_host_pool_alloc_and_free_delegate(gen):
    pool, alloc = make_pool("mha", 4, torch.float16, pages=3, layer_num=2)
    host = make_host(pool, alloc, host_pages=5)
    assert host.available_size() == 20
    slots = host.alloc(8)
    _assert_whole_pages(slots, 4)
    assert host.available_size() == 12
    assert host.alloc(16) is None
    host.free(slots)
    assert host.available_size() == 20
    with pytest.raises(OwnershipError):
        host.free(slots)
    with pytest.raises(InvalidArgumentError, match="6"):
        host.alloc(6)


def test_lazy_release_reuses_freed_pages_last():
    """Freed pages are staged; the primary free list is used up first, then they merge."""
    n = 3
    a = HostSlotAllocator(PAGES * P, P)
    taken = a.alloc((PAGES - n) * P)
    assert _pages(taken) == list(range(PAGES - n))
    freed = [5, 1, 7]
    a.free(_slots(freed))
    assert a.available_size() == (n + len(freed)) * P
    assert not a.is_allocated(_slots(freed)).any()
    # n pages are still on the primary list: they come first, not the freed ones.
    primary = a.alloc(n * P)
    assert _pages(primary) == list(range(PAGES - n, PAGES))
    assert a.available_size() == len(freed) * P
    # The primary list is empty now: the next allocation merges the staged pages (sorted).
    got = a.alloc(P)
    assert _pages(got) == [1]
    assert _pages(a.alloc(2 * P)) == [5, 7]
    assert a.alloc(P) is None
    assert a.available_size() == 0


def test_lazy_release_merges_only_when_short():
    a = HostSlotAllocator(PAGES * P, P)
    first = a.alloc(4 * P)
    a.free(first[: 2 * P])  # pages 0, 1 staged
    assert _pages(a.alloc((PAGES - 4) * P)) == list(range(4, PAGES))
    # Three pages asked, two staged: merging cannot make enough, so None and nothing taken.
    assert a.alloc(3 * P) is None
    assert a.available_size() == 2 * P
    assert _pages(a.alloc(2 * P)) == [0, 1]


def _assert_unchanged(a: HostSlotAllocator, before_available: int, owned: torch.Tensor) -> None:
    assert a.available_size() == before_available
    assert a.is_allocated(owned).all()
    # Later allocations stay consistent: they never hand out an owned slot.
    got = a.alloc(a.available_size())
    assert got is not None
    assert set(got.tolist()).isdisjoint(owned.tolist())
    a.free(got)


@pytest.fixture
def half_full() -> tuple[HostSlotAllocator, torch.Tensor]:
    a = HostSlotAllocator(PAGES * P, P)
    owned = a.alloc(6 * P)
    return a, owned


def test_double_free_of_a_page_raises_and_changes_nothing(half_full):
    a, owned = half_full
    a.free(owned[2 * P : 3 * P])
    avail = a.available_size()
    with pytest.raises(OwnershipError, match=str(2 * P)):
        a.free(owned[2 * P : 3 * P])
    # A call mixing an owned page with the freed one is refused whole.
    with pytest.raises(OwnershipError, match=str(2 * P)):
        a.free(torch.cat([owned[:P], owned[2 * P : 3 * P]]))
    rest = torch.cat([owned[: 2 * P], owned[3 * P :]])
    _assert_unchanged(a, avail, rest)


def test_page_listed_twice_in_one_call_raises(half_full):
    a, owned = half_full
    avail = a.available_size()
    bad = torch.cat([owned[3 * P : 4 * P], owned[:P], owned[3 * P : 4 * P]])
    with pytest.raises(OwnershipError, match=str(3 * P)):
        a.free(bad)
    _assert_unchanged(a, avail, owned)


def test_free_of_never_allocated_slots_raises(half_full):
    a, owned = half_full
    avail = a.available_size()
    never = _slots([9])
    with pytest.raises(OwnershipError, match=str(9 * P)):
        a.free(torch.cat([owned[:P], never]))
    _assert_unchanged(a, avail, owned)


def _head(t: torch.Tensor) -> str:
    """How the error lists a bad block: its first slots, as a Python list."""
    return str(t[:2].tolist())[:-1]


@pytest.mark.parametrize(
    "make_bad",
    [
        pytest.param(lambda o: (o[: P - 3], f"{P - 3} host slots"), id="partial-page"),
        pytest.param(lambda o: (o[P + 1 : 2 * P + 1], _head(o[P + 1 :])), id="not-page-start"),
        pytest.param(lambda o: (o[:P].flip(0), _head(o[:P].flip(0))), id="reversed-in-page"),
        pytest.param(
            lambda o: (torch.cat([o[1:2], o[:1], o[2:P]]), _head(torch.cat([o[1:2], o[:1]]))),
            id="swapped-in-page",
        ),
        pytest.param(
            lambda o: (torch.cat([o[:P], o[P + 3 : 2 * P + 3]]), _head(o[P + 3 :])),
            id="second-block-misaligned",
        ),
    ],
)
def test_page_misaligned_free_raises(make_bad, half_full):
    a, owned = half_full
    avail = a.available_size()
    bad, named = make_bad(owned)
    with pytest.raises(InvalidArgumentError, match="page") as info:
        a.free(bad)
    assert named in str(info.value)
    _assert_unchanged(a, avail, owned)


@pytest.mark.parametrize("need", (1, P - 1, P + 1, 5 * P + 7))
def test_page_misaligned_alloc_raises(need, half_full):
    a, owned = half_full
    avail = a.available_size()
    with pytest.raises(InvalidArgumentError, match=f"{need} slots"):
        a.alloc(need)
    _assert_unchanged(a, avail, owned)


@pytest.mark.parametrize("need", (-P, 2.0 * P, True, "16"))
def test_alloc_of_a_non_count_raises(need, half_full):
    a, owned = half_full
    avail = a.available_size()
    with pytest.raises(InvalidArgumentError, match="need_size"):
        a.alloc(need)
    _assert_unchanged(a, avail, owned)


@pytest.mark.parametrize("bad_slot", (-P, PAGES * P, PAGES * P + 5 * P))
def test_out_of_range_free_raises(bad_slot, half_full):
    a, owned = half_full
    avail = a.available_size()
    bad = torch.cat([owned[:P], torch.arange(bad_slot, bad_slot + P)])
    with pytest.raises(InvalidArgumentError, match=str(bad_slot)):
        a.free(bad)
    _assert_unchanged(a, avail, owned)


def test_free_of_bad_index_tensors_raises(half_full):
    a, owned = half_full
    avail = a.available_size()
    with pytest.raises(InvalidArgumentError, match="float"):
        a.free(owned[:P].float())
    with pytest.raises(InvalidArgumentError, match="1-D"):
        a.free(owned[:P].view(2, -1))
    with pytest.raises(InvalidArgumentError, match="meta"):
        a.free(torch.empty(P, dtype=torch.int64, device="meta"))
    _assert_unchanged(a, avail, owned)
    a.free(owned[:P].to(torch.int32))  # int32 is fine
    assert a.available_size() == avail + P


def test_construction_arguments_checked():
    with pytest.raises(InvalidArgumentError, match="50"):
        HostSlotAllocator(50, 16)
    with pytest.raises(InvalidArgumentError, match="page_size"):
        HostSlotAllocator(64, 0)
    with pytest.raises(InvalidArgumentError, match="size"):
        HostSlotAllocator(0, 16)


def test_clear_returns_everything():
    a = HostSlotAllocator(PAGES * P, P)
    x = a.alloc(5 * P)
    a.free(x[:P])
    a.clear()
    assert a.available_size() == PAGES * P
    assert not a.is_allocated(torch.arange(PAGES * P)).any()
    assert _pages(a.alloc(PAGES * P)) == list(range(PAGES))


def test_concurrent_alloc_and_free_never_double_hands_out():
    page, pages, threads, rounds = 4, 64, 6, 400
    a = HostSlotAllocator(pages * page, page)
    owners: dict[int, int] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def worker(tid: int) -> None:
        rng = random.Random(tid * 7919 + 1)
        mine: list[torch.Tensor] = []
        try:
            start.wait()
            for _ in range(rounds):
                if mine and (rng.random() < 0.45 or len(mine) > 6):
                    slots = mine.pop(rng.randrange(len(mine)))
                    with lock:  # unregister first: a freed slot may be handed out at once
                        for s in slots.tolist():
                            assert owners.pop(s) == tid
                    a.free(slots)
                else:
                    slots = a.alloc(rng.randint(0, 5) * page)
                    if slots is None:
                        continue
                    with lock:
                        for s in slots.tolist():
                            assert s not in owners, f"slot {s} handed out twice"
                            owners[s] = tid
                    mine.append(slots)
            for slots in mine:
                with lock:
                    for s in slots.tolist():
                        assert owners.pop(s) == tid
                a.free(slots)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[0]
    assert not owners
    assert a.available_size() == pages * page
    assert not a.is_allocated(torch.arange(pages * page)).any()
    everything = a.alloc(pages * page)
    assert sorted(everything.tolist()) == list(range(pages * page))
