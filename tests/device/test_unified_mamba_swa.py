"""UnifiedMambaSWATokenToKVPoolAllocator: full KV, window KV and Mamba state in one page budget.

A hypothesis state machine admits requests (KV and state together, or one after the other in
either order), extends, decodes, slides the window, takes and drops extra state slots (cache
snapshots), frees and clears, and checks after every step: no KV page or state slot owned
twice, free + owned == totals on both KV sides and on the state side, the state's pages never
more than the gap between the KV ends, every capacity answer equal to a brute-force oracle and
to what allocation then does (a refusal changes nothing), and every held slot still carrying
the state written into it. Then the conversion from bytes to pages, debug-mode misuse,
byte-exact KV writes at planned physical locs, and the request pool drawing on the budget."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiered_kv.device.allocator import num_new_pages
from tiered_kv.device.allocator.unified_mamba_swa import UnifiedMambaSWATokenToKVPoolAllocator
from tiered_kv.device.allocator.unified_mamba_swa_budget import (
    page_nbytes,
    pages_per_state_slot,
    state_slot_nbytes,
)
from tiered_kv.device.hybrid_req_pool import HybridReqToTokenPool, HybridRequestKV
from tiered_kv.device.mamba_pool import MambaPool
from tiered_kv.device.slot_states import ShortConvPool
from tiered_kv.device.unified_swa_pool import UnifiedSWAKVPool
from tiered_kv.errors import InvalidArgumentError, OwnershipError


def _t(*v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def _tl(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def mamba(size=6, spec=0):
    return MambaPool(
        size=size,
        spec_state_size=spec,
        conv_shapes=[(3, 8)],
        temporal_shape=(2, 8, 8),
        mamba_layer_ids=[4],
    )


def rig(num_pages=10, page_size=4, slots=6, spec=0, cost=None, debug=True):
    """Full layers 0, 2 (2 heads x 8); window layers 1, 3 (1 head x 12, another geometry)."""
    pool = UnifiedSWAKVPool(
        num_pages, page_size, torch.float16, 2, 8, [0, 2], [1, 3], swa_head_num=1, swa_head_dim=12
    )
    mp = mamba(slots, spec)
    alloc = UnifiedMambaSWATokenToKVPoolAllocator(
        num_pages, page_size, torch.float16, "cpu", pool, mp,
        state_slot_pages=cost, debug_mode=debug, kernel_backend="torch",
    )  # fmt: skip
    return pool, mp, alloc


def extend(alloc, n, prefix=()):
    pre, last = len(prefix), (prefix[-1] if prefix else -1)
    return alloc.alloc_extend(_t(pre), _t(pre), _t(pre + n), _t(pre + n), _t(last), n)


def snapshot(alloc):
    m = alloc.mamba_allocator
    return (
        alloc.pages.snapshot(),
        alloc.get_all_free_pages().tolist(),
        m.get_all_free_slots().tolist(),
        m.spec_free_list.live.tolist(),
        m.held_pages(),
    )


def assert_same(alloc, before):
    now = snapshot(alloc)
    a, b = now[0], before[0]
    assert all(torch.equal(x, y) for x, y in zip(a[:4], b[:4], strict=True)), "a table changed"
    assert a[4:] == b[4:], "KV counts or ends changed"
    assert now[1:] == before[1:], "the virtual queue or the state slots changed"


# -- the brute-force oracle ------------------------------------------------------------------
def oracle_fits(full_live, swa_live, n_pages, n, state_pages) -> bool:
    """n full pages (lowest free below every window page), then n window pages (highest free
    above every full page), and afterwards ``state_pages`` of the pages no KV side holds."""
    bottom = min(swa_live, default=n_pages + 1)
    free_full = [q for q in range(1, bottom) if q not in full_live]
    if len(free_full) < n:
        return False
    top = max([*full_live, *free_full[:n]], default=0)
    free_swa = [q for q in range(n_pages, top, -1) if q not in swa_live]
    if len(free_swa) < n:
        return False
    unheld = [q for q in range(1, n_pages + 1) if q not in full_live and q not in swa_live]
    return len(unheld) - 2 * n >= state_pages


def oracle_joint(full_live, swa_live, n_pages, state_pages) -> int:
    fits = [
        n for n in range(n_pages + 1) if oracle_fits(full_live, swa_live, n_pages, n, state_pages)
    ]
    assert fits, "the state holds more pages than KV left free"
    return max(fits)


class MambaSWAMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 3, 4]),
        num_pages=st.integers(3, 20),
        window_pages=st.integers(1, 2),
        cost=st.integers(1, 3),
        num_slots=st.integers(1, 7),
    )
    def setup(self, page_size, num_pages, window_pages, cost, num_slots):
        p = self.page_size = page_size
        self.num_pages, self.window, self.cost = num_pages, window_pages * p, cost
        self.pool = UnifiedSWAKVPool(num_pages, p, torch.float16, 1, 4, [0, 2], [1, 3])
        self.mp = MambaPool(
            size=num_slots, conv_shapes=[(2, 3)], temporal_shape=(3,), mamba_layer_ids=[5]
        )
        self.alloc = UnifiedMambaSWATokenToKVPoolAllocator(
            num_pages, p, torch.float16, "cpu", self.pool, self.mp,
            state_slot_pages=cost, debug_mode=True, kernel_backend="torch",
        )  # fmt: skip
        self.reqs: dict[int, list[list]] = {}  # rid -> per token [virtual, full slot, window slot]
        self.req_slots: dict[int, list[int]] = {}  # rid -> its state slots
        self.snapshots: list[int] = []  # slots the "cache" holds
        self.tag: dict[int, float] = {}  # slot -> the value written into its state
        self.next_id, self.next_tag = 0, 1.0

    # -- helpers ---------------------------------------------------------------------------
    def _live(self, col):
        return {
            t[col] // self.page_size for ts in self.reqs.values() for t in ts if t[col] is not None
        }

    def _held(self):
        return [s for ss in self.req_slots.values() for s in ss] + self.snapshots

    def _fits(self, kv_pages, new_slots) -> bool:
        free_slots = self.mp.size - len(self._held())
        state_pages = (len(self._held()) + new_slots) * self.cost
        return new_slots <= free_slots and oracle_fits(
            self._live(1), self._live(2), self.num_pages, kv_pages, state_pages
        )

    def _write_state(self, slots) -> None:
        """Check a fresh slot reads zero, then write a tag no other slot has."""
        for s in slots:
            assert float(self.mp.temporal[:, s].abs().sum()) == 0, "a fresh slot was not zeroed"
            assert float(self.mp.conv[0][s].abs().sum()) == 0
            self.mp.temporal[:, s] = self.next_tag
            self.mp.conv[0][s] = -self.next_tag
            self.tag[s] = self.next_tag
            self.next_tag += 1

    def _record(self, ids, parts) -> None:
        for i, part in zip(ids, parts, strict=True):
            self.reqs.setdefault(i, [])
            if part.numel():
                loc = self.alloc.plan(part)
                rows = zip(part.tolist(), loc.loc.tolist(), loc.swa_loc.tolist(), strict=True)
                self.reqs[i].extend([v, f, s] for v, f, s in rows)

    def _undo_kv(self, out, ext) -> None:
        for part in torch.split(out, ext):
            if part.numel():
                self.alloc.free(part)

    # -- rules ---------------------------------------------------------------------------------
    @rule(
        data=st.data(),
        n=st.integers(1, 2),
        per=st.integers(1, 2),
        order=st.sampled_from(["joint", "kv_first", "state_first"]),
    )
    def admit(self, data, n, per, order):
        """New requests: KV for their prompts and ``per`` state slots each."""
        a, p = self.alloc, self.page_size
        ext = data.draw(st.lists(st.integers(0, 2 * p + 1), min_size=n, max_size=n))
        ids = list(range(self.next_id, self.next_id + n))
        zero, seq = _tl([0] * n), _tl(ext)
        pages = sum(-(-e // p) for e in ext)
        fits = self._fits(pages, n * per)
        assert a.prealloc_reqs_fit(ext, num_state_slots=n * per) == fits
        assert a.new_pages_available(pages, pages, n * per) == fits
        before = snapshot(a)
        args = (zero, zero.clone(), seq, seq.clone(), _tl([-1] * n), sum(ext))
        if order == "joint":
            got = a.alloc_extend_with_state(*args, n * per)
            assert (got is not None) == fits, "the capacity answer and the allocation disagree"
            if got is None:
                assert_same(a, before)
                return
            out, slots = got
        else:
            first_kv = order == "kv_first"
            out = a.alloc_extend(*args) if first_kv else None
            slots = None if first_kv else a.alloc_state(n * per)
            if fits:
                out = a.alloc_extend(*args) if out is None else out
                slots = a.alloc_state(n * per) if slots is None else slots
                assert out is not None and slots is not None, "reported to fit, then refused"
            else:
                if (out if first_kv else slots) is None:  # the first step refused: nothing taken
                    assert_same(a, before)
                    return
                mid = snapshot(a)
                second = a.alloc_state(n * per) if first_kv else a.alloc_extend(*args)
                assert second is None, "reported not to fit, then allocated"
                assert_same(a, mid)
                if first_kv:
                    self._undo_kv(out, ext)
                else:
                    a.free_state(slots)
                return
        self.next_id += n
        self._record(ids, torch.split(out, ext))
        sl = slots.tolist()
        self._write_state(sl)
        for k, rid in enumerate(ids):
            self.req_slots[rid] = sl[k * per : (k + 1) * per]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def extend(self, data):
        a, p = self.alloc, self.page_size
        ids = data.draw(
            st.lists(st.sampled_from(sorted(self.reqs)), unique=True, min_size=1, max_size=3)
        )
        ext = data.draw(st.lists(st.integers(0, p + 1), min_size=len(ids), max_size=len(ids)))
        cur = [self.reqs[i] for i in ids]
        pre = _tl(len(c) for c in cur)
        seq = pre + _tl(ext)
        last = _tl(c[-1][0] if c else -1 for c in cur)
        need = num_new_pages(pre, seq, p)
        fits = self._fits(need, 0)
        assert a.prealloc_reqs_fit(seq.tolist(), pre.tolist()) == fits
        before = snapshot(a)
        out = a.alloc_extend(pre, pre.clone(), seq, seq.clone(), last, sum(ext))
        assert (out is not None) == fits
        if out is None:
            assert_same(a, before)
            return
        self._record(ids, torch.split(out, ext))

    @precondition(lambda self: any(self.reqs.values()))
    @rule(data=st.data())
    def decode(self, data):
        a, p = self.alloc, self.page_size
        live = sorted(i for i, s in self.reqs.items() if s)
        ids = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1, max_size=4))
        seq = _tl(len(self.reqs[i]) + 1 for i in ids)
        fits = self._fits(num_new_pages(seq - 1, seq, p), 0)
        before = snapshot(a)
        out = a.alloc_decode(seq, seq.clone(), _tl(self.reqs[i][-1][0] for i in ids))
        assert (out is not None) == fits
        if out is None:
            assert_same(a, before)
            return
        self._record(ids, [out[k : k + 1] for k in range(len(ids))])

    def _slidable(self) -> list[int]:
        """Requests with a whole page, before the window, that still holds window KV."""
        p = self.page_size
        return [
            i
            for i, ts in sorted(self.reqs.items())
            if any(t[2] is not None for t in ts[: (len(ts) - self.window) // p * p])
        ]

    @precondition(lambda self: self._slidable())
    @rule(data=st.data())
    def slide(self, data):
        """Whole pages that left the window give their window pages back."""
        rid = data.draw(st.sampled_from(self._slidable()))
        p, toks = self.page_size, self.reqs[rid]
        out_pages = (len(toks) - self.window) // p
        gone = [j for j in range(out_pages * p) if toks[j][2] is not None]
        live_before = self.alloc.pages.live["swa"]
        freed = len({toks[j][2] // p for j in gone})
        self.alloc.free_swa(_tl(toks[j][0] for j in gone))
        for j in gone:
            toks[j][2] = None
        assert self.alloc.pages.live["swa"] == live_before - freed

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), grouped=st.booleans())
    def finish(self, data, grouped):
        """A request leaves: its KV and its state slots."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        ids = [v for v, _, _ in self.reqs.pop(rid)]
        slots = self.req_slots.pop(rid)
        if grouped:
            self.alloc.free_group_begin()
        if ids:
            self.alloc.free(_tl(ids))
        if grouped:
            self.alloc.free_group_end()
        self.alloc.free_state(_tl(slots))
        for s in slots:
            self.tag.pop(s)

    @rule(k=st.integers(0, 3))
    def snapshot_state(self, k):
        """The cache takes ``k`` state slots of its own."""
        fits = self._fits(0, k)
        assert (
            self.alloc.available_state_slots() >= k
            if fits
            else self.alloc.available_state_slots() < k
        )
        assert self.alloc.prealloc_fits(0, num_state_slots=k) == fits
        before = snapshot(self.alloc)
        got = self.alloc.alloc_state(k)
        assert (got is not None) == fits
        if got is None:
            assert_same(self.alloc, before)
            return
        self._write_state(got.tolist())
        self.snapshots.extend(got.tolist())

    @precondition(lambda self: self.snapshots)
    @rule(data=st.data())
    def drop_snapshots(self, data):
        drop = data.draw(st.lists(st.sampled_from(self.snapshots), unique=True, min_size=1))
        self.alloc.free_state(_tl(drop))
        for s in drop:
            self.snapshots.remove(s)
            self.tag.pop(s)

    @precondition(lambda self: self._held())
    @rule(kind=st.sampled_from(["free_twice", "repeat", "padding", "out_of_range", "not_held"]))
    def misuse(self, kind):
        """Debug mode refuses a bad state free before anything changes."""
        held, size = self._held(), self.mp.size
        free = sorted(set(range(1, size + 1)) - set(held))
        if kind == "free_twice" and held:
            bad = _t(held[0], held[0])
        elif kind == "repeat" and held and free:
            bad = _t(held[0], free[0], held[0])
        elif kind == "padding":
            bad = _t(0)
        elif kind == "out_of_range":
            bad = _t(size + 1)
        elif kind == "not_held" and free:
            bad = _t(free[0])
        else:
            return
        before = snapshot(self.alloc)
        with pytest.raises(OwnershipError):
            self.alloc.free_state(bad)
        assert_same(self.alloc, before)

    @rule()
    def clear(self):
        self.alloc.clear()
        self.reqs.clear()
        self.req_slots.clear()
        self.snapshots.clear()
        self.tag.clear()

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def kv_pages_owned_once_and_counted(self):
        if not hasattr(self, "alloc"):
            return
        a, p, n = self.alloc, self.page_size, self.num_pages
        for col, side in ((1, "full"), (2, "swa")):
            slots = [t[col] for ts in self.reqs.values() for t in ts if t[col] is not None]
            assert len(slots) == len(set(slots)), f"{side}: a physical slot is owned twice"
            assert all(s >= p for s in slots), f"{side}: a padding-page slot was handed out"
            table = {int(q) for q in torch.nonzero(a.pages.p2v[side]).reshape(-1)}
            assert table == self._live(col) and a.pages.live[side] == len(table)
        full, swa = self._live(1), self._live(2)
        assert not full & swa and max(full, default=0) < min(swa, default=n + 1)
        free = [q for q in range(1, n + 1) if q not in full and q not in swa]
        assert len(full) + len(swa) + len(free) == n, "owned + free != capacity"

    @invariant()
    def state_slots_owned_once_and_counted(self):
        if not hasattr(self, "alloc"):
            return
        held, m = self._held(), self.alloc.mamba_allocator
        free = m.get_all_free_slots().tolist()
        assert len(held) == len(set(held)), "a state slot is owned twice"
        assert not set(held) & set(free), "a held state slot is also free"
        assert sorted(held + free) == list(range(1, self.mp.size + 1)), "state slots leaked"
        assert m.held_slots() == len(held)

    @invariant()
    def budget_and_sizes_match_the_oracle(self):
        if not hasattr(self, "alloc"):
            return
        a, p, n = self.alloc, self.page_size, self.num_pages
        full, swa = self._live(1), self._live(2)
        state_pages = len(self._held()) * self.cost
        unheld = n - len(full) - len(swa)
        assert a.state_pages_held() == state_pages <= unheld, "KV + state > the range"
        a.check_budget()
        assert a.available_size() == oracle_joint(full, swa, n, state_pages) * p
        free_slots = self.mp.size - len(self._held())
        assert a.available_state_slots() == min(free_slots, (unheld - state_pages) // self.cost)
        bottom, top = min(swa, default=n + 1), max(full, default=0)
        spare = unheld - state_pages
        own_f = sum(1 for q in range(1, bottom) if q not in full)
        own_s = sum(1 for q in range(top + 1, n + 1) if q not in swa)
        assert a.full_available_size() == min(own_f, spare) * p
        assert a.swa_available_size() == min(own_s, spare) * p

    @invariant()
    def held_state_survives(self):
        if not hasattr(self, "alloc"):
            return
        for s in self._held():
            assert bool((self.mp.temporal[:, s] == self.tag[s]).all()), f"slot {s}'s state moved"
            assert bool((self.mp.conv[0][s] == -self.tag[s]).all())


MambaSWAMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestUnifiedMambaSWAMachine = MambaSWAMachine.TestCase


# -- the conversion and the shared budget ------------------------------------------------------
def test_a_state_slot_costs_its_bytes_in_pages_of_the_larger_side():
    pool = UnifiedSWAKVPool(
        7, 3, torch.float16, 2, 8, [0, 2], [1, 3], swa_head_num=3, swa_head_dim=8
    )
    mp = mamba(4)
    sib = ShortConvPool(size=4, state_shape=(5,), layer_ids=[4], dtype=torch.float32)
    mp.register_slot_state(sib)
    # full: 2 heads x (8 + 8) x 2 B x 2 layers = 128 B/token; window: 3 x 16 x 2 x 2 = 192
    assert page_nbytes(pool) == 3 * 192
    # conv 3x8 fp32 (96 B) + temporal 2x8x8 fp32 (512 B) + sibling 5 fp32 (20 B)
    assert state_slot_nbytes(mp) == 628
    assert pages_per_state_slot(pool, mp) == 2  # 628 / 576, rounded up
    alloc = UnifiedMambaSWATokenToKVPoolAllocator(7, 3, torch.float16, "cpu", pool, mp)
    assert alloc.state_slot_pages == 2


def test_state_slots_and_kv_pages_draw_on_one_budget():
    _, _, alloc = rig(num_pages=10, page_size=4)  # 608 B / 512 B pages: 2 pages a slot
    assert alloc.state_slot_pages == 2
    assert alloc.available_size() == 5 * 4 and alloc.available_state_slots() == 5
    slots = alloc.alloc_state(2)
    assert slots.tolist() == [1, 2] and alloc.state_pages_held() == 4
    assert alloc.available_size() == 3 * 4, "the state's pages still counted as free KV"
    assert alloc.full_available_size() == alloc.swa_available_size() == 6 * 4
    assert alloc.available_state_slots() == 3
    v = extend(alloc, 9)  # 3 full + 3 window pages: the 4 left are the state's
    assert v is not None and alloc.available_size() == 0 and alloc.available_state_slots() == 0
    before = snapshot(alloc)
    assert alloc.alloc_state(1) is None and extend(alloc, 1) is None
    assert_same(alloc, before)
    alloc.free_state(slots[:1])
    assert alloc.available_state_slots() == 1 and alloc.available_size() == 4
    alloc.free(v)
    alloc.free_state(slots[1:])
    assert alloc.available_size() == 5 * 4 and alloc.state_pages_held() == 0


def test_window_pages_that_left_the_window_pay_for_state_at_once():
    _, _, alloc = rig(num_pages=10, page_size=4, cost=2)
    v = extend(alloc, 16)  # 4 + 4 pages, 2 left
    assert alloc.available_state_slots() == 1
    assert alloc.alloc_state(2) is None
    alloc.free_swa(v[:8])  # the first two pages left the window: holes at the high end
    assert alloc.pages.gap == 2, "the window end retreated (the holes are at the top)"
    assert alloc.available_state_slots() == 2
    assert alloc.alloc_state(2) is not None and alloc.available_size() == 0


def test_the_ends_geometry_still_binds_kv_when_pages_are_spare():
    _, _, alloc = rig(num_pages=10, page_size=4, cost=2)
    a = extend(alloc, 12)  # full 1-3, window 10-8
    assert extend(alloc, 8) is not None  # full 4-5, window 7-6: no gap left
    alloc.free_swa(a)  # window holes 8-10; the full side cannot grow past the window's 6
    assert alloc.pages.gap == 0 and alloc.available_state_slots() == 1
    assert alloc.available_size() == 0 and alloc.swa_available_size() == 3 * 4
    assert alloc.prealloc_fits(0, num_state_slots=1) and not alloc.prealloc_fits(4)
    assert alloc.new_pages_available(0, 1, 1) and not alloc.new_pages_available(0, 2, 1)


def test_capacity_answers_validate_their_input():
    _, _, alloc = rig()
    for call in (
        lambda: alloc.prealloc_fits(-1),
        lambda: alloc.prealloc_fits(4, num_state_slots=-1),
        lambda: alloc.prealloc_reqs_fit([4, 2], [1]),
        lambda: alloc.prealloc_reqs_fit([4], [5]),
        lambda: alloc.alloc_state(-1),
        lambda: alloc.alloc_state(True),
    ):
        before = snapshot(alloc)
        with pytest.raises(InvalidArgumentError):
            call()
        assert_same(alloc, before)


def test_construction_checks_name_the_fix():
    pool, mp, _ = rig()
    with pytest.raises(InvalidArgumentError, match="state_slot_pages"):
        UnifiedMambaSWATokenToKVPoolAllocator(10, 4, torch.float16, "cpu", None, mp)
    with pytest.raises(InvalidArgumentError, match="MambaPool"):
        UnifiedMambaSWATokenToKVPoolAllocator(10, 4, torch.float16, "cpu", pool, object())
    small = UnifiedSWAKVPool(1, 1, torch.float16, 1, 4, [0], [1])
    with pytest.raises(InvalidArgumentError, match="costs .* pages"):
        UnifiedMambaSWATokenToKVPoolAllocator(1, 1, torch.float16, "cpu", small, mamba(2))
    assert small.allocator is None, "a refused construction attached itself to the pool"


def test_alloc_extend_with_state_takes_both_or_nothing():
    _, mp, alloc = rig(num_pages=10, page_size=4, cost=2)
    assert alloc.alloc_state(3) is not None  # 6 pages held, 4 left: 2 joint pages
    args = (_t(0, 0), _t(0, 0), _t(4, 4), _t(4, 4), _t(-1, -1), 8)
    assert not alloc.prealloc_reqs_fit([4, 4], num_state_slots=1)
    before = snapshot(alloc)
    assert alloc.alloc_extend_with_state(*args, 1) is None
    assert_same(alloc, before)
    assert alloc.prealloc_reqs_fit([4, 4]) and alloc.alloc_extend_with_state(*args, 0) is not None


# -- misuse -------------------------------------------------------------------------------------
@pytest.mark.parametrize("debug", [True, False])
def test_a_double_free_of_state_is_refused_before_any_change(debug):
    _, _, alloc = rig(slots=4, debug=debug)
    slots = alloc.alloc_state(2)
    alloc.free_state(slots[:1])
    before = snapshot(alloc)
    with pytest.raises(OwnershipError):
        alloc.free_state(_t(1, 2, 3))  # more than are held: refused by counting, any mode
    assert_same(alloc, before)
    if debug:
        for bad in (_t(1), _t(2, 2), _t(0), _t(5), _t(4)):  # free, repeated, padding, range
            with pytest.raises(OwnershipError):
                alloc.free_state(bad)
            assert_same(alloc, before)


def test_a_foreign_slot_and_draft_slots_are_refused():
    _, _, alloc = rig(slots=3, spec=2)
    _, _, other = rig(slots=3, spec=2)
    mine, theirs = alloc.alloc_state(1), other.alloc_state(2)
    before = snapshot(alloc)
    with pytest.raises(OwnershipError, match="already free"):
        alloc.free_state(theirs[1:])  # slot 2 is handed out there, free here
    with pytest.raises(OwnershipError, match="valid slots are 1..3"):
        alloc.free_state(_t(4))  # a draft slot freed as a state slot
    assert_same(alloc, before)
    draft = alloc.mamba_allocator.alloc_spec(1)
    assert draft.tolist() == [4] and alloc.state_pages_held() == 2 * alloc.state_slot_pages
    with pytest.raises(OwnershipError):
        alloc.mamba_allocator.free_spec(_t(4, 4))
    alloc.mamba_allocator.free_spec(draft)
    alloc.free_state(mine)
    assert alloc.state_pages_held() == 0


# -- bytes --------------------------------------------------------------------------------------
def test_kv_writes_land_byte_exact_at_planned_physical_locs():
    pool, mp, alloc = rig(num_pages=12, page_size=3, cost=1)
    lens = [7, 5]
    got = alloc.alloc_extend_with_state(
        _t(0, 0), _t(0, 0), _tl(lens), _tl(lens), _t(-1, -1), sum(lens), 2
    )
    assert got is not None
    gen = torch.Generator().manual_seed(7)
    reqs = torch.split(got.out_cache_loc, lens)
    written = {}
    for r, v in enumerate(reqs):
        loc = alloc.plan(v)
        assert loc.physical and int(loc.loc.max()) < int(loc.swa_loc.min()), "ends crossed"
        for layer in range(4):
            heads, dim = (2, 8) if layer in (0, 2) else (1, 12)
            k = torch.randn(v.numel(), heads, dim, generator=gen).half()
            val = torch.randn(v.numel(), heads, dim, generator=gen).half()
            pool.set_kv_buffer(layer, loc, k, val)
            written[r, layer] = (loc, k, val)
    for (_, layer), (loc, k, val) in written.items():  # request 1 left request 0's bytes alone
        at = loc.loc if layer in (0, 2) else loc.swa_loc
        assert torch.equal(pool.get_key_buffer(layer)[at].view(torch.uint8), k.view(torch.uint8))
        assert torch.equal(
            pool.get_value_buffer(layer)[at].view(torch.uint8), val.view(torch.uint8)
        )


def test_state_written_into_a_slot_survives_unrelated_allocations():
    _, mp, alloc = rig(num_pages=16, page_size=4, slots=5, cost=1)
    sib = ShortConvPool(size=5, state_shape=(3,), layer_ids=[4], dtype=torch.bfloat16)
    mp.register_slot_state(sib)
    mine = int(alloc.alloc_state(1))
    gen = torch.Generator().manual_seed(11)
    mp.conv[0][mine] = torch.randn(3, 8, generator=gen)
    mp.temporal[:, mine] = torch.randn(1, 2, 8, 8, generator=gen)
    sib.conv_state[:, mine] = torch.randn(1, 3, generator=gen).bfloat16()
    keep = [t[:, mine].clone() for t in (mp.temporal, sib.conv_state)] + [mp.conv[0][mine].clone()]
    other = alloc.alloc_state(3)
    mp.temporal[:, other] = 5.0
    alloc.free_state(other[:2])
    again = alloc.alloc_state(2)  # reused slots come back zeroed, siblings too
    assert bool((mp.temporal[:, again] == 0).all()) and bool((sib.conv_state[:, again] == 0).all())
    v = extend(alloc, 11)
    alloc.free_swa(v[:4])
    alloc.free(v)
    now = [t[:, mine] for t in (mp.temporal, sib.conv_state)] + [mp.conv[0][mine]]
    for a, b in zip(now, keep, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# -- wiring -------------------------------------------------------------------------------------
def test_the_request_pool_draws_its_slots_from_the_budget():
    _, mp, alloc = rig(num_pages=10, page_size=4, slots=4, cost=2)
    req_pool = HybridReqToTokenPool(4, 64, "cpu", mamba_pool=mp, debug_mode=True)
    alloc.attach_req_pool(req_pool)
    assert req_pool.mamba_allocator is alloc.mamba_allocator
    assert extend(alloc, 16) is not None  # 4 full + 4 window pages: 2 left, one slot
    a, b = HybridRequestKV(), HybridRequestKV()
    before = snapshot(alloc)
    assert req_pool.alloc([a, b]) is None and not a.holds_kv, "rows taken though state is short"
    assert_same(alloc, before)
    assert req_pool.alloc([a]) is not None and alloc.state_pages_held() == 2
    assert alloc.available_size() == 0
    req_pool.free(a)
    assert alloc.state_pages_held() == 0 and alloc.available_size() == 4
    other = HybridReqToTokenPool(2, 64, "cpu", mamba_pool=mamba(4))
    with pytest.raises(InvalidArgumentError):
        alloc.attach_req_pool(other)


def test_a_used_request_pool_is_not_rewired():
    _, mp, alloc = rig(slots=4)
    req_pool = HybridReqToTokenPool(4, 64, "cpu", mamba_pool=mp)
    req_pool.alloc([HybridRequestKV()])
    with pytest.raises(OwnershipError, match="already holds"):
        alloc.attach_req_pool(req_pool)


def test_host_routes_and_clear():
    pool, _, alloc = rig()
    full_view, route = alloc.host_part_route(pool.host_pool_decls()[0])
    assert full_view.get_kvcache() is pool.full_kv_pool
    v = extend(alloc, 6)
    assert route(v).tolist() == alloc.translate_kv_loc(v).tolist()
    assert alloc.alloc_state(2) is not None
    alloc.clear()
    assert alloc.state_pages_held() == 0 and alloc.available_size() == 5 * 4
    assert alloc.available_state_slots() == 5
