"""Device KV pools on CPU: layout, exact writes, layer ranges, byte accounting, bad input."""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch

from tiered_kv.device.kv_cache import mha_kv_bytes, mla_kv_bytes
from tiered_kv.device.mha_pool import MHATokenToKOnlyPool, MHATokenToKVPool
from tiered_kv.device.mla_pool import MLATokenToKVPool
from tiered_kv.device.write_loc import KVWriteLoc
from tiered_kv.errors import (
    InvalidArgumentError,
    LayoutError,
    PhysicalWriteLocError,
    TieredKVError,
)

CPU = "cpu"
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, *FP8)
BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, **{d: 1 for d in FP8}}
PAGE_SIZES = (1, 16, 64)
KINDS = ("mha", "mha_v", "mla", "konly")

H, D, DV = 3, 10, 6  # MHA head count, K head dim, V head dim of the "mha_v" variant
R, DR = 12, 5  # MLA kv_lora_rank, qk_rope_head_dim
L = 3
N = 11  # tokens per write


def _seed(*parts: object) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode())


def _gen(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(*parts))


def _size(page_size: int) -> int:
    return 3 * page_size + 7  # not a multiple of the page size


def _make(kind, page_size=16, dtype=torch.float32, *, layer_num=L, size=None, cls=None, **kw):
    size = _size(page_size) if size is None else size
    if kind == "mha":
        return (cls or MHATokenToKVPool)(size, page_size, dtype, H, D, layer_num, CPU, **kw)
    if kind == "mha_v":
        return MHATokenToKVPool(size, page_size, dtype, H, D, layer_num, CPU, v_head_dim=DV, **kw)
    if kind == "mla":
        return MLATokenToKVPool(size, page_size, dtype, R, DR, layer_num, CPU, **kw)
    if kind == "konly":
        return MHATokenToKOnlyPool(size, page_size, dtype, H, D, layer_num, CPU, **kw)
    raise AssertionError(kind)


def _token_shapes(pool) -> list[tuple[int, ...]]:
    """Per-token shape of each store buffer: [K, V] for MHA, [latent] for MLA, [K] for K-only."""
    if isinstance(pool, MLATokenToKVPool):
        return [(1, pool.kv_cache_dim)]
    if isinstance(pool, MHATokenToKOnlyPool):
        return [(pool.head_num, pool.head_dim)]
    return [(pool.head_num, pool.head_dim), (pool.head_num, pool.v_head_dim)]


def _stores(pool, local: int) -> list[torch.Tensor]:
    if isinstance(pool, MLATokenToKVPool):
        return [pool.kv_buffer[local]]
    if isinstance(pool, MHATokenToKOnlyPool):
        return [pool.k_buffer[local]]
    return [pool.k_buffer[local], pool.v_buffer[local]]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _fill_sentinel(pool, gen: torch.Generator) -> None:
    """Random raw bytes in every buffer, so an unintended write cannot hide behind zeros."""
    for t in pool.buffers():
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=gen, dtype=torch.uint8))


def _snapshot(pool) -> list[list[torch.Tensor]]:
    return [[t.clone() for t in _stores(pool, i)] for i in range(pool.layer_num)]


def _assert_unchanged(pool, snap) -> None:
    for i, bufs in enumerate(snap):
        for now, before in zip(_stores(pool, i), bufs, strict=True):
            assert torch.equal(_u8(now), _u8(before)), f"local layer {i} changed"


def _assert_wrote(pool, snap, local: int, loc: torch.Tensor, expected: list[torch.Tensor]):
    """Rows ``loc`` of local layer ``local`` hold ``expected`` (one tensor per store buffer)
    byte for byte; every other row of every layer is byte-identical to ``snap``."""
    loc = loc.long()
    for i, bufs in enumerate(snap):
        stores = _stores(pool, i)
        for j, (now, before) in enumerate(zip(stores, bufs, strict=True)):
            if i != local:
                assert torch.equal(_u8(now), _u8(before)), f"local layer {i} changed"
                continue
            untouched = torch.ones(now.shape[0], dtype=torch.bool)
            untouched[loc] = False
            assert untouched.sum() == now.shape[0] - loc.unique().numel()
            assert torch.equal(_u8(now[untouched]), _u8(before[untouched])), "unnamed slot changed"
            want = expected[j].reshape(now[loc].shape)
            if want.dtype != now.dtype:  # fp8 values vs the uint8 store
                want = want.view(now.dtype)
            assert torch.equal(_u8(now[loc]), _u8(want)), "named slot holds wrong bytes"


