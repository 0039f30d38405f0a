"""GPU check (marker ``gpu``): with debug mode off, the allocators never sync with the host,
except ``free``'s ``torch.unique`` at page size > 1 (``free_segment`` is the sync-free release).
``torch.cuda.set_sync_debug_mode("error")`` turns any synchronising call into an error."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tiered_kv.device import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _paged_calls(page_size, sync_check):
    alloc = PagedTokenToKVPoolAllocator(256 * page_size, page_size, None, "cuda", debug_mode=False)
    lens = torch.tensor([3 * page_size + 1, 5, page_size])
    zeros = torch.zeros_like(lens)
    dz, dl, none = zeros.cuda(), lens.cuda(), torch.full((3,), -1, device="cuda")
    first = alloc.alloc_extend(dz, zeros, dl, lens, none, int(lens.sum()))
    last = first[(torch.cumsum(lens, 0) - 1).cuda()]
    seq = lens + 1
    dseq, dl7 = seq.cuda(), dl + 7
    with sync_check():
        out = alloc.alloc_extend(dl, lens, dl7, lens + 7, last, 21)
        dec = alloc.alloc_decode(dseq, seq, last)
        alloc.free_segment(first[:page_size], start_pos=0)
    torch.cuda.synchronize()
    return out, dec


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_allocator_does_not_sync_without_debug_mode(page_size):
    expect = _paged_calls(page_size, contextlib.nullcontext)  # compiles the kernels first
    got = _paged_calls(page_size, no_sync)
    assert all(torch.equal(a, b) for a, b in zip(expect, got, strict=True))


def test_token_allocator_does_not_sync_without_debug_mode():
    alloc = TokenToKVPoolAllocator(4096, None, "cuda", debug_mode=False)
    lens = torch.tensor([7, 9])
    dl, last = lens.cuda(), torch.full((2,), -1, device="cuda")
    with no_sync():
        a = alloc.alloc_extend(dl * 0, lens * 0, dl, lens, last, 16)
        b = alloc.alloc_decode(dl + 1, lens + 1, last)
        alloc.free(a)
        alloc.free(b)
    assert alloc.available_size() == 4096
