"""A hypothesis state machine drives UnifiedSWATokenToKVPoolAllocator (page 1 and paged) through
random extends, decodes, window slides (``free_swa`` of whole pages that left the window), frees,
free groups, tail segments and clears, and checks after every step on *both* sub-pools: no
physical page owned twice, the padding page never handed out, owned + free == capacity, the ends
never cross, token j at offset j % P (continuing its page), virtual ids never alias two live
physical slots, every live id translates to the slots it got when it was allocated, and the
sizes agree with a brute-force oracle. A refused allocation changes nothing."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiered_kv.device.allocator import num_new_pages
from tiered_kv.device.allocator.unified_swa import UnifiedSWATokenToKVPoolAllocator
from tiered_kv.device.unified_swa_pool import UnifiedSWAKVPool


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def oracle_joint(full_live: set[int], swa_live: set[int], n_pages: int) -> int:
    """Largest n for which n full pages (lowest free below every window page) and then n window
    pages (highest free above every full page) exist, by trying each n."""
    bottom = min(swa_live, default=n_pages + 1)
    free_full = [p for p in range(1, bottom) if p not in full_live]
    for n in range(n_pages, -1, -1):
        if len(free_full) < n:
            continue
        top = max([*full_live, *free_full[:n]], default=0)
        if sum(1 for q in range(top + 1, n_pages + 1) if q not in swa_live) >= n:
            return n
    raise AssertionError("n = 0 always fits")


class UnifiedSWAMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 4]),
        num_pages=st.integers(1, 16),
        window_pages=st.integers(1, 3),
    )
    def setup(self, page_size, num_pages, window_pages):
        p = self.page_size = page_size
        self.num_pages = num_pages
        self.window = window_pages * p
        pool = UnifiedSWAKVPool(num_pages, p, torch.float16, 1, 4, [0, 2], [1, 3])
        self.alloc = UnifiedSWATokenToKVPoolAllocator(
            num_pages, p, torch.float16, "cpu", pool, debug_mode=True, kernel_backend="torch"
        )
        # rid -> per token: [virtual id, full physical slot, window slot or None]
        self.reqs: dict[int, list[list]] = {}
        self.next_id = 0

    # -- helpers ---------------------------------------------------------------------------
    def _snapshot(self):
        a = self.alloc
        return (a.pages.snapshot(), a.get_all_free_pages().tolist())

    def _same(self, before) -> bool:
        now = self._snapshot()
        tables = all(torch.equal(x, y) for x, y in zip(now[0][:4], before[0][:4], strict=True))
        return tables and now[0][4:] == before[0][4:] and now[1] == before[1]

    def _record(self, ids, parts) -> None:
        for i, part in zip(ids, parts, strict=True):
            if part.numel() == 0:
                self.reqs.setdefault(i, [])
                continue
            loc = self.alloc.plan(part)
            rows = zip(part.tolist(), loc.loc.tolist(), loc.swa_loc.tolist(), strict=True)
            self.reqs.setdefault(i, []).extend([v, f, s] for v, f, s in rows)

    # -- rules ---------------------------------------------------------------------------------
    @rule(data=st.data(), n_new=st.integers(0, 3))
    def extend(self, data, n_new):
        existing = data.draw(
            st.lists(st.sampled_from(sorted(self.reqs)), unique=True, max_size=3)
            if self.reqs
            else st.just([])
        )
        ids = existing + list(range(self.next_id, self.next_id + n_new))
        if not ids:
            return
        p = self.page_size
        ext = data.draw(st.lists(st.integers(0, 3 * p + 1), min_size=len(ids), max_size=len(ids)))
        cur = [self.reqs.get(i, []) for i in ids]
        pre = _t([len(c) for c in cur])
        seq = pre + _t(ext)
        last = _t([c[-1][0] if c else -1 for c in cur])
        need = num_new_pages(pre, seq, p) if p > 1 else sum(ext)
        before = self._snapshot()
        out = self.alloc.alloc_extend(pre, pre.clone(), seq, seq.clone(), last, sum(ext))
        if out is None:
            assert need > self.alloc.available_size() // p, "refused although pages were free"
            assert self._same(before), "a refused extend changed something"
            return
        self.next_id += n_new
        self._record(ids, torch.split(out, ext))

    @precondition(lambda self: any(self.reqs.values()))
    @rule(data=st.data())
    def decode(self, data):
        live = sorted(i for i, s in self.reqs.items() if s)
        ids = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1, max_size=5))
        seq = _t([len(self.reqs[i]) + 1 for i in ids])
        last = _t([self.reqs[i][-1][0] for i in ids])
        need = num_new_pages(seq - 1, seq, self.page_size) if self.page_size > 1 else len(ids)
        before = self._snapshot()
        out = self.alloc.alloc_decode(seq, seq.clone(), last)
        if out is None:
            assert need > self.alloc.available_size() // self.page_size
            assert self._same(before)
            return
        self._record(ids, [out[k : k + 1] for k in range(len(ids))])

    @precondition(lambda self: any(self.reqs.values()))
    @rule(data=st.data())
    def slide(self, data):
        """Whole pages entirely before the window give their window KV back."""
        rid = data.draw(st.sampled_from(sorted(i for i, s in self.reqs.items() if s)))
        p, toks = self.page_size, self.reqs[rid]
        out_pages = max(0, (len(toks) - self.window) // p)
        if not out_pages:
            return
        pages = data.draw(st.lists(st.integers(0, out_pages - 1), min_size=1, max_size=out_pages))
        gone = sorted({j for pg in set(pages) for j in range(pg * p, pg * p + p)})
        live_before = self.alloc.pages.live["swa"]
        freed = len({toks[j][2] // p for j in gone if toks[j][2] is not None})
        self.alloc.free_swa(_t([toks[j][0] for j in gone]))
        for j in gone:
            toks[j][2] = None
        assert self.alloc.pages.live["swa"] == live_before - freed

    def _drop(self, rid: int) -> list[int]:
        return [v for v, _, _ in self.reqs.pop(rid)]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_request(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        ids = self._drop(rid)
        if ids:
            perm = data.draw(st.permutations(range(len(ids))))
            self.alloc.free(_t(ids)[list(perm)])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_group(self, data):
        rids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), unique=True, min_size=1))
        self.alloc.free_group_begin()
        avail = self.alloc.available_size()
        for rid in rids:
            ids = self._drop(rid)
            if not ids:
                continue
            if data.draw(st.booleans()):
                self.alloc.free(_t(ids))
            else:
                self.alloc.free_segment(_t(ids), start_pos=0)
            assert self.alloc.available_size() == avail  # deferred to the group end
        self.alloc.free_group_end()

    @precondition(lambda self: any(self.reqs.values()))
    @rule(data=st.data())
    def free_tail_segment(self, data):
        rid = data.draw(st.sampled_from(sorted(i for i, s in self.reqs.items() if s)))
        toks = self.reqs[rid]
        start = data.draw(st.sampled_from(list(range(0, len(toks), self.page_size))))
        self.alloc.free_segment(_t([v for v, _, _ in toks[start:]]), start_pos=start)
        self.reqs[rid] = toks[:start]

    @rule()
    def clear(self):
        self.alloc.clear()
        self.reqs.clear()

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def both_sub_pools_own_exactly(self):
        if not hasattr(self, "alloc"):
            return
        a, p, n = self.alloc, self.page_size, self.num_pages
        pages = {}
        for col, side in ((1, "full"), (2, "swa")):
            slots = [t[col] for ts in self.reqs.values() for t in ts if t[col] is not None]
            assert len(slots) == len(set(slots)), f"{side}: a physical slot is owned twice"
            assert all(s >= p for s in slots), f"{side}: a padding-page slot was handed out"
            owned = {s // p for s in slots}
            table = {int(q) for q in torch.nonzero(a.pages.p2v[side]).reshape(-1)}
            assert table == owned, f"{side}: p2v disagrees with the pages the tokens hold"
            assert a.pages.live[side] == len(owned)
            pages[side] = owned
        full, swa = pages["full"], pages["swa"]
        assert not full & swa, "a physical page is live on both sides"
        assert max(full, default=0) < min(swa, default=n + 1), "the two ends crossed"
        free_both = [q for q in range(1, n + 1) if q not in full and q not in swa]
        assert len(full) + len(swa) + len(free_both) == n, "owned + free != capacity"
        assert a.available_size() == oracle_joint(full, swa, n) * p
        bottom = min(swa, default=n + 1)
        assert a.full_available_size() == sum(1 for q in range(1, bottom) if q not in full) * p
        top = max(full, default=0)
        assert a.swa_available_size() == sum(1 for q in range(top + 1, n + 1) if q not in swa) * p

    @invariant()
    def virtual_ids_are_live_once_and_queue_the_rest(self):
        if not hasattr(self, "alloc"):
            return
        p = self.page_size
        vids = [t[0] for ts in self.reqs.values() for t in ts]
        assert len(vids) == len(set(vids)), "a virtual id is held twice"
        live = {v // p for v in vids}
        queue = self.alloc.get_all_free_pages().tolist()
        assert len(queue) == len(set(queue)), "a virtual page is queued twice"
        assert not live & set(queue), "a live virtual page is in the queue"
        assert live | set(queue) == set(range(1, self.num_pages + 1)), "virtual pages leaked"

    @invariant()
    def every_live_id_translates_to_its_slots(self):
        if not hasattr(self, "alloc"):
            return
        a, p = self.alloc, self.page_size
        toks = [t for ts in self.reqs.values() for t in ts]
        if toks:
            v = _t([t[0] for t in toks])
            assert a.translate_kv_loc(v).tolist() == [t[1] for t in toks], "full moved"
            assert a.translate_kv_indices_for_transfer(v).tolist() == [t[1] for t in toks]
            swa = a.translate_loc_from_full_to_swa(v).tolist()
            want = [t[2] if t[2] is not None else t[0] % p for t in toks]
            assert swa == want, "window slots moved (or a slid-out token is not on padding)"
        assert a.translate_kv_loc(_t([-1])).tolist() == [-1]
        assert a.translate_loc_from_full_to_swa(_t([-1])).tolist() == [-1]

    @invariant()
    def tokens_sit_at_their_page_offsets(self):
        if not hasattr(self, "alloc"):
            return
        p = self.page_size
        for ts in self.reqs.values():
            for j, t in enumerate(ts):
                for col in (0, 1, 2):
                    s = t[col]
                    if s is None:
                        continue
                    assert s % p == j % p, f"token {j} at {s}: wrong page offset"
                    prev = ts[j - 1][col] if j else None
                    if j % p and prev is not None:
                        assert s == prev + 1, f"token {j} did not continue its page"


UnifiedSWAMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestUnifiedSWAAllocator = UnifiedSWAMachine.TestCase
