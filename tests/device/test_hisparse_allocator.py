"""Issue 14: HiSparseTokenToKVPoolAllocator under a hypothesis state machine (page 1 and paged):
prefills take logical and device slots, decodes logical only, a staged request's device slots
become its fixed buffer (surplus pages freed, a short buffer topped up), device slots are given
back while logical slots stay. After every step, on both sides: no slot owned twice, padding
never handed out, owned + free == capacity; the table pairs exactly the tokens that have a
device slot and its -1 sentinel stays; a refused allocation changes nothing. Then transfers:
logical ids translate to device slots, and one without a device slot is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiered_kv.device.allocator import num_new_pages
from tiered_kv.device.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from tiered_kv.errors import InvalidArgumentError, StateError


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class HiSparseMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 4]),
        device_pages=st.integers(1, 12),
        ratio=st.integers(1, 4),
        need_sort=st.booleans(),
    )
    def setup(self, page_size, device_pages, ratio, need_sort):
        self.p, self.device_pages, self.ratio = page_size, device_pages, ratio
        self.alloc = HiSparseTokenToKVPoolAllocator(
            device_pages * page_size, page_size, torch.float16, "cpu", None, need_sort,
            host_to_device_ratio=ratio, debug_mode=True, kernel_backend="torch",
        )  # fmt: skip
        self.logical: dict[int, list[int]] = {}
        self.dev: dict[int, list[int | None]] = {}  # per token: its device slot, or None
        self.buffer: dict[int, list[int]] = {}  # a staged request's fixed device buffer
        self.next_id = 0

    def _snapshot(self):
        a = self.alloc
        return (
            sorted(a.logical_allocator.get_all_free_pages().tolist()),
            sorted(a.device_allocator.get_all_free_pages().tolist()),
            a.logical_to_device.clone(),
        )

    def _same(self, before) -> bool:
        now = self._snapshot()
        return now[:2] == before[:2] and torch.equal(now[2], before[2])

    @rule(data=st.data())
    def prefill(self, data):
        """A new request's prefill (fresh requests only: a staged one decodes)."""
        p = self.p
        n = data.draw(st.integers(1, 3 * p + 1))
        pre, seq = _t([0]), _t([n])
        need = num_new_pages(pre, seq, p) if p > 1 else n
        before = self._snapshot()
        out = self.alloc.alloc_extend(pre, pre.clone(), seq, seq.clone(), _t([-1]), n)
        if out is None:
            assert need * p > self.alloc.available_size()
            assert self._same(before)
            return
        rid = self.next_id
        self.next_id += 1
        self.logical[rid] = out.tolist()
        self.dev[rid] = self.alloc.translate_loc(out).tolist()

    @precondition(lambda self: self.logical)
    @rule(data=st.data())
    def decode(self, data):
        rid = data.draw(st.sampled_from(sorted(self.logical)))
        seq = _t([len(self.logical[rid]) + 1])
        dev_free = self.alloc.device_available_size()
        out = self.alloc.alloc_decode(seq, seq.clone(), _t([self.logical[rid][-1]]))
        assert self.alloc.device_available_size() == dev_free  # logical only
        if out is not None:
            self.logical[rid].append(int(out))
            self.dev[rid].append(None)

    @precondition(lambda self: any(r not in self.buffer for r in self.logical))
    @rule(data=st.data())
    def stage(self, data):
        """Staging finished: the request keeps a fixed device buffer."""
        rid = data.draw(st.sampled_from(sorted(r for r in self.logical if r not in self.buffer)))
        need = data.draw(st.integers(0, 3)) * self.p
        held = [d for d in self.dev[rid] if d is not None]
        before = self._snapshot()
        got = self.alloc.alloc_device_buffer(_t(self.logical[rid]), need)
        if got is None:
            assert self._same(before)
            return
        got = got.tolist()
        assert len(got) == need and len(set(got)) == need
        assert got[: min(need, len(held))] == held[: min(need, len(held))]
        self.buffer[rid] = got
        self.dev[rid] = [None] * len(self.logical[rid])

    @precondition(lambda self: any(any(d is not None for d in v) for v in self.dev.values()))
    @rule(data=st.data())
    def give_back(self, data):
        rid = data.draw(
            st.sampled_from(sorted(r for r, v in self.dev.items() if any(d is not None for d in v)))
        )
        p = self.p
        # whole pages of the request's tokens (device pages are shared by a page's tokens)
        pages = sorted({j // p for j, d in enumerate(self.dev[rid]) if d is not None})
        pick = data.draw(st.lists(st.sampled_from(pages), unique=True, min_size=1))
        idx = [j for pg in pick for j in range(pg * p, min(pg * p + p, len(self.dev[rid])))]
        self.alloc.free_device(_t([self.logical[rid][j] for j in idx]))
        for j in idx:
            self.dev[rid][j] = None

    @precondition(lambda self: self.logical)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.logical)))
        self.alloc.free(_t(self.logical.pop(rid)))
        self.dev.pop(rid)
        buf = self.buffer.pop(rid, [])
        if buf:
            self.alloc.free_device_slots(_t(buf))

    @rule()
    def clear(self):
        self.alloc.clear()
        self.logical.clear()
        self.dev.clear()
        self.buffer.clear()

    # -- invariants ----------------------------------------------------------------------------
    def _side(self, owned: list[list[int]], sub, pages: int, name: str) -> None:
        p = self.p
        slots = [s for ss in owned for s in ss]
        assert len(slots) == len(set(slots)), f"{name}: a slot is owned twice"
        assert all(s >= p for s in slots), f"{name}: padding handed out"
        held = {s // p for s in slots}
        free = sub.get_all_free_pages().tolist()
        assert len(free) == len(set(free)) and not held & set(free), f"{name}: free list"
        assert held | set(free) == set(range(1, pages + 1)), f"{name}: pages leaked"

    @invariant()
    def ownership(self):
        if not hasattr(self, "alloc"):
            return
        a = self.alloc
        self._side(
            list(self.logical.values()),
            a.logical_allocator,
            self.device_pages * self.ratio,
            "logical",
        )
        dev = [[d for d in v if d is not None] for v in self.dev.values()]
        self._side(
            dev + list(self.buffer.values()), a.device_allocator, self.device_pages, "device"
        )

    @invariant()
    def the_table(self):
        if not hasattr(self, "alloc"):
            return
        table = self.alloc.logical_to_device
        assert int(table[-1]) == -1
        want = torch.zeros_like(table[:-1])
        for rid, ls in self.logical.items():
            for lg, d in zip(ls, self.dev[rid], strict=True):
                want[lg] = 0 if d is None else d
        assert torch.equal(table[:-1], want)


HiSparseMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestHiSparseAllocator = HiSparseMachine.TestCase


def test_transfers_translate_and_refuse_host_only_tokens():
    a = HiSparseTokenToKVPoolAllocator(32, 4, torch.float16, "cpu", host_to_device_ratio=4)
    assert (a.size, a.size_device, a.available_size()) == (128, 32, 32)
    out = a.alloc_extend(_t([0]), _t([0]), _t([10]), _t([10]), _t([-1]), 10)
    dev = a.translate_kv_indices_for_transfer(out)
    assert torch.equal(dev, a.translate_loc(out)) and bool((dev > 0).all())
    tok = a.alloc_decode(_t([11]), _t([11]), out[-1:])
    with pytest.raises(StateError, match="have no device slot"):
        a.translate_kv_indices_for_transfer(torch.cat([out, tok]))
    assert a.translate_loc(_t([-1])).tolist() == [-1]
    with pytest.raises(InvalidArgumentError, match="multiple of 4"):
        a.alloc_device_buffer(out, 6)
    buf = a.alloc_device_buffer(torch.cat([out, tok]), 8)
    assert buf.tolist() == dev[:8].tolist()
    assert a.device_available_size() == 32 - 8  # the third page went back
    a.free(torch.cat([out, tok]))
    a.free_device_slots(buf)
    assert a.available_size() == 32 and a.logical_available_size() == 128
