"""Recurrent-state pools: tracking-slot counts, the Mamba slot allocator, MambaPool and its
sibling slot states (ShortConvPool, NGramPool). Buffers are filled with fresh random data
(never zeros) first, so an operation that touches the wrong rows, or none, shows."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device.allocator.mamba_slots import MambaSlotAllocator
from tiered_kv.device.mamba_pool import MambaPool
from tiered_kv.device.sizing import get_mamba_tracking_slots
from tiered_kv.device.slot_states import NGramPool, ShortConvPool
from tiered_kv.errors import InvalidArgumentError, LayoutError, OwnershipError, StateError

# -- tracking slots ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra_buffer", "overlap", "lazy", "want"),
    [
        (False, False, False, 0),
        (False, False, True, 0),
        (False, True, False, 0),
        (False, True, True, 0),
        (True, False, False, 1),
        (True, False, True, 1),
        (True, True, False, 2),
        (True, True, True, 1),
    ],
)
def test_tracking_slots(extra_buffer, overlap, lazy, want):
    assert get_mamba_tracking_slots(extra_buffer=extra_buffer, overlap=overlap, lazy=lazy) == want


def test_tracking_slots_refuses_non_bools():
    with pytest.raises(InvalidArgumentError, match="overlap"):
        get_mamba_tracking_slots(extra_buffer=True, overlap=1)
    assert get_mamba_tracking_slots(extra_buffer=True, overlap=True) == 2  # lazy defaults off


# -- the slot allocator -----------------------------------------------------------------------


def _free(a: MambaSlotAllocator) -> list[int]:
    return sorted(a.get_all_free_slots().tolist())


def test_allocator_alloc_free_and_short():
    a = MambaSlotAllocator(5, device="cpu")
    assert a.available_size() == 5 and _free(a) == [1, 2, 3, 4, 5]
    s = a.alloc(3)
    assert s.dtype == torch.int64 and sorted(s.tolist()) == [1, 2, 3]
    assert a.alloc(3) is None and a.available_size() == 2, "a short alloc must take nothing"
    assert a.alloc(0).numel() == 0
    a.free(s[1:].to(torch.int32))
    assert _free(a) == [2, 3, 4, 5]
    a.clear()
    assert _free(a) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("bad", "match"),
    [([0], "padding"), ([6], "valid slots are 1..5"), ([2, 2], "repeat"), ([4], "double free")],
)
def test_allocator_debug_refuses_before_change(bad, match):
    a = MambaSlotAllocator(5, device="cpu", debug_mode=True)
    held = a.alloc(3)  # 1, 2, 3 held; 4, 5 free
    before = _free(a)
    with pytest.raises(OwnershipError, match=match):
        a.free(torch.tensor([held[0].item(), *bad]) if match != "repeat" else torch.tensor(bad))
    assert _free(a) == before


def test_allocator_checks_shape_and_dtype_without_debug():
    a = MambaSlotAllocator(5, device="cpu", debug_mode=False)
    for bad in (torch.tensor([[1]]), torch.tensor([1.0]), [1]):
        with pytest.raises(InvalidArgumentError):
            a.free(bad)
    with pytest.raises(InvalidArgumentError, match="need_size"):
        a.alloc(-1)
    assert a.available_size() == 5


def test_allocator_debug_mode_follows_platform(monkeypatch):
    monkeypatch.setenv("TIERED_KV_DEBUG", "0")
    assert not MambaSlotAllocator(3, device="cpu").debug_mode
    monkeypatch.setenv("TIERED_KV_DEBUG", "1")
    assert MambaSlotAllocator(3, device="cpu").debug_mode


def test_allocator_group():
    a = MambaSlotAllocator(6, device="cpu")
    a.alloc_group_begin(3)
    assert a.available_size() == 6, "a reserve is still available"
    with pytest.raises(StateError):
        a.alloc_group_begin(1)
    one, two = a.alloc(1), a.alloc(1)
    big = a.alloc(3)  # 1 left in the reserve + 2 from the free list
    assert big.numel() == 3 and a.available_size() == 1
    got = [*one.tolist(), *two.tolist(), *big.tolist()]
    assert len(set(got)) == 5
    assert a.alloc(2) is None
    a.alloc_group_end()
    assert a.available_size() == 1 and set(_free(a)).isdisjoint(got)
    with pytest.raises(StateError):
        a.alloc_group_end()
    a.alloc_group_begin(4)  # fewer free than asked: reserves what there is
    assert a.alloc(1).numel() == 1 and a.available_size() == 0
    a.alloc_group_end()


def test_allocator_unused_reserve_returns():
    a = MambaSlotAllocator(4, device="cpu")
    a.alloc_group_begin(3)
    a.alloc(1)
    a.alloc_group_end()
    assert a.available_size() == 3 and len(_free(a)) == 3


def test_allocator_spec_slots():
    a = MambaSlotAllocator(4, spec_size=3, device="cpu", debug_mode=True)
    d = a.alloc_spec(2)
    assert set(d.tolist()) <= {5, 6, 7} and a.spec_available_size() == 1
    assert a.alloc_spec(2) is None and a.available_size() == 4
    with pytest.raises(OwnershipError, match="5..7"):
        a.free_spec(torch.tensor([2]))
    with pytest.raises(OwnershipError, match="double free"):
        a.free_spec(torch.cat((d[:1], a.spec_free_list.live[:1])))
    a.free_spec(d)
    assert a.spec_available_size() == 3
    with pytest.raises(OwnershipError, match="no draft slots"):
        MambaSlotAllocator(4, device="cpu").free_spec(torch.tensor([5]))


# -- MambaPool ---------------------------------------------------------------------------------

CONV = [(6, 3), (5, 2), (7, 4)]  # per-layer kernel widths differ
TEMPORAL = (2, 3, 5)
LAYERS = [1, 4, 6]  # global ids, sparse


def _random_fill(t: torch.Tensor, gen: torch.Generator) -> None:
    if t.is_floating_point():
        t.copy_(torch.rand(t.shape, generator=gen) + 0.5)  # never zero
    else:
        t.copy_(torch.randint(100, 1000, t.shape, generator=gen))  # never eos


def _pools(gen, size=7, spec=2):
    mp = MambaPool(
        size=size, spec_state_size=spec, conv_shapes=CONV, temporal_shape=TEMPORAL,
        mamba_layer_ids=LAYERS, conv_dtype=torch.bfloat16, device="cpu",
    )  # fmt: skip
    sc = ShortConvPool(
        size=size, spec_state_size=spec, state_shape=(3, 2), layer_ids=[0, 3],
        dtype=torch.float16, device="cpu",
    )  # fmt: skip
    ng = NGramPool(size=size, spec_state_size=spec, context_len=5, eos_token_id=2, device="cpu")
    mp.register_slot_state(sc)
    mp.register_slot_state(ng)
    for d in (mp.state_decl(), sc.state_decl(), ng.state_decl()):
        for p in d.parts:
            _random_fill(p.buffer(), gen)
    return mp, sc, ng


def _all_parts(mp):
    decls = (mp.state_decl(), *(s.state_decl() for s in mp.slot_states))
    return [(f"{d.name}.{p.name}", p) for d in decls for p in d.parts]


def _row_bytes(mp, slot):
    return {n: p.buffer()[slot].contiguous().view(torch.uint8).clone() for n, p in _all_parts(mp)}


def _snapshot(mp):
    return {n: p.buffer().clone() for n, p in _all_parts(mp)}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_mamba_pool_buffers_and_layers(gen):
    mp, _, _ = _pools(gen)
    assert mp.num_rows == 7 + 2 + 1
    assert [tuple(c.shape) for c in mp.conv] == [(10, *s) for s in CONV]
    assert mp.temporal.shape == (3, 10, *TEMPORAL) and mp.conv[0].dtype == torch.bfloat16
    assert mp.mamba_map == {1: 0, 4: 1, 6: 2}
    st = mp.layer_cache(4)
    assert len(st.conv) == 1 and st.conv[0].shape == (10, 5, 2)
    st.temporal[3] = 7.0  # a view: writes land in the pool
    assert torch.equal(mp.temporal[1, 3], torch.full(TEMPORAL, 7.0))
    assert st.conv[0].data_ptr() == mp.conv[1].data_ptr()
    for bad in (0, 2, 5, "1", None):
        with pytest.raises(InvalidArgumentError, match=r"\[1, 4, 6\]"):
            mp.layer_cache(bad)


def test_clear_slots_touches_every_buffer_and_sibling_only_there(gen):
    mp, sc, ng = _pools(gen)
    before = _snapshot(mp)
    mp.clear_slots(torch.tensor([3, 8], dtype=torch.int32))  # 8: a draft row
    after = _snapshot(mp)
    for name, t in after.items():
        rows = [r for r in range(mp.num_rows) if r not in (3, 8)]
        assert torch.equal(t[rows], before[name][rows]), f"{name}: other rows changed"
        fill = 2 if name == "ngram.tokens" else 0
        assert bool((t[[3, 8]] == fill).all()), f"{name}: rows not reset"
    assert ng.context(torch.tensor([3])).tolist() == [[2] * 5]


def test_copy_from_is_byte_exact_for_every_part(gen):
    mp, sc, ng = _pools(gen)
    src, dst = torch.tensor([2, 5, 9]), torch.tensor([6, 1, 3])
    want = {s: _row_bytes(mp, s) for s in src.tolist()}
    untouched = [r for r in range(mp.num_rows) if r not in dst.tolist()]
    before = _snapshot(mp)
    mp.copy_from(src, dst)
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        assert _same(_row_bytes(mp, d), want[s])
    after = _snapshot(mp)
    assert all(torch.equal(after[k][untouched], before[k][untouched]) for k in after)


def test_copy_from_overlapping_reads_old_rows(gen):
    mp, _, _ = _pools(gen)
    a, b = _row_bytes(mp, 1), _row_bytes(mp, 2)
    mp.copy_from(torch.tensor([1, 2]), torch.tensor([2, 1]))  # a swap
    assert _same(_row_bytes(mp, 1), b) and _same(_row_bytes(mp, 2), a)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda mp: mp.clear_slots(torch.tensor([1, 0])), "padding"),
        (lambda mp: mp.clear_slots(torch.tensor([10])), "1..9"),
        (lambda mp: mp.clear_slots(torch.tensor([[1]])), "1-D"),
        (lambda mp: mp.clear_slots(torch.tensor([1.0])), "dtype"),
        (lambda mp: mp.copy_from(torch.tensor([1, 2]), torch.tensor([3])), "one to one"),
        (lambda mp: mp.copy_from(torch.tensor([1, 2]), torch.tensor([3, 3])), "repeat"),
        (lambda mp: mp.copy_from(torch.tensor([0]), torch.tensor([3])), "padding"),
    ],
)
def test_slot_errors_are_typed_and_change_nothing(gen, call, match):
    mp, _, _ = _pools(gen)
    before = _snapshot(mp)
    with pytest.raises(InvalidArgumentError, match=match):
        call(mp)
    assert _same(_snapshot(mp), before)


def test_state_decl_matches_the_tensors(gen):
    mp, sc, ng = _pools(gen)
    d = mp.state_decl()
    assert (d.name, d.kind, d.num_rows, d.owner) == ("mamba", "mamba", 10, mp)
    assert [p.name for p in d.parts] == [f"{k}.L{g}" for g in LAYERS for k in ("conv", "temporal")]
    for i, _g in enumerate(LAYERS):
        conv, temporal = d.parts[2 * i], d.parts[2 * i + 1]
        assert conv.buffer() is mp.conv[i] and conv.slot_shape == CONV[i]
        assert temporal.buffer().data_ptr() == mp.temporal[i].data_ptr()
        assert tuple(temporal.buffer().shape) == (10, *TEMPORAL)
    bf16, f32 = 2, 4
    want = sum(a * b for a, b in CONV) * bf16 + 3 * 30 * f32
    assert mp.slot_nbytes == d.slot_nbytes == want
    assert mp.mem_usage_bytes() == sum(
        t.numel() * t.element_size() for t in (*mp.conv, mp.temporal)
    )
    assert mp.mem_usage_bytes() == want * 10
    s = sc.state_decl()
    assert (s.name, s.kind, [p.name for p in s.parts]) == (
        "short_conv",
        "short_conv",
        ["conv.L0", "conv.L3"],
    )
    assert s.slot_nbytes == 2 * 6 * 2 and sc.mem_usage_bytes() == 2 * 10 * 6 * 2
    n = ng.state_decl()
    assert (n.kind, [(p.name, p.slot_shape, p.dtype) for p in n.parts]) == (
        "ngram", [("tokens", (5,), torch.int32), ("num_tokens", (1,), torch.int64)],
    )  # fmt: skip
    for decl in (d, s, n):
        for p in decl.parts:
            assert tuple(p.buffer().shape) == (decl.num_rows, *p.slot_shape)
            assert p.buffer().dtype == p.dtype


def test_register_slot_state_refusals(gen):
    mp, sc, _ = _pools(gen)
    with pytest.raises(InvalidArgumentError, match="already registered"):
        mp.register_slot_state(sc)
    off = ShortConvPool(
        size=7, spec_state_size=2, state_shape=None, layer_ids=[], dtype=torch.float16
    )
    with pytest.raises(InvalidArgumentError, match="disabled"):
        mp.register_slot_state(off)
    wrong = NGramPool(size=6, spec_state_size=2, context_len=3, eos_token_id=0)
    with pytest.raises(InvalidArgumentError, match="rows"):
        mp.register_slot_state(wrong)
    twin = NGramPool(size=7, spec_state_size=2, context_len=3, eos_token_id=0)
    with pytest.raises(InvalidArgumentError, match="'ngram' is already declared"):
        mp.register_slot_state(twin)
    with pytest.raises(InvalidArgumentError, match="lacks"):
        mp.register_slot_state(object())
    assert len(mp.slot_states) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(conv_shapes=[(4, 3)]), "one per layer"),
        (dict(conv_shapes=[(4, 0), (4, 3)]), r"conv_shapes\[0\]"),
        (dict(temporal_shape=()), "temporal_shape"),
        (dict(mamba_layer_ids=[3, 3]), "twice"),
        (dict(mamba_layer_ids=[]), "non-empty"),
        (dict(conv_dtype=torch.int32), "conv_dtype"),
        (dict(size=0), "size"),
        (dict(spec_state_size=-1), "spec_state_size"),
    ],
)
def test_mamba_pool_construction_errors(kwargs, match):
    args = dict(size=3, conv_shapes=[(4, 3), (4, 2)], temporal_shape=(2,), mamba_layer_ids=[0, 2])
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=match):
        MambaPool(**args)


# -- sibling pools -----------------------------------------------------------------------------


def test_short_conv_pool():
    sc = ShortConvPool(size=4, state_shape=(3, 2), layer_ids=[5, 2], dtype=torch.float32)
    assert sc.enabled and sc.num_rows == 5 and sc.layer_cache(2).shape == (5, 3, 2)
    assert sc.layer_cache(2).data_ptr() == sc.conv_state[1].data_ptr()
    with pytest.raises(InvalidArgumentError, match=r"\[5, 2\]"):
        sc.layer_cache(3)
    with pytest.raises(InvalidArgumentError, match="state_shape"):
        ShortConvPool(size=4, state_shape=None, layer_ids=[1], dtype=torch.float32)
    off = ShortConvPool(size=4, state_shape=None, layer_ids=[], dtype=torch.float32)
    assert not off.enabled and off.mem_usage_bytes() == 0 and off.slot_nbytes == 0
    off.clear_slots(torch.tensor([1]))  # a no-op
    for call in (off.state_decl, lambda: off.layer_cache(0)):
        with pytest.raises(LayoutError, match="disabled"):
            call()


def test_ngram_push_and_context_match_a_list_reference(gen):
    ng = NGramPool(size=3, context_len=4, eos_token_id=9, device="cpu")
    ref = {s: [] for s in (1, 2, 3)}
    for _ in range(40):
        slot = int(torch.randint(1, 4, (1,), generator=gen))
        k = int(torch.randint(0, 7, (1,), generator=gen))
        toks = torch.randint(10, 50, (k,), generator=gen)
        ng.push(slot, toks if k % 2 else toks.tolist())
        ref[slot] += toks.tolist()
    ctx = ng.context(torch.tensor([1, 2, 3]))
    for s in (1, 2, 3):
        want = ([9] * 4 + ref[s])[-4:]
        assert ctx[s - 1].tolist() == want and int(ng.num_tokens[s]) == len(ref[s])
    assert ctx.dtype == torch.int32
    ng.clear_slots(torch.tensor([2]))
    assert ng.context(torch.tensor([2])).tolist() == [[9] * 4] and int(ng.num_tokens[2]) == 0
    for bad in (0, 4, True):
        with pytest.raises(InvalidArgumentError, match="slot"):
            ng.push(bad, [1])
    with pytest.raises(InvalidArgumentError, match="1-D"):
        ng.push(1, torch.tensor([[1, 2]]))
    off = NGramPool(size=3, context_len=0, eos_token_id=0)
    assert not off.enabled
    with pytest.raises(LayoutError):
        off.push(1, [1])
