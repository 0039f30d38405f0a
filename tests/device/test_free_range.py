"""Issue 27: a free of an id outside the pool is refused in every mode, by every allocator.

Before, with debug mode off, ``free(torch.tensor([100000]))`` on a paged allocator raised nothing
and grew the free space; the next legitimate free then failed as a double free. Here, for every
free path of every allocator (``free``, ``free_segment``, ``free_page_ids``, the SWA window and
full frees, the HiSparse device frees, the unified frees, state and draft slot frees, and each
of them inside a free group), with debug mode off and on: an id past the pool, far past it,
negative, on the padding page, or one such id among good ones, raises a typed error naming it
and the valid range, and leaves every piece of state as it was (free lists, staged pages, open
groups, peer tables), so the legitimate frees and allocations after it behave as if it never
happened. Irregular geometry (37 pages of 3 slots and the like) and fresh random data (the held
slots, where the bad id goes, how far out it lies) every run.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator
from tiered_kv.device.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from tiered_kv.device.allocator.mamba_slots import MambaSlotAllocator
from tiered_kv.device.allocator.page_interleave import PageInterleavePoolAllocator
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.allocator.swa import SWATokenToKVPoolAllocator
from tiered_kv.device.allocator.token import TokenToKVPoolAllocator
from tiered_kv.device.allocator.unified_mamba_swa import UnifiedMambaSWATokenToKVPoolAllocator
from tiered_kv.device.allocator.unified_swa import UnifiedSWATokenToKVPoolAllocator
from tiered_kv.device.mamba_pool import MambaPool
from tiered_kv.device.swa_pool import SWAKVPool
from tiered_kv.device.unified_swa_pool import UnifiedSWAKVPool
from tiered_kv.errors import InvalidArgumentError, OwnershipError, TieredKVError

P, PAGES = 3, 37  # irregular on purpose: an odd page size, a prime page count
KV = dict(kernel_backend="torch")


def _t(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def _randint(gen: torch.Generator, lo: int, hi: int) -> int:
    """An int in lo..hi (inclusive)."""
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


# -- the allocators -----------------------------------------------------------------------------
def _swa(debug: bool) -> SWATokenToKVPoolAllocator:
    pool = SWAKVPool(PAGES * P, 29 * P, P, torch.float16, 1, 4, [0], [1])
    return SWATokenToKVPoolAllocator(
        PAGES * P, 29 * P, P, torch.float16, "cpu", pool, debug_mode=debug, **KV
    )


def _unified(debug: bool) -> UnifiedSWATokenToKVPoolAllocator:
    pool = UnifiedSWAKVPool(PAGES, P, torch.float16, 1, 4, [0], [1])
    return UnifiedSWATokenToKVPoolAllocator(
        PAGES, P, torch.float16, "cpu", pool, debug_mode=debug, **KV
    )


def _unified_mamba(debug: bool) -> UnifiedMambaSWATokenToKVPoolAllocator:
    pool = UnifiedSWAKVPool(PAGES, P, torch.float16, 1, 4, [0], [1])
    mamba = MambaPool(
        size=7, spec_state_size=5, conv_shapes=[(3, 8)], temporal_shape=(2, 8, 8),
        mamba_layer_ids=[4],
    )  # fmt: skip
    return UnifiedMambaSWATokenToKVPoolAllocator(
        PAGES, P, torch.float16, "cpu", pool, mamba, state_slot_pages=1, debug_mode=debug, **KV
    )


def _paged(debug: bool, need_sort: bool = False) -> PagedTokenToKVPoolAllocator:
    return PagedTokenToKVPoolAllocator(
        PAGES * P, P, None, "cpu", need_sort=need_sort, debug_mode=debug, **KV
    )


BUILD: dict[str, Callable[[bool], Any]] = {
    "token": lambda d: TokenToKVPoolAllocator(PAGES * P, None, "cpu", debug_mode=d),
    "paged": _paged,
    "paged_sorted": lambda d: _paged(d, need_sort=True),
    "swa": _swa,
    "hisparse": lambda d: HiSparseTokenToKVPoolAllocator(
        PAGES * P, P, torch.float16, "cpu", host_to_device_ratio=2, debug_mode=d, **KV
    ),
    "interleave": lambda d: PageInterleavePoolAllocator(13 * P, P, 3, "cpu", debug_mode=d),
    "unified": _unified,
    "unified_mamba": _unified_mamba,
    "mamba": lambda d: MambaSlotAllocator(29, 5, "cpu", debug_mode=d),
}


def hold_kv(alloc, gen) -> torch.Tensor:
    """Churn first (so the free list is not the fresh ascending one; with need_sort the frees
    are staged), then hold a random number of units."""
    u = getattr(alloc, "page_size", 1)  # whole pages (the Mamba slots have none)
    first = alloc.alloc(_randint(gen, 2, 6) * u)
    held = alloc.alloc(_randint(gen, 3, 8) * u)
    alloc.free(first[torch.randperm(first.shape[0], generator=gen)])
    return held


def hold_state(alloc, gen) -> torch.Tensor:
    first, held = alloc.alloc_state(1), alloc.alloc_state(_randint(gen, 2, 4))
    alloc.free_state(first)
    return held


def hold_spec(alloc, gen) -> torch.Tensor:
    m = alloc if isinstance(alloc, MambaSlotAllocator) else alloc.mamba_allocator
    first, held = m.alloc_spec(1), m.alloc_spec(_randint(gen, 2, 4))
    m.free_spec(first)
    return held


def _spec(a):
    return a if isinstance(a, MambaSlotAllocator) else a.mamba_allocator


# -- every free path ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Path:
    kind: str
    name: str
    call: Callable[[Any, torch.Tensor], None]
    valid: Callable[[Any], tuple[int, int]]  # [low, high) of the ids the call takes
    error: type[TieredKVError] = InvalidArgumentError
    hold: Callable[[Any, torch.Generator], torch.Tensor] = hold_kv
    release: Callable[[Any, torch.Tensor], None] = lambda a, held: a.free(held)
    ids: Callable[[Any, torch.Tensor], torch.Tensor] = lambda a, held: held  # held -> call's ids

    def __str__(self) -> str:
        return f"{self.kind}.{self.name}"


def slots_of(a) -> tuple[int, int]:
    """Slots of pages 1..num_pages of a paged or token allocator (page 0 is padding)."""
    return a.page_size, (a.num_pages + 1) * a.page_size


def _free(a, x):
    a.free(x)


def _segment(a, x):
    a.free_segment(x, start_pos=0)


def _pages(a, held):
    return torch.unique(held // a.page_size)


def full(a):
    return slots_of(a.full_attn_allocator)


def logical(a):
    return slots_of(a.logical_allocator)


def interleaved(a):  # logical pages 0..N-1 are the N ranks' padding pages
    return a.shard_size * a.page_size, a.num_pages * a.page_size


def virtual(a):
    return slots_of(a._virtual)


def state(a):
    return 1, _spec(a).size + 1


def draft(a):
    return _spec(a).size + 1, _spec(a).size + _spec(a).spec_size + 1


PATHS: list[Path] = []
for kind in ("token", "paged", "paged_sorted"):
    PATHS += [
        Path(kind, "free", _free, slots_of),
        Path(kind, "free_segment", _segment, slots_of),
        Path(kind, "free_page_ids", lambda a, x: a.free_page_ids(x),
             lambda a: (1, a.num_pages + 1), ids=_pages),
    ]  # fmt: skip
PATHS += [
    Path("swa", "free", _free, full),
    Path("swa", "free_swa", lambda a, x: a.free_swa(x), full),
    Path("swa", "free_full", lambda a, x: a.free_full(x), full),
    Path("swa", "free_segment", _segment, full),
]
PATHS += [
    Path("hisparse", "free", _free, logical),
    Path("hisparse", "free_device", lambda a, x: a.free_device(x), logical),
    Path("hisparse", "alloc_device_buffer", lambda a, x: a.alloc_device_buffer(x, 0), logical),
    Path("hisparse", "free_device_slots", lambda a, x: a.free_device_slots(x),
         lambda a: slots_of(a.device_allocator), ids=lambda a, held: a.translate_loc(held)),
]  # fmt: skip
PATHS += [
    Path("interleave", "free", _free, interleaved),
    Path("interleave", "free_segment", _segment, interleaved),
]
for kind in ("unified", "unified_mamba"):
    PATHS += [
        Path(kind, "free", _free, virtual),
        Path(kind, "free_swa", lambda a, x: a.free_swa(x), virtual),
        Path(kind, "free_segment", _segment, virtual),
    ]
PATHS += [
    Path("unified_mamba", "free_state", lambda a, x: a.free_state(x), state, OwnershipError,
         hold_state, lambda a, held: a.free_state(held)),
    Path("mamba", "free", _free, state, OwnershipError),
]  # fmt: skip
for kind in ("unified_mamba", "mamba"):
    PATHS.append(
        Path(kind, "free_spec", lambda a, x: _spec(a).free_spec(x), draft, OwnershipError,
             hold_spec, lambda a, held: _spec(a).free_spec(held))
    )  # fmt: skip


# -- what must not change -----------------------------------------------------------------------
def _lists(group) -> list | None:
    return None if group is None else [t.tolist() for t in group]


def snap(a) -> dict:
    """Every piece of an allocator's state, as plain values (sub-allocators recursively)."""
    out: dict[str, Any] = {}
    for name in (
        "full_attn_allocator", "swa_attn_allocator", "logical_allocator", "device_allocator",
        "_virtual", "mamba_allocator",
    ):  # fmt: skip
        sub = getattr(a, name, None)
        if sub is not None:
            out[name] = snap(sub)
    for name in ("full_to_swa_index_mapping", "logical_to_device"):
        if hasattr(a, name):
            out[name] = getattr(a, name).tolist()
    if isinstance(a, BaseTokenToKVPoolAllocator):
        out["free"] = a.free_list.live.tolist()
        out["staged"] = (_lists(a.staged_pages), a.num_staged_pages)
        out["groups"] = (_lists(a.free_group), _lists(a.free_page_ids_group))
    if isinstance(a, MambaSlotAllocator):
        out["free"] = (a.free_list.live.tolist(), a.spec_free_list.live.tolist())
        out["reserve"] = None if a._reserve is None else a._reserve.tolist()
    if isinstance(a, PageInterleavePoolAllocator):
        out["classes"] = ([list(f) for f in a._free], [list(r) for r in a._released])
        out["group"] = _lists(a._group)
    if hasattr(a, "pages"):  # the unified allocators' two-ended page range
        s = a.pages.snapshot()
        out["pages"] = ([t.tolist() for t in s[:4]], s[4:])
        out["group"] = None if a._group is None else tuple(_lists(g) for g in a._group)
    return out


