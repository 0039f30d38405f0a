"""Torch references of the allocation kernels, with the launchers' exact signatures.

They are the CPU production path (the Triton interpreter is correct but slow) and the oracle the
Triton kernels are tested against. Like the kernels they trust the caller: the allocator has
already validated the lengths and proved that ``free_pages`` holds every page they will read.

On a CPU a torch call costs a few microseconds whatever its size, so at the sizes an allocator
sees the number of calls is the cost: the general path makes about ten calls over the tokens and
a dozen over the requests, and the common shapes have shorter paths (one request; page size 1;
a decode step that opens no page or opens one for every request). The keyword-only hints are
what the allocator already knows on the host (``num_new_pages``, the CPU copies of the
lengths); without them the reference reads the device tensors (a sync on CUDA).
"""

from __future__ import annotations

import torch


def _ceil_pages(lens: torch.Tensor, page_size: int) -> torch.Tensor:
    return (lens + (page_size - 1)) // page_size


def _host(t: torch.Tensor, hint: torch.Tensor | None) -> list[int]:
    return (hint if hint is not None else t).tolist()


def alloc_extend(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    out_indices: torch.Tensor,
    page_size: int,
    *,
    num_new_pages: int | None = None,
    prefix_lens_cpu: torch.Tensor | None = None,
    seq_lens_cpu: torch.Tensor | None = None,
) -> None:
    """Fill ``out_indices`` with the physical slots of every request's new tokens.

    Request i owns ``out_indices[sum(ext[:i]) : sum(ext[:i+1])]`` (ext = seq - prefix). Its
    tokens first continue the half-full page that ends at ``last_loc[i]`` (part 1), then take
    whole pages from ``free_pages`` starting at the prefix sum of earlier requests' new-page
    counts (parts 2 and 3)."""
    total = int(out_indices.numel())
    if total == 0:
        return
    if page_size == 1:  # no page to continue: the slots are the first free pages, in order
        out_indices.copy_(free_pages[:total])
        return
    if prefix_lens.shape[0] == 1:
        pre = _host(prefix_lens, prefix_lens_cpu)[0]
        seq = _host(seq_lens, seq_lens_cpu)[0]
        _extend_one(pre, seq, last_loc, free_pages, out_indices, page_size)
        return
    P = page_size
    prefix = prefix_lens.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    ext = seq - prefix
    ceil_pre = _ceil_pages(prefix, P)
    new_pages = _ceil_pages(seq, P) - ceil_pre
    if num_new_pages is None:
        num_new_pages = int(new_pages.sum())
    out_start = torch.cumsum(ext, 0) - ext
    page_start = torch.cumsum(new_pages, 0) - new_pages
    num1 = torch.minimum(seq, ceil_pre * P) - prefix  # part 1: the rest of the current page
    # Per request, three numbers that turn the output position j of one of its tokens into
    # that token's slot with one add each: part 1 slots are last_loc + 1 + (j - out_start);
    # "u" counts page-part tokens from the batch's first new page, so the token is at slot
    # u % P of page free_pages[u // P]; j < end1 marks part 1.
    per_req = torch.stack(
        (
            last_loc.to(torch.int64) + 1 - out_start,
            page_start * P - num1 - out_start,
            out_start + num1,
        ),
        dim=1,
    )
    per_tok = torch.repeat_interleave(per_req, ext, dim=0, output_size=total)
    j = torch.arange(total, dtype=torch.int64, device=out_indices.device)
    part1 = per_tok[:, 0] + j
    if num_new_pages == 0:
        out_indices.copy_(part1)
        return
    u = per_tok[:, 1] + j
    # Part 1 tokens have u < page_start * P, so u // P >= -1: index -1 reads a valid (unused)
    # entry of the first num_new_pages pages.
    page_slots = free_pages[:num_new_pages] * P
    slots = page_slots[u // P] + u % P
    torch.where(j < per_tok[:, 2], part1, slots, out=out_indices)


def _extend_one(
    pre: int,
    seq: int,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    out: torch.Tensor,
    page_size: int,
) -> None:
    """One request: part 1 from ``last_loc``, then whole pages, with Python ints for lengths."""
    boundary = -(-pre // page_size) * page_size
    num1 = min(seq, boundary) - pre
    if num1:
        steps = torch.arange(1, num1 + 1, dtype=torch.int64, device=out.device)
        torch.add(steps, last_loc.to(torch.int64), out=out[:num1])
    rest = seq - boundary
    if rest <= 0:
        return
    pages = -(-rest // page_size)
    offsets = torch.arange(page_size, dtype=torch.int64, device=out.device)
    slots = free_pages[:pages, None] * page_size + offsets
    out[num1:] = slots.view(-1)[:rest]


def alloc_decode(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    out_indices: torch.Tensor,
    page_size: int,
    *,
    num_new_pages: int | None = None,
    seq_lens_cpu: torch.Tensor | None = None,
) -> None:
    """Fill ``out_indices[i]`` with the slot of request i's one new token (``seq_lens`` already
    counts it): ``last_loc + 1`` inside the current page, or the first slot of the next free
    page when the previous length filled its last page."""
    bs = out_indices.numel()
    if bs == 0:
        return
    if page_size == 1:  # every token opens a page
        out_indices.copy_(free_pages[:bs])
        return
    opens = None
    if num_new_pages is None:
        opens = seq_lens % page_size == 1  # seq - 1 tokens filled whole pages
        num_new_pages = int(opens.sum())
    if num_new_pages == 0:
        torch.add(last_loc, 1, out=out_indices)
    elif num_new_pages == bs:
        torch.mul(free_pages[:bs], page_size, out=out_indices)
    else:
        if opens is None:
            opens = seq_lens % page_size == 1
        # The k-th opening request takes free page k; the others' index is unused (>= -1).
        rank = torch.cumsum(opens, 0) - 1
        fresh = free_pages[:num_new_pages][rank] * page_size
        torch.where(opens, fresh, last_loc.to(torch.int64) + 1, out=out_indices)
