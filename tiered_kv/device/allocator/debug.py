"""Debug mode's checks of the allocators: the ones that read index values beyond their range.

Reading values costs a device sync on CUDA and O(free list) work on any device, so they run only
with ``debug_mode`` (``TIERED_KV_DEBUG=1``, on in the test suite), as the seed runs its
``free_group_end`` check. (The range of freed ids is checked in every mode, by
``inputs.check_free_slots``: one ``aminmax``, O(1) in Python.) Each raises before anything
changes: OwnershipError for what would hand one slot to two owners (a double free, a page freed
twice, a slot handed out twice), InvalidArgumentError for a malformed segment.
"""

from __future__ import annotations

import torch

from tiered_kv.device.allocator.inputs import AllocatorView
from tiered_kv.errors import InvalidArgumentError, OwnershipError


def check_segment(free_index: torch.Tensor, reps: torch.Tensor, page_size: int) -> None:
    """``free_index[::page_size]`` names each page of ``free_index`` exactly once."""
    pages = free_index // page_size
    uniq = torch.unique(reps)
    if uniq.numel() != reps.numel() or not torch.equal(torch.unique(pages), uniq):
        raise InvalidArgumentError(
            "free_segment: free_index does not list each page's slots contiguously from a "
            "page boundary; use free()"
        )


def check_release(alloc: AllocatorView, page_ids: tuple[torch.Tensor, ...]) -> None:
    """Releasing ``page_ids`` would put no page in the free list twice and no page outside
    1..num_pages into it."""
    new = torch.cat(page_ids)
    bad = new[(new < 1) | (new > alloc.num_pages)]
    if bad.numel():
        raise OwnershipError(
            f"pages {bad[:8].tolist()} are outside 1..{alloc.num_pages} (page 0 is padding)"
        )
    merged = torch.cat((alloc.get_all_free_pages(), new))
    uniq, counts = torch.unique(merged, return_counts=True)
    dup = uniq[counts > 1]
    if dup.numel():
        raise OwnershipError(
            f"double free: pages {dup[:16].tolist()} would be in the free list twice "
            f"({int(dup.numel())} pages)"
        )


def check_alloc(alloc: AllocatorView, out: torch.Tensor) -> None:
    """The slots just handed out are distinct, not padding, and none of their pages is still
    in the free list."""
    if out.numel() == 0:
        return
    if torch.unique(out).numel() != out.numel():
        raise OwnershipError("allocation handed out a slot twice within one call")
    if int(out.min()) < alloc.page_size:
        raise OwnershipError("allocation handed out a slot of the padding page")
    pages = torch.unique(out // alloc.page_size)
    if torch.isin(pages, alloc.get_all_free_pages()).any():
        raise OwnershipError("allocation handed out a page that is still in the free list")


def check_no_duplicate_pages(alloc: AllocatorView) -> None:
    """The free list (staged included) holds no page twice and no invalid page."""
    pages = alloc.get_all_free_pages()
    uniq, counts = torch.unique(pages, return_counts=True)
    if (counts > 1).any():
        raise OwnershipError(f"free list holds pages twice: {uniq[counts > 1][:16].tolist()}")
    if pages.numel() and (int(pages.min()) < 1 or int(pages.max()) > alloc.num_pages):
        raise OwnershipError(f"free list holds pages outside 1..{alloc.num_pages}")