SIZES = (
    "available_size", "full_available_size", "swa_available_size", "logical_available_size",
    "device_available_size", "spec_available_size", "available_state_slots",
    "class_free_page_counts",
)  # fmt: skip


def sizes(a) -> dict:
    return {name: getattr(a, name)() for name in SIZES if hasattr(a, name)}


# -- the bad ids --------------------------------------------------------------------------------
def bad_ids(low: int, high: int, gen) -> list[int]:
    """Past the end, far past it, 100000, negative (near and far), padding: slot 0 and the last
    slot before ``low`` (the padding page's last slot, or the last state slot for draft slots)."""
    far = high + _randint(gen, 1, 5 * high)
    ids = [high, far, 100000, -1, -_randint(gen, 2, 10**6), 0, low - 1]
    return sorted({i for i in ids if not low <= i < high})


def with_bad(good: torch.Tensor, bad: int, gen) -> torch.Tensor:
    """``good`` with ``bad`` at a random position."""
    i = _randint(gen, 0, good.shape[0])
    return torch.cat((good[:i], _t([bad]).to(good.dtype), good[i:]))


def refused(path: Path, alloc, x: torch.Tensor, bad: int) -> None:
    """The call raises the path's typed error naming ``bad`` and the valid range, and changes
    nothing at all."""
    low, high = path.valid(alloc)
    before, avail = snap(alloc), sizes(alloc)
    with pytest.raises(path.error) as info:
        path.call(alloc, x)
    assert isinstance(info.value, TieredKVError)
    message = str(info.value)
    assert re.search(rf"\[{bad}\]", message), f"{path}: the message does not name {bad}: {message}"
    assert f"{low}..{high - 1}" in message, f"{path}: no valid range in: {message}"
    assert sizes(alloc) == avail, f"{path}: a refused free changed the free space"
    assert snap(alloc) == before, f"{path}: a refused free changed the allocator's state"


