"""Freeing in the unified sliding-window allocator: whole virtual pages, their window pages
alone (tokens that left the window), page-aligned segments and free groups.

Every free validates first (ids inside virtual pages 1..N, pages allocated, none listed twice)
and changes nothing when it raises; it reads the page tables to find what to release (a device
sync on CUDA). Inside a free group the releases wait for ``free_group_end``, window frees first.
"""

from __future__ import annotations

import torch

from tiered_kv.device.allocator import debug
from tiered_kv.device.allocator.inputs import check_index
from tiered_kv.device.allocator.unified_swa_pages import FULL, SWA
from tiered_kv.errors import InvalidArgumentError, OwnershipError, StateError


class UnifiedSWAFrees:
    """The free side of ``UnifiedSWATokenToKVPoolAllocator`` (mixed into it; it reads the
    allocator's ``pages``, ``_virtual``, ``page_size`` and ``_check_ids``)."""

    _group: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def _check_live(self, pages: torch.Tensor, where: str) -> None:
        """Virtual ``pages`` (1..N) all hold a full page: they are allocated."""
        dead = self.pages.v2p[FULL][pages] <= 0
        if pages.numel() and bool(dead.any()):
            raise OwnershipError(
                f"{where}: virtual pages {pages[dead][:8].tolist()} are not allocated (a double "
                "free, or ids never handed out)"
            )

    def _release(self, full_pages: torch.Tensor, swa_pages: torch.Tensor) -> None:
        """Unbind window pages of ``swa_pages``, then every side of ``full_pages`` and return
        those virtual pages to the queue. Both distinct, validated, live."""
        if swa_pages.numel():
            self.pages.unbind(SWA, swa_pages)
        if full_pages.numel():
            self.pages.unbind(SWA, full_pages)
            self.pages.unbind(FULL, full_pages)
            self._virtual.free_page_ids(full_pages)

    def _pages_of(self, ids: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        pages = ids.to(torch.int64) if ps == 1 else torch.div(ids, ps, rounding_mode="floor")
        return torch.unique(pages)

    def free(self, free_index: torch.Tensor) -> None:
        """Release the virtual pages holding ``free_index`` (each once, however many of its
        ids are listed) and their full and window pages (window pages already freed are
        skipped). Inside a free group the release waits for ``free_group_end``."""
        check_index("free_index", free_index, self._virtual)
        if free_index.numel() == 0:
            return
        self._check_ids("free_index", free_index)
        pages = self._pages_of(free_index)
        self._check_live(pages, "free")
        self._apply(pages, pages[:0])

    def free_swa(self, free_index: torch.Tensor) -> None:
        """Give back the window pages of the (whole) virtual pages holding ``free_index``: the
        tokens left the window; their virtual ids and full pages stay. Pages without a window
        page are skipped."""
        check_index("free_index", free_index, self._virtual)
        if free_index.numel() == 0:
            return
        self._check_ids("free_index", free_index)
        pages = self._pages_of(free_index)
        self._check_live(pages, "free_swa")
        self._apply(pages[:0], pages)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """``free`` of a segment that starts on a page boundary (``start_pos``, the position of
        ``free_index[0]`` in its request) and lists each page's ids contiguously."""
        if type(start_pos) is not int or start_pos < 0 or start_pos % self.page_size:
            raise InvalidArgumentError(
                f"start_pos={start_pos!r} must be an int >= 0 on a page boundary (page_size="
                f"{self.page_size}); use free() for unaligned segments"
            )
        check_index("free_index", free_index, self._virtual)
        if free_index.numel() == 0:
            return
        self._check_ids("free_index", free_index)
        ps = self.page_size
        reps = free_index.to(torch.int64)[::ps]
        pages = reps if ps == 1 else torch.div(reps, ps, rounding_mode="floor")
        if ps > 1 and self.debug_mode:
            if int(reps[0]) % ps:
                raise InvalidArgumentError(
                    f"free_segment: free_index[0]={int(reps[0])} is not the first id of its "
                    "page, so the segment does not list its pages contiguously; use free()"
                )
            debug.check_segment(free_index.to(torch.int64), pages, ps)
        if torch.unique(pages).numel() != pages.numel():
            raise OwnershipError("free_segment: a page is listed twice (a double free)")
        self._check_live(pages, "free_segment")
        self._apply(pages, pages[:0])

    def _apply(self, full_pages: torch.Tensor, swa_pages: torch.Tensor) -> None:
        if self._group is not None:
            self._group[0].append(full_pages)
            self._group[1].append(swa_pages)
            return
        self._release(full_pages, swa_pages)

    def free_group_begin(self) -> None:
        """Collect frees (``free``, ``free_segment``, ``free_swa``) until ``free_group_end``."""
        if self._group is not None:
            raise StateError("free_group_begin called twice without free_group_end")
        self._group = ([], [])

    def free_group_end(self) -> None:
        """Release everything collected since ``free_group_begin``, window frees first. A page
        freed twice in the group is refused there, before anything is released."""
        if self._group is None:
            raise StateError("free_group_end called without free_group_begin")
        full_parts, swa_parts = self._group
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        full = torch.cat([empty, *full_parts])
        if torch.unique(full).numel() != full.numel():
            raise OwnershipError("free_group_end: a page was freed twice in the group")
        self._group = None
        self._release(full, torch.unique(torch.cat([empty, *swa_parts])))