def _rand(shape, dtype, gen) -> torch.Tensor:
    """Finite random values (never all zero) in ``dtype``; fp8 values stay in range."""
    return (torch.randn(shape, generator=gen) * 3 + 0.25).to(dtype)


def _random_kv(pool, n, gen, dtype=None) -> list[torch.Tensor]:
    dtype = pool.dtype if dtype is None else dtype
    return [_rand((n, *s), dtype, gen) for s in _token_shapes(pool)]


def _write(pool, layer, loc_info, kv, **scales) -> None:
    k, v = kv[0], (kv[1] if len(kv) > 1 else None)
    pool.set_kv_buffer(layer, loc_info, k, v, **scales)


def _random_loc(pool, n, gen, dtype=torch.int64) -> torch.Tensor:
    return torch.randperm(pool.num_slots, generator=gen)[:n].to(dtype)


def _prepared(kind, page_size=16, dtype=torch.float32, **kw):
    """A pool full of sentinel bytes, its snapshot, and a generator for the test's data."""
    gen = _gen(kind, page_size, dtype, *sorted(kw.items()))
    pool = _make(kind, page_size, dtype, **kw)
    _fill_sentinel(pool, gen)
    return pool, _snapshot(pool), gen


# -- layout -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_buffers_one_tensor_per_layer_with_padding_page(kind, page_size, dtype):
    pool = _make(kind, page_size, dtype)
    store = torch.uint8 if dtype in FP8 else dtype
    assert pool.store_dtype == store
    assert pool.num_slots == _size(page_size) + page_size
    bufs = pool.buffers()
    per_layer = len(_token_shapes(pool))
    assert len(bufs) == per_layer * L
    assert len({t.data_ptr() for t in bufs}) == len(bufs)  # distinct tensors
    for t in bufs:
        assert t.shape[0] == _size(page_size) + page_size
        assert t.dtype == store
        assert t.device.type == "cpu"
        assert not t.any()  # zero-filled: the padding page holds finite values
    for layer in range(L):
        stores = _stores(pool, layer)
        shapes = _token_shapes(pool)
        for t, s in zip(stores, shapes, strict=True):
            assert t.shape == (pool.num_slots, *s)
        key = pool.get_key_buffer(layer)
        assert key.dtype == dtype
        assert key.shape == (pool.num_slots, *shapes[0])
        assert key.data_ptr() == stores[0].data_ptr()  # a view, not a copy
        if kind.startswith("mha"):
            val = pool.get_value_buffer(layer)
            assert val.dtype == dtype
            assert val.shape == (pool.num_slots, *shapes[1])
            assert val.data_ptr() == stores[1].data_ptr()
            k2, v2 = pool.get_kv_buffer(layer)
            assert k2.data_ptr() == key.data_ptr() and v2.data_ptr() == val.data_ptr()


