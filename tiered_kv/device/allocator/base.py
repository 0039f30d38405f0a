"""BaseTokenToKVPoolAllocator: one interface for every allocator, plus the shared free list.

Bookkeeping only: a tensor of free page ids (``free_pages``) on the allocator's device and a list
of staged (freed but not yet merged) page id tensors. Page p covers slots p*page_size ..
p*page_size + page_size - 1; page 0 is the padding sink and is never handed out. With page_size 1
pages and slots coincide.

Contracts:
- an allocation that cannot be satisfied returns None and changes nothing (at most it merges
  staged pages into ``free_pages``, which reorders free pages and keeps their set);
- ``available_size()`` counts staged pages;
- a call that raises changes nothing;
- the scheduler calls the capacity hooks without branching on the allocator type.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import NamedTuple

import torch

from tiered_kv import platform
from tiered_kv._checks import check_index_tensor, check_positive_int, check_range
from tiered_kv.device.kv_cache import KVCache
from tiered_kv.device.sizing import AllocSizingConfig, get_alloc_reserve_per_decode
from tiered_kv.errors import InvalidArgumentError, OwnershipError, StateError


class AllocatorState(NamedTuple):
    """A snapshot for ``restore_state``. Tensors are never mutated in place, so holding
    references is a faithful copy."""

    allocator_id: int
    free_pages: torch.Tensor
    staged_pages: tuple[torch.Tensor, ...]
    num_staged_pages: int


class BaseTokenToKVPoolAllocator(abc.ABC):
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
        debug_mode: bool = False,
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
        if kvcache is not None and (kvcache.size != size or kvcache.page_size != page_size):
            raise InvalidArgumentError(
                f"kvcache has size={kvcache.size}, page_size={kvcache.page_size}; the allocator "
                f"has size={size}, page_size={page_size}; they must match"
            )
        self._kvcache = kvcache
        self.need_sort = bool(need_sort)
        self.debug_mode = bool(debug_mode)
        self.sizing = sizing if sizing is not None else AllocSizingConfig(page_size=page_size)
        # Reading index values to validate them is free on CPU and a sync on CUDA.
        self.validate_values = self.device.type == "cpu" or self.debug_mode
        self.free_group: list[torch.Tensor] | None = None
        self.free_page_ids_group: list[torch.Tensor] | None = None
        self.clear()

    # -- state ------------------------------------------------------------------------------
    def clear(self) -> None:
        """Every page free again, sorted ascending; staged pages and an open free group dropped."""
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.staged_pages: list[torch.Tensor] = []
        self.num_staged_pages = 0
        self.free_group = None
        self.free_page_ids_group = None

    def get_kvcache(self) -> KVCache | None:
        return self._kvcache

    def available_size(self) -> int:
        """Free tokens, staged pages included."""
        return (len(self.free_pages) + self.num_staged_pages) * self.page_size

    def get_all_free_pages(self) -> torch.Tensor:
        return torch.cat((self.free_pages, *self.staged_pages))

    def merge_and_sort_free(self) -> None:
        """Fold staged pages into ``free_pages`` and sort, so later allocations take runs of
        consecutive pages. Deferred until an allocation finds ``free_pages`` short."""
        if not self.staged_pages:
            return
        self.free_pages, _ = torch.sort(self.get_all_free_pages())
        self.staged_pages = []
        self.num_staged_pages = 0

    def backup_state(self) -> AllocatorState:
        return AllocatorState(
            id(self), self.free_pages, tuple(self.staged_pages), self.num_staged_pages
        )

    def restore_state(self, state: AllocatorState) -> None:
        if not isinstance(state, AllocatorState) or state.allocator_id != id(self):
            raise InvalidArgumentError(
                "restore_state needs an AllocatorState returned by this allocator's backup_state"
            )
        if self.free_group is not None:
            raise StateError("restore_state inside a free group; call free_group_end first")
        self.free_pages = state.free_pages
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
    def _check_slots(self, name: str, free_index: torch.Tensor) -> None:
        check_index_tensor(name, free_index, self.device)
        if self.validate_values:
            lo = self.page_size  # page 0 is padding
            check_range(name, free_index, lo, (self.num_pages + 1) * self.page_size)

    def free(self, free_index: torch.Tensor) -> None:
        """Return the pages holding ``free_index`` (each page once, however many of its slots
        are listed). Inside a free group the release waits for ``free_group_end``. Slot 0 or a
        slot outside the pool raises; in debug mode so does a page that is already free."""
        self._check_slots("free_index", free_index)
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(free_index.clone())
            return
        page_ids = torch.unique(free_index // self.page_size)
        self._release_checked((page_ids,))

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """``free`` for a segment that starts on a page boundary (``start_pos``, the position of
        ``free_index[0]`` in its request) and lists each page's slots contiguously: then
        ``free_index[::page_size]`` names each page once and no ``torch.unique`` is needed."""
        if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
            raise InvalidArgumentError(f"start_pos={start_pos!r} must be an int >= 0")
        if start_pos % self.page_size:
            raise InvalidArgumentError(
                f"segment start {start_pos} is not page-aligned (page_size={self.page_size}); "
                "use free() for unaligned segments"
            )
        self._check_slots("free_index", free_index)
        if free_index.numel() == 0:
            return
        reps = free_index[:: self.page_size] // self.page_size
        if self.debug_mode:
            pages = free_index // self.page_size
            if (
                not torch.equal(torch.unique(pages), torch.unique(reps))
                or reps.numel() != torch.unique(reps).numel()
            ):
                raise InvalidArgumentError(
                    "free_segment: free_index does not list each page's slots contiguously from a "
                    "page boundary; use free()"
                )
        self.free_page_ids(reps)

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """Release whole pages by id (deferred inside a free group)."""
        if self.free_page_ids_group is not None:
            self.free_page_ids_group.append(page_ids.clone())
            return
        self._release_checked((page_ids,))

    def free_group_begin(self) -> None:
        """Collect frees until ``free_group_end`` and release them with one concatenation."""
        if self.free_group is not None:
            raise StateError("free_group_begin called twice without free_group_end")
        self.free_group = []
        self.free_page_ids_group = []

    def free_group_end(self) -> None:
        """Release everything freed since ``free_group_begin``. The no-double-free contract can
        only be checked here (grouped pages are not in the free list yet); debug mode does."""
        if self.free_group is None:
            raise StateError("free_group_end called without free_group_begin")
        parts: list[torch.Tensor] = []
        if self.free_group:
            parts.append(torch.unique(torch.cat(self.free_group) // self.page_size))
        parts.extend(self.free_page_ids_group or [])
        if parts:
            self._release_checked(tuple(parts))
        self.free_group = None
        self.free_page_ids_group = None

    def _release_checked(self, page_ids: tuple[torch.Tensor, ...]) -> None:
        if self.debug_mode:
            self._debug_check_release(page_ids)
        self._release_page_ids(*page_ids)

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        # need_sort: stage now, merge and sort only when an allocation finds free_pages short.
        if self.need_sort:
            self.staged_pages.extend(page_ids)
            self.num_staged_pages += sum(int(ids.numel()) for ids in page_ids)
        else:
            self.free_pages = torch.cat((*page_ids, self.free_pages))

    def _debug_check_release(self, page_ids: tuple[torch.Tensor, ...]) -> None:
        """Raise (changing nothing) if releasing ``page_ids`` would put a page in the free list
        twice, or release the padding page or a page outside the pool."""
        new = torch.cat(page_ids)
        bad = new[(new < 1) | (new > self.num_pages)]
        if bad.numel():
            raise OwnershipError(
                f"pages {bad[:8].tolist()} are outside 1..{self.num_pages} (page 0 is padding)"
            )
        merged = torch.cat((self.get_all_free_pages(), new))
        uniq, counts = torch.unique(merged, return_counts=True)
        dup = uniq[counts > 1]
        if dup.numel():
            raise OwnershipError(
                f"double free: pages {dup[:16].tolist()} would be in the free list twice "
                f"({int(dup.numel())} pages)"
            )

    def debug_check_no_duplicate_pages(self) -> None:
        """Raise if the free list (staged included) holds a page twice or an invalid page."""
        pages = self.get_all_free_pages()
        uniq, counts = torch.unique(pages, return_counts=True)
        if (counts > 1).any():
            raise OwnershipError(f"free list holds pages twice: {uniq[counts > 1][:16].tolist()}")
        if pages.numel() and (int(pages.min()) < 1 or int(pages.max()) > self.num_pages):
            raise OwnershipError(f"free list holds pages outside 1..{self.num_pages}")

    # -- scheduler-facing capacity hooks ------------------------------------------------------
    # The scheduler calls these unconditionally, with no allocator-type branches on its side;
    # byte-accounted composites override the token-count defaults.
    def request_slot_reserve(self) -> int:
        """Slots to keep per running request beyond its prefill: the per-step decode reserve
        (twice one step's allocation, for overlap scheduling). Plain pools have no private
        per-request workspace."""
        return get_alloc_reserve_per_decode(self.sizing)

    def max_new_tokens_for_memory(
        self,
        input_tokens: int,
        max_new_tokens: int,
        *,
        token_capacity: int,
        sliding_window_size: int | None = None,
        chunk_size: int | None = None,
    ) -> int | None:
        """Clip generation to an empty pool of ``token_capacity`` tokens: the prompt rounded up
        to pages, one more page for the page the last token may open, and one slot, as the seed
        computes it (0 when that budget is used up). None only when the prompt itself, rounded
        up to pages, cannot fit. ``sliding_window_size``/``chunk_size`` matter only to
        sliding-window composites."""
        for name, value in (
            ("input_tokens", input_tokens),
            ("max_new_tokens", max_new_tokens),
            ("token_capacity", token_capacity),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{name}={value!r} must be an int >= 0")
        paged_input = -(-input_tokens // self.page_size) * self.page_size
        if paged_input > token_capacity:
            return None
        return max(0, min(max_new_tokens, token_capacity - paged_input - self.page_size - 1))

    def _pages_for(self, num_tokens: int) -> int:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens={num_tokens!r} must be an int >= 0")
        return -(-num_tokens // self.page_size)

    def prealloc_fits(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` (rounded up to pages) fit in the free pages now."""
        return self._pages_for(num_tokens) * self.page_size <= self.available_size()

    def prealloc_ceiling_fits(self, num_tokens: int, evictable_tokens: int = 0) -> bool:
        """Whether ``num_tokens`` could fit after evicting up to ``evictable_tokens`` cached
        tokens: the ceiling the scheduler may admit to, evicting first if ``prealloc_fits`` is
        False."""
        if (
            isinstance(evictable_tokens, bool)
            or not isinstance(evictable_tokens, int)
            or evictable_tokens < 0
        ):
            raise InvalidArgumentError(f"evictable_tokens={evictable_tokens!r} must be an int >= 0")
        evictable = evictable_tokens // self.page_size * self.page_size
        return self._pages_for(num_tokens) * self.page_size <= self.available_size() + evictable

    def evict_to_free_tokens(self, num_tokens: int, evict_fn: Callable[[int], object]) -> bool:
        """Make ``num_tokens`` available: if short, call ``evict_fn(missing_tokens)`` once (it
        evicts cached KV and frees it into this allocator). Returns whether they now fit."""
        missing = self._pages_for(num_tokens) * self.page_size - self.available_size()
        if missing > 0:
            evict_fn(missing)
        return self.prealloc_fits(num_tokens)
