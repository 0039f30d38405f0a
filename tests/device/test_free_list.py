"""The allocators' free lists: a queue whose handed-out views never change, a stack that never
grows and refuses more pages than are handed out."""

from __future__ import annotations

import pytest
import torch

from tiered_kv import OwnershipError
from tiered_kv.device.allocator.free_list import PageStack, SlotQueue

CPU = torch.device("cpu")


def test_queue_takes_from_the_head_and_appends_behind_the_tail(gen):
    q = SlotQueue(10, CPU)
    a = q.take(4)
    assert a.tolist() == [1, 2, 3, 4] and q.count == 6
    q.put(torch.tensor([3, 1]))
    assert q.live.tolist() == [5, 6, 7, 8, 9, 10, 3, 1]
    views, model = [a], list(range(5, 11)) + [3, 1]
    for _ in range(200):  # many times around: the live ids move to fresh buffers
        k = int(torch.randint(0, q.count + 1, (1,), generator=gen))
        got = q.take(k)
        assert got.tolist() == model[:k]
        views.append((got, got.tolist()))
        model = model[k:]
        back = got[torch.randperm(k, generator=gen)] if k else got
        q.put(back)
        model += back.tolist()
        assert q.live.tolist() == model and q.count == len(model) == 8
    assert a.tolist() == [1, 2, 3, 4]
    assert all(v.tolist() == held for v, held in views[1:])  # no handed-out view was written


def test_queue_replace_and_snapshot():
    q = SlotQueue(6, CPU)
    snap = q.snapshot()
    q.take(6)
    q.put(torch.tensor([4, 2]))
    assert snap.tolist() == [1, 2, 3, 4, 5, 6]
    q.replace(snap)
    assert q.live.tolist() == [1, 2, 3, 4, 5, 6] and q.count == 6


def test_stack_pushes_in_front_and_never_takes_more_than_handed_out():
    s = PageStack(5, CPU)
    first = s.live[:3].tolist()
    s.take(3)
    s.put(torch.tensor([2, 1]))
    assert first == [1, 2, 3] and s.live.tolist() == [2, 1, 4, 5]
    snap = s.snapshot()
    s.take(2)
    s.put(torch.tensor([1]))
    assert snap.tolist() == [2, 1, 4, 5]  # a copy: later pushes do not reach it
    with pytest.raises(OwnershipError, match="3 pages freed but only 2 of 5"):
        s.put(torch.tensor([2, 3, 3]))
    assert s.live.tolist() == [1, 4, 5]
    s.replace(s.live[1:])  # a view of the buffer itself
    assert s.live.tolist() == [4, 5]
    with pytest.raises(OwnershipError, match="6 free pages for a pool of 5"):
        s.replace(torch.arange(6))
