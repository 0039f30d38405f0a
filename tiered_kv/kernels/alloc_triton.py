"""Triton allocation kernels and their launchers (``*_kernel`` / launcher pairs).

Import this module only through :func:`tiered_kv.kernels.alloc_kernels`, which imports Triton via
``tiered_kv.platform`` first so that a CPU-only process runs the kernels under the interpreter.

One program handles one request. Each program recomputes the prefix sums it needs (its output
offset and its first new page) from a masked load of the whole batch: O(bs^2) loads in total,
cheap for bs up to a few hundred, and no cross-program communication. Nothing here synchronises
with the host; the allocator has proved that ``free_pages`` is deep enough before launching.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiered_kv.errors import InvalidArgumentError

# Full pages are written BLOCK_EXTEND slots at a time in a loop whose bound is a runtime value,
# so Triton emits a real loop and compiles the kernel once for every extend length.
BLOCK_EXTEND = 4096


# free_page_ptr is a sliced view whose alignment changes every call; do not specialise on it.
@triton.jit(do_not_specialize=["free_page_ptr"], do_not_specialize_on_alignment=["free_page_ptr"])
def alloc_extend_kernel(
    pre_lens_ptr,
    seq_lens_ptr,
    last_loc_ptr,
    free_page_ptr,
    out_indices_ptr,
    BS_UPPER: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    load_offset = tl.arange(0, BS_UPPER)
    upto_self = load_offset <= pid
    seq_lens = tl.load(seq_lens_ptr + load_offset, mask=upto_self, other=0).to(tl.int64)
    pre_lens = tl.load(pre_lens_ptr + load_offset, mask=upto_self, other=0).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + pid).to(tl.int64)
    pre_len = tl.load(pre_lens_ptr + pid).to(tl.int64)

    # Prefix sum 1: where this request's slots start in out_indices.
    output_start_loc = tl.sum(seq_lens - pre_lens) - (seq_len - pre_len)
    # Prefix sum 2: which entry of free_pages is this request's first new page.
    num_new_pages = (seq_lens + PAGE_SIZE - 1) // PAGE_SIZE - (
        pre_lens + PAGE_SIZE - 1
    ) // PAGE_SIZE
    num_new_pages_self = (seq_len + PAGE_SIZE - 1) // PAGE_SIZE - (
        pre_len + PAGE_SIZE - 1
    ) // PAGE_SIZE
    new_page_start_loc = tl.sum(num_new_pages) - num_new_pages_self

    # Part 1: continue the half-full page that ends at last_loc.
    first_boundary = (pre_len + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
    num_part1 = tl.minimum(seq_len, first_boundary) - pre_len
    offset_one_page = tl.arange(0, PAGE_BLOCK)
    last_loc = tl.load(last_loc_ptr + pid).to(tl.int64)
    tl.store(
        out_indices_ptr + output_start_loc + offset_one_page,
        last_loc + 1 + offset_one_page,
        mask=offset_one_page < num_part1,
    )
    if pre_len + num_part1 == seq_len:
        return

    # Part 2: whole new pages.
    num_part2 = seq_len // PAGE_SIZE * PAGE_SIZE - first_boundary
    num_blocks = (num_part2 + BLOCK - 1) // BLOCK
    for block_id in range(num_blocks):
        offset = block_id * BLOCK + tl.arange(0, BLOCK)
        mask = offset < num_part2
        page = tl.load(free_page_ptr + new_page_start_loc + offset // PAGE_SIZE, mask=mask, other=0)
        tl.store(
            out_indices_ptr + output_start_loc + num_part1 + offset,
            page.to(tl.int64) * PAGE_SIZE + offset % PAGE_SIZE,
            mask=mask,
        )

    # Part 3: the head of the last new page, which the sequence only partly fills.
    num_part3 = seq_len - seq_len // PAGE_SIZE * PAGE_SIZE
    if num_part3 > 0:
        last_page = tl.load(free_page_ptr + new_page_start_loc + num_new_pages_self - 1)
        tl.store(
            out_indices_ptr + output_start_loc + num_part1 + num_part2 + offset_one_page,
            last_page.to(tl.int64) * PAGE_SIZE + offset_one_page,
            mask=offset_one_page < num_part3,
        )


@triton.jit(do_not_specialize=["free_page_ptr"], do_not_specialize_on_alignment=["free_page_ptr"])
def alloc_decode_kernel(
    seq_lens_ptr,
    last_loc_ptr,
    free_page_ptr,
    out_indices_ptr,
    BS_UPPER: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    load_offset = tl.arange(0, BS_UPPER)
    upto_self = load_offset <= pid
    seq_lens = tl.load(seq_lens_ptr + load_offset, mask=upto_self, other=1).to(tl.int64)
    # seq_lens already counts the new token, so the length before this step is seq_len - 1.
    opens_page = ((seq_lens - 1) % PAGE_SIZE == 0) & upto_self
    seq_len = tl.load(seq_lens_ptr + pid).to(tl.int64)
    opens_page_self = (seq_len - 1) % PAGE_SIZE == 0
    new_page_start_loc = tl.sum(opens_page.to(tl.int64)) - opens_page_self.to(tl.int64)
    if opens_page_self:
        page = tl.load(free_page_ptr + new_page_start_loc)
        tl.store(out_indices_ptr + pid, page.to(tl.int64) * PAGE_SIZE)
    else:
        last_loc = tl.load(last_loc_ptr + pid).to(tl.int64)
        tl.store(out_indices_ptr + pid, last_loc + 1)


def _check_vectors(bs: int, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dim() != 1 or t.numel() != bs or not t.is_contiguous():
            raise InvalidArgumentError(
                f"{name} must be a contiguous 1-D tensor of length {bs}, got shape "
                f"{tuple(t.shape)} (contiguous={t.is_contiguous()})"
            )


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
    """Launch :func:`alloc_extend_kernel`: one program per request, filling ``out_indices``.
    The host-side hints of the torch reference are accepted and not needed."""
    bs = prefix_lens.numel()
    _check_vectors(bs, prefix_lens=prefix_lens, seq_lens=seq_lens, last_loc=last_loc)
    if bs == 0 or out_indices.numel() == 0:
        return
    if out_indices.dtype != torch.int64 or not out_indices.is_contiguous():
        raise InvalidArgumentError(
            f"out_indices must be contiguous int64, got {out_indices.dtype} "
            f"(contiguous={out_indices.is_contiguous()})"
        )
    alloc_extend_kernel[(bs,)](
        prefix_lens,
        seq_lens,
        last_loc,
        free_pages,
        out_indices,
        BS_UPPER=triton.next_power_of_2(bs),
        PAGE_SIZE=page_size,
        PAGE_BLOCK=triton.next_power_of_2(page_size),
        BLOCK=BLOCK_EXTEND,
    )


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
    """Launch :func:`alloc_decode_kernel`: one program per request, one slot each (the
    reference's hints are accepted and not needed)."""
    bs = seq_lens.numel()
    _check_vectors(bs, seq_lens=seq_lens, last_loc=last_loc, out_indices=out_indices)
    if bs == 0:
        return
    alloc_decode_kernel[(bs,)](
        seq_lens,
        last_loc,
        free_pages,
        out_indices,
        BS_UPPER=triton.next_power_of_2(bs),
        PAGE_SIZE=page_size,
    )
