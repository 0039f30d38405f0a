"""Issue 14: a hypothesis state machine drives SWATokenToKVPoolAllocator (page 1 and paged, both
sub-pools of their own sizes) through random extends, decodes, window slides (``free_swa`` of
whole pages that left the window), frees, free groups, tail segments and clears, and checks
after every step, on *both* sub-pools: no slot owned twice, the padding page never handed out,
owned + free == capacity, token j at offset j % page_size (continuing its page), and the table:
every live token's full slot maps to its window slot, a slid-out token's to 0, the -1 sentinel
stays -1. A refused allocation changes nothing on either side."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiered_kv.device.allocator import num_new_pages
from tiered_kv.device.allocator.swa import SWATokenToKVPoolAllocator
from tiered_kv.device.swa_pool import SWAKVPool


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class SWAAllocatorMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 4, 16]),
        full_pages=st.integers(1, 20),
        swa_pages=st.integers(1, 20),
        window_pages=st.integers(1, 3),
        need_sort=st.booleans(),
    )
    def setup(self, page_size, full_pages, swa_pages, window_pages, need_sort):
        p = self.page_size = page_size
        self.full_pages, self.swa_pages = full_pages, swa_pages
        self.window = window_pages * p
        pool = SWAKVPool(full_pages * p, swa_pages * p, p, torch.float16, 1, 4, [0, 2], [1, 3])
        self.alloc = SWATokenToKVPoolAllocator(
            full_pages * p, swa_pages * p, p, torch.float16, "cpu", pool, need_sort,
            debug_mode=True, kernel_backend="torch",
        )  # fmt: skip
        self.full: dict[int, list[int]] = {}
        self.swa: dict[int, list[int | None]] = {}
        self.next_id = 0

    # -- helpers ---------------------------------------------------------------------------
    def _free_pages(self) -> int:
        return self.alloc.available_size() // self.page_size

    def _snapshot(self):
        a = self.alloc
        return (
            sorted(a.full_attn_allocator.get_all_free_pages().tolist()),
            sorted(a.swa_attn_allocator.get_all_free_pages().tolist()),
            a.full_to_swa_index_mapping.clone(),
        )

    def _same(self, before) -> bool:
        now = self._snapshot()
        return now[0] == before[0] and now[1] == before[1] and torch.equal(now[2], before[2])

    def _record(self, ids, parts) -> None:
        for i, part in zip(ids, parts, strict=True):
            full = part.tolist()
            self.full.setdefault(i, []).extend(full)
            swa = self.alloc.translate_loc_from_full_to_swa(part).tolist()
            self.swa.setdefault(i, []).extend(swa)

    def _drop(self, rid: int) -> list[int]:
        self.swa.pop(rid)
        return self.full.pop(rid)

    # -- rules ---------------------------------------------------------------------------------
    @rule(data=st.data(), n_new=st.integers(0, 3))
    def extend(self, data, n_new):
        existing = data.draw(
            st.lists(st.sampled_from(sorted(self.full)), unique=True, max_size=3)
            if self.full
            else st.just([])
        )
        ids = existing + list(range(self.next_id, self.next_id + n_new))
        if not ids:
            return
        p = self.page_size
        ext = data.draw(st.lists(st.integers(0, 3 * p + 1), min_size=len(ids), max_size=len(ids)))
        cur = [self.full.get(i, []) for i in ids]
        pre = _t([len(c) for c in cur])
        seq = pre + _t(ext)
        last = _t([c[-1] if c else -1 for c in cur])
        need = num_new_pages(pre, seq, p) if p > 1 else sum(ext)
        before = self._snapshot()
        out = self.alloc.alloc_extend(pre, pre.clone(), seq, seq.clone(), last, sum(ext))
        if out is None:
            assert need > self._free_pages(), "refused although both sides had the pages"
            assert self._same(before), "a refused extend changed something"
            return
        self.next_id += n_new
        self._record(ids, torch.split(out, ext))

    @precondition(lambda self: any(self.full.values()))
    @rule(data=st.data())
    def decode(self, data):
        live = sorted(i for i, s in self.full.items() if s)
        ids = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1, max_size=5))
        seq = _t([len(self.full[i]) + 1 for i in ids])
        last = _t([self.full[i][-1] for i in ids])
        need = num_new_pages(seq - 1, seq, self.page_size) if self.page_size > 1 else len(ids)
        before = self._snapshot()
        out = self.alloc.alloc_decode(seq, seq.clone(), last)
        if out is None:
            assert need > self._free_pages()
            assert self._same(before)
            return
        self._record(ids, [out[k : k + 1] for k in range(len(ids))])

    @precondition(lambda self: any(self.full.values()))
    @rule(data=st.data())
    def slide(self, data):
        """The window moved: whole pages that lie entirely before it give their window KV
        back (their full KV stays)."""
        rid = data.draw(st.sampled_from(sorted(i for i, s in self.full.items() if s)))
        p, n = self.page_size, len(self.full[rid])
        out_pages = max(0, (n - self.window) // p)
        if not out_pages:
            return
        k = data.draw(st.integers(1, out_pages))
        pages = data.draw(st.lists(st.integers(0, out_pages - 1), min_size=1, max_size=k))
        slots = [self.full[rid][j] for pg in sorted(set(pages)) for j in range(pg * p, pg * p + p)]
        before = self.alloc.swa_available_size()
        self.alloc.free_swa(_t(slots))
        gone = {j for pg in set(pages) for j in range(pg * p, pg * p + p)}
        freed = sum(1 for j in gone if self.swa[rid][j] is not None)
        for j in gone:
            self.swa[rid][j] = None
        assert self.alloc.swa_available_size() == before + freed

    @precondition(lambda self: self.full)
    @rule(data=st.data())
    def free_request(self, data):
        rid = data.draw(st.sampled_from(sorted(self.full)))
        slots = self._drop(rid)
        if slots:
            perm = data.draw(st.permutations(range(len(slots))))
            self.alloc.free(_t(slots)[list(perm)])

    @precondition(lambda self: self.full)
    @rule(data=st.data())
    def free_group(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.full)), unique=True, min_size=1))
        self.alloc.free_group_begin()
        full_free = self.alloc.full_available_size()
        for rid in ids:
            slots = self._drop(rid)
            if not slots:
                continue
            if data.draw(st.booleans()):
                self.alloc.free(_t(slots))
            else:
                self.alloc.free_segment(_t(slots), start_pos=0)
            assert self.alloc.full_available_size() == full_free  # deferred to the group end
        self.alloc.free_group_end()

    @precondition(lambda self: any(self.full.values()))
    @rule(data=st.data())
    def free_tail_segment(self, data):
        rid = data.draw(st.sampled_from(sorted(i for i, s in self.full.items() if s)))
        slots = self.full[rid]
        start = data.draw(st.sampled_from(list(range(0, len(slots), self.page_size))))
        self.alloc.free_segment(_t(slots[start:]), start_pos=start)
        self.full[rid], self.swa[rid] = slots[:start], self.swa[rid][:start]

    @rule()
    def clear(self):
        self.alloc.clear()
        self.full.clear()
        self.swa.clear()

    # -- invariants ----------------------------------------------------------------------------
    def _check_side(self, owned: dict[int, list[int]], sub, num_pages: int, name: str) -> None:
        p = self.page_size
        slots = [s for ss in owned.values() for s in ss]
        assert len(slots) == len(set(slots)), f"{name}: a slot is owned twice"
        assert all(s >= p for s in slots), f"{name}: a padding-page slot was handed out"
        owners: dict[int, int] = {}
        for rid, ss in owned.items():
            for s in ss:
                assert owners.setdefault(s // p, rid) == rid, f"{name}: two requests share a page"
        pages = set(owners)
        free = sub.get_all_free_pages().tolist()
        assert len(free) == len(set(free)), f"{name}: a page is free twice"
        assert not pages & set(free), f"{name}: an owned page is in the free list"
        assert pages | set(free) == set(range(1, num_pages + 1)), f"{name}: pages leaked"
        assert sub.available_size() == len(free) * p

    @invariant()
    def both_sides_own_exactly(self):
        if not hasattr(self, "alloc"):
            return
        a = self.alloc
        self._check_side(self.full, a.full_attn_allocator, self.full_pages, "full")
        live_swa = {r: [s for s in ss if s is not None] for r, ss in self.swa.items()}
        self._check_side(live_swa, a.swa_attn_allocator, self.swa_pages, "window")
        assert a.available_size() == min(a.full_available_size(), a.swa_available_size())

    @invariant()
    def tokens_sit_at_their_page_offsets(self):
        if not hasattr(self, "alloc"):
            return
        p = self.page_size
        for side in (self.full, self.swa):
            for ss in side.values():
                for j, s in enumerate(ss):
                    if s is None:
                        continue
                    assert s % p == j % p, f"token {j} at slot {s}: wrong page offset"
                    if j % p and ss[j - 1] is not None:
                        assert s == ss[j - 1] + 1, f"token {j} did not continue its page"

    @invariant()
    def the_table_pairs_live_tokens_only(self):
        if not hasattr(self, "alloc"):
            return
        table = self.alloc.full_to_swa_index_mapping
        assert int(table[-1]) == -1, "the -1 sentinel was overwritten"
        want = torch.zeros_like(table[:-1])
        for rid, ss in self.full.items():
            for f, s in zip(ss, self.swa[rid], strict=True):
                want[f] = 0 if s is None else s
        assert torch.equal(table[:-1], want), "the full -> window table is wrong"
        assert self.alloc.translate_loc_from_full_to_swa(_t([-1])).tolist() == [-1]


SWAAllocatorMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSWAAllocator = SWAAllocatorMachine.TestCase
