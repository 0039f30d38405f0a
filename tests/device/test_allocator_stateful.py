"""A hypothesis state machine drives the paged allocator through random alloc_extend /
alloc_decode / free / free_group / free_segment / clear sequences and checks after every step:
no slot owned twice, slot 0 never handed out, owned + free == capacity, and every request's
token j sits at offset j % page_size of its page, right after token j-1 inside a page (new
slots continue the last page before opening new pages)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiered_kv.device import PagedTokenToKVPoolAllocator
from tiered_kv.device.allocator import num_new_pages


class PagedAllocatorMachine(RuleBasedStateMachine):
    backend = "torch"

    @initialize(
        page_size=st.sampled_from([1, 4, 16, 64]),
        num_pages=st.integers(1, 24),
        need_sort=st.booleans(),
    )
    def setup(self, page_size, num_pages, need_sort):
        self.page_size = page_size
        self.num_pages = num_pages
        self.alloc = PagedTokenToKVPoolAllocator(
            num_pages * page_size,
            page_size,
            torch.float16,
            "cpu",
            need_sort=need_sort,
            debug_mode=True,
            kernel_backend=self.backend,
        )
        self.reqs: dict[int, list[int]] = {}
        self.next_id = 0

    # -- helpers ---------------------------------------------------------------------------
    def _free_pages(self) -> int:
        return self.alloc.available_size() // self.page_size

    def _snapshot(self):
        return sorted(self.alloc.get_all_free_pages().tolist()), self.alloc.available_size()

    # -- rules ---------------------------------------------------------------------------------
    @rule(data=st.data(), n_new=st.integers(0, 3))
    def extend(self, data, n_new):
        existing = data.draw(
            st.lists(st.sampled_from(sorted(self.reqs)), unique=True, max_size=3)
            if self.reqs
            else st.just([])
        )
        new_ids = list(range(self.next_id, self.next_id + n_new))
        ids = existing + new_ids
        if not ids:
            return
        ext = data.draw(
            st.lists(st.integers(0, 3 * self.page_size + 1), min_size=len(ids), max_size=len(ids))
        )
        cur = [self.reqs.get(i, []) for i in ids]
        pre = torch.tensor([len(c) for c in cur], dtype=torch.int64)
        seq = pre + torch.tensor(ext, dtype=torch.int64)
        last = torch.tensor([c[-1] if c else -1 for c in cur], dtype=torch.int64)
        need = num_new_pages(pre, seq, self.page_size)
        before = self._snapshot()
        out = self.alloc.alloc_extend(pre, pre.clone(), seq, seq.clone(), last, sum(ext))
        if out is None:
            assert need > self._free_pages(), "refused although enough pages were free"
            assert self._snapshot() == before
            return
        assert need <= before[1] // self.page_size
        assert out.numel() == sum(ext)
        self.next_id += n_new
        for i, part in zip(ids, torch.split(out, ext), strict=True):
            self.reqs[i] = self.reqs.get(i, []) + part.tolist()
        assert self.alloc.available_size() == before[1] - need * self.page_size

    @precondition(lambda self: any(self.reqs.values()))
    @rule(data=st.data())
    def decode(self, data):
        ids = data.draw(
            st.lists(
                st.sampled_from(sorted(i for i, s in self.reqs.items() if s)),
                unique=True,
                min_size=1,
                max_size=5,
            )
        )
        seq = torch.tensor([len(self.reqs[i]) + 1 for i in ids], dtype=torch.int64)
        last = torch.tensor([self.reqs[i][-1] for i in ids], dtype=torch.int64)
        need = num_new_pages(seq - 1, seq, self.page_size)
        before = self._snapshot()
        out = self.alloc.alloc_decode(seq, seq.clone(), last)
        if out is None:
            assert need > self._free_pages()
            assert self._snapshot() == before
            return
        for i, slot in zip(ids, out.tolist(), strict=True):
            self.reqs[i].append(slot)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_request(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        slots = self.reqs.pop(rid)
        if slots:
            perm = data.draw(st.permutations(range(len(slots))))
            self.alloc.free(torch.tensor(slots, dtype=torch.int64)[list(perm)])

    @precondition(lambda self: len(self.reqs) >= 1)
    @rule(data=st.data())
    def free_group(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), unique=True, min_size=1))
        self.alloc.free_group_begin()
        available = self.alloc.available_size()
        for rid in ids:
            slots = self.reqs.pop(rid)
            if not slots:
                continue
            if data.draw(st.booleans()):
                self.alloc.free(torch.tensor(slots, dtype=torch.int64))
            else:
                self.alloc.free_segment(torch.tensor(slots, dtype=torch.int64), start_pos=0)
            assert self.alloc.available_size() == available  # nothing released inside a group
        self.alloc.free_group_end()

    @precondition(lambda self: any(len(s) > 0 for s in self.reqs.values()))
    @rule(data=st.data())
    def free_tail_segment(self, data):
        rid = data.draw(st.sampled_from(sorted(i for i, s in self.reqs.items() if s)))
        slots = self.reqs[rid]
        starts = list(range(0, len(slots), self.page_size))
        start = data.draw(st.sampled_from(starts))
        self.alloc.free_segment(torch.tensor(slots[start:], dtype=torch.int64), start_pos=start)
        self.reqs[rid] = slots[:start]

    @rule()
    def clear(self):
        self.alloc.clear()
        self.reqs.clear()

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def ownership_is_exact(self):
        if not hasattr(self, "alloc"):
            return
        p = self.page_size
        owned_slots = [s for slots in self.reqs.values() for s in slots]
        assert len(owned_slots) == len(set(owned_slots)), "a slot is owned twice"
        assert all(s >= p for s in owned_slots), "a padding-page slot was handed out"
        owned_pages = {s // p for s in owned_slots}
        owners = {}
        for rid, slots in self.reqs.items():
            for s in slots:
                assert owners.setdefault(s // p, rid) == rid, "two requests share a page"
        free = self.alloc.get_all_free_pages().tolist()
        assert len(free) == len(set(free)), "a page is free twice"
        assert not owned_pages & set(free), "an owned page is in the free list"
        assert owned_pages | set(free) == set(range(1, self.num_pages + 1)), "pages leaked"
        assert self.alloc.available_size() == len(free) * p

    @invariant()
    def pages_are_filled_in_order(self):
        if not hasattr(self, "alloc"):
            return
        p = self.page_size
        for slots in self.reqs.values():
            for j, s in enumerate(slots):
                assert s % p == j % p, f"token {j} at slot {s} is at the wrong page offset"
                if j % p:
                    assert s == slots[j - 1] + 1, f"token {j} did not continue its page"


PagedAllocatorMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPagedAllocatorTorch = PagedAllocatorMachine.TestCase


class TritonPagedAllocatorMachine(PagedAllocatorMachine):
    """The same machine on the Triton kernels (interpreted on CPU: fewer, shorter runs)."""

    backend = "triton"


TritonPagedAllocatorMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPagedAllocatorTriton = pytest.mark.slow(TritonPagedAllocatorMachine.TestCase)
