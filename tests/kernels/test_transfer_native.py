"""The native copier: available here, its plan cache reused across the calls of a layer-wise
load and rebuilt whenever its arguments change, and its threaded path on a large transfer.

Every check of the cache compares bytes exactly with the torch reference run on a copy of the
same state, and re-runs layers whose addresses are already built: a plan used after its indices
changed in place writes the old rows, which the comparison catches."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import torch

from tests.host._util import (
    assert_device_equal,
    assert_host_equal,
    device_snapshot,
    expected_device_after_load,
    expected_host_after_backup,
    fill_bits,
    fill_device,
    host_snapshot,
    ints,
    make_host,
    random_host_pages,
    shuffle_free_pages,
)
from tests.host.conftest import torch_threads
from tests.kernels._transfer_util import (
    LAYERS,
    Transfer,
    assert_same_bytes,
    make_transfer,
    random_nonzero,
    random_records,
    random_rows,
)
from tiered_kv import kernels
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.errors import TransferError
from tiered_kv.kernels import PlanCache, transfer_kernels
from tiered_kv.kernels.transfer_native import NativeRowPlan, copy_blocks, transfer_rows
from tiered_kv.platform import KernelBackend


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


def _plan(cache: PlanCache, to_host: bool) -> NativeRowPlan:
    (plan,) = [p for (_, direction), p in cache.entries.items() if direction == to_host]
    assert isinstance(plan, NativeRowPlan)
    return plan


def _both(got: Transfer, expected: Transfer, to_host: bool, cache: PlanCache, gen, **kw) -> None:
    """One native call and the reference, after fresh source bytes on both sides (so a repeated
    call moves new bytes, and rows written through stale addresses differ)."""
    sources = [b for bufs in got.dev for b in bufs] if to_host else [got.host]
    mirrors = [b for bufs in expected.dev for b in bufs] if to_host else [expected.host]
    for src, mirror in zip(sources, mirrors, strict=True):
        mirror.copy_(random_nonzero(tuple(src.shape), src.dtype, gen))
        src.copy_(mirror)
    got.run(transfer_rows, to_host, plan_cache=cache, **kw)
    expected.reference(to_host, **kw)
    assert_same_bytes(got, expected)


def test_native_backend_is_available_here():
    assert shutil.which("gcc") is not None
    assert kernels.native_available() is True
    assert transfer_kernels(torch.device("cpu"), "native").backend is KernelBackend.NATIVE


@pytest.mark.parametrize("token_major", (False, True))
@pytest.mark.parametrize("to_host", (True, False), ids=("to_host", "to_device"))
def test_a_layer_wise_load_reuses_one_plan_built_layer_by_layer(to_host, token_major, gen):
    got = make_transfer(gen)
    expected = got.clone_state()
    cache = PlanCache()
    order = torch.randperm(LAYERS, generator=gen).tolist()
    _both(got, expected, to_host, cache, gen, layers=[order[0]], token_major=token_major)
    plan = _plan(cache, to_host)
    # Layer 0 of the load did not wait for the other layers' addresses.
    assert set(plan._per_layer) == {order[0]} and plan._whole is None
    for layer in order[1:]:
        _both(got, expected, to_host, cache, gen, layers=[layer], token_major=token_major)
        assert _plan(cache, to_host) is plan
    assert set(plan._per_layer) == set(range(LAYERS))
    _both(got, expected, to_host, cache, gen, layers=order[:2], token_major=token_major)
    _both(got, expected, to_host, cache, gen, token_major=token_major)  # every layer: one call
    assert _plan(cache, to_host) is plan and len(cache.entries) == 1


@pytest.mark.parametrize("index_dtype", (torch.int64, torch.int32))
@pytest.mark.parametrize("changed", ("dev_rows", "host_offsets"))
@pytest.mark.parametrize("to_host", (True, False), ids=("to_host", "to_device"))
def test_an_in_place_change_of_an_index_tensor_rebuilds_the_plan(
    to_host, changed, index_dtype, gen
):
    got = make_transfer(gen, index_dtype=index_dtype)
    expected = got.clone_state()
    cache = PlanCache()
    for layer in (1, 3):
        _both(got, expected, to_host, cache, gen, layers=[layer])
    _both(got, expected, to_host, cache, gen)
    old = _plan(cache, to_host)
    # The same tensor objects, new values: other rows, or other host records.
    if changed == "dev_rows":
        fresh = random_rows(gen, got.dev_rows.numel(), exclude=got.dev_rows)
        assert fresh.numel() == got.dev_rows.numel()
        got.dev_rows.copy_(fresh)
    else:
        got.host_offsets.copy_(random_records(gen, LAYERS, got.host_offsets.shape[1]) * got.record)
    for layer in (1, 3, 0):  # 1 and 3 were built from the old values
        _both(got, expected, to_host, cache, gen, layers=[layer])
        assert _plan(cache, to_host) is not old
    new = _plan(cache, to_host)
    _both(got, expected, to_host, cache, gen)
    assert _plan(cache, to_host) is new


def test_other_tensors_with_equal_values_rebuild_the_plan(gen):
    got = make_transfer(gen)
    expected = got.clone_state()
    cache = PlanCache()
    _both(got, expected, False, cache, gen, layers=[2])
    first = _plan(cache, False)
    got.dev_rows = expected.dev_rows = got.dev_rows.clone()
    _both(got, expected, False, cache, gen, layers=[2])
    assert _plan(cache, False) is not first
    # Other device buffers (a list, not a tuple): the copy goes to them, not to the old ones.
    second = _plan(cache, False)
    old_dev = got.dev
    before = [[b.clone() for b in bufs] for bufs in old_dev]
    got.dev = [[b.clone() for b in bufs] for bufs in got.dev]
    _both(got, expected, False, cache, gen, layers=[2])
    assert _plan(cache, False) is not second
    for bufs, kept in zip(old_dev, before, strict=True):
        assert all(torch.equal(ints(a), ints(b)) for a, b in zip(bufs, kept, strict=True))
    # One cache holds a plan per direction.
    _both(got, expected, True, cache, gen, layers=[2])
    assert {direction for _, direction in cache.entries} == {False, True}


def test_a_tuple_of_device_buffers_is_reused_and_the_same_list_checked(gen):
    got = make_transfer(gen)
    expected = got.clone_state()
    cache = PlanCache()
    got.dev = tuple(tuple(bufs) for bufs in got.dev)
    _both(got, expected, False, cache, gen, layers=[0])
    plan = _plan(cache, False)
    _both(got, expected, False, cache, gen, layers=[1])
    assert _plan(cache, False) is plan
    as_list = [list(bufs) for bufs in got.dev]  # the same tensors in a new list
    got.dev = as_list
    _both(got, expected, False, cache, gen, layers=[0])
    assert _plan(cache, False) is plan
    as_list[1][0] = as_list[1][0].clone()  # one buffer swapped inside the list
    expected.dev[1][0] = expected.dev[1][0].clone()
    _both(got, expected, False, cache, gen, layers=[0])
    assert _plan(cache, False) is not plan


@pytest.mark.parametrize("layout", ("layer_first", "page_first"))
def test_large_native_transfer_uses_threads_and_streams(layout, gen):
    """A transfer above the native copier's thread and streaming-store thresholds (16 MiB)
    equals the torch reference byte for byte and round-trips."""
    page, k = 64, 16
    pool = MHATokenToKVPool(40 * page, page, torch.float16, 8, 128, 4, "cpu")
    alloc = PagedTokenToKVPoolAllocator(40 * page, page, torch.float16, "cpu", kvcache=pool)
    native = make_host(pool, alloc, layout, host_pages=k + 3, kernel_backend="native")
    ref = make_host(pool, alloc, layout, host_pages=k + 3, kernel_backend="torch")
    assert k * page * 4 * pool.bytes_per_token_per_layer() >= 16 << 20
    fill_device(pool, gen)
    fill_bits(native.buffer, gen)
    ref.buffer.copy_(native.buffer)
    shuffle_free_pages(alloc, gen)
    src, dst = alloc.alloc(k * page), alloc.alloc(k * page)
    host_idx = random_host_pages(native, k, gen)
    dev0, host0 = device_snapshot(pool), host_snapshot(native)
    with torch_threads(4):  # the native copier splits a large transfer over torch's threads
        native.backup_from_device_all_layer(pool, host_idx, src)
    ref.backup_from_device_all_layer(pool, host_idx, src)
    assert torch.equal(ints(native.buffer), ints(ref.buffer))
    assert_host_equal(native, expected_host_after_backup(pool, host0, dev0, host_idx, src))
    with torch_threads(4):
        native.load_to_device_all_layer(pool, host_idx, dst)
    assert_device_equal(pool, expected_device_after_load(dev0, dev0, src, dst))


def test_copy_blocks_moves_exactly_the_addressed_blocks(gen):
    """Blocks of an irregular size between random rows of two buffers of fresh random bits:
    exactly those destination rows change, to their sources' bytes."""
    src = torch.randint(0, 256, (53, 37), dtype=torch.uint8, generator=gen)
    dst = torch.randint(0, 256, (41, 37), dtype=torch.uint8, generator=gen)
    before = dst.clone()
    s_rows = torch.randperm(53, generator=gen)[:17]
    d_rows = torch.randperm(41, generator=gen)[:17]
    copy_blocks((dst.data_ptr() + d_rows * 37).numpy(), (src.data_ptr() + s_rows * 37).numpy(), 37)
    before[d_rows] = src[s_rows]
    assert torch.equal(dst, before)
    with pytest.raises(TransferError, match="one length"):
        copy_blocks(d_rows.numpy(), s_rows[:3].numpy(), 37)