# -- exact writes -------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [False, True], ids=["writeloc", "tensor"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_set_kv_buffer_writes_exactly_the_named_slots(kind, page_size, dtype, raw):
    pool, snap, gen = _prepared(kind, page_size, dtype)
    loc_dtype = torch.int32 if _seed(kind, page_size, dtype) % 2 else torch.int64
    loc = _random_loc(pool, N, gen, loc_dtype)
    kv = _random_kv(pool, N, gen)
    inputs = [t.clone() for t in kv]

    _write(pool, 1, loc if raw else KVWriteLoc(loc), kv)

    _assert_wrote(pool, snap, 1, loc, kv)
    for a, b in zip(kv, inputs, strict=True):
        assert torch.equal(_u8(a), _u8(b))  # inputs untouched
    # The typed getters read the same bytes back.
    assert torch.equal(_u8(pool.get_key_buffer(1)[loc.long()]), _u8(kv[0]))
    if kind.startswith("mha"):
        assert torch.equal(_u8(pool.get_value_buffer(1)[loc.long()]), _u8(kv[1]))


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("kind", KINDS)
def test_fp8_write_from_float32_with_scale(kind, dtype, scale_kind):
    pool, snap, gen = _prepared(kind, 16, dtype)
    loc = _random_loc(pool, N, gen)
    x = [(torch.randn((N, *s), generator=gen) * 5 + 0.5) for s in _token_shapes(pool)]
    inputs = [t.clone() for t in x]
    ks, vs = (0.37, 1.9) if scale_kind == "float" else (torch.tensor(0.37), torch.tensor(1.9))

    _write(pool, 2, KVWriteLoc(loc), x, k_scale=ks, v_scale=vs)

    expected = [(x[0] / ks).to(dtype)]
    if len(x) > 1:
        expected.append((x[1] / vs).to(dtype))
    _assert_wrote(pool, snap, 2, loc, expected)
    # The scale was applied to a copy: the caller's tensors are unchanged.
    for a, b in zip(x, inputs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, *FP8], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_float32_input_is_cast_to_the_pool_dtype(kind, dtype):
    pool, snap, gen = _prepared(kind, 1, dtype)
    loc = _random_loc(pool, N, gen)
    x = _random_kv(pool, N, gen, torch.float32)
    _write(pool, 0, KVWriteLoc(loc), x)
    _assert_wrote(pool, snap, 0, loc, [t.to(dtype) for t in x])


@pytest.mark.parametrize("dtype", [torch.float32, *FP8], ids=str)
def test_scale_is_ignored_when_input_already_has_the_pool_dtype(dtype):
    pool, snap, gen = _prepared("mha", 16, dtype)
    loc = _random_loc(pool, N, gen)
    kv = _random_kv(pool, N, gen)
    _write(pool, 0, KVWriteLoc(loc), kv, k_scale=4.0, v_scale=0.5)
    _assert_wrote(pool, snap, 0, loc, kv)


@pytest.mark.parametrize("kind", KINDS)
def test_flat_last_dim_is_accepted(kind):
    pool, snap, gen = _prepared(kind, 16, torch.bfloat16)
    loc = _random_loc(pool, N, gen)
    kv = _random_kv(pool, N, gen)
    flat = [t.reshape(N, -1) for t in kv]
    _write(pool, 1, KVWriteLoc(loc), flat)
    _assert_wrote(pool, snap, 1, loc, kv)


@pytest.mark.parametrize("kind", KINDS)
def test_write_goes_to_full_loc_when_given(kind):
    pool, snap, gen = _prepared(kind, 16, torch.float16)
    perm = torch.randperm(pool.num_slots, generator=gen)
    loc, full = perm[:N], perm[N : 2 * N]
    kv = _random_kv(pool, N, gen)
    _write(pool, 2, KVWriteLoc(loc, full_loc=full), kv)
    _assert_wrote(pool, snap, 2, full, kv)  # loc's own slots are untouched


@pytest.mark.parametrize("kind", KINDS)
def test_successive_writes_accumulate(kind):
    pool, snap, gen = _prepared(kind, 16, torch.float32)
    perm = torch.randperm(pool.num_slots, generator=gen)
    loc_a, loc_b = perm[:7], perm[7:20]
    kv_a, kv_b = _random_kv(pool, 7, gen), _random_kv(pool, 13, gen)
    _write(pool, 0, KVWriteLoc(loc_a), kv_a)
    _write(pool, 0, KVWriteLoc(loc_b), kv_b)
    both = torch.cat([loc_a, loc_b])
    _assert_wrote(pool, snap, 0, both, [torch.cat([a, b]) for a, b in zip(kv_a, kv_b, strict=True)])


def test_empty_write_changes_nothing():
    pool, snap, gen = _prepared("mha", 16, torch.float32)
    kv = _random_kv(pool, 0, gen)
    _write(pool, 0, KVWriteLoc(torch.empty(0, dtype=torch.int64)), kv)
    _assert_unchanged(pool, snap)


# -- layer ranges -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_start_layer_maps_global_ids_to_local_buffers(kind):
    pool, snap, gen = _prepared(kind, 16, torch.float32, layer_num=4, start_layer=3)
    assert (pool.start_layer, pool.end_layer) == (3, 6)
    for global_id in range(3, 7):
        local = global_id - 3
        assert pool.layer_index(global_id) == local
        assert pool.get_key_buffer(global_id).data_ptr() == _stores(pool, local)[0].data_ptr()
        if kind.startswith("mha"):
            assert pool.get_value_buffer(global_id).data_ptr() == _stores(pool, local)[1].data_ptr()
    loc = _random_loc(pool, N, gen)
    kv = _random_kv(pool, N, gen)
    _write(pool, 5, KVWriteLoc(loc), kv)
    _assert_wrote(pool, snap, 2, loc, kv)