@pytest.mark.parametrize("debug", [False, True], ids=["debug_off", "debug_on"])
@pytest.mark.parametrize("path", PATHS, ids=str)
def test_out_of_range_free_is_refused_and_changes_nothing(path, debug, gen):
    alloc = BUILD[path.kind](debug)
    fresh = sizes(alloc)
    held = path.hold(alloc, gen)
    ids = path.ids(alloc, held)
    low, high = path.valid(alloc)
    assert bool(((ids >= low) & (ids < high)).all())  # the good ids are good
    for bad in bad_ids(low, high, gen):
        refused(path, alloc, _t([bad]), bad)
        # one bad among good ones (one fewer than held: the budgeted state slots count first)
        refused(path, alloc, with_bad(ids[: max(1, ids.shape[0] - 1)], bad, gen), bad)
    # The legitimate frees and a whole cycle after it: no spurious double free, nothing lost.
    path.release(alloc, held)
    assert sizes(alloc) == fresh
    path.release(alloc, path.hold(alloc, gen))
    assert sizes(alloc) == fresh


GROUPED = [
    p for p in PATHS if p.hold is hold_kv and hasattr(BUILD[p.kind](False), "free_group_end")
]


@pytest.mark.parametrize("debug", [False, True], ids=["debug_off", "debug_on"])
@pytest.mark.parametrize("path", GROUPED, ids=str)
def test_out_of_range_free_inside_a_group_is_refused_at_the_call(path, debug, gen):
    """Inside a free group the bad id is refused by the call itself, not later at
    ``free_group_end``; the group keeps what it had and releases it as if nothing happened."""
    alloc = BUILD[path.kind](debug)
    fresh = sizes(alloc)
    held = path.hold(alloc, gen)
    u = alloc.page_size
    cut = u * _randint(gen, 1, held.shape[0] // u - 1)
    alloc.free_group_begin()
    alloc.free(held[:cut])
    rest = path.ids(alloc, held[cut:])
    low, high = path.valid(alloc)
    for bad in bad_ids(low, high, gen):
        refused(path, alloc, _t([bad]), bad)
        refused(path, alloc, with_bad(rest, bad, gen), bad)
    alloc.free_group_end()
    alloc.free(held[cut:])
    assert sizes(alloc) == fresh


@pytest.mark.parametrize("need_sort", [False, True])
def test_the_issue_example(need_sort):
    """The report: 4096 slots of 16; 16 pages held, 240 free; ``free([100000])`` grew the free
    space to 256 pages, and freeing the held pages then failed as a double free."""
    alloc = PagedTokenToKVPoolAllocator(
        4096, 16, None, "cpu", need_sort=need_sort, debug_mode=False, **KV
    )
    held = alloc.alloc(256)
    assert alloc.available_size() == 240 * 16
    with pytest.raises(InvalidArgumentError, match=r"\[100000\].*valid slots are 16\.\.4111"):
        alloc.free(torch.tensor([100000]))
    assert alloc.available_size() == 240 * 16
    alloc.free(held)
    assert alloc.available_size() == 4096
