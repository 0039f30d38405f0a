"""HybridReqToTokenPool (request rows that own Mamba slots) and HybridLinearKVPool (one map of
global layer ids over the full-attention KV pool and the Mamba state pool).

The state machine fills every state buffer with random sentinels first and has every owner write
random data into its slots, so a slot handed out without clearing, a sibling row left stale, or
an operation that touches another owner's rows shows up as a byte difference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiered_kv.device.allocator import TokenToKVPoolAllocator
from tiered_kv.device.hybrid_linear_pool import HybridLinearKVPool
from tiered_kv.device.hybrid_req_pool import HybridReqToTokenPool, HybridRequestKV
from tiered_kv.device.mamba_pool import MambaPool
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.device.slot_states import NGramPool, ShortConvPool
from tiered_kv.errors import InvalidArgumentError, LayoutError, OwnershipError
from tiered_kv.host.host_kv_cache import host_pool_for

EOS = 3


def _build(rows=4, slots=9, *, extra=True, overlap=True, lazy=False, siblings=True, spec=0):
    mp = MambaPool(
        size=slots, spec_state_size=spec, conv_shapes=[(4, 3), (3, 2)], temporal_shape=(2, 3),
        mamba_layer_ids=[0, 2], device="cpu",
    )  # fmt: skip
    sc = ng = None
    if siblings:
        sc = ShortConvPool(
            size=slots, spec_state_size=spec, state_shape=(2, 2), layer_ids=[1],
            dtype=torch.float16, device="cpu",
        )  # fmt: skip
        ng = NGramPool(size=slots, spec_state_size=spec, context_len=3, eos_token_id=EOS)
    pool = HybridReqToTokenPool(
        rows, 8, "cpu", mamba_pool=mp, enable_extra_buffer=extra, overlap=overlap, lazy=lazy,
        short_conv=sc, ngram=ng, debug_mode=True,
    )  # fmt: skip
    return pool


def _parts(pool):
    return [(d.name, p) for d in pool.state_pool_decls() for p in d.parts]


def _fill_random(pool, gen, slots=None):
    """Random non-zero, non-eos data into ``slots`` (all rows when None) of every part."""
    for _, p in _parts(pool):
        buf = p.buffer()
        idx = slice(None) if slots is None else torch.tensor(slots)
        shape = buf[idx].shape
        if buf.is_floating_point():
            buf[idx] = (torch.rand(shape, generator=gen) + 0.5).to(buf.dtype)
        else:
            buf[idx] = torch.randint(EOS + 1, 1000, shape, generator=gen).to(buf.dtype)


def _slot_bytes(pool, slot):
    return torch.cat([p.buffer()[slot].reshape(-1).view(torch.uint8) for _, p in _parts(pool)])


def _is_fresh(pool, slot):
    for name, p in _parts(pool):
        fill = EOS if (name, p.name) == ("ngram", "tokens") else 0
        if not bool((p.buffer()[slot] == fill).all()):
            return False
    return True


# -- plain behaviour ----------------------------------------------------------------------------


def test_alloc_binds_cleared_slots_and_mappings(gen):
    pool = _build(extra=True, overlap=True)
    _fill_random(pool, gen)
    a, b = HybridRequestKV(), HybridRequestKV()
    rows = pool.alloc([a, b])
    assert rows == [a.req_pool_idx, b.req_pool_idx]
    for kv in (a, b):
        assert len(kv.mamba_tracking) == 2 and -1 not in kv.mamba_tracking
        for s in (kv.mamba_pool_idx, *kv.mamba_tracking):
            assert _is_fresh(pool, s), f"slot {s} was handed out with stale state"
        assert int(pool.req_index_to_mamba_index_mapping[kv.req_pool_idx]) == kv.mamba_pool_idx
        got = pool.req_index_to_mamba_tracking_mapping[kv.req_pool_idx].tolist()
        assert got == kv.mamba_tracking
        assert kv.mamba_generation == 1
    held = pool.mamba_slots_in_use()
    assert len(held) == len(set(held)) == 6 and pool.mamba_allocator.available_size() == 3
    assert pool.get_mamba_indices(torch.tensor(rows)).tolist() == [
        a.mamba_pool_idx,
        b.mamba_pool_idx,
    ]
    assert pool.mamba2_layer_cache(2).conv[0] is pool.mamba_pool.conv[1]


def test_continuing_request_keeps_row_slots_and_state(gen):
    pool = _build()
    a = HybridRequestKV()
    pool.alloc([a])
    _fill_random(pool, gen, [a.mamba_pool_idx])
    state = _slot_bytes(pool, a.mamba_pool_idx)
    a.kv_allocated_len = 5
    row, slot, track = a.req_pool_idx, a.mamba_pool_idx, list(a.mamba_tracking)
    b = HybridRequestKV()
    assert pool.alloc([a, b])[0] == row
    assert (a.mamba_pool_idx, a.mamba_tracking) == (slot, track)
    assert torch.equal(_slot_bytes(pool, slot), state), "a continuing request lost its state"
    assert int(pool.req_generation[row]) == 1


def test_short_mamba_slots_take_nothing():
    pool = _build(rows=4, slots=5, extra=True, overlap=True)  # 3 slots per request
    a = HybridRequestKV()
    pool.alloc([a])
    before = (
        pool.available_size(), pool.mamba_allocator.available_size(),
        pool.req_generation.clone(), pool.req_index_to_mamba_index_mapping.clone(),
    )  # fmt: skip
    b, c = HybridRequestKV(), HybridRequestKV()
    assert pool.alloc([b]) is None  # 2 slots left, 3 needed
    assert pool.alloc([c, b]) is None
    after = (
        pool.available_size(), pool.mamba_allocator.available_size(),
        pool.req_generation, pool.req_index_to_mamba_index_mapping,
    )  # fmt: skip
    assert before[:2] == after[:2] and all(
        torch.equal(x, y) for x, y in zip(before[2:], after[2:], strict=True)
    )
    for kv in (b, c):
        assert kv == HybridRequestKV(), "a refused request must stay unbound"


def test_short_rows_take_nothing():
    pool = _build(rows=1, slots=9)
    assert pool.alloc([HybridRequestKV()]) is not None
    avail = pool.mamba_allocator.available_size()
    assert pool.alloc([HybridRequestKV()]) is None
    assert pool.mamba_allocator.available_size() == avail


def test_inconsistent_requests_are_refused_unchanged():
    pool = _build()
    a = HybridRequestKV()
    pool.alloc([a])
    a.kv_allocated_len = 1
    avail = (pool.available_size(), pool.mamba_allocator.available_size())
    stray = HybridRequestKV(mamba_pool_idx=5)
    with pytest.raises(OwnershipError, match="no row"):
        pool.alloc([stray])
    forged = HybridRequestKV(req_pool_idx=a.req_pool_idx, kv_allocated_len=1, mamba_pool_idx=8)
    with pytest.raises(OwnershipError, match="did not bind"):
        pool.alloc([forged])
    with pytest.raises(InvalidArgumentError, match="HybridRequestKV"):
        pool.alloc([object()])
    assert (pool.available_size(), pool.mamba_allocator.available_size()) == avail


def test_free_returns_row_and_every_slot():
    pool = _build(slots=9)
    a, b = HybridRequestKV(), HybridRequestKV()
    pool.alloc([a, b])
    held_b = [b.mamba_pool_idx, *b.mamba_tracking]
    pool.free(a)
    assert (a.req_pool_idx, a.mamba_pool_idx, a.mamba_tracking) == (None, None, [])
    assert pool.mamba_allocator.available_size() == 6 and pool.mamba_slots_in_use() == sorted(
        held_b
    )
    row = b.req_pool_idx
    pool.free(row)  # by row: slots come back too
    assert pool.mamba_allocator.available_size() == 9 and pool.available_size() == 4
    assert int(pool.req_index_to_mamba_index_mapping[row]) == 0
    for bad in (row, 0, 5, [1, 1], True):
        with pytest.raises(OwnershipError):
            pool.free(bad)
    assert pool.mamba_allocator.available_size() == 9


def test_free_refuses_a_double_free_of_a_slot_before_the_row():
    pool = _build(siblings=False)
    a = HybridRequestKV()
    pool.alloc([a])
    pool.mamba_allocator.free(torch.tensor([a.mamba_tracking[0]]))  # someone else freed it
    with pytest.raises(OwnershipError, match="double free"):
        pool.free(a)
    assert a.req_pool_idx is not None and pool.available_size() == 3


def test_lazy_tracking_and_release():
    pool = _build(rows=3, slots=5, lazy=True, overlap=True)
    a, b = HybridRequestKV(), HybridRequestKV()
    pool.alloc([a, b])  # 2 slots each: own + the first tracking slot
    assert a.mamba_tracking[1] == -1 and pool.mamba_allocator.available_size() == 1
    assert pool.req_index_to_mamba_tracking_mapping[a.req_pool_idx].tolist()[1] == -1
    assert pool.ensure_tracking_slots(a) and -1 not in a.mamba_tracking
    assert pool.ensure_tracking_slots(a), "nothing missing: nothing to do"
    assert not pool.ensure_tracking_slots(b) and b.mamba_tracking[1] == -1
    kept = pool.release_tracking_slot(a, 0)  # the cache keeps the tracked state
    assert a.mamba_tracking[0] == -1 and kept not in pool.mamba_slots_in_use()
    with pytest.raises(OwnershipError, match="empty"):
        pool.release_tracking_slot(a, 0)
    with pytest.raises(InvalidArgumentError, match="0..1"):
        pool.release_tracking_slot(a, 2)
    pool.free(a)
    assert pool.mamba_allocator.available_size() == 2  # a's own + second tracking, not the kept
    pool.mamba_allocator.free(torch.tensor([kept]))
    pool.check_integrity()


def test_without_extra_buffer_there_is_no_tracking():
    pool = _build(extra=False)
    a = HybridRequestKV()
    pool.alloc([a])
    assert a.mamba_tracking == [] and pool.req_index_to_mamba_tracking_mapping is None
    assert pool.ensure_tracking_slots(a) and pool.mamba_allocator.available_size() == 8


def test_clear_keeps_generations_monotonic():
    pool = _build(rows=2)
    a = HybridRequestKV()
    pool.alloc([a])
    row, slot = a.req_pool_idx, a.mamba_pool_idx
    pool.clear()
    assert pool.mamba_allocator.available_size() == 9 and pool.mamba_slots_in_use() == []
    assert int(pool.req_generation[row]) == 1 and int(pool.mamba_slot_generation[slot]) == 1
    b = HybridRequestKV()
    pool.alloc([b])
    assert b.req_pool_idx == row and int(pool.req_generation[row]) == 2
    assert b.mamba_generation == int(pool.mamba_slot_generation[b.mamba_pool_idx]) >= 1


def test_state_pool_decls_declare_registered_siblings_only():
    pool = _build()
    assert [d.name for d in pool.state_pool_decls()] == ["mamba", "short_conv", "ngram"]
    assert [d.kind for d in pool.state_pool_decls()] == ["mamba", "short_conv", "ngram"]
    bare = _build(siblings=False)
    assert [d.name for d in bare.state_pool_decls()] == ["mamba"]
    mp = MambaPool(size=3, conv_shapes=[(2, 2)], temporal_shape=(2,), mamba_layer_ids=[1])
    off = ShortConvPool(size=3, state_shape=None, layer_ids=[], dtype=torch.float32)
    p = HybridReqToTokenPool(2, 4, mamba_pool=mp, short_conv=off)
    assert p.mamba_pool.slot_states == () and p.short_conv_pool is off


def test_construction_registers_all_siblings_or_none():
    mp = MambaPool(size=3, conv_shapes=[(2, 2)], temporal_shape=(2,), mamba_layer_ids=[1])
    sc = ShortConvPool(size=3, state_shape=(2,), layer_ids=[0], dtype=torch.float32)
    wrong = NGramPool(size=4, context_len=2, eos_token_id=0)
    with pytest.raises(InvalidArgumentError, match="rows"):
        HybridReqToTokenPool(2, 4, mamba_pool=mp, short_conv=sc, ngram=wrong)
    assert mp.slot_states == ()
    with pytest.raises(InvalidArgumentError, match="NGramPool"):
        HybridReqToTokenPool(2, 4, mamba_pool=mp, ngram=sc)
    with pytest.raises(InvalidArgumentError, match="max_context_len"):
        HybridReqToTokenPool(2, 0, mamba_pool=mp, short_conv=sc)
    assert mp.slot_states == ()


# -- the state machine ----------------------------------------------------------------------------


class HybridPoolMachine(RuleBasedStateMachine):
    """Rows, Mamba slots, tracking slots, cache snapshots and siblings under random use."""

    @initialize(
        rows=st.integers(1, 5),
        slots=st.integers(1, 14),
        mode=st.sampled_from(
            [(False, True, False), (True, True, False), (True, True, True), (True, False, False)]
        ),  # fmt: skip
        seed=st.integers(0, 2**31 - 1),
    )
    def setup(self, rows, slots, mode, seed):
        extra, overlap, lazy = mode
        self.gen = torch.Generator().manual_seed(seed)
        self.pool = _build(rows, slots, extra=extra, overlap=overlap, lazy=lazy)
        self.size = slots
        _fill_random(self.pool, self.gen)  # sentinels everywhere, padding row included
        self.reqs: list[HybridRequestKV] = []
        self.cache: set[int] = set()
        self.data: dict[int, torch.Tensor] = {}  # slot -> the bytes its owner last wrote
        self.generations = self.pool.req_generation.clone()

    # -- helpers ---------------------------------------------------------------------------
    def _own(self, slots):
        """An owner writes its own random data into fresh ``slots``; remember it."""
        if not slots:
            return
        for s in slots:
            assert _is_fresh(self.pool, s), f"slot {s} handed out with stale state"
        _fill_random(self.pool, self.gen, slots)
        for s in slots:
            self.data[s] = _slot_bytes(self.pool, s)

    def _slots_of(self, kv):
        return [kv.mamba_pool_idx, *(s for s in kv.mamba_tracking if s >= 0)]

    # -- rules ------------------------------------------------------------------------------
    @rule(n_new=st.integers(1, 2), n_old=st.integers(0, 2))
    def alloc(self, n_new, n_old):
        old = self.reqs[:n_old]
        for kv in old:
            kv.kv_allocated_len = 1
        new = [HybridRequestKV() for _ in range(n_new)]
        per = 1 + self.pool.initial_tracking_slots
        fits = n_new <= self.pool.available_size() and n_new * per <= (
            self.pool.mamba_allocator.available_size()
        )
        out = self.pool.alloc(old + new)
        if out is None:
            assert not fits, "refused although rows and slots sufficed"
            assert all(kv == HybridRequestKV() for kv in new)
            return
        assert fits and out[: len(old)] == [kv.req_pool_idx for kv in old]
        for kv in new:
            assert int(self.pool.req_generation[kv.req_pool_idx]) == (
                int(self.generations[kv.req_pool_idx]) + 1
            )
            self._own(self._slots_of(kv))
        self.reqs += new

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), by_row=st.booleans())
    def free(self, data, by_row):
        kv = data.draw(st.sampled_from(self.reqs))
        self.reqs.remove(kv)
        for s in self._slots_of(kv):
            del self.data[s]
        self.pool.free(kv.req_pool_idx if by_row else kv)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def ensure_tracking(self, data):
        kv = data.draw(st.sampled_from(self.reqs))
        empty = [i for i, s in enumerate(kv.mamba_tracking) if s < 0]
        avail = self.pool.mamba_allocator.available_size()
        ok = self.pool.ensure_tracking_slots(kv)
        assert ok == (len(empty) <= avail)
        if ok:
            self._own([kv.mamba_tracking[i] for i in empty])

    @precondition(lambda self: any(s >= 0 for kv in self.reqs for s in kv.mamba_tracking))
    @rule(data=st.data())
    def release_tracking(self, data):
        kv = data.draw(
            st.sampled_from([k for k in self.reqs if any(s >= 0 for s in k.mamba_tracking)])
        )
        i = data.draw(st.sampled_from([i for i, s in enumerate(kv.mamba_tracking) if s >= 0]))
        self.cache.add(self.pool.release_tracking_slot(kv, i))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def cache_snapshots_a_request(self, data):
        """The cache takes a slot straight from the allocator and copies a row's state in."""
        kv = data.draw(st.sampled_from(self.reqs))
        got = self.pool.mamba_allocator.alloc(1)
        if got is None:
            return
        dst = int(got[0])
        self.pool.copy_mamba_state(torch.tensor([kv.mamba_pool_idx]), got)
        self.cache.add(dst)
        self.data[dst] = self.data[kv.mamba_pool_idx]

    @precondition(lambda self: self.reqs and self.cache)
    @rule(data=st.data())
    def prefix_hit_restores_a_snapshot(self, data):
        kv = data.draw(st.sampled_from(self.reqs))
        src = data.draw(st.sampled_from(sorted(self.cache)))
        self.pool.copy_mamba_state(torch.tensor([src]), torch.tensor([kv.mamba_pool_idx]))
        self.data[kv.mamba_pool_idx] = self.data[src]

    @precondition(lambda self: self.cache)
    @rule(data=st.data())
    def cache_evicts(self, data):
        s = data.draw(st.sampled_from(sorted(self.cache)))
        self.cache.remove(s)
        del self.data[s]
        self.pool.mamba_allocator.free(torch.tensor([s]))

    @rule(now=st.integers(0, 3))
    def clear(self, now):
        if now:  # rarely: a clear forgets everything the run built up
            return
        self.pool.clear()
        for kv in self.reqs:
            kv.req_pool_idx, kv.mamba_pool_idx, kv.mamba_tracking = None, None, []
        self.reqs, self.cache, self.data = [], set(), {}

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def no_slot_owned_twice(self):
        rows = [s for kv in self.reqs for s in self._slots_of(kv)]
        free = self.pool.mamba_allocator.get_all_free_slots().tolist()
        everyone = rows + sorted(self.cache) + free
        assert sorted(everyone) == list(range(1, self.size + 1)), "slots lost or owned twice"
        assert self.pool.mamba_slots_in_use() == sorted(rows)
        self.pool.check_integrity()

    @invariant()
    def owners_keep_their_bytes(self):
        for s, want in self.data.items():
            assert torch.equal(_slot_bytes(self.pool, s), want), f"slot {s}'s state changed"

    @invariant()
    def mappings_match_requests(self):
        m = self.pool.req_index_to_mamba_index_mapping
        t = self.pool.req_index_to_mamba_tracking_mapping
        for kv in self.reqs:
            assert int(m[kv.req_pool_idx]) == kv.mamba_pool_idx
            if t is not None:
                assert t[kv.req_pool_idx].tolist() == kv.mamba_tracking
        held = {kv.req_pool_idx for kv in self.reqs}
        assert all(int(m[r]) == 0 for r in range(self.pool.size + 1) if r not in held)

    @invariant()
    def generations_monotonic(self):
        g = self.pool.req_generation
        assert bool((g >= self.generations).all())
        self.generations = g.clone()


HybridPoolMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestHybridPoolMachine = HybridPoolMachine.TestCase


# -- HybridLinearKVPool ---------------------------------------------------------------------

FULL, MAMBA = [1, 4], [0, 2, 3]


def _linear(**kw):
    kv = kw.pop("kv", None) or MHATokenToKVPool(16, 2, torch.float32, 2, 3, len(FULL), "cpu")
    mp = MambaPool(size=3, conv_shapes=[(2, 2)] * 3, temporal_shape=(2,), mamba_layer_ids=MAMBA)
    req = HybridReqToTokenPool(2, 8, "cpu", mamba_pool=mp)
    args = dict(full_layer_ids=FULL, mamba_layer_ids=MAMBA) | kw
    return HybridLinearKVPool(kv, req, **args), kv, req


def test_full_layers_land_in_the_kv_pool_by_global_id(gen):
    pool, kv, _ = _linear()
    loc = torch.tensor([2, 7, 5])
    for local, g in enumerate(FULL):
        k, v = torch.randn(3, 2, 3, generator=gen), torch.randn(3, 2, 3, generator=gen)
        pool.set_kv_buffer(g, loc, k, v)
        assert torch.equal(kv.k_buffer[local][loc], k) and torch.equal(kv.v_buffer[local][loc], v)
        assert pool.get_key_buffer(g) is kv.k_buffer[local]
        assert pool.get_kv_buffer(g)[1] is kv.v_buffer[local]
    assert pool.is_mamba_layer(3) and not pool.is_mamba_layer(4)
    assert (pool.size, pool.page_size, pool.layer_num) == (16, 2, 5)


