"""GPU checks (marker ``gpu``; run by ``benchmarks/gpu_check.sh`` on an NVIDIA machine): the
Triton kernels compiled, not interpreted, against their torch references, and pinned host
round trips through every layout and io backend."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import naive_extend
from tests.kernels.test_alloc_kernels import _random_extend_batch
from tiered_kv import platform
from tiered_kv.device import MHATokenToKVPool, MLATokenToKVPool, PagedTokenToKVPoolAllocator
from tiered_kv.host import host_pool_for
from tiered_kv.kernels import alloc_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
CUDA = torch.device("cuda")


def test_triton_is_compiled_not_interpreted():
    assert not platform.triton_interpreted()
    assert platform.kernel_backend(CUDA).value == "triton"


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("bs", [1, 7, 64, 300])
def test_alloc_extend_compiled_matches_reference(gen, page_size, bs):
    prefix, seq, last_loc = _random_extend_batch(gen, bs, page_size)
    need = int(((seq + page_size - 1) // page_size - (prefix + page_size - 1) // page_size).sum())
    free_pages = torch.randperm(50_000, generator=gen)[:need] + 1
    expect, _ = naive_extend(
        prefix.tolist(), seq.tolist(), last_loc.tolist(), free_pages.tolist(), page_size
    )
    total = int((seq - prefix).sum())
    outs = []
    for backend in ("triton", "torch"):
        out = torch.full((total,), -7, dtype=torch.int64, device=CUDA)
        alloc_kernels(CUDA, backend).alloc_extend(
            prefix.cuda(), seq.cuda(), last_loc.cuda(), free_pages.cuda(), out, page_size
        )
        outs.append(out.cpu())
    assert outs[0].tolist() == expect
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_allocator_on_cuda(gen, page_size):
    alloc = PagedTokenToKVPoolAllocator(
        512 * page_size, page_size, torch.bfloat16, "cuda", debug_mode=True
    )
    assert alloc.kernel_backend.value == "triton"
    lens = torch.randint(1, 3 * page_size + 2, (33,), generator=gen)
    zeros = torch.zeros_like(lens)
    out = alloc.alloc_extend(
        zeros.cuda(), zeros, lens.cuda(), lens, torch.full((33,), -1).cuda(), int(lens.sum())
    )
    assert out is not None and torch.unique(out).numel() == out.numel()
    seq = lens + 1
    last = torch.stack([t[-1] for t in torch.split(out.cpu(), lens.tolist())])
    dec = alloc.alloc_decode(seq.cuda(), seq, last.cuda())
    assert dec is not None and not torch.isin(dec, out).any()


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pinned_round_trip(gen, layout, io_backend, page_size, kind):
    pages, layers = 40, 5
    size = pages * page_size
    if kind == "mha":
        pool = MHATokenToKVPool(
            size, page_size, torch.bfloat16, 4, 64, layers, "cuda", v_head_dim=32
        )
    else:
        pool = MLATokenToKVPool(size, page_size, torch.bfloat16, 64, 16, layers, "cuda")
    for buf in pool.buffers():
        _bits(buf).copy_(
            torch.randint(-(2**15), 2**15, buf.shape, generator=gen, dtype=torch.int16)
        )
    alloc = PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cuda", kvcache=pool)
    alloc.free_pages = alloc.free_pages[torch.randperm(pages, generator=gen).cuda()]
    host = host_pool_for(pool.host_pool_decls()[0], alloc, layout=layout, size_tokens=size)
    assert host.pinned and host.kernel_backend.value == "triton"
    src = alloc.alloc(12 * page_size)
    dst = alloc.alloc(12 * page_size)
    h = (
        host.alloc(12 * page_size)
        .view(12, page_size)[torch.randperm(12, generator=gen)]
        .reshape(-1)
    )
    before = [b.clone() for b in pool.buffers()]
    host.backup_from_device_all_layer(pool, h, src, io_backend)
    for layer in range(layers):
        host.load_to_device_per_layer(pool, h, dst, layer, io_backend)
    torch.cuda.synchronize()
    for old, buf in zip(before, pool.buffers(), strict=True):
        expect = old.clone()
        expect[dst] = old[src]
        assert torch.equal(_bits(buf), _bits(expect))
    host.destroy()
