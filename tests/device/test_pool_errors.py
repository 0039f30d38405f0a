"""Bad input to the device pools and allocators is a typed error naming the value and what would
be valid, and changes nothing: a write's dtype, an allocator's kvcache, a pool too big to hold."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device import KVWriteLoc, MHATokenToKVPool, PagedTokenToKVPoolAllocator
from tiered_kv.device.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from tiered_kv.device.allocator.token import TokenToKVPoolAllocator
from tiered_kv.device.allocator.unified_swa import UnifiedSWATokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import DSATokenToKVPool
from tiered_kv.device.mha_pool import MHATokenToKOnlyPool
from tiered_kv.device.mla_pool import MLATokenToKVPool
from tiered_kv.errors import HostMemoryError, InvalidArgumentError, TieredKVError

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
P, H, D, L = 4, 3, 10, 3


def _pool(kind: str, dtype: torch.dtype, size: int = 13 * P):
    if kind == "mha":
        return MHATokenToKVPool(size, P, dtype, H, D, L, "cpu", v_head_dim=6)
    if kind == "konly":
        return MHATokenToKOnlyPool(size, P, dtype, H, D, L, "cpu")
    return MLATokenToKVPool(size, P, dtype, 12, 5, L, "cpu")


def _kv(pool, n: int, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    """Random K (and V where the pool has one) of ``n`` tokens in ``dtype``, never all zero."""
    if isinstance(pool, MLATokenToKVPool):
        shapes = [(n, 1, pool.kv_cache_dim)]
    elif isinstance(pool, MHATokenToKOnlyPool):
        shapes = [(n, H, D)]
    else:
        shapes = [(n, H, D), (n, H, pool.v_head_dim)]
    kv = [(torch.randn(s, generator=gen) * 3 + 0.25).to(dtype) for s in shapes]
    return kv[0], kv[1] if len(kv) > 1 else None


def _loc(pool, n: int, gen: torch.Generator) -> KVWriteLoc:
    return KVWriteLoc(torch.randperm(pool.size, generator=gen)[:n] + pool.page_size)


def _snapshot(pool) -> list[torch.Tensor]:
    return [t.clone() for t in pool.buffers()]


def _unchanged(pool, snap) -> bool:
    return all(torch.equal(a, b) for a, b in zip(pool.buffers(), snap, strict=True))


# (pool dtype, input dtype) pairs a write refuses: no KV dtype, the other half type, another fp8
REFUSED = [
    (torch.float32, torch.float64),
    (torch.bfloat16, torch.float64),
    (torch.bfloat16, torch.float16),
    (torch.float16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.float8_e4m3fn, torch.float64),
    (torch.float8_e4m3fn, torch.float8_e5m2),
]


@pytest.mark.parametrize("kind", ["mha", "konly", "mla"])
@pytest.mark.parametrize(("pool_dtype", "bad"), REFUSED, ids=str)
def test_write_of_a_dtype_the_pool_does_not_take_is_refused(kind, pool_dtype, bad, gen):
    pool = _pool(kind, pool_dtype)
    n = int(torch.randint(1, 9, (), generator=gen))
    loc = _loc(pool, n, gen)
    k, v = _kv(pool, n, bad, gen)
    snap = _snapshot(pool)
    with pytest.raises(InvalidArgumentError) as err:
        pool.set_kv_buffer(1, loc, k, v)
    msg = str(err.value)
    assert str(bad) in msg and str(pool_dtype) in msg and "cache_k" in msg
    assert _unchanged(pool, snap)


def test_a_bad_v_dtype_after_a_good_k_writes_nothing(gen):
    pool = _pool("mha", torch.bfloat16)
    loc = _loc(pool, 7, gen)
    k, _ = _kv(pool, 7, torch.bfloat16, gen)
    _, v = _kv(pool, 7, torch.float64, gen)
    snap = _snapshot(pool)
    with pytest.raises(InvalidArgumentError, match=r"cache_v has dtype torch\.float64"):
        pool.set_kv_buffer(0, loc, k, v)
    assert _unchanged(pool, snap)


@pytest.mark.parametrize("pool_dtype", FP8, ids=str)
@pytest.mark.parametrize("src", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_an_fp8_pool_quantizes_the_model_dtypes(pool_dtype, src, gen):
    pool = _pool("mha", pool_dtype)
    loc = _loc(pool, 5, gen)
    k, v = _kv(pool, 5, src, gen)
    pool.set_kv_buffer(2, loc, k, v, k_scale=0.5, v_scale=2.0)
    assert torch.equal(pool.get_key_buffer(2)[loc.loc], (k / 0.5).to(pool_dtype))
    assert torch.equal(pool.get_value_buffer(2)[loc.loc], (v / 2.0).to(pool_dtype))


@pytest.mark.parametrize(
    "make",
    [
        lambda pool: PagedTokenToKVPoolAllocator(
            pool.size, P, torch.float32, "cpu", kvcache="pool"
        ),
        lambda pool: TokenToKVPoolAllocator(pool.size, torch.float32, "cpu", kvcache="pool"),
        lambda pool: HiSparseTokenToKVPoolAllocator(pool.size, P, None, "cpu", kvcache="pool"),
        lambda pool: UnifiedSWATokenToKVPoolAllocator(8, P, torch.float32, "cpu", "pool"),
    ],
    ids=["paged", "token", "hisparse", "unified_swa"],
)
def test_an_allocator_refuses_a_kvcache_that_is_not_a_pool(make):
    pool = _pool("mha", torch.float32)
    with pytest.raises(InvalidArgumentError, match=r"kvcache='pool' \(str\) is not a"):
        make(pool)


def test_an_allocator_over_a_real_pool_still_builds():
    pool = _pool("mha", torch.float32)
    alloc = PagedTokenToKVPoolAllocator(pool.size, P, torch.float32, "cpu", kvcache=pool)
    assert alloc.get_kvcache() is pool


@pytest.mark.parametrize(
    "make",
    [
        lambda size: MHATokenToKVPool(size, 16, torch.bfloat16, 8, 128, 32, "cpu"),
        lambda size: MHATokenToKOnlyPool(size, 16, torch.bfloat16, 8, 128, 32, "cpu"),
        lambda size: MLATokenToKVPool(size, 16, torch.bfloat16, 512, 64, 61, "cpu"),
        lambda size: DSATokenToKVPool(size, 16, torch.bfloat16, 512, 64, 61, "cpu"),
    ],
    ids=["mha", "konly", "mla", "dsa"],
)
def test_a_pool_too_big_for_memory_is_refused_before_allocating(make, gen):
    size = 10**12 + 16 * int(torch.randint(0, 1000, (), generator=gen))
    with pytest.raises(HostMemoryError) as err:
        make(size)
    msg = str(err.value)
    assert f"size={size}" in msg and "GiB" in msg and "lower size" in msg
    assert isinstance(err.value, TieredKVError)