@pytest.mark.parametrize("bad", [2, 7, 0, -1, 100])
@pytest.mark.parametrize("kind", KINDS)
def test_layer_outside_the_range_raises_naming_it(kind, bad):
    pool, snap, gen = _prepared(kind, 16, torch.float32, layer_num=4, start_layer=3)
    with pytest.raises(InvalidArgumentError) as ei:
        pool.get_key_buffer(bad)
    assert f"layer_id={bad}" in str(ei.value) and "3..6" in str(ei.value)
    loc = _random_loc(pool, N, gen)
    with pytest.raises(InvalidArgumentError) as ei:
        _write(pool, bad, KVWriteLoc(loc), _random_kv(pool, N, gen))
    assert f"layer_id={bad}" in str(ei.value) and "3..6" in str(ei.value)
    _assert_unchanged(pool, snap)


@pytest.mark.parametrize("bad", ["4", 4.0, None, torch.tensor(4)], ids=repr)
def test_non_int_layer_id_raises(bad):
    pool, snap, _ = _prepared("mha", 16, torch.float32, layer_num=4, start_layer=3)
    with pytest.raises(InvalidArgumentError, match="layer_id must be an int"):
        pool.get_key_buffer(bad)
    _assert_unchanged(pool, snap)


@pytest.mark.parametrize("kind", KINDS)
def test_end_layer_must_match_start_and_count(kind):
    pool = _make(kind, 16, torch.float32, layer_num=4, start_layer=3, end_layer=6)
    assert pool.end_layer == 6
    for end in (7, 5):
        with pytest.raises(InvalidArgumentError) as ei:
            _make(kind, 16, torch.float32, layer_num=4, start_layer=3, end_layer=end)
        msg = str(ei.value)
        assert f"end_layer={end}" in msg and "expected end_layer=6" in msg
    with pytest.raises(InvalidArgumentError, match="start_layer=-1"):
        _make(kind, 16, torch.float32, layer_num=4, start_layer=-1)


# -- MLA ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mla_value_buffer_is_a_view_of_the_latent(dtype):
    pool, snap, gen = _prepared("mla", 16, dtype)
    for layer in range(L):
        k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        assert v.shape == (pool.num_slots, 1, R)
        assert v.dtype == dtype
        assert v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        assert v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
    loc = _random_loc(pool, N, gen)
    latent = _rand((N, 1, R + DR), dtype, gen)
    pool.set_kv_buffer(1, KVWriteLoc(loc), latent, None)
    _assert_wrote(pool, snap, 1, loc, [latent])
    assert torch.equal(_u8(pool.get_key_buffer(1)[loc]), _u8(latent))
    assert torch.equal(_u8(pool.get_value_buffer(1)[loc]), _u8(latent[..., :R]))


def test_mla_write_through_the_value_view_reaches_the_latent():
    pool, snap, gen = _prepared("mla", 16, torch.float32)
    loc = _random_loc(pool, N, gen)
    nope = _rand((N, 1, R), torch.float32, gen)
    pool.get_value_buffer(2)[loc] = nope
    key = pool.get_key_buffer(2)
    assert torch.equal(_u8(key[loc][..., :R]), _u8(nope))
    assert torch.equal(_u8(key[loc][..., R:]), _u8(snap[2][0][loc][..., R:]))


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_set_mla_kv_buffer_equals_set_kv_buffer_of_the_concatenation(dtype, flat):
    a, snap, gen = _prepared("mla", 16, dtype)
    b = _make("mla", 16, dtype)
    for ta, tb in zip(a.buffers(), b.buffers(), strict=True):
        tb.copy_(ta)
    loc = _random_loc(a, N, gen)
    nope, rope = _rand((N, 1, R), dtype, gen), _rand((N, 1, DR), dtype, gen)
    latent = torch.cat([nope.view(torch.uint8), rope.view(torch.uint8)], dim=-1).view(dtype)

    a.set_kv_buffer(0, KVWriteLoc(loc), latent, None)
    if flat:
        b.set_mla_kv_buffer(0, KVWriteLoc(loc), nope.reshape(N, R), rope.reshape(N, DR))
    else:
        b.set_mla_kv_buffer(0, KVWriteLoc(loc), nope, rope)

    for ta, tb in zip(a.buffers(), b.buffers(), strict=True):
        assert torch.equal(_u8(ta), _u8(tb))  # bytes: the sentinel may hold NaN patterns
    _assert_wrote(b, snap, 0, loc, [latent])


