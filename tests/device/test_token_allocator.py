"""TokenToKVPoolAllocator: page_size 1, slot granular, extend and decode are plain allocs."""

from __future__ import annotations

import pytest
import torch

from tiered_kv import InvalidArgumentError
from tiered_kv.device import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


def test_alloc_takes_from_the_head_and_never_slot_zero():
    alloc = TokenToKVPoolAllocator(10, torch.float16, "cpu")
    assert alloc.page_size == 1
    assert alloc.alloc(3).tolist() == [1, 2, 3]
    assert alloc.alloc(8) is None
    rest = alloc.alloc(7)
    assert rest.tolist() == list(range(4, 11))
    assert alloc.available_size() == 0


def test_extend_and_decode_match_paged_allocator_with_page_one(gen):
    token = TokenToKVPoolAllocator(500, torch.float16, "cpu")
    paged = PagedTokenToKVPoolAllocator(500, 1, torch.float16, "cpu", kernel_backend="torch")
    pre = torch.randint(0, 50, (6,), generator=gen)
    seq = pre + torch.randint(0, 30, (6,), generator=gen)
    last = torch.where(pre > 0, torch.randint(1, 400, (6,), generator=gen), -1)
    n = int((seq - pre).sum())
    a = token.alloc_extend(pre, pre.clone(), seq, seq.clone(), last, n)
    b = paged.alloc_extend(pre, pre.clone(), seq, seq.clone(), last, n)
    assert torch.equal(a, b)
    d_seq = seq + 1
    d_last = torch.randint(1, 400, (6,), generator=gen)
    assert torch.equal(
        token.alloc_decode(d_seq, d_seq.clone(), d_last),
        paged.alloc_decode(d_seq, d_seq.clone(), d_last),
    )
    assert token.available_size() == paged.available_size()


def test_free_and_need_sort():
    alloc = TokenToKVPoolAllocator(8, torch.float16, "cpu", need_sort=True)
    slots = alloc.alloc(8)
    alloc.free(slots[[6, 1, 4]])
    assert alloc.available_size() == 3 and alloc.free_pages.numel() == 0
    assert alloc.alloc(2).tolist() == [2, 5]  # merged and sorted first
    with pytest.raises(InvalidArgumentError, match="\\[0\\] outside"):
        alloc.free(torch.tensor([0]))
    with pytest.raises(InvalidArgumentError, match="\\[9\\] outside"):
        alloc.free(torch.tensor([9]))


def test_extend_validates_like_the_paged_allocator():
    alloc = TokenToKVPoolAllocator(8, torch.float16, "cpu")
    pre, seq = torch.tensor([4]), torch.tensor([2])
    with pytest.raises(InvalidArgumentError, match="longer than seq_lens"):
        alloc.alloc_extend(pre, pre, seq, seq, torch.tensor([3]), 0)
    assert alloc.available_size() == 8
