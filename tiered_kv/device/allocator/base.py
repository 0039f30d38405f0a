"""BaseTokenToKVPoolAllocator: one interface for every allocator, plus the shared free list.

Bookkeeping only: the free ids in one preallocated buffer on the allocator's device
(``free_list``: a queue for the token allocator, a stack for the paged one) and a list of staged
(freed but not yet merged) page id tensors. Page p covers slots p*page_size .. p*page_size +
page_size - 1; page 0 is the padding sink and is never handed out. With page_size 1 pages and
slots coincide.

Contracts:
- an allocation that cannot be satisfied returns None and changes nothing (at most it merges
  staged pages into ``free_pages``, which reorders free pages and keeps their set);
- ``available_size()`` counts staged pages;
- a call that raises changes nothing;
- the scheduler calls the capacity hooks without branching on the allocator type.

Checks: shapes, dtypes and devices always (attribute reads), and the range of every freed id
(one ``aminmax``: an id outside the pool would otherwise enter the free list and turn a later,
legitimate free into a double free); the other checks that read index values (double frees,
``last_loc`` and length consistency) only in debug mode (``debug_mode=``, default
``TIERED_KV_DEBUG``). Each raises before anything changes. Nothing here syncs with the device
unless debug mode is on, except a free's range check and ``free``'s deduplication
(``torch.unique``, as in the seed; ``free_segment`` avoids it).
"""

from __future__ import annotations

import abc
from typing import NamedTuple

import torch

from tiered_kv import platform
from tiered_kv._checks import check_positive_int
from tiered_kv.device.allocator import debug
from tiered_kv.device.allocator.capacity import CapacityHooks
from tiered_kv.device.allocator.free_list import PageStack, SlotQueue
from tiered_kv.device.allocator.inputs import (
    check_free_pages,
    check_free_slots,
    check_index,
    check_kv_pool,
)
from tiered_kv.device.kv_cache import KVCache
from tiered_kv.device.sizing import AllocSizingConfig, resolve_sizing
from tiered_kv.errors import InvalidArgumentError, OwnershipError, StateError

# From this many slots on, ``free`` drops runs of one page first (a linear pass): the sort in
# ``torch.unique`` then sees one id per page instead of page_size ids (5-10x at 33k slots).
RUNS_FIRST = 1024


class AllocatorState(NamedTuple):
    """A snapshot for ``restore_state``: the free ids as they were (a copy, or a view that
    nothing writes again) and the staged tensors (never mutated in place)."""

    allocator_id: int
    free_pages: torch.Tensor
    staged_pages: tuple[torch.Tensor, ...]
    num_staged_pages: int


