"""A layer-wise load reuses one validated plan; any change to the index tensors invalidates it."""

from __future__ import annotations

import pytest
import torch

from tiered_kv import InvalidArgumentError
from tiered_kv.device import MHATokenToKVPool, PagedTokenToKVPoolAllocator
from tiered_kv.host import host_pool_for
from tiered_kv.host.engine_jobs import EngineJobs
from tiered_kv.hugepages import advise_huge_pages, empty_zeroed

P = 16


def _setup(gen, kernel_backend):
    pool = MHATokenToKVPool(24 * P, P, torch.float16, 2, 8, 3, "cpu")
    for buf in pool.buffers():
        buf.view(torch.int16).copy_(
            torch.randint(-(2**15), 2**15, buf.shape, generator=gen, dtype=torch.int16)
        )
    alloc = PagedTokenToKVPoolAllocator(24 * P, P, torch.float16, "cpu", kvcache=pool)
    host = host_pool_for(
        pool.host_pool_decls()[0],
        alloc,
        layout="page_first",
        size_tokens=8 * P,
        kernel_backend=kernel_backend,
        reserve_bytes=0,
    )
    return pool, alloc, host


@pytest.mark.parametrize("kernel_backend", ["native", "torch"])
def test_in_place_change_of_indices_is_seen(gen, kernel_backend):
    pool, alloc, host = _setup(gen, kernel_backend)
    src = alloc.alloc(2 * P)
    dst = alloc.alloc(2 * P)
    h = host.alloc(2 * P)
    host.backup_from_device_all_layer(pool, h, src)
    host.load_to_device_per_layer(pool, h, dst, 0)  # plan cached for (h, dst)
    # Retarget the same tensor objects in place: the next layer must go to the new slots.
    other = alloc.alloc(2 * P)
    dst.copy_(other)
    host.load_to_device_per_layer(pool, h, dst, 1)
    k = pool.k_buffer[1].view(torch.int16)
    assert torch.equal(k[other], k[src])
    # An in-place change that makes an index invalid is refused, not served from the cache.
    h[0] = host.size + 5
    with pytest.raises(InvalidArgumentError, match="outside the valid range"):
        host.load_to_device_per_layer(pool, h, dst, 2)


def test_a_layer_wise_load_builds_one_native_plan(gen, monkeypatch):
    """The native backend's copies run on the copy engine from a job kept with the prepared
    transfer: one job per transfer and direction, not one per call of a layer-wise load."""
    built = []
    real = EngineJobs.job

    def counted(self, host_indices, physical, to_host, where, explain):
        built.append(to_host)
        return real(self, host_indices, physical, to_host, where, explain)

    monkeypatch.setattr(EngineJobs, "job", counted)
    pool, alloc, host = _setup(gen, "native")
    src, dst, h = alloc.alloc(2 * P), alloc.alloc(2 * P), host.alloc(2 * P)
    host.backup_from_device_all_layer(pool, h, src)
    for layer in (2, 0, 1):
        host.load_to_device_per_layer(pool, h, dst, layer)
    host.load_to_device_all_layer(pool, h, dst)
    assert built == [True, False]
    k = pool.k_buffer[1].view(torch.int16)
    assert torch.equal(k[dst], k[src])
    host.load_to_device_per_layer(pool, h, dst.clone(), 0)  # other indices: a new transfer
    assert built == [True, False, False]


def test_huge_page_advice_is_best_effort_and_zeroes():
    t = empty_zeroed((3 << 20,), torch.uint8, torch.device("cpu"))
    assert int(t.count_nonzero()) == 0
    assert isinstance(advise_huge_pages(torch.empty(5)), bool)
    assert advise_huge_pages(torch.empty(5)) is False  # smaller than one huge page
