"""Torch references of the allocation kernels, with the launchers' exact signatures.

They are the CPU production path (the Triton interpreter is correct but slow) and the oracle the
Triton kernels are tested against. Like the kernels they trust the caller: the allocator has
already validated the lengths and proved that ``free_pages`` holds every page they will read.
"""

from __future__ import annotations

import torch


def _ceil_pages(lens: torch.Tensor, page_size: int) -> torch.Tensor:
    return (lens + page_size - 1) // page_size


def alloc_extend(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    out_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Fill ``out_indices`` with the physical slots of every request's new tokens.

    Request i owns ``out_indices[sum(ext[:i]) : sum(ext[:i+1])]`` (ext = seq - prefix). Its
    tokens first continue the half-full page that ends at ``last_loc[i]`` (part 1), then take
    whole pages from ``free_pages`` starting at the prefix sum of earlier requests' new-page
    counts (parts 2 and 3)."""
    prefix = prefix_lens.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    ext = seq - prefix
    total = int(out_indices.numel())
    if total == 0:
        return
    device = out_indices.device
    new_pages = _ceil_pages(seq, page_size) - _ceil_pages(prefix, page_size)
    page_start = torch.cumsum(new_pages, 0) - new_pages
    out_start = torch.cumsum(ext, 0) - ext

    req = torch.repeat_interleave(torch.arange(ext.numel(), device=device), ext)
    pos = prefix[req] + torch.arange(total, device=device) - out_start[req]
    boundary = _ceil_pages(prefix, page_size)[req] * page_size
    in_part1 = pos < boundary
    # Part 1 continues the request's last page right after last_loc.
    part1 = last_loc.to(torch.int64)[req] + 1 + (pos - prefix[req])
    # Parts 2 and 3: the k-th new page of the request, slot pos % page_size inside it.
    new_page_idx = page_start[req] + (pos - boundary).clamp_min(0) // page_size
    safe_idx = torch.where(in_part1, torch.zeros_like(new_page_idx), new_page_idx)
    pages = free_pages[safe_idx] if free_pages.numel() else torch.zeros_like(safe_idx)
    part23 = pages.to(torch.int64) * page_size + pos % page_size
    out_indices.copy_(torch.where(in_part1, part1, part23))


def alloc_decode(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    out_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Fill ``out_indices[i]`` with the slot of request i's one new token (``seq_lens`` already
    counts it): ``last_loc + 1`` inside the current page, or the first slot of the next free
    page when the previous length filled its last page."""
    if out_indices.numel() == 0:
        return
    seq = seq_lens.to(torch.int64)
    opens_page = (seq - 1) % page_size == 0
    new_pages = opens_page.to(torch.int64)
    page_idx = torch.cumsum(new_pages, 0) - new_pages
    safe_idx = torch.where(opens_page, page_idx, torch.zeros_like(page_idx))
    fresh = free_pages[safe_idx].to(torch.int64) * page_size if free_pages.numel() else safe_idx
    out_indices.copy_(torch.where(opens_page, fresh, last_loc.to(torch.int64) + 1))