def test_wrong_kind_of_layer_is_a_typed_error():
    pool, _, req = _linear()
    for g in MAMBA:
        with pytest.raises(LayoutError, match=r"full-attention layers are \[1, 4\]"):
            pool.get_key_buffer(g)
        with pytest.raises(LayoutError, match="Mamba layer"):
            pool.set_kv_buffer(g, torch.tensor([1]), torch.ones(1, 2, 3), torch.ones(1, 2, 3))
        assert (
            pool.mamba2_layer_cache(g).temporal.data_ptr()
            == req.mamba_pool.temporal[MAMBA.index(g)].data_ptr()
        )
    with pytest.raises(LayoutError, match=r"Mamba layers are \[0, 2, 3\]"):
        pool.mamba2_layer_cache(1)
    for bad in (5, -1, "1"):
        with pytest.raises(InvalidArgumentError, match="0..4"):
            pool.get_value_buffer(bad)


def test_host_pool_decls_are_the_kv_pools_only():
    pool, kv, _ = _linear()
    (mine,), (theirs,) = pool.host_pool_decls(), kv.host_pool_decls()
    for f in ("name", "kind", "parts", "dtype", "page_size", "num_slots"):
        assert getattr(mine, f) == getattr(theirs, f), f
    assert mine.layer_ids == tuple(FULL) and mine.device_pool is pool
    assert pool.get_kv_size_bytes() == kv.get_kv_size_bytes()


