"""Issue 14: PageInterleavePoolAllocator under a hypothesis state machine: chains are extended
at page boundaries, decoded, freed, freed in groups and cleared over 2-4 ranks. After every step:
every free page sits in its own rank's class once, no padding page (logical pages 0..N-1) is
ever handed out, owned + free == capacity, token j sits at offset j % P of a page owned by rank
``(base + j // P) % N`` (so one chain's pages per rank differ by at most one), local rows invert
to the logical slot, and a refused allocation changes nothing. Two allocators fed the same
stream end in the same state (every rank agrees without talking)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiered_kv.device.allocator.page_interleave import PageInterleavePoolAllocator
from tiered_kv.errors import InvalidArgumentError, OwnershipError


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class InterleaveMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 4]),
        shard=st.integers(2, 4),
        pages_per_rank=st.integers(1, 6),
        need_sort=st.booleans(),
    )
    def setup(self, page_size, shard, pages_per_rank, need_sort):
        self.p, self.n, self.k = page_size, shard, pages_per_rank
        self.alloc = PageInterleavePoolAllocator(
            pages_per_rank * page_size, page_size, shard, need_sort=need_sort, debug_mode=True
        )
        self.reqs: dict[int, list[int]] = {}
        self.bases: dict[int, int] = {}
        self.next_id = 0

    def _snapshot(self):
        return sorted(self.alloc.get_all_free_pages().tolist()), self.alloc.class_free_page_counts()

    @rule(data=st.data())
    def extend(self, data):
        p = self.p
        aligned = sorted(r for r, s in self.reqs.items() if len(s) % p == 0)
        existing = data.draw(
            st.lists(st.sampled_from(aligned), unique=True, max_size=2) if aligned else st.just([])
        )
        ids = existing + [self.next_id] * data.draw(st.integers(0, 1))
        if not ids:
            return
        ext = data.draw(st.lists(st.integers(1, 3 * p + 1), min_size=len(ids), max_size=len(ids)))
        cur = [self.reqs.get(i, []) for i in ids]
        pre = _t([len(c) for c in cur])
        seq = pre + _t(ext)
        last = _t([c[-1] if c else -1 for c in cur])
        bases = [self.bases.get(i) for i in ids]
        before = self._snapshot()
        out = self.alloc.alloc_extend(pre, pre.clone(), seq, seq.clone(), last, sum(ext), bases)
        if out is None:
            assert self._snapshot() == before, "a refused extend changed something"
            assert [self.bases.get(i) for i in ids] == [self.bases.get(i) for i in ids]
            return
        if ids[-1] == self.next_id:
            self.next_id += 1
        for i, part, b in zip(ids, torch.split(out, ext), bases, strict=True):
            self.reqs.setdefault(i, []).extend(part.tolist())
            assert b is not None
            self.bases.setdefault(i, b)

    @precondition(lambda self: any(self.reqs.values()))
    @rule(data=st.data())
    def decode(self, data):
        ids = data.draw(
            st.lists(st.sampled_from(sorted(self.reqs)), unique=True, min_size=1, max_size=3)
        )
        seq = _t([len(self.reqs[i]) + 1 for i in ids])
        last = _t([self.reqs[i][-1] for i in ids])
        before = self._snapshot()
        out = self.alloc.alloc_decode(seq, seq.clone(), last)
        if out is None:
            assert self._snapshot() == before
            return
        for i, s in zip(ids, out.tolist(), strict=True):
            self.reqs[i].append(s)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.bases.pop(rid)
        slots = self.reqs.pop(rid)
        perm = data.draw(st.permutations(range(len(slots))))
        self.alloc.free(_t(slots)[list(perm)])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish_group(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), unique=True, min_size=1))
        self.alloc.free_group_begin()
        free = self.alloc.aggregate_free_size()
        for rid in ids:
            self.bases.pop(rid)
            self.alloc.free(_t(self.reqs.pop(rid)))
            assert self.alloc.aggregate_free_size() == free
        self.alloc.free_group_end()

    @rule()
    def clear(self):
        self.alloc.clear()
        self.reqs.clear()
        self.bases.clear()

    @invariant()
    def classes_and_ownership(self):
        if not hasattr(self, "alloc"):
            return
        a, p, n = self.alloc, self.p, self.n
        owned = [s for ss in self.reqs.values() for s in ss]
        assert len(owned) == len(set(owned)), "a slot is owned twice"
        pages = {s // p for s in owned}
        assert all(q >= n for q in pages), "a padding page was handed out"
        free = a.get_all_free_pages().tolist()
        assert len(free) == len(set(free)) and not pages & set(free)
        assert pages | set(free) == {j * n + r for j in range(1, self.k + 1) for r in range(n)}
        for c, (f, r) in enumerate(zip(a._free, a._released, strict=True)):
            assert all(q % n == c for q in f + r), f"class {c} holds another rank's page"
        assert a.available_size() == n * p * min(a.class_free_page_counts())

    @invariant()
    def chains_rotate_through_the_ranks(self):
        if not hasattr(self, "alloc"):
            return
        a, p, n = self.alloc, self.p, self.n
        for rid, ss in self.reqs.items():
            b = self.bases[rid]
            t = _t(ss)
            assert a.owner_rank(t).tolist() == [(b + j // p) % n for j in range(len(ss))]
            assert all(s % p == j % p for j, s in enumerate(ss))
            local = a.local_slot(t)
            assert bool((local < a.size_per_rank + p).all()) and bool((local >= p).all())
            back = (local // p) * n * p + a.owner_rank(t) * p + local % p
            assert torch.equal(back, t), "local rows do not invert"
            per_rank = torch.bincount(
                a.owner_rank(_t(sorted({s // p * p for s in ss}))), minlength=n
            )
            assert int(per_rank.max() - per_rank.min()) <= 1


InterleaveMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPageInterleave = InterleaveMachine.TestCase


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.booleans()), max_size=12))
def test_two_ranks_fed_the_same_stream_agree(stream):
    a, b = (PageInterleavePoolAllocator(16, 4, 3, debug_mode=True) for _ in range(2))
    held = []
    for n, free_first in stream:
        if free_first and held:
            x = held.pop(0)
            a.free(x)
            b.free(x.clone())
        outs = [z.alloc_extend(_t([0]), _t([0]), _t([n]), _t([n]), _t([-1]), n) for z in (a, b)]
        assert (outs[0] is None) == (outs[1] is None)
        if outs[0] is not None:
            assert torch.equal(outs[0], outs[1])
            held.append(outs[0])
        assert a._free == b._free and a._released == b._released


def test_the_tightest_rank_gates_admission_and_misuse_is_named():
    a = PageInterleavePoolAllocator(8, 4, 2, debug_mode=True)  # 2 pages per rank
    x = a.alloc_cyclic(0, 4)  # one page of rank 0
    assert a.class_free_page_counts() == [1, 2]
    assert a.available_size() == 8 and a.aggregate_free_size() == 12
    assert a.alloc_cyclic(0, 12) is None and a.class_free_page_counts() == [1, 2]
    assert a.alloc_cyclic(1, 12) is not None  # rank 1, 0, 1
    with pytest.raises(InvalidArgumentError, match="not whole pages"):
        a.alloc_extend(_t([2]), _t([2]), _t([5]), _t([5]), _t([17]), 3)
    with pytest.raises(OwnershipError, match="already free|double free"):
        a.free(x)
        a.free(x)
    with pytest.raises(InvalidArgumentError):
        PageInterleavePoolAllocator(8, 4, 1)
    with pytest.raises(InvalidArgumentError, match="whole pages"):
        PageInterleavePoolAllocator(10, 4, 2)