@pytest.mark.parametrize(
    "nope_dim, rope_dim", [(R + 1, DR), (R, DR - 1), (R - 2, DR + 2)], ids=["nope", "rope", "both"]
)
def test_set_mla_kv_buffer_wrong_dims_raise_and_write_nothing(nope_dim, rope_dim):
    pool, snap, gen = _prepared("mla", 16, torch.float32)
    loc = _random_loc(pool, N, gen)
    nope, rope = (
        _rand((N, 1, nope_dim), torch.float32, gen),
        _rand((N, 1, rope_dim), torch.float32, gen),
    )
    with pytest.raises(InvalidArgumentError) as ei:
        pool.set_mla_kv_buffer(0, KVWriteLoc(loc), nope, rope)
    msg = str(ei.value)
    if nope_dim != R:
        assert f"cache_k_nope has shape ({N}, 1, {nope_dim})" in msg and f"({N}, 1, {R})" in msg
    else:
        assert f"cache_k_rope has shape ({N}, 1, {rope_dim})" in msg and f"({N}, 1, {DR})" in msg
    _assert_unchanged(pool, snap)


@pytest.mark.parametrize("rope_tokens", [N + 1, N // 2])
def test_set_mla_kv_buffer_rope_with_another_token_count_raises(rope_tokens):
    """nope has N tokens; a rope part with another token count is refused, not reshaped."""
    pool, snap, gen = _prepared("mla", 16, torch.float32)
    loc = _random_loc(pool, N, gen)
    nope = _rand((N, 1, R), torch.float32, gen)
    # N // 2 tokens of twice the rope width has exactly N * DR elements.
    width = DR if rope_tokens == N + 1 else N * DR // rope_tokens
    rope = _rand((rope_tokens, 1, width), torch.float32, gen)
    with pytest.raises(InvalidArgumentError) as ei:
        pool.set_mla_kv_buffer(0, KVWriteLoc(loc), nope, rope)
    assert "cache_k_rope" in str(ei.value) and str(rope_tokens) in str(ei.value)
    _assert_unchanged(pool, snap)


def test_mla_set_kv_buffer_with_cache_v_raises_and_writes_nothing():
    pool, snap, gen = _prepared("mla", 16, torch.float32)
    loc = _random_loc(pool, N, gen)
    latent = _rand((N, 1, R + DR), torch.float32, gen)
    with pytest.raises(InvalidArgumentError, match="cache_v=None"):
        pool.set_kv_buffer(0, KVWriteLoc(loc), latent, latent[..., :R])
    _assert_unchanged(pool, snap)


def test_mla_allows_no_rope_part():
    pool = MLATokenToKVPool(29, 4, torch.float16, 8, 0, 2, CPU)
    gen = _gen("mla-no-rope")
    _fill_sentinel(pool, gen)
    snap = _snapshot(pool)
    loc = _random_loc(pool, 5, gen)
    latent = _rand((5, 1, 8), torch.float16, gen)
    pool.set_kv_buffer(1, KVWriteLoc(loc), latent, None)
    _assert_wrote(pool, snap, 1, loc, [latent])
    assert pool.get_value_buffer(1).shape == (33, 1, 8)


# -- K-only -------------------------------------------------------------------------------------
def test_k_only_pool_has_no_value_buffer():
    pool, snap, gen = _prepared("konly", 16, torch.float16)
    with pytest.raises(LayoutError) as ei:
        pool.get_value_buffer(1)
    assert isinstance(ei.value, TieredKVError)
    assert "layer 1" in str(ei.value)
    k, v = pool.get_kv_buffer(2)
    assert v is None and k.data_ptr() == pool.k_buffer[2].data_ptr()
    _assert_unchanged(pool, snap)


def test_k_only_pool_refuses_cache_v_and_writes_nothing():
    pool, snap, gen = _prepared("konly", 16, torch.float16)
    loc = _random_loc(pool, N, gen)
    k = _rand((N, H, D), torch.float16, gen)
    with pytest.raises(InvalidArgumentError, match="cache_v=None"):
        pool.set_kv_buffer(0, KVWriteLoc(loc), k, k.clone())
    _assert_unchanged(pool, snap)


# -- bytes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_byte_accounting(page_size, dtype):
    tokens = _size(page_size) + page_size
    b = BYTES[dtype]
    mha = _make("mha", page_size, dtype)
    mla = _make("mla", page_size, dtype)
    konly = _make("konly", page_size, dtype)
    mha_v = _make("mha_v", page_size, dtype)

    assert mha.get_kv_size_bytes() == mha_kv_bytes(L, tokens, H, D, dtype)
    assert mha.get_kv_size_bytes() == 2 * L * tokens * H * D * b
    assert mla.get_kv_size_bytes() == mla_kv_bytes(L, tokens, R, DR, dtype)
    assert mla.get_kv_size_bytes() == L * tokens * (R + DR) * b
    assert 2 * konly.get_kv_size_bytes() == mha.get_kv_size_bytes()
    assert mha_v.get_kv_size_bytes() == L * tokens * H * (D + DV) * b

    assert mha.bytes_per_token_per_layer() == 2 * H * D * b
    assert mla.bytes_per_token_per_layer() == (R + DR) * b
    assert konly.bytes_per_token_per_layer() == H * D * b
    assert mha_v.bytes_per_token_per_layer() == H * (D + DV) * b
    for pool in (mha, mla, konly, mha_v):
        assert pool.bytes_per_token_per_layer() * L * tokens == pool.get_kv_size_bytes()


def test_fp8_counts_one_byte_in_the_formulas():
    for dtype in FP8:
        assert mha_kv_bytes(2, 7, 3, 5, dtype) == 2 * 2 * 7 * 3 * 5
        assert mla_kv_bytes(2, 7, 12, 5, dtype) == 2 * 7 * 17
    assert mha_kv_bytes(2, 7, 3, 5, torch.bfloat16) == 2 * 2 * 7 * 3 * 5 * 2


# -- bad input ----------------------------------------------------------------------------------
def _check_bad_write(pool, snap, call, needles, exc=InvalidArgumentError):
    with pytest.raises(exc) as ei:
        call()
    assert isinstance(ei.value, TieredKVError) and isinstance(ei.value, ValueError)
    for needle in needles:
        assert needle in str(ei.value), (needle, str(ei.value))
    _assert_unchanged(pool, snap)


@pytest.mark.parametrize("delta", [1, -1, -N])
@pytest.mark.parametrize("kind", KINDS)
def test_loc_of_wrong_length_raises(kind, delta):
    pool, snap, gen = _prepared(kind)
    loc = _random_loc(pool, N + delta, gen)
    kv = _random_kv(pool, N, gen)
    _check_bad_write(
        pool,
        snap,
        lambda: _write(pool, 1, KVWriteLoc(loc), kv),
        [f"has {N + delta} slots", f"{N} tokens"],
    )


@pytest.mark.parametrize("where", ["end", "negative", "far"])
@pytest.mark.parametrize("kind", KINDS)
def test_loc_out_of_range_raises(kind, where):
    pool, snap, gen = _prepared(kind)
    loc = _random_loc(pool, N, gen)
    bad = {"end": pool.num_slots, "negative": -1, "far": 10**6}[where]
    loc[N // 2] = bad
    kv = _random_kv(pool, N, gen)
    _check_bad_write(
        pool,
        snap,
        lambda: _write(pool, 0, KVWriteLoc(loc), kv),
        [f"[{bad}]", f"[0, {pool.num_slots})"],
    )


@pytest.mark.parametrize("kind", KINDS)
def test_loc_with_float_dtype_raises(kind):
    pool, snap, gen = _prepared(kind)
    loc = _random_loc(pool, N, gen).to(torch.float32)
    kv = _random_kv(pool, N, gen)
    _check_bad_write(pool, snap, lambda: _write(pool, 0, loc, kv), ["torch.float32"])
    _check_bad_write(pool, snap, lambda: KVWriteLoc(loc), ["torch.float32"])


@pytest.mark.parametrize("kind", KINDS)
def test_loc_2d_raises(kind):
    pool, snap, gen = _prepared(kind)
    loc = _random_loc(pool, N - 1, gen).reshape(2, -1)
    kv = _random_kv(pool, 2, gen)
    _check_bad_write(pool, snap, lambda: _write(pool, 0, loc, kv), ["1-D", "(2, 5)"])


@pytest.mark.parametrize(
    "which, shape",
    [
        ("k", (N, H + 1, D)),
        ("k", (N, H, D + 1)),
        ("k", (N, H - 1, D)),
        ("k", (N + 1, H, D)),
        ("v", (N, H, D - 3)),
        ("v", (N, H + 2, D)),
    ],
)
def test_mha_k_or_v_with_wrong_heads_raises(which, shape):
    pool, snap, gen = _prepared("mha")
    loc = _random_loc(pool, N, gen)
    kv = _random_kv(pool, N, gen)
    kv[0 if which == "k" else 1] = _rand(shape, torch.float32, gen)
    needle = str(shape) if which == "v" or shape[0] == N else f"{shape[0]} tokens"
    _check_bad_write(pool, snap, lambda: _write(pool, 0, KVWriteLoc(loc), kv), [needle])


@pytest.mark.parametrize("kind", ["mha", "konly"])
@pytest.mark.parametrize("shape", [(N, 2, 15), (N, 5, 6), (N, D, H)])
def test_k_with_wrong_heads_but_same_numel_raises(kind, shape):
    """Only a flat last dim may be reshaped: a (n, heads', dim') tensor with the right element
    count but another head layout must be refused, not silently reshaped into (n, H, D)."""
    pool, snap, gen = _prepared(kind)
    loc = _random_loc(pool, N, gen)
    kv = _random_kv(pool, N, gen)
    kv[0] = _rand(shape, torch.float32, gen)
    _check_bad_write(pool, snap, lambda: _write(pool, 0, KVWriteLoc(loc), kv), [str(shape)])


@pytest.mark.parametrize("kind", KINDS)
def test_k_with_wrong_width_raises(kind):
    pool, snap, gen = _prepared(kind)
    loc = _random_loc(pool, N, gen)
    kv = _random_kv(pool, N, gen)
    shape = (N, *_token_shapes(pool)[0][:-1], _token_shapes(pool)[0][-1] + 1)
    kv[0] = _rand(shape, torch.float32, gen)
    _check_bad_write(pool, snap, lambda: _write(pool, 0, KVWriteLoc(loc), kv), [str(shape)])


@pytest.mark.parametrize("kind", KINDS)
def test_k_with_integer_dtype_raises(kind):
    pool, snap, gen = _prepared(kind)
    loc = _random_loc(pool, N, gen)
    kv = _random_kv(pool, N, gen)
    kv[0] = torch.randint(1, 50, kv[0].shape, generator=gen, dtype=torch.int32)
    _check_bad_write(
        pool, snap, lambda: _write(pool, 0, KVWriteLoc(loc), kv), ["cache_k", "torch.int32"]
    )


@pytest.mark.parametrize("bad", [torch.tensor(1.5), [1.0, 2.0]], ids=["0d", "list"])
@pytest.mark.parametrize("kind", KINDS)
def test_k_not_a_token_tensor_raises(kind, bad):
    pool, snap, gen = _prepared(kind)
    loc = _random_loc(pool, 1, gen)
    kv = _random_kv(pool, 1, gen)
    kv[0] = bad
    _check_bad_write(pool, snap, lambda: _write(pool, 0, KVWriteLoc(loc), kv), ["cache_k"])


def test_mha_without_cache_v_raises():
    pool, snap, gen = _prepared("mha")
    loc = _random_loc(pool, N, gen)
    k = _rand((N, H, D), torch.float32, gen)
    _check_bad_write(pool, snap, lambda: pool.set_kv_buffer(0, loc, k, None), ["cache_v"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"dtype": torch.int32}, "torch.int32"),
        ({"dtype": torch.uint8}, "torch.uint8"),
        ({"dtype": torch.float64}, "torch.float64"),
        ({"size": 0}, "size=0"),
        ({"size": -40}, "size=-40"),
        ({"page_size": 0}, "page_size=0"),
        ({"layer_num": 0}, "layer_num=0"),
    ],
)
def test_bad_construction_raises_naming_the_value(kind, kwargs, needle):
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", torch.float32)
    page_size = kwargs.pop("page_size", 16)
    with pytest.raises(InvalidArgumentError) as ei:
        _make(kind, page_size, dtype, **kwargs)
    assert isinstance(ei.value, TieredKVError) and isinstance(ei.value, ValueError)
    assert needle in str(ei.value)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: MHATokenToKVPool(40, 4, torch.float16, 0, 8, 2, CPU), "head_num=0"),
        (lambda: MHATokenToKVPool(40, 4, torch.float16, 2, -8, 2, CPU), "head_dim=-8"),
        (
            lambda: MHATokenToKVPool(40, 4, torch.float16, 2, 8, 2, CPU, v_head_dim=0),
            "v_head_dim=0",
        ),
        (lambda: MHATokenToKOnlyPool(40, 4, torch.float16, 2, 0, 2, CPU), "head_dim=0"),
        (lambda: MLATokenToKVPool(40, 4, torch.float16, 0, 8, 2, CPU), "kv_lora_rank=0"),
        (lambda: MLATokenToKVPool(40, 4, torch.float16, 8, -1, 2, CPU), "qk_rope_head_dim=-1"),
    ],
)
def test_bad_geometry_raises_naming_the_value(make, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        make()


# -- physical write locs ------------------------------------------------------------------------
class _VirtualIdPool(MHATokenToKVPool):
    """A pool whose ids are virtual: it must only be written with physical locs."""

    requires_physical_write_loc = True


def _physical_pool():
    pool, snap, gen = _prepared("mha", 16, torch.bfloat16, cls=_VirtualIdPool)
    return pool, snap, gen


@pytest.mark.parametrize("how", ["unmarked", "tensor", "batch_false", "batch_missing"])
def test_physical_pool_refuses_unmarked_locs(how):
    pool, snap, gen = _physical_pool()
    loc = _random_loc(pool, N, gen)
    kv = _random_kv(pool, N, gen)
    loc_info = {
        "unmarked": lambda: KVWriteLoc(loc),
        "tensor": lambda: loc,
        "batch_false": lambda: KVWriteLoc.for_batch(
            SimpleNamespace(out_cache_loc=loc, out_cache_loc_is_physical=False)
        ),
        "batch_missing": lambda: KVWriteLoc.for_batch(SimpleNamespace(out_cache_loc=loc)),
    }[how]()
    _check_bad_write(
        pool,
        snap,
        lambda: _write(pool, 0, loc_info, kv),
        ["physical", "not marked"],
        exc=PhysicalWriteLocError,
    )
    assert issubclass(PhysicalWriteLocError, InvalidArgumentError)


@pytest.mark.parametrize("how", ["marked", "batch"])
def test_physical_pool_accepts_marked_locs(how):
    pool, snap, gen = _physical_pool()
    loc = _random_loc(pool, N, gen)
    kv = _random_kv(pool, N, gen)
    if how == "marked":
        loc_info = KVWriteLoc(loc, physical=True)
    else:
        batch = SimpleNamespace(out_cache_loc=loc, out_cache_loc_is_physical=True)
        loc_info = KVWriteLoc.for_batch(batch)
    _write(pool, 2, loc_info, kv)
    _assert_wrote(pool, snap, 2, loc, kv)


def test_physical_mark_does_not_bypass_other_checks():
    pool, snap, gen = _physical_pool()
    loc = _random_loc(pool, N, gen)
    loc[3] = pool.num_slots + 2
    kv = _random_kv(pool, N, gen)
    _check_bad_write(
        pool,
        snap,
        lambda: _write(pool, 0, KVWriteLoc(loc, physical=True), kv),
        [f"[{pool.num_slots + 2}]"],
    )


def test_plain_pool_accepts_unmarked_locs():
    assert MHATokenToKVPool.requires_physical_write_loc is False
    pool, snap, gen = _prepared("mha", 16, torch.bfloat16)
    loc = _random_loc(pool, N, gen)
    kv = _random_kv(pool, N, gen)
    _write(pool, 0, loc, kv)
    _assert_wrote(pool, snap, 0, loc, kv)