class BaseTokenToKVPoolAllocator(CapacityHooks, abc.ABC):
    """Maps "n new tokens" to physical slots of a KV pool of ``size`` usable slots."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype | None,
        device: str | torch.device | None,
        kvcache: KVCache | None = None,
        need_sort: bool = False,
        *,
        debug_mode: bool | None = None,
        sizing: AllocSizingConfig | None = None,
    ) -> None:
        self.size = check_positive_int("size", size)
        self.page_size = check_positive_int("page_size", page_size)
        if size % page_size:
            raise InvalidArgumentError(
                f"size={size} is not a multiple of page_size={page_size}; use "
                f"{size // page_size * page_size} or {(size // page_size + 1) * page_size}"
            )
        self.num_pages = size // page_size
        self.dtype = dtype
        self.device = platform.resolve_device(device)
        # None: the CPU; else the CUDA index a tensor's get_device() must return.
        self.device_index: int | None = None
        if self.device.type == "cuda":
            index = self.device.index
            self.device_index = torch.cuda.current_device() if index is None else index
        check_kv_pool("kvcache", kvcache)
        if kvcache is not None and (kvcache.size != size or kvcache.page_size != page_size):
            raise InvalidArgumentError(
                f"kvcache has size={kvcache.size}, page_size={kvcache.page_size}; the allocator "
                f"has size={size}, page_size={page_size}; they must match"
            )
        self._kvcache = kvcache
        self.need_sort = bool(need_sort)
        self.debug_mode = platform.debug_mode() if debug_mode is None else bool(debug_mode)
        self.sizing = resolve_sizing(sizing, page_size)
        self._shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
        self.free_list = self._new_free_list()
        self.free_group: list[torch.Tensor] | None = None
        self.free_page_ids_group: list[torch.Tensor] | None = None
        self.clear()

    def _new_free_list(self) -> SlotQueue | PageStack:
        """The free list's order: a stack (last freed, first reused) unless overridden."""
        return PageStack(self.num_pages, self.device)

    # -- state ------------------------------------------------------------------------------
    def clear(self) -> None:
        """Every page free again, ascending; staged pages and an open free group dropped."""
        self.free_list.clear()
        self.staged_pages: list[torch.Tensor] = []
        self.num_staged_pages = 0
        self.free_group = None
        self.free_page_ids_group = None

    @property
    def free_pages(self) -> torch.Tensor:
        """The free page ids that allocations take from, head first (staged ones excluded): a
        view, valid until the next free (``backup_state`` keeps a copy)."""
        return self.free_list.live

    @free_pages.setter
    def free_pages(self, ids: torch.Tensor) -> None:
        self.free_list.replace(ids)

    def get_kvcache(self) -> KVCache | None:
        return self._kvcache

    def available_size(self) -> int:
        """Free tokens, staged pages included."""
        return (self.free_list.count + self.num_staged_pages) * self.page_size

    def get_all_free_pages(self) -> torch.Tensor:
        """A new tensor of every free page id, staged ones last."""
        return torch.cat((self.free_list.live, *self.staged_pages))

    def merge_and_sort_free(self) -> None:
        """Fold staged pages into ``free_pages`` and sort, so later allocations take runs of
        consecutive pages. Deferred until an allocation finds ``free_pages`` short."""
        if not self.staged_pages:
            return
        self.free_list.replace(torch.sort(self.get_all_free_pages())[0])
        self.staged_pages = []
        self.num_staged_pages = 0

    def backup_state(self) -> AllocatorState:
        return AllocatorState(
            id(self), self.free_list.snapshot(), tuple(self.staged_pages), self.num_staged_pages
        )

    def restore_state(self, state: AllocatorState) -> None:
        if not isinstance(state, AllocatorState) or state.allocator_id != id(self):
            raise InvalidArgumentError(
                "restore_state needs an AllocatorState returned by this allocator's backup_state"
            )
        if self.free_group is not None:
            raise StateError("restore_state inside a free group; call free_group_end first")
        self.free_list.replace(state.free_pages)
        self.staged_pages = list(state.staged_pages)
        self.num_staged_pages = state.num_staged_pages

    def translate_kv_indices_for_transfer(self, indices: torch.Tensor) -> torch.Tensor:
        """Slot ids as the KV pool addresses them. Identity here (ids are physical); pools with
        virtual ids override it. Every inter-tier transfer calls it first."""
        return indices

    # -- allocation interface -----------------------------------------------------------------
    @abc.abstractmethod
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` slots (whole pages), or None if the pool is short."""

    @abc.abstractmethod
    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Slots for tokens ``prefix_lens[i]..seq_lens[i]-1`` of every request, request after
        request, continuing each request's last page first. None if the pool is short."""

    @abc.abstractmethod
    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """One slot per request for the token that makes its length ``seq_lens[i]``."""

    # -- freeing ----------------------------------------------------------------------------
    def _pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Each page holding one of ``slots``, once, ascending. At page size 1 a slot is its
        page: a slot listed twice is a double free, which only debug mode looks for."""
        if self.page_size == 1:
            return slots
        pages = slots >> self._shift if self._shift >= 0 else slots // self.page_size
        if pages.shape[0] >= RUNS_FIRST:
            pages = torch.unique_consecutive(pages)
        # torch.unique's own call (sorted, nothing else returned) without its Python wrapper,
        # 1.5 of the ~8 us it takes for a few hundred slots on a CPU.
        return torch._unique2(pages)[0]

    def free(self, free_index: torch.Tensor) -> None:
        """Return the pages holding ``free_index`` (each page once, however many of its slots
        are listed; at page size 1 list each slot once). Inside a free group the release waits
        for ``free_group_end``. A slot outside pages 1..num_pages (padding page 0 included) is
        refused in every mode, inside a group too (InvalidArgumentError); debug mode also refuses
        a page that is already free (OwnershipError). Either changes nothing."""
        check_index("free_index", free_index, self)
        if free_index.shape[0] == 0:
            return
        if self.page_size == 1 or self.free_group is not None:
            check_free_slots(self, "free_index", free_index)
            self._free_checked(free_index)
            return
        # The pages come back sorted: their first and last bound every slot (a slot lies in
        # pages 1..num_pages exactly when its page does), one read instead of a pass.
        pages = self._pages_of(free_index)
        if pages.shape[0] <= 64:  # a few pages: one read of them all is the cheapest
            ends = pages.tolist()
            first, last = ends[0], ends[-1]
        else:
            first, last = pages[0].item(), pages[-1].item()
        if first < 1 or last > self.num_pages:
            check_free_slots(self, "free_index", free_index)  # raises, naming the slots
        self._release((pages,))

    def _free_checked(self, free_index: torch.Tensor) -> None:
        """``free`` of a non-empty ``free_index`` whose shape and range the caller checked (a
        composite allocator checks once, before any of its sides changes)."""
        if self.free_group is not None:
            self.free_group.append(free_index.clone())
            return
        pages = self._pages_of(free_index)
        if pages is free_index and self.need_sort:
            pages = pages.clone()  # staged for later: never the caller's tensor
        self._release((pages,))

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """``free`` for a segment that starts on a page boundary (``start_pos``, the position of
        ``free_index[0]`` in its request) and lists each page's slots contiguously: then
        ``free_index[::page_size]`` names each page once and no ``torch.unique`` is needed."""
        if type(start_pos) is not int or start_pos < 0:
            raise InvalidArgumentError(f"start_pos={start_pos!r} must be an int >= 0")
        if start_pos % self.page_size:
            raise InvalidArgumentError(
                f"segment start {start_pos} is not page-aligned (page_size={self.page_size}); "
                "use free() for unaligned segments"
            )
        check_index("free_index", free_index, self)
        if free_index.shape[0] == 0:
            return
        check_free_slots(self, "free_index", free_index)
        if self.page_size == 1:
            self._free_page_ids_checked(free_index)
            return
        reps = free_index[:: self.page_size] // self.page_size
        if self.debug_mode:
            debug.check_segment(free_index, reps, self.page_size)
        self._free_page_ids_checked(reps)

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """Release whole pages by id, each listed once (deferred inside a free group). A page
        outside 1..num_pages is refused in every mode (InvalidArgumentError), changing nothing."""
        check_index("page_ids", page_ids, self)
        if page_ids.shape[0] == 0:
            return
        check_free_pages(self, "page_ids", page_ids)
        self._free_page_ids_checked(page_ids)

    def _free_page_ids_checked(self, page_ids: torch.Tensor) -> None:
        """``free_page_ids`` of non-empty pages inside 1..num_pages (checked by the caller)."""
        if self.free_page_ids_group is not None or self.need_sort:
            page_ids = page_ids.clone()  # kept for later: never the caller's tensor
        if self.free_page_ids_group is not None:
            self.free_page_ids_group.append(page_ids)
            return
        self._release((page_ids,))

    def free_group_begin(self) -> None:
        """Collect frees until ``free_group_end`` and release them with one concatenation."""
        if self.free_group is not None:
            raise StateError("free_group_begin called twice without free_group_end")
        self.free_group = []
        self.free_page_ids_group = []

    def free_group_end(self) -> None:
        """Release everything freed since ``free_group_begin``. Each free checked its range
        when it was called; the no-double-free contract can only be checked here (grouped pages
        are not in the free list yet): debug mode does, before releasing anything."""
        if self.free_group is None:
            raise StateError("free_group_end called without free_group_begin")
        parts: list[torch.Tensor] = []
        if self.free_group:
            parts.append(self._pages_of(torch.cat(self.free_group)))
        parts.extend(self.free_page_ids_group or [])
        if parts:
            self._release(tuple(parts))
        self.free_group = None
        self.free_page_ids_group = None

    def _release(self, page_ids: tuple[torch.Tensor, ...]) -> None:
        if self.debug_mode:
            debug.check_release(self, page_ids)
        n = page_ids[0].shape[0] if len(page_ids) == 1 else sum(t.shape[0] for t in page_ids)
        free = self.free_list.count + self.num_staged_pages
        if free + n > self.num_pages:
            # Counting needs no value read: more pages back than were handed out.
            raise OwnershipError(
                f"double free: {n} pages freed but only {self.num_pages - free} of "
                f"{self.num_pages} are allocated"
            )
        # need_sort: stage now, merge and sort only when an allocation finds free_pages short.
        if self.need_sort:
            self.staged_pages.extend(page_ids)
            self.num_staged_pages += n
        else:
            self._put(page_ids)

    def _put(self, page_ids: tuple[torch.Tensor, ...]) -> None:
        # A stack: the first part ends up in front, as torch.cat((*page_ids, free_pages)).
        if len(page_ids) == 1:
            self.free_list.put(page_ids[0])
            return
        for ids in reversed(page_ids):
            self.free_list.put(ids)

    def debug_check_no_duplicate_pages(self) -> None:
        """Raise if the free list (staged included) holds a page twice or an invalid page."""
        debug.check_no_duplicate_pages(self)