def test_host_round_trip_through_the_hybrid_pool(gen):
    pool, kv, _ = _linear(kv=MHATokenToKVPool(16, 1, torch.float32, 2, 3, len(FULL), "cpu"))
    alloc = TokenToKVPoolAllocator(16, torch.float32, "cpu", kvcache=pool)
    host = host_pool_for(pool.host_pool_decls()[0], alloc, size_tokens=8, pin=False)
    loc = alloc.alloc(3)
    k, v = torch.randn(3, 2, 3, generator=gen), torch.randn(3, 2, 3, generator=gen)
    pool.set_kv_buffer(4, loc, k, v)
    h = host.alloc(3)
    host.backup_from_device_all_layer(pool, h, loc, "direct")
    kv.k_buffer[1].zero_()
    host.load_to_device_per_layer(pool, h, loc, 4, "direct")
    assert torch.equal(pool.get_key_buffer(4)[loc], k)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(full_layer_ids=[1, 2]), "both full and Mamba"),
        (dict(full_layer_ids=[4]), r"missing \[1\]"),  # layer 1 in neither list
        (dict(full_layer_ids=[1, 5]), r"beyond it \[5\]"),
        (dict(mamba_layer_ids=[0, 3, 2]), "same order"),
        (dict(kv=MHATokenToKVPool(16, 2, torch.float32, 2, 3, 3, "cpu")), "layer_num=2"),
    ],
)
def test_construction_errors(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        _linear(**kw)
